"""A crafted DCP ``.metadata`` never runs: every entry point reads it through ckptd's allowlist.

torch's ``FileSystemReader.read_metadata()`` is a plain ``pickle.load``.  Each payload below
creates a marker file when unpickled by plain pickle (checked first, so the payloads are live);
every ckptd entry point that can meet a DCP directory must instead raise a ``ckptd.errors`` type
naming the file, and the marker must not appear.  Real DCP checkpoints (several writers and
shapes) still load bit for bit, and a ckptd checkpoint with a crafted ``.metadata`` beside its
manifest loads as ckptd without that file being opened.
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_same
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

import ckptd
from ckptd.compat import megatron
from ckptd.errors import CkptdError, CorruptCheckpointError, UnsafeCheckpointError
from ckptd.load.dcp_metadata import unpickle_metadata
from ckptd.load.reader import CheckpointReader
from ckptd.tools.tensor_sources import load_dcp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = str(Path(__file__).resolve().parents[2])
STEP = 5


# ---- payloads ------------------------------------------------------------------------------------


class OpenPayload:
    """``open(marker, "w")`` when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


class SystemPayload:
    """``os.system("touch marker")`` when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _text(value: str) -> bytes:
    assert "\n" not in value and "\\" not in value
    return value.encode()


def reduce_open(marker: str, reference: str = "") -> bytes:
    return pickle.dumps(OpenPayload(marker))


def reduce_system(marker: str, reference: str = "") -> bytes:
    return pickle.dumps(SystemPayload(marker))


def global_eval(marker: str, reference: str) -> bytes:
    """Hand-written protocol 0: GLOBAL builtins.eval, REDUCE."""
    expression = f"__import__('pathlib').Path({marker!r}).touch()"
    return b"cbuiltins\neval\n(V" + _text(expression) + b"\ntR."


def global_popen(marker: str, reference: str) -> bytes:
    """GLOBAL subprocess.Popen(["touch", marker]), REDUCE."""
    return b"csubprocess\nPopen\n((Vtouch\nV" + _text(marker) + b"\nltR."


def inst_system(marker: str, reference: str) -> bytes:
    """The INST opcode (protocol 0: find the class and call it in one step) on os.system."""
    return b"(V" + _text(f"touch {shlex.quote(marker)}") + b"\nios\nsystem\n."


def legit_metadata(directory: str) -> Any:
    """The Metadata of a real DCP save in ``directory`` (our own file: plain pickle is fine)."""
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        return pickle.load(f)


def nested(marker: str, reference: str) -> bytes:
    """A real Metadata with the payload deep inside its planner data."""
    metadata = legit_metadata(reference)
    metadata.planner_data["weight"] = ("weight", {"hidden": [1, OpenPayload(marker)]})
    return pickle.dumps(metadata)


def nested_system(marker: str, reference: str) -> bytes:
    """A real Metadata with the payload in its storage meta's module list."""
    metadata = legit_metadata(reference)
    metadata.storage_meta.modules = ["torch", SystemPayload(marker)]
    return pickle.dumps(metadata)


LIVE_PAYLOADS: dict[str, Callable[[str, str], bytes]] = {
    "reduce_open": reduce_open,
    "reduce_os_system": reduce_system,
    "global_builtins_eval": global_eval,
    "global_subprocess_popen": global_popen,
    "inst_os_system": inst_system,
    "nested_in_planner_data": nested,
    "nested_in_storage_meta": nested_system,
}


def persistent_id_payload(reference: str) -> bytes:
    """A Metadata pickled as torch.save pickles tensors: with a persistent id for a storage."""
    metadata = legit_metadata(reference)
    sentinel = object()
    metadata.planner_data["weight"] = ("weight", sentinel)

    class StoragePickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", "FloatStorage", "0", "cpu", 6) if obj is sentinel else None

    out = io.BytesIO()
    StoragePickler(out, protocol=2).dump(metadata)
    return out.getvalue()


# ---- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny real DCP save (``{"weight": ...}``, flat), written once for the module."""
    path = str(tmp_path_factory.mktemp("reference") / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"weight": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[str]:
    path = str(tmp_path / "PWNED")
    yield path
    assert not os.path.exists(path), "a payload ran"  # again at teardown: a Popen payload touches it later


def craft(root: Path, data: bytes) -> str:
    """``root/checkpoint-5`` holding a ``.metadata`` of ``data`` and a data file: a DCP directory."""
    directory = root / f"checkpoint-{STEP}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".metadata").write_bytes(data)
    (directory / "__0_0.distcp").write_bytes(b"\0" * 64)
    return str(directory)


def ran(marker: str) -> bool:
    return os.path.exists(marker)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    environment = dict(os.environ)
    environment["PYTHONPATH"] = REPO + os.pathsep + environment.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "ckptd", *args], capture_output=True, text=True, timeout=180, env=environment
    )


# ---- the payloads are live under plain pickle -----------------------------------------------------


@pytest.mark.parametrize("name", sorted(LIVE_PAYLOADS))
def test_each_payload_runs_under_plain_pickle(name, tmp_path, reference):
    target = str(tmp_path / "PLAIN")
    result = pickle.loads(LIVE_PAYLOADS[name](target, reference))
    if isinstance(result, subprocess.Popen):
        result.wait(timeout=30)
    elif isinstance(result, io.IOBase):
        result.close()
    assert os.path.exists(target), f"{name}: the payload is not live, so the tests below would prove nothing"


# ---- every payload is refused ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LIVE_PAYLOADS))
def test_reader_refuses_every_payload(name, tmp_path, marker, reference):
    directory = craft(tmp_path / "root", LIVE_PAYLOADS[name](marker, reference))
    with pytest.raises(UnsafeCheckpointError, match=r"checkpoint-5/\.metadata: refused to unpickle"):
        CheckpointReader.open(directory)
    assert not ran(marker)


def test_a_named_global_is_not_even_imported(tmp_path, marker, monkeypatch):
    """A GLOBAL that is never called still imports its module under plain pickle, and an import
    runs the module's code: a module that touches the marker when imported."""
    module = f"ckptd_crafted_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text(f"open({marker!r}, 'w').close()\nVALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = b"\x80\x02" + pickle.GLOBAL + module.encode() + b"\nVALUE\n" + pickle.STOP
    try:
        assert pickle.loads(data) == 1 and ran(marker)  # live under plain pickle
    finally:
        sys.modules.pop(module, None)
        if ran(marker):
            os.remove(marker)
    directory = craft(tmp_path / "root", data)
    with pytest.raises(UnsafeCheckpointError, match=f"global {module}.VALUE is not one of DCP's metadata classes"):
        CheckpointReader.open(directory)
    assert module not in sys.modules and not ran(marker)


def test_persistent_id_is_refused(tmp_path, reference):
    directory = craft(tmp_path / "root", persistent_id_payload(reference))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: .*persistent id"):
        CheckpointReader.open(directory)


def test_build_cannot_set_attributes_on_a_class(tmp_path):
    """GLOBAL Metadata, BUILD (None, {"injected": True}): plain pickle sets a class attribute
    (state shared by every later load in the process); the allowlist refuses."""
    data = b"\x80\x04" + pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\nMetadata\n"
    data += pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x08injected" + pickle.NEWTRUE
    data += pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP
    try:
        pickle.loads(data)
        assert Metadata.injected is True  # type: ignore[attr-defined]  # live under plain pickle
    finally:
        if "injected" in vars(Metadata):
            delattr(Metadata, "injected")
    directory = craft(tmp_path / "root", data)
    with pytest.raises(UnsafeCheckpointError, match=r"BUILD of a .*not an allowed class"):
        CheckpointReader.open(directory)
    assert "injected" not in vars(Metadata)


_METADATA_MODULE = b"torch.distributed.checkpoint.metadata\n"
MISUSES = {
    # an allowed enum called with the functional API's arguments (it would build a new class)
    "enum_functional_api": pickle.GLOBAL + _METADATA_MODULE + b"_MEM_FORMAT_ENCODING\n"
    + b"(VX\nVA B\ntR.",
    # SETITEMS aimed at an allowed instance instead of a dict (calls its __setitem__)
    "setitems_on_an_object": pickle.GLOBAL + _METADATA_MODULE + b"Metadata\n" + pickle.EMPTY_TUPLE
    + pickle.NEWOBJ + b"(VK\nVV\nu.",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MISUSES))
def test_allowed_globals_used_the_wrong_way_are_refused(name, tmp_path):
    directory = craft(tmp_path / "root", b"\x80\x02" + MISUSES[name])
    with pytest.raises(UnsafeCheckpointError, match="refused to unpickle"):
        CheckpointReader.open(directory)


def test_dunder_state_is_refused(tmp_path, reference):
    """A legit-looking Metadata whose BUILD state holds a dunder name."""
    metadata = legit_metadata(reference)
    metadata.__dict__["__init__"] = None
    directory = craft(tmp_path / "root", pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="plain attribute names"):
        CheckpointReader.open(directory)


def test_a_data_file_outside_the_directory_is_refused(tmp_path, reference):
    """Allowed classes only, but a ``_StorageInfo`` pointing at ``../secret``: no read outside."""
    metadata = legit_metadata(reference)
    metadata.storage_data = {index: _StorageInfo("../secret", 0, 8) for index in metadata.storage_data}
    directory = craft(tmp_path / "root", pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"\.\./secret"):
        CheckpointReader.open(directory)


def test_garbage_and_wrong_types_are_corrupt_not_unsafe(tmp_path, reference):
    for data, fragment in (
        (b"not a pickle", "not a readable DCP metadata pickle"),
        (pickle.dumps({"state_dict_metadata": {}}), "holds a dict, not a Metadata"),
        (pickle.dumps(legit_metadata(reference))[:-20], "not a readable DCP metadata pickle"),
    ):
        directory = craft(tmp_path / "root", data)
        with pytest.raises(CorruptCheckpointError, match=fragment):
            CheckpointReader.open(directory)


# ---- one test per entry point ----------------------------------------------------------------------


def _entry_points() -> dict[str, Callable[[Path, str], Any]]:
    return {
        "Checkpointer.load(step)": lambda root, d: ckptd.Checkpointer(str(root)).load(STEP),
        "Checkpointer.load(into=)": lambda root, d: ckptd.Checkpointer(str(root)).load(
            d, into={"model": torch.nn.Linear(2, 2)}
        ),
        "load_checkpoint": lambda root, d: ckptd.load_checkpoint(d),
        "load_checkpoint(keys=)": lambda root, d: ckptd.load_checkpoint(d, keys={"weight"}),
        "load_tensors_metadata": lambda root, d: ckptd.load_tensors_metadata(d),
        "CheckpointReader.open": lambda root, d: CheckpointReader.open(d),
        "convert": lambda root, d: ckptd.convert(d, str(root / "converted")),
        "export_hf": lambda root, d: ckptd.export_hf(d, str(root / "exported")),
        "consolidate": lambda root, d: ckptd.consolidate(d, str(root / "consolidated")),
        "tensor_sources.load_dcp": lambda root, d: load_dcp(d),
        "megatron.load": lambda root, d: megatron.load({}, d),
        "megatron.load_tensors_metadata": lambda root, d: megatron.load_tensors_metadata(d),
        "megatron.LoadStrategy": lambda root, d: _megatron_strategy().load_tensors_metadata(d),
    }


def _megatron_strategy() -> Any:
    pytest.importorskip("megatron.core")  # the strategies subclass Megatron's own
    return megatron.LoadStrategy()


@pytest.mark.parametrize("entry", sorted(_entry_points()))
def test_every_entry_point_refuses_the_payload(entry, tmp_path, marker):
    root = tmp_path / "root"
    directory = craft(root, reduce_open(marker))
    # Megatron's torch_dist directories carry metadata.json: the bridge then goes to DCP itself
    (Path(directory) / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    with pytest.raises(CkptdError) as raised:
        _entry_points()[entry](root, directory)
    assert not ran(marker)
    assert isinstance(raised.value, UnsafeCheckpointError), raised.value
    assert f"{directory}{os.sep}.metadata" in str(raised.value)


def test_validate_checkpoint_says_no(tmp_path, marker):
    directory = craft(tmp_path / "root", reduce_system(marker))
    assert ckptd.validate_checkpoint(directory) is False
    assert not ran(marker)


@pytest.mark.parametrize("command", ["info", "verify", "convert"])
def test_cli_refuses_the_payload(command, tmp_path, marker):
    directory = craft(tmp_path / "root", reduce_system(marker))
    args = [command, directory] + ([str(tmp_path / "out")] if command == "convert" else [])
    out = cli(*args)
    assert not ran(marker)
    assert out.returncode == 4, (out.returncode, out.stdout, out.stderr)  # EXIT_CORRUPT
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"ckptd {command}: error: {directory}/.metadata: refused to unpickle" in lines[0]


def test_fsspec_reader_refuses_the_payload(marker):
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe("/crafted/.metadata", reduce_open(marker))
    memory.pipe("/crafted/__0_0.distcp", b"\0" * 64)
    try:
        with pytest.raises(UnsafeCheckpointError, match=r"memory://crafted/\.metadata: refused"):
            CheckpointReader.open("memory://crafted")
        with pytest.raises(UnsafeCheckpointError):
            ckptd.load_checkpoint("memory://crafted")
    finally:
        memory.rm("/crafted", recursive=True)
    assert not ran(marker)


# ---- torch re-reads .metadata itself: a file swapped after the layout was read ----------------------


def test_torch_load_reads_metadata_through_the_allowlist_too(tmp_path, marker):
    """The reader was opened on a real save; the ``.metadata`` is then replaced.  The tensor read
    (torch.distributed.checkpoint.load reads .metadata again) and the object read must refuse."""
    path = str(tmp_path / "dcp")
    state = {"model": {"w": torch.arange(4.0)}, "extra": {"lr": 0.5}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    reader = CheckpointReader.open(path)
    Path(path, ".metadata").write_bytes(reduce_open(marker))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refused"):
        reader.read("model")
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refused"):
        reader.read_dcp_objects(["extra.lr"])
    assert not ran(marker)


def test_a_tensor_entry_turned_into_pickled_bytes_is_not_unpickled(tmp_path, marker):
    """Allowed classes only, but the entry read as a tensor now says BytesStorageMetadata and
    points at a ``torch.save`` payload: torch's default planner would
    ``torch.load(weights_only=False)`` it."""
    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=path, no_dist=True)
    reader = CheckpointReader.open(path)
    payload = io.BytesIO()
    torch.save(OpenPayload(marker), payload)
    Path(path, "__9_0.distcp").write_bytes(payload.getvalue())
    metadata = legit_metadata(path)
    metadata.state_dict_metadata["w"] = BytesStorageMetadata()
    metadata.storage_data = {MetadataIndex("w"): _StorageInfo("__9_0.distcp", 0, len(payload.getvalue()))}
    Path(path, ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match=r"'w' is stored as pickled bytes"):
        reader.read("model")
    assert not ran(marker)


# ---- a ckptd checkpoint is ckptd's, whatever lies beside it ------------------------------------------

_opened: dict[str, Any] = {"watch": None, "seen": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    watch = _opened["watch"]
    if watch is not None and event == "open" and args and isinstance(args[0], str | bytes):
        if os.path.basename(os.fsdecode(args[0])) == ".metadata" and os.fsdecode(args[0]).startswith(watch):
            _opened["seen"].append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def test_a_ckptd_manifest_wins_over_a_crafted_metadata(tmp_path, marker):
    root = tmp_path / "root"
    state = {"model": {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.ones(2, dtype=torch.bfloat16)}}
    with ckptd.Checkpointer(str(root)) as checkpointer:
        checkpointer.save(STEP, state)
    directory = craft(root, reduce_system(marker))  # into the committed checkpoint-5
    assert "checkpoint_manifest.json" in os.listdir(directory)
    _opened.update(watch=str(tmp_path), seen=[])
    try:
        with ckptd.Checkpointer(str(root)) as checkpointer:
            assert_same(state, checkpointer.load(STEP))
        assert CheckpointReader.open(directory).kind == "ckptd"
        assert_same(state["model"], ckptd.load_checkpoint(directory))
        assert ckptd.load_tensors_metadata(directory)["model"]["weight"].shape == (2, 3)
        assert ckptd.convert(directory, str(tmp_path / "hf")).format == "hf"
        out = cli("info", directory)
        assert out.returncode == 0, out.stderr
    finally:
        _opened["watch"] = None
    assert _opened["seen"] == [], "the .metadata beside a ckptd manifest was opened"
    assert not ran(marker)


# ---- real DCP checkpoints still load, bit for bit ---------------------------------------------------


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3, bias=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model(torch.randn(5, 6)).pow(2).mean().backward()
    optimizer.step()
    extra = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "fp16": torch.randn(7).half(),
        "int16": torch.arange(-4, 4, dtype=torch.int16),
        "uint8": torch.arange(9, dtype=torch.uint8).reshape(3, 3),
        "bool": torch.tensor([True, False, True]),
        "complex": torch.randn(2, dtype=torch.complex64),
        "f8": torch.tensor([0.5, -2.0], dtype=torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "nested": {"deeper": {"t": torch.arange(12, dtype=torch.int64).reshape(2, 2, 3)}},
    }
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra, "step": 11}


def _writers(tmp_path: Path) -> dict[str, tuple[str, Any]]:
    return {
        "FileSystemWriter": (str(tmp_path / "fs"), dcp.FileSystemWriter(str(tmp_path / "fs"))),
        "FileSystemWriter(single_file_per_rank=False)": (
            str(tmp_path / "per_item"),
            dcp.FileSystemWriter(str(tmp_path / "per_item"), single_file_per_rank=False),
        ),
        "FsspecWriter(local)": (str(tmp_path / "fsspec"), FsspecWriter(str(tmp_path / "fsspec"))),
        "FsspecWriter(memory://)": (f"memory://ckptd-crafted-{os.getpid()}", None),
    }


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        if isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value.detach().contiguous()
        elif isinstance(value, (dict, list)):
            out.update(_tensors(value, f"{prefix}{key}."))
    return out


@pytest.mark.parametrize("writer", list(_writers(Path("/unused"))))
def test_real_dcp_checkpoints_load_bit_exact(writer, tmp_path):
    state = _state()
    path, storage_writer = _writers(tmp_path)[writer]
    if storage_writer is None:
        storage_writer = FsspecWriter(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=storage_writer, no_dist=True)
    try:
        reader = CheckpointReader.open(path)
        assert reader.kind == "dcp"
        assert sorted(reader.components()) == ["extra", "model", "optimizer"]
        for component in ("model", "optimizer", "extra"):
            assert_same(_tensors(state[component]), reader.read(component), f"{writer}:{component}")
        assert reader.read_dcp_objects(["step"]) == {"step": 11}
        optimizer = reader.read_dcp_nested("optimizer", reader.read("optimizer"))
        assert optimizer["param_groups"] == state["optimizer"]["param_groups"]
        if "://" not in path:
            assert load_dcp(path)["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
            with open(os.path.join(path, ".metadata"), "rb") as f:
                assert unpickle_metadata(f, path) == legit_metadata(path)  # what plain pickle gives, exactly
    finally:
        if "://" in path:
            import fsspec

            fsspec.filesystem("memory").rm(path.split("://", 1)[1], recursive=True)


def test_flat_and_fresh_module_loads_from_dcp(tmp_path):
    state = _state()
    path = str(tmp_path / "flat")
    dcp.save(state["model"], checkpoint_id=path, no_dist=True)
    assert_same(_tensors(state["model"]), ckptd.load_checkpoint(path))
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3, bias=False))
    ckptd.load_checkpoint(path, fresh, strict=True)
    assert_same(_tensors(state["model"]), _tensors(fresh.state_dict()))
    assert ckptd.load_tensors_metadata(path)["model"]["0.weight"] == ckptd.TensorInfo(torch.float32, (4, 6))


def test_checkpointer_load_of_a_real_dcp_step_directory(tmp_path):
    """``Checkpointer(root).load(5)`` of a real DCP save under ``checkpoint-5`` (the reproduced
    defect's layout, honest files): the state comes back."""
    state = _state()
    root = tmp_path / "root"
    dcp.save(state, checkpoint_id=str(root / f"checkpoint-{STEP}"), no_dist=True)
    with ckptd.Checkpointer(str(root)) as checkpointer:
        loaded = checkpointer.load(STEP)
    assert_same(_tensors(state["model"]), loaded["model"])
    assert_same(_tensors(state["extra"]), _tensors(loaded["extra"]))
