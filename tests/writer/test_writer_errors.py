"""Errors of the staging arenas, shared-memory segments and writers are ckptd.errors types whose
messages say what failed and where (no bare ValueError / RuntimeError / KeyError)."""

from __future__ import annotations

import errno
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ckptd.errors import ConfigError, CorruptCheckpointError, WriterError
from ckptd.formats.manifest import parse_state_file
from ckptd.save.arena import StagingArena
from ckptd.save.plan import LocalTensor, plan_save
from ckptd.save.staging_pool import StagingPool
from ckptd.writer.client import InProcessWriter, WriterClient
from ckptd.writer.protocol import FileSpec, WriteOrder
from ckptd.writer.shm import SharedSegment


def _rank_plan(count: int):
    local = [LocalTensor("model", f"w{i}", "F32", (1024,), (0,), (1024,)) for i in range(count)]
    return plan_save([local], 2**30).ranks[0]


def test_memfd_that_cannot_grow_is_a_storage_error_naming_the_size():
    # Under RLIMIT_FSIZE, ftruncate of the memfd fails with EFBIG (Python ignores SIGXFSZ).
    code = textwrap.dedent(
        """
        import resource
        from ckptd.errors import StorageError
        from ckptd.writer.shm import SharedSegment
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            SharedSegment.create(64 << 20)
        except StorageError as e:
            print("StorageError", e.errno, e)
        else:
            print("created")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"StorageError {errno.EFBIG} "), result.stdout
    assert f"cannot reserve {64 << 20} bytes of shared memory" in result.stdout
    assert f"(file-size limit {1 << 20} bytes)" in result.stdout
    assert "ulimit -f" in result.stdout


def test_segment_smaller_than_announced_and_closed_segment_are_writer_errors():
    segment = SharedSegment.create(mmap.PAGESIZE)
    try:
        with pytest.raises(
            WriterError, match=rf"holds {mmap.PAGESIZE} bytes, the sender announced {4 * mmap.PAGESIZE}"
        ):
            SharedSegment.attach(os.dup(segment.fd), 4 * mmap.PAGESIZE)
    finally:
        segment.close()
    with pytest.raises(WriterError, match="is closed"):
        segment.view()


def test_arena_misuse_is_a_writer_error_naming_the_arena():
    arena = StagingArena(7, 4096)
    try:
        with pytest.raises(WriterError, match="staging arena 7 has no layout"):
            arena.stage({})
        too_big = _rank_plan(2048)  # 8 MiB of tensors, the arena is 2 MiB: streamed through it
        arena.layout(too_big)
        assert arena.streamed
        with pytest.raises(WriterError, match="a streamed save is staged on the staging thread"):
            arena.stage({})
    finally:
        arena.close()
    with pytest.raises(WriterError, match="staging arena 7 is closed"):
        arena.layout(_rank_plan(1))


def test_closed_staging_pool_is_a_writer_error():
    writer = InProcessWriter()
    pool = StagingPool(writer, 1)
    pool.close()
    try:
        with pytest.raises(WriterError, match="staging pool is closed"):
            pool.acquire(_rank_plan(1))
    finally:
        writer.close()


def test_in_process_writer_refuses_an_unknown_arena_and_a_shared_file_it_cannot_write(tmp_path):
    writer = InProcessWriter()
    segment = SharedSegment.create(mmap.PAGESIZE)
    try:
        future = writer.write_files(WriteOrder(arena_id=5, directory=str(tmp_path), files=[]))
        with pytest.raises(WriterError, match="staging arena 5, which is not attached"):
            future.result(30)

        writer.attach_arena(1, segment)
        spec = FileSpec("part.bin", 0, 8, file_offset=16, whole_file=False)
        future = writer.write_files(WriteOrder(arena_id=1, directory="memory://ckptd-test-errors", files=[spec]))
        # The storage contract: a backend without write_at refuses a shared file by name.
        with pytest.raises(ConfigError, match=r"part\.bin: .* cannot write one file from several ranks"):
            future.result(30)
    finally:
        writer.close()
        segment.close()


@pytest.mark.multiprocess
def test_writer_process_refuses_an_unknown_arena(tmp_path):
    client = WriterClient()
    try:
        future = client.write_files(WriteOrder(arena_id=42, directory=str(tmp_path), files=[]))
        with pytest.raises(WriterError, match="staging arena 42, which is not attached to the writer"):
            future.result(60)
        assert client.ping().busy is False  # the writer lives on
    finally:
        client.close()


def test_state_file_without_a_components_object_is_corrupt():
    with pytest.raises(CorruptCheckpointError, match=r"state\.json: malformed state file"):
        parse_state_file(b'{"components": [1, 2]}', "state.json")


def test_close_kills_a_stopped_writer_within_one_timeout():
    # A SIGSTOPped writer answers neither the Shutdown request nor exits: close() waits for both
    # under one deadline (they were two, so twice the timeout), then kills it.
    client = WriterClient()
    client.ensure_running()
    pid = client.pid
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    client.close(timeout=2.0)
    elapsed = time.monotonic() - started
    assert pid is not None and not os.path.exists(f"/proc/{pid}")  # killed and reaped
    assert elapsed < 3.5, f"close(timeout=2) took {elapsed:.1f} s"
