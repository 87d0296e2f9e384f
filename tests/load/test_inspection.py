"""The torch-free view of a checkpoint (:mod:`ckptd.load.inspection`) sees what the reader sees,
and :func:`ckptd.load.compare.same_bytes` matches elements across any two piece layouts."""

from __future__ import annotations

import itertools
import math
import os
import struct

import pytest
import safetensors.torch
import torch
from conftest import TinyLM

import ckptd
from ckptd.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptd.formats.checksum import crc32c, format_crc
from ckptd.formats.manifest import ChunkRecord, ComponentRecord, FileRecord, Manifest, TensorRecord, utc_now
from ckptd.load.compare import same_bytes
from ckptd.load.inspection import CheckpointView, open_view
from ckptd.load.reader import CheckpointReader

# ---- the view and the reader agree ------------------------------------------------------------


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The same tied model as a ckptd checkpoint, an HF sharded directory and a single file."""
    base = tmp_path_factory.mktemp("inspection")
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.Adam(model.parameters())
    with ckptd.Checkpointer(str(base / "runs")) as ckpt:
        ckpt.save(3, {"model": model, "optimizer": optimizer, "progress": {"step": 3}})
    checkpoint = str(base / "runs" / "checkpoint-3")
    ckptd.export_hf(checkpoint, str(base / "hf"), max_shard_size="4KB")
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    safetensors.torch.save_file(state, str(base / "model.safetensors"))
    return {"ckptd": checkpoint, "hf_sharded": str(base / "hf"), "safetensors": str(base / "model.safetensors")}


@pytest.mark.parametrize("kind", ["ckptd", "hf_sharded", "safetensors"])
def test_the_view_describes_what_the_reader_does(formats, kind):
    view = open_view(formats[kind])
    reader = CheckpointReader.open(formats[kind])
    try:
        assert isinstance(view, CheckpointView)
        assert (view.kind, view.directory) == (reader.kind, reader.directory)
        assert view.components() == reader.components()
        for component in view.components():
            assert sorted(view.keys(component)) == sorted(reader.keys(component))
            assert view.tied_groups(component) == reader.tied_groups(component)
            assert view.locate(component) == reader.locate(component)
        if kind == "hf_sharded":
            assert view.tied_groups("model") == [["embed.weight", "head.weight"]]
            assert len({r.file for r in view.locate("model").values()}) > 1
    finally:
        view.close()
        reader.close()


def test_view_verify_and_check_files_find_damage(formats, tmp_path):
    import shutil

    copy = str(tmp_path / "copy")
    shutil.copytree(formats["ckptd"], copy)
    view = open_view(copy, require_manifest=True)
    assert isinstance(view, CheckpointView)
    view.verify()
    shard = next(n for n in os.listdir(copy) if n.startswith("model-"))
    with open(os.path.join(copy, shard), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x7f")
    with pytest.raises(CorruptCheckpointError, match="CRC32C mismatch"):
        view.verify([shard])
    os.truncate(os.path.join(copy, shard), 10)
    fresh = open_view(copy)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        fresh.check_files()
    view.close()
    fresh.close()


def test_require_manifest_refuses_other_formats_without_torch_readers(formats):
    with pytest.raises(CheckpointNotFoundError, match="not a committed ckptd checkpoint"):
        open_view(formats["hf_sharded"], require_manifest=True)


# ---- comparing bytes across piece layouts -------------------------------------------------------

Tiling = list[tuple[tuple[int, ...], tuple[int, ...]]]  # (offset, shape) per piece

SHAPE = (4, 6)
TILINGS: dict[str, Tiling] = {
    "whole": [((0, 0), (4, 6))],
    "rows": [((0, 0), (2, 6)), ((2, 0), (2, 6))],
    "cols": [((0, 0), (4, 2)), ((0, 2), (4, 2)), ((0, 4), (4, 2))],
    "blocks": [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))],
    "uneven": [((0, 0), (1, 6)), ((1, 0), (3, 4)), ((1, 4), (3, 2))],
}


def _write(directory: str, shape: tuple[int, ...], tiling: Tiling, values: list[float]) -> CheckpointView:
    """A ckptd checkpoint whose one tensor ``w`` (F32, row-major ``values``) is stored in the pieces
    of ``tiling``, written into one file in reverse order after 8 bytes of padding."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    data = bytearray(b"\xee" * 8)
    chunks = []
    for offset, piece in reversed(tiling):
        start = len(data)
        for index in itertools.product(*(range(o, o + n) for o, n in zip(offset, piece, strict=True))):
            data += struct.pack("<f", values[sum(i * s for i, s in zip(index, strides, strict=True))])
        chunks.append(ChunkRecord("pieces.bin", start, len(data), offset, piece))
    os.makedirs(directory)
    with open(os.path.join(directory, "pieces.bin"), "wb") as f:
        f.write(data)
    record = TensorRecord("F32", shape, tuple(chunks))
    manifest = Manifest(
        step=1,
        created_utc=utc_now(),
        world_size=len(tiling),
        library_version="test",
        components={"model": ComponentRecord("safetensors", {"w": record})},
        files={"pieces.bin": FileRecord(len(data), format_crc(crc32c(bytes(data))))},
    )
    with open(os.path.join(directory, "checkpoint_manifest.json"), "wb") as f:
        f.write(manifest.to_json())
    view = open_view(directory)
    assert isinstance(view, CheckpointView) and len(view.locate("model")["w"].chunks) == len(tiling)
    return view


def _same(a: CheckpointView, b: CheckpointView, block: int) -> bool:
    return same_bytes(a, a.locate("model")["w"], b, b.locate("model")["w"], block)


@pytest.mark.parametrize(("left", "right"), list(itertools.combinations_with_replacement(TILINGS, 2)))
def test_same_bytes_matches_elements_across_layouts(tmp_path, left, right):
    values = [float(i) * 1.5 for i in range(math.prod(SHAPE))]
    changed = list(values)
    changed[2 * 6 + 4] += 1.0  # element (2, 4)
    a = _write(str(tmp_path / "a"), SHAPE, TILINGS[left], values)
    b = _write(str(tmp_path / "b"), SHAPE, TILINGS[right], values)
    c = _write(str(tmp_path / "c"), SHAPE, TILINGS[right], changed)
    for block in (5, 1 << 20):  # blocks smaller than a run, and the whole run at once
        assert _same(a, b, block) and _same(b, a, block)
        assert not _same(a, c, block) and not _same(c, a, block)
    for view in (a, b, c):
        view.close()


def test_same_bytes_with_a_middle_dimension_split_and_scalars(tmp_path):
    shape = (2, 3, 4)
    values = [float(i) for i in range(24)]
    whole = _write(str(tmp_path / "whole"), shape, [((0, 0, 0), shape)], values)
    split = _write(str(tmp_path / "split"), shape, [((0, 0, 0), (2, 1, 4)), ((0, 1, 0), (2, 2, 4))], values)
    assert _same(whole, split, 3)
    values[1 * 12 + 2 * 4 + 3] = -1.0  # element (1, 2, 3)
    other = _write(str(tmp_path / "other"), shape, [((0, 0, 0), (2, 1, 4)), ((0, 1, 0), (2, 2, 4))], values)
    assert not _same(whole, other, 3)
    one = _write(str(tmp_path / "one"), (), [((), ())], [2.5])
    two = _write(str(tmp_path / "two"), (), [((), ())], [3.5])
    assert _same(one, one, 1) and not _same(one, two, 1)
