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
from ckptd.errors import CkptdError
from ckptd.formats.checksum import crc32c, format_crc
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
        return  # relative opens (none on the load path) cannot be resolved reliably here
    real = os.path.realpath(path)
    inside = real == root or real.startswith(root + os.sep)
    # Imports open library files anywhere; what matters is the test area around the case (the
    # planted secrets, the golden copies) and what hostile names point at (/etc, /dev).
    suspicious = real.startswith((_watch["area"] + os.sep, "/etc/", "/dev/", "/proc/"))
    if suspicious and not inside:
        _watch["outside"].append(real)


sys.addaudithook(_audit)


@contextlib.contextmanager
def watching(root: str, area: str) -> Iterator[list[str]]:
    """Record every file opened in ``area`` (or /etc, /dev, /proc) outside ``root`` while the
    block runs."""
    _watch["root"], _watch["area"], _watch["outside"] = os.path.realpath(root), os.path.realpath(area), []
    try:
        yield _watch["outside"]
    finally:
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
