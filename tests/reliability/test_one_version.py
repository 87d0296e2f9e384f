"""Reliability defect 6: a load sees one version of a checkpoint that is overwritten meanwhile.

Every tensor of a save of version ``v`` holds ``v`` (several components, several shards each, the
same shapes every time, so sizes never tell versions apart), and so does a non-tensor value.  A
load is *mixed* when the values it returns hold two versions.

* Loops: one process overwrites step 0 again and again (``overwrite=True``), another loads it
  again and again (plain, ``verify=True``, ``keys=``, ``into=`` a module): many loads, several
  versions seen, retries counted, no mix.  Locally, and on the moto S3 server.
* The moment itself, deterministically: a loader process stopped (SIGSTOP, from an ``os.open``
  hook of its own) between opening the first and the second shard of a component while the
  checkpoint is overwritten; a reader that read part of a checkpoint before an overwrite, then
  the rest (locally and on S3); a reader of an older incremental save whose referenced sibling
  is replaced; a cached remote file of an older version.  Each returns one version whole or
  raises :class:`~ckptd.errors.CheckpointReplacedError`.
* That the moment is real: the same stopped-loader scenario read the naive way (the manifest,
  then each shard by its path) does mix versions.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import time
from typing import Any

import pytest
import torch
from conftest import S3Place, process_stopped, wait_for

import ckptd
from ckptd.errors import CheckpointNotFoundError, CheckpointReplacedError
from ckptd.load.reader import CheckpointReader

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

LAYERS = 4
WIDTH = 64  # 16 KiB per float32 tensor: one tensor per shard with max_shard_size below
SHARD = "20KiB"
LOOP_SECONDS = 12.0
"""The loads run at least this long, and on until they have done enough complete loads and seen
enough versions (a loaded machine saves and loads slower: the test waits for the behaviour it
checks, not for a time), up to ``LOOP_CAP_SECONDS``."""
LOOP_CAP_SECONDS = 120.0
LEAST_VERSIONS_SEEN = 4  # of versions 2, 3, ...: the saver got to version 5 at least, as checked


# ---- state of one version, and what a load returned ------------------------------------------


def _module() -> torch.nn.Sequential:
    return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def _state(version: int) -> dict[str, Any]:
    """Three components, ``LAYERS`` shards each for the tensor ones; every value is ``version``."""
    value = float(version)
    return {
        "model": {f"{i}.weight": torch.full((WIDTH, WIDTH), value) for i in range(LAYERS)},
        "optimizer": {f"m{i}": torch.full((WIDTH, WIDTH), version, dtype=torch.int32) for i in range(LAYERS)},
        "progress": {"version": version},
    }


def _versions(value: Any) -> set[int]:
    """Every version number in a loaded value (tensors: their distinct elements)."""
    if isinstance(value, torch.Tensor):
        return {int(v) for v in torch.unique(value.detach().float()).tolist()}
    if isinstance(value, dict):
        return set().union(*(_versions(v) for v in value.values())) if value else set()
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    return set()


class _Retries(logging.Handler):
    """Counts ``Checkpointer.load``'s retries (its log records saying it loads again)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "loading again" in record.getMessage():
            self.count += 1


def _count_retries() -> _Retries:
    handler = _Retries()
    logger = logging.getLogger("ckptd.checkpointer")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _load(ckpt: ckptd.Checkpointer, mode: str) -> set[int]:
    """One load of step 0 in ``mode``; the versions its values hold."""
    if mode == "plain":
        return _versions(ckpt.load(0))
    if mode == "verify":
        return _versions(ckpt.load(0, verify=True))
    if mode == "keys":
        return _versions(ckpt.load(0, keys=["model.0.weight", f"model.{LAYERS - 1}.weight", "optimizer.m1"]))
    module, progress = _module(), {}
    optimizer = {f"m{i}": torch.zeros(WIDTH, WIDTH, dtype=torch.int32) for i in range(LAYERS)}
    ckpt.load(0, into={"model": module, "optimizer": optimizer, "progress": progress})
    return _versions(dict(module.state_dict())) | _versions(optimizer) | _versions(progress)


# ---- the processes of the loops --------------------------------------------------------------


def _overwrite_loop(root: str, options: dict[str, Any], pause: float, stop: Any, report: Any) -> None:
    """Save step 0 as versions 2, 3, ... until ``stop`` is set; report the last version.

    Between two saves it waits ``pause`` times as long as the last save took: a loaded machine
    slows the loads as much as the saves, and a fixed pause would leave a slow load no quiet window
    to finish in (the test would then measure the machine's load, not the retries)."""
    version = 1
    with ckptd.Checkpointer(root, storage_options=options, max_shard_size=SHARD) as ckpt:
        while not stop.is_set():
            version += 1
            began = time.monotonic()
            ckpt.save(0, _state(version), overwrite=True)
            stop.wait(pause * (time.monotonic() - began))
    report.put(version)


def _load_loop(root: str, options: dict[str, Any], least_loads: int, started: Any, report: Any) -> None:
    """Load step 0 in turn in every mode (``LOOP_SECONDS`` at least, then until ``least_loads``
    complete loads have seen ``LEAST_VERSIONS_SEEN`` versions); report counts, and any mixed load."""
    retries = _count_retries()
    counts: dict[str, Any] = {
        "loads": 0,
        "mixed": [],
        "replaced": 0,
        "absent": 0,
        "recovered": 0,
        "errors": [],
        "seen": [],
    }
    modes = ["plain", "verify", "keys", "into"]
    with ckptd.Checkpointer(root, storage_options=options) as ckpt:
        started.set()
        start = time.monotonic()

        def enough() -> bool:
            complete = counts["loads"] - counts["replaced"] - counts["absent"]
            return complete >= least_loads and len(counts["seen"]) >= LEAST_VERSIONS_SEEN

        while time.monotonic() < start + LOOP_SECONDS or (not enough() and time.monotonic() < start + LOOP_CAP_SECONDS):
            mode = modes[counts["loads"] % len(modes)]
            retries_before = retries.count
            try:
                versions = _load(ckpt, mode)
            except CheckpointReplacedError:
                counts["replaced"] += 1  # replaced on every try: an answer, not a mix
                continue
            except CheckpointNotFoundError:
                counts["absent"] += 1  # object stores: asked while an overwrite had no manifest yet
                continue
            except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
                counts["errors"].append(f"{mode}: {type(e).__name__}: {e}")
                continue
            finally:
                counts["loads"] += 1
            if retries.count > retries_before:
                counts["recovered"] += 1  # replaced while read, then loaded whole by a retry
            if len(versions) != 1:
                counts["mixed"].append(f"{mode}: {sorted(versions)}")
            counts["seen"] = sorted(set(counts["seen"]) | versions)
    counts["retries"] = retries.count
    report.put(counts)


def _run_loops(root: str, options: dict[str, Any], least_loads: int, pause: float) -> tuple[dict[str, Any], int]:
    context = multiprocessing.get_context("spawn")
    stop, started, report = context.Event(), context.Event(), context.Queue()
    with ckptd.Checkpointer(root, storage_options=options, max_shard_size=SHARD) as ckpt:
        path = ckpt.save(0, _state(1)).path
    loader = context.Process(target=_load_loop, args=(root, options, least_loads, started, report), name="loader")
    saver = context.Process(target=_overwrite_loop, args=(root, options, pause, stop, report), name="saver")
    saver.start()
    wait_for(lambda: _saved_again(path, options), timeout=120, interval=0.2)  # the saver is up: overwrites from now on
    loader.start()
    started.wait(120)
    try:
        counts = report.get(timeout=LOOP_CAP_SECONDS + 120)
        stop.set()
        last = report.get(timeout=120)
    finally:
        stop.set()
        for process in (loader, saver):
            process.join(60)
            if process.is_alive():
                process.kill()
                process.join()
    return counts, last


def _saved_again(path: str, options: dict[str, Any]) -> bool:
    """Whether the checkpoint at ``path`` holds a version other than 1 now."""
    try:
        with CheckpointReader.open(path, options, require_manifest=True) as reader:
            return _versions(reader.read("model", ["0.weight"])) != {1}
    except (CheckpointNotFoundError, CheckpointReplacedError):
        return False


def _check_loops(counts: dict[str, Any], last: int, least_loads: int, absent: bool = False) -> None:
    summary = {k: v if not isinstance(v, list) else len(v) for k, v in counts.items()}
    print(f"loops: {summary}, versions saved: 2..{last}, seen by loads: {counts['seen'][:3]}...{counts['seen'][-3:]}")
    assert counts["mixed"] == [], f"loads that mixed versions: {counts['mixed'][:5]}"
    assert counts["errors"] == [], f"loads that failed: {counts['errors'][:5]}"
    # The overwrites really ran under the loads: the loads saw many of the versions saved.
    assert last >= 5 and len(counts["seen"]) >= LEAST_VERSIONS_SEEN, summary
    # The retries are what turns an overwrite under a load into a whole load: some loads were
    # replaced while read and then completed (none without retries).  A load replaced on every try
    # is an answer, not a failure, but rare: without retries about a third of the loads are.
    assert counts["recovered"] >= 1, summary
    assert counts["replaced"] <= counts["loads"] // 5, summary
    assert absent or counts["absent"] == 0, summary  # locally an overwrite swaps directories: never absent
    assert counts["loads"] - counts["replaced"] - counts["absent"] >= least_loads, summary


def test_loads_during_local_overwrites_see_one_version(tmp_path):
    counts, last = _run_loops(str(tmp_path / "root"), {}, least_loads=100, pause=0.0)
    _check_loops(counts, last, least_loads=100)


@pytest.mark.objectstore
def test_loads_during_s3_overwrites_see_one_version(s3: S3Place):
    pytest.importorskip("s3fs")
    # A pause between saves (twice the last save's time): on an object store the checkpoint has no
    # manifest for most of an overwrite, and back-to-back overwrites would leave the loads few
    # chances to find one.
    counts, last = _run_loops(s3.url("loops"), s3.options(), least_loads=15, pause=2.0)
    _check_loops(counts, last, least_loads=15, absent=True)


# ---- the moment itself -----------------------------------------------------------------------

_STOP_AT_SECOND_SHARD = """
import os, signal, sys
real_open, opened = os.open, []
def hooked_open(path, flags, *args, **kwargs):  # stop before the second shard file is opened
    if str(path).endswith(".safetensors") and not flags & os.O_CREAT:
        opened.append(path)
        if len(opened) == 2:
            os.kill(os.getpid(), signal.SIGSTOP)
    return real_open(path, flags, *args, **kwargs)
os.open = hooked_open
"""

_LOAD_ONCE = """
import json, logging, sys, ckptd
from test_one_version import _count_retries, _versions
retries = _count_retries()
with ckptd.Checkpointer(sys.argv[1]) as ckpt:
    loaded = ckpt.load(0)
print(json.dumps({"versions": sorted(_versions(loaded)), "retries": retries.count}))
"""

_NAIVE_LOAD = """
import json, os, sys
from safetensors.torch import load
from test_one_version import _versions
directory = os.path.join(sys.argv[1], "checkpoint-0")
manifest = json.load(open(os.path.join(directory, "checkpoint_manifest.json")))
versions = set(_versions(json.load(open(os.path.join(directory, "state.json")))))
for name in sorted(n for n in manifest["files"] if n.endswith(".safetensors")):
    fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    data = os.read(fd, manifest["files"][name]["size"])
    os.close(fd)
    versions |= _versions(load(data))
print(json.dumps({"versions": sorted(versions)}))
"""


def _stopped_loader(root: str, script: str) -> dict[str, Any]:
    """Run ``script`` (a load of ``root``'s step 0) in a process that stops itself before it
    opens its second shard; overwrite step 0 as version 2 meanwhile; let it go on."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
    with ckptd.Checkpointer(root, max_shard_size=SHARD) as ckpt:
        ckpt.save(0, _state(1))
        process = subprocess.Popen(
            [sys.executable, "-c", _STOP_AT_SECOND_SHARD + script, root], env=env, stdout=subprocess.PIPE, text=True
        )
        try:
            wait_for(lambda: process_stopped(process.pid) or process.poll() is not None, timeout=60)
            assert process.poll() is None, "the loader ended without opening a second shard"
            ckpt.save(0, _state(2), overwrite=True)  # old directory swapped out and deleted
            os.kill(process.pid, signal.SIGCONT)
            out, _ = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_a_loader_stopped_between_two_shards_reads_one_version(tmp_path):
    result = _stopped_loader(str(tmp_path / "root"), _LOAD_ONCE)
    assert len(result["versions"]) == 1, result
    # The first shard was opened in version 1's directory, which is gone once the loader goes
    # on: the load notices, starts again, and reads version 2 whole.
    assert result == {"versions": [2], "retries": 1}


def test_the_same_moment_read_by_path_mixes_versions(tmp_path):
    """The scenario above is a real mixing opportunity: the manifest and state file of version 1,
    and after the stop, shards of version 2 (what ckptd's reads did before they were pinned)."""
    pytest.importorskip("safetensors")
    result = _stopped_loader(str(tmp_path / "root"), _NAIVE_LOAD)
    assert result["versions"] == [1, 2]


def _read_half_then_rest(root: str, options: dict[str, Any]) -> tuple[set[int], BaseException | None]:
    """Open step 0 (version 1), read its state and the first model tensor, overwrite step 0 as
    version 2 (same sizes), then read the rest through the same reader."""
    with ckptd.Checkpointer(root, storage_options=options, max_shard_size=SHARD) as ckpt:
        ckpt.save(0, _state(1))
        with CheckpointReader.open(ckpt.path_for(0), options) as reader:
            seen = _versions(reader.state_trees()) | _versions(reader.read("model", ["0.weight"]))
            ckpt.save(0, _state(2), overwrite=True)
            try:
                seen |= _versions(reader.read("model"))
                seen |= _versions(reader.read("optimizer", verify=True))
            except CheckpointReplacedError as e:
                return seen, e
            return seen, None


def test_a_reader_never_mixes_the_versions_before_and_after_an_overwrite(tmp_path):
    seen, error = _read_half_then_rest(str(tmp_path / "root"), {})
    assert seen == {1}  # the first reads, and nothing of version 2
    assert isinstance(error, CheckpointReplacedError) and "replaced" in str(error)


@pytest.mark.objectstore
def test_an_s3_reader_never_mixes_the_versions_before_and_after_an_overwrite(s3: S3Place):
    pytest.importorskip("s3fs")
    seen, error = _read_half_then_rest(s3.url("moment"), s3.options())
    assert seen == {1}
    assert isinstance(error, CheckpointReplacedError) and "checkpoint_manifest.json" in str(error)


@pytest.mark.objectstore
def test_a_cached_remote_file_of_an_older_version_is_never_served(s3: S3Place, tmp_path):
    pytest.importorskip("s3fs")
    cache = str(tmp_path / "cache")
    with ckptd.Checkpointer(s3.url("cached"), storage_options=s3.options(), max_shard_size=SHARD) as ckpt:
        ckpt.save(0, _state(1))
        assert _versions(ckpt.load(0, cache_dir=cache)) == {1}
        ckpt.save(0, _state(2), overwrite=True)  # same names, same sizes
        assert _versions(ckpt.load(0, cache_dir=cache)) == {2}
        assert _versions(ckpt.load(0, cache_dir=cache, verify=True)) == {2}
    copies = [name.split(".v-")[0] for _, _, names in os.walk(cache) for name in names]
    assert len(copies) == len(set(copies)), copies  # version 2's copies only: version 1's were removed
    assert len([c for c in copies if c.endswith(".safetensors")]) == LAYERS * 2, copies


def test_an_older_incremental_save_reads_its_referenced_sibling_as_opened(legacy_root):
    """Checkpoint 2 of an older ckptd references checkpoint 1's frozen shard: the reader holds
    that sibling directory open too, so a new directory put in its place is not read."""
    directory = os.path.join(legacy_root, "checkpoint-2")
    expected = CheckpointReader.open(directory).read("model")
    with CheckpointReader.open(directory) as reader:
        sibling = os.path.join(legacy_root, "checkpoint-1")
        shutil.copytree(sibling, sibling + ".new")
        shard = os.path.join(sibling + ".new", "model-00002-of-00002.safetensors")
        with open(shard, "r+b") as f:  # same size, other values
            f.seek(os.path.getsize(shard) - 4)
            f.write(b"\x00\x00\x80\x7f")
        os.rename(sibling, sibling + ".old")
        os.rename(sibling + ".new", sibling)
        loaded = reader.read("model")
    assert set(loaded) == set(expected)
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype and loaded[key].shape == tensor.shape
        assert torch.equal(loaded[key], tensor), key
    changed = CheckpointReader.open(directory).read("model")  # a new reader reads the new sibling
    assert any(not torch.equal(changed[key], tensor) for key, tensor in expected.items())


def _replaced_under_targets(root: str, options: dict[str, Any]) -> tuple[dict[str, torch.Tensor], BaseException]:
    """Open step 0 (version 1), overwrite it as version 2, then read the model into targets."""
    targets = {f"{i}.weight": torch.full((WIDTH, WIDTH), -1.0) for i in range(LAYERS)}
    with ckptd.Checkpointer(root, storage_options=options, max_shard_size=SHARD) as ckpt:
        ckpt.save(0, _state(1))
        with CheckpointReader.open(ckpt.path_for(0), options) as reader:
            ckpt.save(0, _state(2), overwrite=True)
            with pytest.raises(CheckpointReplacedError) as raised:
                reader.read("model", targets=targets)
    return targets, raised.value


@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.objectstore)])
def test_a_read_of_a_replaced_checkpoint_writes_nothing_into_its_targets(backend, tmp_path, request):
    """Bytes go straight into the targets (a module's own tensors): the replacement is noticed
    once every file is open, before a byte is read (local: a file gone from the pinned
    directory; S3: the manifest checked again after the shards' ETags were taken)."""
    if backend == "local":
        targets, error = _replaced_under_targets(str(tmp_path / "root"), {})
    else:
        pytest.importorskip("s3fs")
        place: S3Place = request.getfixturevalue("s3")
        targets, error = _replaced_under_targets(place.url("targets"), place.options())
    assert "load it again" in str(error)
    for key, tensor in targets.items():
        assert torch.equal(tensor, torch.full((WIDTH, WIDTH), -1.0)), f"{key} was written"


@pytest.mark.objectstore
def test_an_s3_reader_reads_only_the_object_version_it_opened(s3: S3Place):
    """Ranged GETs ask ``If-Match`` the ETag the reader opened: an object replaced between two
    reads of one reader is an error naming it, never bytes of the new object."""
    from ckptd.errors import StorageError
    from ckptd.storage import storage_for

    storage = storage_for(s3.url("object"), s3.options())
    path = s3.url("object/shard.bin")
    storage.write_bytes(path, b"a" * 1024)
    reader = storage.open_reader(path)
    assert reader.read(0, 4) == b"aaaa"
    s3.client.put_object(Bucket=s3.bucket, Key="object/shard.bin", Body=b"b" * 1024)
    with pytest.raises(StorageError, match="replaced since it was opened"):
        reader.read(4, 4)
    assert storage.open_reader(path).read(0, 4) == b"bbbb"


def test_every_backend_names_an_object_version(storage_place):
    """``version`` (the stamp object-store loads compare before and after their reads) is stable
    while a file stays, changes when it is written again, and a missing file is MissingFileError."""
    from ckptd.errors import MissingFileError

    storage, path = storage_place.storage, storage_place.path("stamped.json")
    storage.write_bytes(path, b'{"v": 1}')
    first = storage.version(path)
    assert first is not None and storage.version(path) == first
    time.sleep(0.01)  # stores that stamp by time: a later write has a later time
    storage.write_bytes(path, b'{"v": 2}')
    assert storage.version(path) != first
    storage.remove(path)
    with pytest.raises(MissingFileError):
        storage.version(path)
