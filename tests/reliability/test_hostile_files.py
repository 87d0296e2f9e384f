"""Hostile-file suite (issue 13): a seeded mutator over real checkpoints, run against every
loader entry point.

Two golden checkpoints are written once: a ckptd checkpoint (manifest, state file, index,
safetensors shard) and an HF sharded checkpoint (index + two shards).  Each case copies one,
mutates one of its files (flipped, inserted or dropped bytes, truncation; or, on the parsed
JSON: a value of the wrong type, a huge or negative number, a wrong dtype, a name with ``..``
or ``/``, deep nesting, a deleted key), sometimes re-signs the result (drops the manifest
checksum and fixes the file's CRC, as an old or malicious writer would) so the parsers behind
the checksums are exercised too, and then runs every entry point.  Each must either succeed or
raise a ``ckptd.errors`` type; a success must return the saved data whenever the mutation
could not have changed it undetected; listing the root never raises; and no file outside the
case's directory is opened (an audit hook watches every ``open``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same

import ckptd
from ckptd import cli
from ckptd.catalog import list_checkpoints
from ckptd.errors import AllocationError, CkptdError, CorruptCheckpointError, KeyMismatchError
from ckptd.formats.checksum import crc32c, format_crc
from ckptd.load import fetch
from ckptd.load.reader import CheckpointReader
from ckptd.storage import LocalStorage

MANIFEST = "checkpoint_manifest.json"
CASES = 300
SECRET = 424242.0  # the value of every tensor outside the checkpoints: must never be loaded

_watch: dict[str, Any] = {"root": None, "area": None, "outside": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    root = _watch["root"]
    if root is None or event != "open" or not args or not isinstance(args[0], str | bytes):
        return
    path = os.fsdecode(args[0])
    if not os.path.isabs(path):
        return  # relative to a directory descriptor: resolved by _open_relative below
    _check(path)


def _check(path: str) -> None:
    root = _watch["root"]
    if root is None:
        return
    real = os.path.realpath(path)
    inside = real == root or real.startswith(root + os.sep)
    # Imports open library files anywhere; what matters is the test area around the case (the
    # planted secrets, the golden copies) and what hostile names point at (/etc, /dev).
    suspicious = real.startswith((_watch["area"] + os.sep, "/etc/", "/dev/", "/proc/"))
    if suspicious and not inside:
        _watch["outside"].append(real)


sys.addaudithook(_audit)
_os_open = os.open


def _open_relative(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
    """``os.open``, checking what a name relative to a directory descriptor resolves to (the load
    path opens every file of a checkpoint relative to the directory it pinned; the audit event
    does not carry the descriptor)."""
    if dir_fd is not None and _watch["root"] is not None and not os.path.isabs(os.fsdecode(path)):
        _check(os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), os.fsdecode(path)))
    return _os_open(path, flags, mode, dir_fd=dir_fd)


@contextlib.contextmanager
def watching(root: str, area: str) -> Iterator[list[str]]:
    """Record every file opened in ``area`` (or /etc, /dev, /proc) outside ``root`` while the
    block runs."""
    _watch["root"], _watch["area"], _watch["outside"] = os.path.realpath(root), os.path.realpath(area), []
    os.open = _open_relative
    try:
        yield _watch["outside"]
    finally:
        os.open = _os_open
        _watch["root"] = None


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("golden")
    torch.manual_seed(0)
    model = {"embed.weight": torch.randn(4, 3), "head.bias": torch.arange(5, dtype=torch.int64)}
    state = {"model": model, "data": {"pos": 12, "seen": (1, 2), "lr": 0.5, "ids": {3: "x"}}}
    with ckptd.Checkpointer(str(base / "ckpt")) as ckpt:
        path = ckpt.save(1, state).path
    safetensors_torch = pytest.importorskip("safetensors.torch")
    hf = base / "hf"
    hf.mkdir()
    shards = {"model-00001-of-00002.safetensors": ["embed.weight"], "model-00002-of-00002.safetensors": ["head.bias"]}
    for name, keys in shards.items():
        safetensors_torch.save_file({k: model[k] for k in keys}, str(hf / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 88}, "weight_map": {k: n for n, keys in shards.items() for k in keys}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = ckptd.Checkpointer(str(base / "loader"))  # one writer process for the whole module
    ckpt.health_check()  # its start (a thread opens /dev/null for the child) is over before a case watches opens
    yield {"ckptd": path, "hf": str(hf), "model": model, "data": state["data"], "checkpointer": ckpt}
    ckpt.close()


def _plant_secrets(case_root: str) -> None:
    """Files a hostile name could point at, just outside the checkpoint directory."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    secret = {"embed.weight": torch.full((4, 3), SECRET), "head.bias": torch.full((5,), int(SECRET))}
    for name in ("secret.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        safetensors_torch.save_file(secret, os.path.join(case_root, name))


# ---- the mutator ---------------------------------------------------------------------------

_HOSTILE_VALUES: list[Any] = [
    5,
    -1,
    0,
    2**70,
    -(2**63),
    1.5,
    1e308,
    True,
    None,
    "",
    "..",
    "../secret.safetensors",
    "/etc/passwd",
    "a/b",
    "checkpoint-2",
    "I32",
    "F64",
    "BOOL",
    "xyz",
    [],
    [5],
    [2**70, 0],
    [-1, 3],
    {},
    {"__ckptd__": "tuple", "items": 5},
    {"__ckptd__": "pickle", "b64": "gASVAAAAAA=="},
    {"__ckptd__": "dtype", "value": "load"},
]


_DEEP = "__deep__"


def _dump(body: Any) -> bytes:
    """JSON text of a mutated document, deep-nesting markers expanded (json.dumps itself
    cannot write a 200,000-deep document)."""
    text = json.dumps(body)
    while (at := text.find(f'"{_DEEP}')) >= 0:
        end = text.index('"', at + 1)
        depth = int(text[at + 1 + len(_DEEP) : end])
        text = text[:at] + "[" * depth + "1" + "]" * depth + text[end + 1 :]
    return text.encode()


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        node = node[part]
    return node


def mutate_json(rng: random.Random, body: Any) -> Any:
    """One structural edit of a parsed JSON document."""
    paths = _paths(body)
    path = rng.choice(paths[1:] or paths)
    choice = rng.random()
    if not path:
        return rng.choice(_HOSTILE_VALUES)
    parent, last = _get(body, path[:-1]), path[-1]
    if choice < 0.55:
        parent[last] = rng.choice(_HOSTILE_VALUES)
    elif choice < 0.7 and isinstance(parent, dict):
        del parent[last]
    elif choice < 0.8:
        parent[last] = f"{_DEEP}{rng.choice([3, 100, 600, 5000, 200_000])}"  # expanded by _dump
    elif choice < 0.9 and isinstance(parent, dict):
        value = parent.pop(last)
        parent[rng.choice(["../x", "/abs", "..", "a/b", last + "\x00"])] = value
    else:
        value = parent[last]
        parent[last] = -value if isinstance(value, int) and not isinstance(value, bool) else str(value)
    return body


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Flip, insert or drop bytes, or truncate."""
    data = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0 and data:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:
        at = rng.randrange(len(data) + 1)
        data[at:at] = rng.choice([b"[", b"{", b'"', b"\xff", b"NaN", b"Infinity", b"-", b"9" * 30])
    elif kind == 2 and data:
        del data[rng.randrange(len(data))]
    else:
        data = data[: rng.randrange(len(data) + 1)]
    return bytes(data)


def _header(data: bytes) -> tuple[Any, bytes] | None:
    (length,) = struct.unpack("<Q", data[:8])
    try:
        return json.loads(data[8 : 8 + length]), data[8 + length :]
    except ValueError:
        return None


def mutate_file(rng: random.Random, path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".safetensors"):
        parsed = _header(data)
        if parsed is not None and rng.random() < 0.7:
            header, rest = parsed
            text = _dump(mutate_json(rng, header))
            text += b" " * (-len(text) % 8)
            data = struct.pack("<Q", len(text)) + text + rest
        else:
            head = mutate_bytes(rng, data[:200])
            data = head + data[200:]
    elif rng.random() < 0.6:
        data = _dump(mutate_json(rng, json.loads(data)))
    else:
        data = mutate_bytes(rng, data)
    with open(path, "wb") as f:
        f.write(data)


def resign(directory: str, changed: str) -> None:
    """Make the manifest accept a changed file (its size and CRC) and drop the manifest's own
    checksum, as a writer from before the checksum (or a careful attacker) would."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            body = json.load(f)
        body.pop("checksum", None)
        if changed != MANIFEST and isinstance(body.get("files"), dict):
            with open(os.path.join(directory, changed), "rb") as f:
                data = f.read()
            body["files"][changed] = {"size": len(data), "crc32c": format_crc(crc32c(data))}
        with open(os.path.join(directory, MANIFEST), "w") as f:
            json.dump(body, f)
    except (ValueError, TypeError, AttributeError, OSError):
        pass  # the mutation already broke the manifest: nothing to re-sign


# ---- the entry points ------------------------------------------------------------------------


def _entry_points(directory: str, root: str, ckpt: ckptd.Checkpointer) -> dict[str, Callable[[], Any]]:
    def reader_all() -> Any:
        reader = CheckpointReader.open(directory)
        out = {c: reader.read(c) for c in reader.components()}
        reader.state_trees()
        return out

    def reader_verify() -> Any:
        reader = CheckpointReader.open(directory)
        reader.verify()
        return {c: reader.read(c, verify=True) for c in reader.components()}

    def checkpointer_load() -> Any:
        return ckpt.load(directory)

    def cli_commands() -> Any:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cli.main(["info", directory])
            assert cli.main(["ls", root]) == 0
            return cli.main(["verify", directory])

    return {
        "reader": reader_all,
        "verify": reader_verify,
        "load_checkpoint": lambda: ckptd.load_checkpoint(directory),
        "load_sharded_state_dict": lambda: ckptd.load_sharded_state_dict(directory),
        "checkpointer": checkpointer_load,
        "cli": cli_commands,
    }


def _only_saved_tensors(value: Any, model: dict[str, torch.Tensor]) -> None:
    """Nothing planted outside the directory was loaded."""
    if isinstance(value, torch.Tensor):
        if value.numel() and value.dtype.is_floating_point:
            assert not bool((value == SECRET).any()), "a tensor from outside the checkpoint was loaded"
    elif isinstance(value, dict):
        for v in value.values():
            _only_saved_tensors(v, model)


def run_case(seed: int, golden: dict[str, Any], workdir: str) -> None:
    rng = random.Random(seed)
    kind = "ckptd" if rng.random() < 0.7 else "hf"
    case_root = os.path.join(workdir, f"case-{seed}")
    os.makedirs(case_root)
    directory = os.path.join(case_root, "checkpoint-1")
    shutil.copytree(golden[kind], directory)
    _plant_secrets(case_root)
    target = rng.choice(sorted(n for n in os.listdir(directory) if n.endswith((".json", ".safetensors"))))
    mutate_file(rng, os.path.join(directory, target))
    resigned = kind == "ckptd" and rng.random() < 0.5
    if resigned:
        resign(directory, target)
    # A success must return the saved data when every edit was under a checksum the load checks:
    # the manifest (self-checksum), state.json (CRC on every load) or a header the loader never
    # uses (ckptd takes tensor locations from the manifest).
    exact = kind == "ckptd" and not resigned and target != "model.safetensors.index.json"
    with watching(directory, workdir) as outside:
        for name, call in _entry_points(directory, case_root, golden["checkpointer"]).items():
            try:
                result = call()
            except CkptdError:
                continue
            except Exception as e:  # the point of the suite
                raise AssertionError(
                    f"seed {seed}: {name} raised {type(e).__name__} (not a ckptd error) after mutating "
                    f"{kind}/{target}: {e}"
                ) from e
            _only_saved_tensors(result, golden["model"])
            if exact and name in ("load_checkpoint", "load_sharded_state_dict"):
                if target.endswith(".safetensors"):
                    continue  # a damaged shard: data is checked only with verify (next entry)
                assert_same(golden["model"], result, f"seed {seed} {name} {target}")
            if exact and name == "checkpointer" and not target.endswith(".safetensors"):
                assert_same(golden["model"], result["model"], f"seed {seed} {name} {target}")
                assert result["data"] == golden["data"], f"seed {seed}: state changed undetected"
            if exact and name == "verify":
                assert_same(golden["model"], result["model"], f"seed {seed} {name} {target}")
        listed = list_checkpoints(LocalStorage(), case_root)  # never raises
        assert [info.step for info in listed] in ([], [1])
    assert not outside, f"seed {seed}: opened files outside the checkpoint: {sorted(set(outside))[:3]}"
    shutil.rmtree(case_root)


@pytest.mark.slow
@pytest.mark.timeout(30)  # a hang in any entry point fails its case, not the run
@pytest.mark.parametrize("seed", range(CASES))
def test_hostile_files(seed: int, golden: dict[str, Any], tmp_path: Any) -> None:
    run_case(seed, golden, str(tmp_path))


def test_the_mutator_is_deterministic_and_mutates(golden: dict[str, Any], tmp_path: Any) -> None:
    manifest = os.path.join(golden["ckptd"], MANIFEST)
    with open(manifest, "rb") as f:
        original = f.read()
    outputs = []
    for _ in range(2):
        copy = str(tmp_path / "m.json")
        with open(copy, "wb") as f:
            f.write(original)
        mutate_file(random.Random(7), copy)
        with open(copy, "rb") as f:
            outputs.append(f.read())
    assert outputs[0] == outputs[1] != original


def test_the_watcher_sees_opens_outside_the_checkpoint_absolute_and_relative(tmp_path: Any) -> None:
    """The audit is not blind: loads open files relative to the checkpoint's directory handle."""
    root, area = tmp_path / "area" / "checkpoint", tmp_path / "area"
    root.mkdir(parents=True)
    (area / "secret").write_bytes(b"x")
    (root / "inside").write_bytes(b"y")
    with watching(str(root), str(area)) as outside:
        directory = os.open(str(area), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.close(os.open("secret", os.O_RDONLY, dir_fd=directory))
        finally:
            os.close(directory)
        with open(area / "secret", "rb"):
            pass
        inner = os.open(str(root), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.close(os.open("inside", os.O_RDONLY, dir_fd=inner))
        finally:
            os.close(inner)
    assert outside == [str((area / "secret").resolve())] * 2


# ---- adversarial pass, item 11: sizes no load can allocate -------------------------------------
#
# A file that claims a 4 TiB tensor costs nothing to make (a sparse file of that size, or a
# .bin whose pickle expands one float).  Loading it used to raise the allocator's RuntimeError,
# or torch's "Stride calculation overflowed" for a shape that holds nothing.

HUGE = 2**40  # float32 elements: 4 TiB, more than any test machine's RAM and swap


def _sparse(path: str, size: int) -> None:
    """Extend ``path`` to ``size`` bytes without writing them (skip where the file system can't)."""
    try:
        os.truncate(path, size)
    except OSError as e:
        pytest.skip(f"no {size}-byte sparse files here: {e}")


def _safetensors_file(path: str, entries: dict[str, tuple[str, list[int], int]]) -> None:
    """A safetensors file whose header lists ``{key: (dtype, shape, nbytes)}`` back to back,
    extended (sparsely) to the size the header needs."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for key, (dtype, shape, nbytes) in entries.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + nbytes]}
        start += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
    _sparse(path, 8 + len(text) + start)


def _hf_checkpoints(base: Any, entries: dict[str, tuple[str, list[int], int]]) -> dict[str, str]:
    """The same crafted tensors as an HF sharded checkpoint and as a single model.safetensors."""
    sharded, single = base / "sharded", base / "single"
    sharded.mkdir()
    single.mkdir()
    shard = "model-00001-of-00001.safetensors"
    _safetensors_file(str(sharded / shard), entries)
    index = {"metadata": {}, "weight_map": dict.fromkeys(entries, shard)}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    _safetensors_file(str(single / "model.safetensors"), entries)
    return {"sharded": str(sharded), "single": str(single)}


def _neighbour(base: Any) -> tuple[str, dict[str, torch.Tensor]]:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)}
    (base / "neighbour").mkdir()
    safetensors_torch.save_file(state, str(base / "neighbour" / "model.safetensors"), metadata={"format": "pt"})
    return str(base / "neighbour"), state


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 6))


def test_ckptd_manifest_of_a_4tib_tensor_in_a_sparse_shard(checkpointer):
    """A valid-looking checkpoint (manifest, sizes, checksum all agree) whose shard is a sparse
    4 TiB file: every load that would allocate it fails before allocating, naming it."""
    state = {"model": {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.ones(3)}}
    for step in (1, 2):
        checkpointer.save(step, state)
    path = checkpointer.path_for(1)
    with open(os.path.join(path, MANIFEST)) as f:
        body = json.load(f)
    shard = body["components"]["model"]["tensors"]["w"]["file"]
    size = body["files"][shard]["size"]
    body["components"]["model"]["tensors"]["w"] = {
        "dtype": "F32",
        "shape": [HUGE],
        "file": shard,
        "offsets": [size, size + 4 * HUGE],
    }
    body["files"][shard]["size"] = size + 4 * HUGE
    _sparse(os.path.join(path, shard), size + 4 * HUGE)
    body.pop("checksum")
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    body["checksum"] = format_crc(crc32c(canonical))
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(body, f)
    message = rf"tensor 'w' \({shard}\): loading needs {4 * HUGE} bytes of new memory, more than this machine has"
    for load in (
        lambda: checkpointer.load(1),
        lambda: checkpointer.load(1, keys=["model.w"]),
        lambda: checkpointer.load(1, into={"model": _Holder()}, strict=False, assign=True),
        lambda: ckptd.load_checkpoint(path),
        lambda: CheckpointReader.open(path).read("model", ["w"]),
    ):
        with pytest.raises(AllocationError, match=message):
            load()
    with pytest.raises(KeyMismatchError, match=r"size mismatch for 'w'"):  # in place: nothing to allocate
        checkpointer.load(1, into={"model": _Holder()}, strict=False)
    assert_same({"b": state["model"]["b"]}, checkpointer.load(1, keys=["model.b"])["model"])  # the rest loads
    assert_same(state["model"], checkpointer.load(2)["model"])


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_hf_header_of_a_4tib_tensor_in_a_sparse_file(tmp_path, layout):
    paths = _hf_checkpoints(tmp_path, {"w": ("F32", [HUGE], 4 * HUGE), "b": ("BF16", [2], 4)})
    shard = "model-00001-of-00001.safetensors" if layout == "sharded" else "model.safetensors"
    message = rf"tensor 'w' \({shard}\): loading needs {4 * HUGE} bytes"
    with pytest.raises(AllocationError, match=message):
        ckptd.load_checkpoint(paths[layout])
    with pytest.raises(AllocationError, match=message):
        ckptd.load_checkpoint(paths[layout], keys={"w"})
    with pytest.raises(AllocationError, match=message):
        ckptd.load_checkpoint(paths[layout], _Holder(), strict=False, assign=True)
    assert ckptd.load_checkpoint(paths[layout], keys={"b"})["b"].shape == (2,)  # the rest still loads
    neighbour, state = _neighbour(tmp_path)
    assert_same(state, ckptd.load_checkpoint(neighbour))


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_hf_header_of_an_empty_tensor_whose_strides_overflow(tmp_path, layout):
    paths = _hf_checkpoints(tmp_path, {"w": ("F32", [0, 2**62, 2**62], 0), "b": ("BF16", [2], 4)})
    shard = "model-00001-of-00001.safetensors" if layout == "sharded" else "model.safetensors"
    message = rf"shape \[0, {2**62}, {2**62}\] is beyond any tensor .*for tensor 'w' in .*{shard}"
    with pytest.raises(CorruptCheckpointError, match=message):
        ckptd.load_checkpoint(paths[layout], keys={"w"})
    with pytest.raises(CorruptCheckpointError, match=message):
        ckptd.load_checkpoint(paths[layout], _Holder(), strict=False)
    neighbour, state = _neighbour(tmp_path)
    assert_same(state, ckptd.load_checkpoint(neighbour))


def test_bin_shard_that_expands_one_float_to_4tib(tmp_path):
    """A .bin pickle may hold a stride-0 view: 4 bytes on disk, 4 TiB once copied."""
    (tmp_path / "bin").mkdir()
    torch.save({"w": torch.zeros(1).expand(HUGE), "b": torch.ones(2)}, str(tmp_path / "bin" / "pytorch_model.bin"))
    message = r"tensor 'w' \(pytorch_model\.bin\): loading needs 4398046511104 bytes"
    with pytest.raises(AllocationError, match=message):
        ckptd.load_checkpoint(str(tmp_path / "bin"))
    with pytest.raises(AllocationError, match=message):
        ckptd.load_checkpoint(str(tmp_path / "bin"), keys={"w"})
    assert_same({"b": torch.ones(2)}, ckptd.load_checkpoint(str(tmp_path / "bin"), keys={"b"}))
    neighbour, state = _neighbour(tmp_path)
    assert_same(state, ckptd.load_checkpoint(neighbour))


def test_allocator_refusal_is_an_allocation_error(tmp_path, monkeypatch):
    """Without the check against RAM and swap, the allocator itself refuses 4 TiB (unless the
    kernel overcommits without limit: then it would hand the memory out and the read would
    fill it, so the case is skipped)."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            overcommit = f.read().strip()
    except OSError:
        overcommit = "unknown"
    if overcommit not in ("0", "2"):
        pytest.skip(f"vm.overcommit_memory is {overcommit}: a 4 TiB allocation might succeed")
    monkeypatch.setattr(fetch, "_memory_bytes", lambda: None)
    paths = _hf_checkpoints(tmp_path, {"w": ("F32", [HUGE], 4 * HUGE)})
    with pytest.raises(AllocationError, match=rf"tensor 'w' \(model\.safetensors\): cannot allocate {4 * HUGE} bytes"):
        ckptd.load_checkpoint(paths["single"])


def test_tensors_that_fit_alone_but_not_together(tmp_path, monkeypatch):
    """Each tensor fits this (pretend 1 MB) machine, both do not: refused before either is
    allocated; each one alone still loads."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {"a": torch.randn(150_000), "b": torch.randn(150_000)}  # 600 kB each
    (tmp_path / "two").mkdir()
    safetensors_torch.save_file(state, str(tmp_path / "two" / "model.safetensors"))
    monkeypatch.setattr(fetch, "_memory_bytes", lambda: 1_000_000)
    with pytest.raises(
        AllocationError, match=r"two: 2 tensors \(the largest 'a'\): loading needs 1200000 bytes of new"
    ):
        ckptd.load_checkpoint(str(tmp_path / "two"))
    for key in state:
        assert_same({key: state[key]}, ckptd.load_checkpoint(str(tmp_path / "two"), keys={key}))


def test_fresh_tensor_of_a_shape_torch_cannot_describe():
    """What every loader allocates through (DCP's reader too, where it can): a ckptd error,
    never torch's "Stride calculation overflowed"."""
    with pytest.raises(CorruptCheckpointError, match=r"ckpt: tensor 'w': shape \[0, 4611686018427387904, 4\]"):
        fetch.empty_tensor((0, 2**62, 4), torch.float32, "ckpt: tensor 'w'")
    assert fetch.empty_tensor((0, 2**30, 2**30), torch.float32, "ckpt: tensor 'w'").stride() == (2**60, 2**30, 1)


def test_dcp_metadata_of_a_4tib_tensor(dcp_checkpoint):
    """A DCP ``.metadata`` (only DCP's own classes: the restricted unpickler admits it) whose
    tensor claims 4 TiB: refused before torch allocates, as ckptd's error."""
    import pickle

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _, _, source = dcp_checkpoint
    path = os.path.join(source, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # the test's own file, written by torch just now
    entry = next(v for v in metadata.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata))
    entry.size = torch.Size([HUGE])
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(AllocationError, match=r"DCP tensor"):
        ckptd.load_checkpoint(source)
