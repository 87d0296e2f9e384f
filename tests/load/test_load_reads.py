"""How a load reads: each byte once, one pass over every component, page cache or O_DIRECT.

Bytes read are taken from ``/proc/self/io`` (``rchar``: what read calls returned to this
process, page cache or disk alike), around real saves and loads on real file systems.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
import torch
from conftest import bytes_read

import ckptd
from ckptd.errors import CorruptCheckpointError
from ckptd.load import direct
from ckptd.load.fetch import tensor_memoryview

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/io and O_DIRECT are Linux's")


def _drop_cache(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _odd_state() -> dict[str, dict[str, torch.Tensor]]:
    """Tensors of odd byte sizes, so almost no tensor starts on a 4 KiB boundary of its file."""
    gen = torch.Generator().manual_seed(1)
    model = {
        "a.u8": torch.randint(0, 255, (1,), generator=gen, dtype=torch.uint8),
        "b.f16": torch.randn(4097, generator=gen).half(),
        "c.i8": torch.randint(-100, 100, (3, 7), generator=gen, dtype=torch.int8),
        "d.f32": torch.randn(1031, 17, generator=gen),
        "e.bool": torch.rand(13, generator=gen) > 0.5,
        "f.f64": torch.randn(777, generator=gen, dtype=torch.float64),
        "g.bf16": torch.randn(300_001, generator=gen).bfloat16(),
        "h.empty": torch.zeros(0, 5),
    }
    optimizer = {f"state.{k}.exp_avg": torch.randn(v.shape, generator=gen) for k, v in model.items() if v.dim()}
    optimizer["step"] = torch.tensor(7)
    return {"model": model, "optimizer": optimizer}


def _payload(state: dict[str, dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for tensors in state.values() for t in tensors.values())


def _assert_same(expected: dict[str, dict[str, torch.Tensor]], actual: dict[str, dict[str, torch.Tensor]]) -> None:
    assert expected.keys() == actual.keys()
    for component, tensors in expected.items():
        assert tensors.keys() == actual[component].keys()
        for key, tensor in tensors.items():
            got = actual[component][key]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
            assert torch.equal(got, tensor), f"{component}.{key}"


def _targets(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    def fill(t: torch.Tensor) -> torch.Tensor:
        return ~t if t.dtype == torch.bool else torch.full_like(t, 3)

    return {c: {k: fill(t) for k, t in ts.items()} for c, ts in state.items()}


@pytest.fixture
def saved(tmp_path):
    state = _odd_state()
    ckpt = ckptd.Checkpointer(str(tmp_path / "ckpts"))
    try:
        result = ckpt.save(1, state)
        yield ckpt, state, result.path
    finally:
        ckpt.close()


def _shard_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


def _small_files(path: str) -> int:
    """Bytes of the checkpoint's files that are not shards (manifest, state, indexes)."""
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if not n.endswith(".safetensors"))


@pytest.mark.parametrize("direct_reads", ["0", "1"])
def test_a_full_load_reads_every_tensor_byte_once(saved, monkeypatch, direct_reads):
    """A load into preallocated tensors reads each stored byte once (both components in one
    pass), warm or cold, through the page cache or with O_DIRECT; the result is bit-exact."""
    ckpt, state, path = saved
    monkeypatch.setenv("CKPTD_DIRECT_READS", direct_reads)
    payload = _payload(state)
    for cold in (False, True):
        if cold:
            _drop_cache(path)
        targets = _targets(state)
        before = bytes_read()
        ckpt.load(1, into=targets)
        read = bytes_read() - before
        _assert_same(state, targets)
        if direct_reads == "0":  # exactly the tensors' bytes, plus the manifest and state.json
            assert payload <= read <= payload + _small_files(path), (cold, read, payload)
        else:
            # Aligned runs also cover the padding between tensors, and where a run meets a range
            # read through the page cache (the header, written buffered, may be cached) both
            # read the page they share: at most two pages per tensor more than the files hold.
            pages = 2 * 4096 * sum(len(ts) for ts in state.values())
            assert payload <= read <= _shard_bytes(path) + _small_files(path) + pages, (cold, read, payload)


def test_verify_true_reads_files_twice_and_still_loads(saved):
    """``verify=True`` checks CRC32C of every file it reads in a pass of its own, before any
    target is touched (documented cost: the files' bytes once more)."""
    ckpt, state, path = saved
    targets = _targets(state)
    shard_bytes = _shard_bytes(path)
    before = bytes_read()
    ckpt.load(1, into=targets, verify=True)
    read = bytes_read() - before
    _assert_same(state, targets)
    assert shard_bytes + _payload(state) <= read <= shard_bytes + _payload(state) + 2 * _small_files(path)


def test_corrupt_tensor_bytes_raise_with_verify_and_leave_targets_untouched(saved):
    ckpt, state, path = saved
    shard = next(os.path.join(path, n) for n in sorted(os.listdir(path)) if n.startswith("optimizer"))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    targets = _targets(state)
    untouched = {c: {k: t.clone() for k, t in ts.items()} for c, ts in targets.items()}
    with pytest.raises(CorruptCheckpointError, match=r"optimizer-.*\.safetensors.*CRC32C"):
        ckpt.load(1, into=targets, verify=True)
    _assert_same(untouched, targets)
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        ckpt.load(1, keys=["optimizer.state.d.f32.exp_avg"], verify=True)


def test_keys_load_reads_about_the_bytes_asked_for(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    state = {"model": {f"w{i}": torch.randn(50_000 + i, generator=gen) for i in range(20)}}
    ckpt = ckptd.Checkpointer(str(tmp_path / "ckpts"))
    try:
        path = ckpt.save(1, state).path
        keys = ["model.w3", "model.w11", "model.w12"]
        wanted = sum(state["model"][k.split(".")[1]].nbytes for k in keys)
        for direct_reads in ("0", "1"):
            monkeypatch.setenv("CKPTD_DIRECT_READS", direct_reads)
            _drop_cache(path)
            before = bytes_read()
            loaded = ckpt.load(1, keys=keys)
            read = bytes_read() - before
            for key in keys:
                got, want = loaded["model"][key.split(".")[1]], state["model"][key.split(".")[1]]
                assert got.dtype == want.dtype and torch.equal(got, want)
            assert wanted <= read <= 1.05 * wanted + _small_files(path), (direct_reads, read, wanted)
    finally:
        ckpt.close()


def test_small_runs_cut_tensors_across_many_reads_bit_exact(saved, monkeypatch):
    """With 4 KiB runs every tensor larger than a page is cut into several O_DIRECT runs whose
    pages overlap their neighbours': every byte still lands in its own tensor."""
    ckpt, state, path = saved
    monkeypatch.setattr(direct, "DIRECT_RUN", 4096)
    monkeypatch.setattr(direct, "_CACHED_BATCH", 8192)
    for direct_reads in ("0", "1"):
        monkeypatch.setenv("CKPTD_DIRECT_READS", direct_reads)
        _drop_cache(path)
        targets = _targets(state)
        ckpt.load(1, into=targets)
        _assert_same(state, targets)
        _assert_same(state, ckpt.load(1))


def _read_every_range_with_o_direct(path: str, size: int) -> bytes:
    out = bytearray(size)
    view = memoryview(out)
    # Odd-sized requests at odd offsets, with a gap, in one job.
    requests = [(1, view[1:4099]), (4099, view[4099:9000]), (9100, view[9100:size])]
    direct.read_local([(path, requests)], every_range=True)
    return bytes(out[1:9000]) + bytes(out[9100:])


@contextlib.contextmanager
def _refusing_directory() -> Iterator[str]:
    """A directory on a file system that refuses O_DIRECT: /dev/shm on kernels before 6.6
    (tmpfs learnt O_DIRECT then), else a ramfs mounted for the test (needs root)."""
    candidates = ["/dev/shm"] if os.path.isdir("/dev/shm") else []
    for base in candidates:
        directory = tempfile.mkdtemp(dir=base)
        probe = os.path.join(directory, "probe")
        open(probe, "wb").close()
        try:
            os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        except OSError:
            os.remove(probe)
            try:
                yield directory
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            return
        shutil.rmtree(directory, ignore_errors=True)
    directory = tempfile.mkdtemp()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "ramfs", "none", directory]).returncode == 0
    try:
        if not mounted:
            pytest.skip("no file system refusing O_DIRECT here (tmpfs accepts it since Linux 6.6; no root for ramfs)")
        yield directory
    finally:
        if mounted:
            subprocess.run(["umount", "-l", directory], check=False)
        shutil.rmtree(directory, ignore_errors=True)


def test_o_direct_refused_by_the_file_system_falls_back_to_the_page_cache(monkeypatch):
    with _refusing_directory() as directory:
        data = os.urandom(3 * 4096 + 123)
        path = os.path.join(directory, "data.bin")
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(OSError):
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        assert _read_every_range_with_o_direct(path, len(data)) == data[1:9000] + data[9100:]
        # And a whole save + load there, O_DIRECT asked for.
        monkeypatch.setenv("CKPTD_DIRECT_READS", "1")
        state = _odd_state()
        with ckptd.Checkpointer(os.path.join(directory, "ckpts")) as ckpt:
            ckpt.save(1, state)
            targets = _targets(state)
            ckpt.load(1, into=targets)
        _assert_same(state, targets)


def test_o_direct_reads_of_odd_ranges_are_exact(tmp_path):
    data = os.urandom(5 * 4096 + 77)
    path = str(tmp_path / "data.bin")
    with open(path, "wb") as f:
        f.write(data)
    assert _read_every_range_with_o_direct(path, len(data)) == data[1:9000] + data[9100:]


def test_a_short_file_raises_naming_it(saved):
    _, _, path = saved
    target = torch.empty(1000, dtype=torch.uint8)
    shard = next(os.path.join(path, n) for n in sorted(os.listdir(path)) if n.startswith("model"))
    size = os.path.getsize(shard)
    for every_range in (False, True):
        with pytest.raises(ckptd.errors.StorageError, match="unexpected end of file"):
            direct.read_local([(shard, [(size - 10, tensor_memoryview(target))])], every_range=every_range)


def test_the_read_pool_is_rebuilt_in_a_forked_child(saved):
    """A child forked after a load (the parent's read threads are not in it) loads again; it
    touches no torch kernels itself (torch's OpenMP pool does not survive a fork)."""
    ckpt, state, _ = saved
    ckpt.load(1)  # the parent's pool exists now
    targets = _targets(state)
    expected = b"".join(bytes(tensor_memoryview(t.contiguous())) for ts in state.values() for t in ts.values())
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_end)
        code = 1
        try:
            ckpt.load(1, into=targets)
            got = b"".join(bytes(tensor_memoryview(t)) for ts in targets.values() for t in ts.values())
            code = 0 if got == expected else 2
        finally:
            os.write(write_end, bytes([code]))
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        report = os.read(read_end, 1) if ready else b""
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert report == b"\x00", "the forked child's load hung or read wrong bytes"
    assert os.waitstatus_to_exitcode(status) == 0


def test_span_crcs_combine_to_the_whole_file_crc(tmp_path, monkeypatch):
    """verify=True checksums 16 MiB spans in parallel and folds them in order: the result is
    the CRC32C of the whole file, whatever its size."""
    from ckptd.formats.checksum import crc32c
    from ckptd.load import verify
    from ckptd.storage import storage_for

    monkeypatch.setattr(verify, "SPAN", 1000)
    storage = storage_for(str(tmp_path))
    files = []
    for size in (0, 1, 999, 1000, 1001, 5000, 12345):
        data = os.urandom(size)
        path = str(tmp_path / f"f{size}")
        with open(path, "wb") as f:
            f.write(data)
        files.append(((lambda p=path: storage.open_reader(p)), size, crc32c(data)))
    assert verify.file_crcs([(opener, size) for opener, size, _ in files]) == [crc for _, _, crc in files]


def test_a_large_page_cache_read_is_one_long_task_per_read_thread():
    """1 GiB in 301 ranges, cut as a load cuts them: one task per read thread, each a run of
    consecutive ranges (long sequential streams read cold files faster than 32 MiB tasks); small
    loads keep 32 MiB tasks."""
    sizes = [(i % 7 + 1) * 1_000_000 for i in range(300)]
    sizes.append(2**30 - sum(sizes))
    buffer = memoryview(bytearray(2**30))
    requests, offset = [], 0
    for size in sizes:
        requests.append((offset, buffer[offset : offset + size]))
        offset += size
    pieces = direct.cut_pieces(requests, direct.DIRECT_RUN)
    batches = direct._batches(pieces, direct._batch_bytes(offset))
    assert len(batches) == direct.READ_THREADS
    assert [p for batch in batches for p in batch] == pieces  # every range once, in file order
    assert direct._batch_bytes(40 * 2**20) == 32 * 2**20  # a small load: at least 32 MiB per task


# ---- verification while reading (ckptd.load.inline_verify) --------------------------------------


def _flip_byte_near_end(path: str, prefix: str) -> str:
    shard = next(os.path.join(path, n) for n in sorted(os.listdir(path)) if n.startswith(prefix))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return shard


def _one_pass_bounds(state: dict[str, dict[str, torch.Tensor]], path: str) -> tuple[int, int]:
    """Bytes a load that reads every shard once may read: the shards whole, plus their headers
    (read when the checkpoint is opened) and the small files.  A second pass over the tensors
    (a checksum pass of its own) is above the upper bound."""
    shards = _shard_bytes(path)
    return shards, shards + (shards - _payload(state)) + 2 * _small_files(path)


@pytest.mark.parametrize("small_spans", [False, True])
def test_verify_true_into_new_tensors_checks_while_reading_one_pass(saved, monkeypatch, small_spans):
    """A load that hands out new tensors checks each file as it is read (nothing of the caller's
    is written before the check ends): every shard byte is read once, the result is bit-exact.
    With 4 KiB windows and 12 KiB spans the CRC32C is folded across many windows and spans."""
    from ckptd.load import inline_verify

    if small_spans:
        monkeypatch.setattr(inline_verify, "WINDOW", 4096)
        monkeypatch.setattr(inline_verify, "SPAN", 3 * 4096)
    ckpt, state, path = saved
    low, high = _one_pass_bounds(state, path)
    before = bytes_read()
    loaded = ckpt.load(1, verify=True)
    read = bytes_read() - before
    _assert_same(state, loaded)
    assert low <= read <= high, (read, low, high)
    _flip_byte_near_end(path, "optimizer")
    with pytest.raises(CorruptCheckpointError, match=r"optimizer-.*\.safetensors.*CRC32C.*while it was read"):
        ckpt.load(1, verify=True)
    _assert_same({"model": state["model"]}, ckpt.load(1, components=["model"], verify=True))


def test_verify_inline_into_live_targets_reads_once_and_raises_on_damage(saved):
    """``verify="inline"`` checks as the bytes land in the caller's tensors: one pass, bit-exact;
    a damaged file still raises (its bytes may then be in the targets)."""
    ckpt, state, path = saved
    low, high = _one_pass_bounds(state, path)
    targets = _targets(state)
    before = bytes_read()
    ckpt.load(1, into=targets, verify="inline")
    read = bytes_read() - before
    _assert_same(state, targets)
    assert low <= read <= high, (read, low, high)
    _flip_byte_near_end(path, "model")
    with pytest.raises(CorruptCheckpointError, match=r"model-.*\.safetensors.*CRC32C"):
        ckpt.load(1, into=_targets(state), verify="inline")


def test_keys_load_with_verify_checks_the_bytes_it_does_not_return(saved):
    """A ``keys=`` load checks the whole file the key lives in: damage in another tensor's bytes
    (read into scratch memory, never returned) is found."""
    ckpt, state, path = saved
    _flip_byte_near_end(path, "model")  # the last tensor of the model shard
    intact = [k for k, t in state["model"].items() if torch.equal(ckpt.load(1, keys=[f"model.{k}"])["model"][k], t)]
    assert len(intact) >= len(state["model"]) - 1  # the flipped byte is in one tensor at most
    first = next(k for k in intact if state["model"][k].numel())
    with pytest.raises(CorruptCheckpointError, match="CRC32C"):
        ckpt.load(1, keys=[f"model.{first}"], verify=True)


def test_verify_accepts_only_true_false_or_inline(saved):
    ckpt, _, _ = saved
    with pytest.raises(ckptd.errors.ConfigError, match="verify must be"):
        ckpt.load(1, verify="yes")  # type: ignore[arg-type]


def test_cover_lays_out_every_byte_once_in_windows():
    from ckptd.load.inline_verify import WINDOW, cover

    buffers = [memoryview(bytearray(n)) for n in (10, WINDOW + 5, 3)]
    requests = [(7, buffers[0]), (WINDOW - 2, buffers[1]), (3 * WINDOW, buffers[2])]
    pieces = cover(requests, 3 * WINDOW + 100)
    assert pieces is not None
    position = 0
    for offset, view, length in pieces:
        assert offset == position and length > 0
        assert offset // WINDOW == (offset + length - 1) // WINDOW  # within one window
        assert view is None or view.nbytes == length
        position += length
    assert position == 3 * WINDOW + 100
    assert sum(length for _, view, length in pieces if view is not None) == sum(b.nbytes for b in buffers)
    assert cover([(0, memoryview(bytearray(10))), (5, memoryview(bytearray(10)))], 100) is None  # overlap
    assert cover([(95, memoryview(bytearray(10)))], 100) is None  # past the end
