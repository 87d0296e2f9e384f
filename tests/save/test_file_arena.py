"""Staging files that become the checkpoint's (``ckptd.save.file_arena``): the pool never stages
into an arena a checkpoint links, forgets the least recently used lent arena beyond its limit,
and a dead trainer's staging files are swept while a live one's are kept.

Real pieces: a real pool with the in-process writer, real files in a directory, real links,
and a real process that dies holding a staging file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ckptd.errors import WriterError
from ckptd.save.file_arena import FileArena, adoptable, mapped_staging_file
from ckptd.save.plan import LocalTensor, plan_save
from ckptd.save.staging_pool import StagingPool
from ckptd.writer.client import InProcessWriter
from ckptd.writer.shm import SharedSegment, remove_abandoned_files


def _rank_plan(count: int, size: int = 1024):
    local = [LocalTensor("model", f"w{i}", "F32", (size,), (0,), (size,)) for i in range(count)]
    return plan_save([local], 2**30).ranks[0]


def _lend(arena: FileArena, directory: str) -> list[str]:
    """Link every file of ``arena`` elsewhere, as a commit does; returns the links."""
    links = []
    for name, (_, segment, _) in arena.files.items():
        link = os.path.join(directory, f"{arena.arena_id}-{name}")
        os.link(segment.path, link)
        links.append(link)
    return links


@pytest.fixture
def places(tmp_path):
    """The staging files' directory and a directory of checkpoints that link them."""
    files, checkpoints = tmp_path / "arenas", tmp_path / "checkpoints"
    files.mkdir()
    checkpoints.mkdir()
    return files, checkpoints


@pytest.fixture
def pool():
    writer = InProcessWriter()
    staging = StagingPool(writer, 1)
    yield staging
    staging.close()
    writer.close()


def test_an_arena_a_checkpoint_links_is_never_staged_into_and_comes_back_once_unlinked(pool, places):
    files, checkpoints = places
    plan = _rank_plan(4)
    first, _ = pool.acquire(plan, files_in=str(files))
    assert isinstance(first, FileArena) and not first.lent
    pool.release(first)
    links = _lend(first, str(checkpoints))
    assert first.lent
    second, _ = pool.acquire(plan, files_in=str(files))  # max_in_flight=1: the lent one does not count
    assert second is not first
    pool.release(second)
    for link in links:  # retention deleted the checkpoint
        os.unlink(link)
    again, _ = pool.acquire(plan, files_in=str(files))
    assert again in (first, second)
    pool.release(again)


def test_beyond_the_limit_the_least_recently_used_lent_arena_is_forgotten_and_its_links_keep_the_bytes(pool, places):
    files, checkpoints = places
    pool.lent_limit = 1
    plan = _rank_plan(2)
    older, _ = pool.acquire(plan, files_in=str(files))
    older.stage({"model": {f"w{i}": torch.full((1024,), float(i + 1)) for i in range(2)}})
    pool.release(older)
    older_links = _lend(older, str(checkpoints))
    newer, _ = pool.acquire(plan, files_in=str(files))
    pool.release(newer)
    _lend(newer, str(checkpoints))
    third, _ = pool.acquire(plan, files_in=str(files))  # two lent, the limit is one: the older goes
    pool.release(third)
    assert older.files == {} and newer.files  # unmapped, names removed
    assert len(os.listdir(files)) == len(newer.files) + len(third.files)
    before = [open(link, "rb").read() for link in older_links]
    assert all(os.stat(link).st_nlink == 1 for link in older_links)  # only the checkpoint's name is left
    assert any(b"\x00\x00\x80?" in data for data in before), "the checkpoint kept the staged bytes (1.0f)"


def test_only_plans_of_whole_files_get_staging_files_and_a_file_arena_keeps_its_layout(tmp_path):
    plan = _rank_plan(3)
    assert adoptable(plan)
    halves = [[LocalTensor("model", "rows", "F32", (8, 1024), (r * 4, 0), (4, 1024))] for r in (0, 1)]
    assert not adoptable(plan_save(halves, 2**30).ranks[1]), "rank 1 writes its rows into a file rank 0 writes too"
    arena = FileArena(1, plan, str(tmp_path), iter(range(10, 20)))
    try:
        assert sorted(os.stat(os.path.join(tmp_path, n)).st_size for n in os.listdir(tmp_path)) == sorted(
            p.size for p in plan.pieces
        )
        with pytest.raises(WriterError, match="another layout"):
            arena.layout(_rank_plan(5))
    finally:
        arena.close()
    assert os.listdir(tmp_path) == []


def test_a_dead_trainers_staging_file_is_swept_and_a_live_ones_is_kept(tmp_path):
    arenas, checkpoint = tmp_path / "arenas", tmp_path / "checkpoint"
    arenas.mkdir()
    checkpoint.mkdir()
    live = SharedSegment.create_file(str(arenas / "live"), 4096)
    try:
        code = textwrap.dedent(
            f"""
            import os
            from ckptd.writer.shm import SharedSegment
            dead = SharedSegment.create_file({str(arenas / "dead")!r}, 4096)
            dead.mmap[:4] = b"ckpt"
            os.link({str(arenas / "dead")!r}, {str(checkpoint / "shard")!r})  # committed
            os._exit(0)  # killed: close() never runs
            """
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert remove_abandoned_files(str(arenas)) == ["dead"]
        assert os.listdir(arenas) == ["live"]
        assert (checkpoint / "shard").read_bytes()[:4] == b"ckpt"  # the checkpoint keeps the file
    finally:
        live.close()
    assert os.listdir(arenas) == []  # its creator closed it: the name is gone


def test_a_staging_file_read_through_its_mapping_is_never_staged_into_even_once_unlinked(pool, places):
    # a promotion reads a held checkpoint's bytes through the trainer's mapping and checks them
    # piece by piece before writing them: no save may copy into them meanwhile, not even after
    # the checkpoint was deleted under it (else a checked piece could be written changed)
    files, checkpoints = places
    plan = _rank_plan(1)
    arena, _ = pool.acquire(plan, files_in=str(files))
    arena.stage({"model": {"w0": torch.full((1024,), 7.0)}})
    pool.release(arena)
    (link,) = _lend(arena, str(checkpoints))
    fd = os.open(link, os.O_RDONLY)
    try:
        with mapped_staging_file(fd, os.fstat(fd).st_size) as view:
            assert view is not None
            before = bytes(view)
            assert torch.full((1024,), 7.0).numpy().tobytes() in before  # the staged tensor, after the header
            os.unlink(link)  # the checkpoint is deleted while the copy reads it
            assert arena.lent
            other, _ = pool.acquire(plan, files_in=str(files))
            assert other is not arena
            other.stage({"model": {"w0": torch.full((1024,), 9.0)}})
            pool.release(other)
            assert bytes(view) == before
        assert not arena.lent  # given back: the next save may stage into it
        os.link(arena.files[next(iter(arena.files))][1].path, link)  # the next checkpoint links it
        with mapped_staging_file(fd, os.fstat(fd).st_size) as view:
            assert view is not None
            pool.close()  # the Checkpointer closes its arenas while a copy still reads one
            assert bytes(view) == before  # still mapped until the copy lets go
    finally:
        os.close(fd)


def test_only_a_linked_staging_file_of_this_process_and_of_the_size_asked_is_handed_out(tmp_path, pool, places):
    files, checkpoints = places
    arena, _ = pool.acquire(_rank_plan(1), files_in=str(files))
    pool.release(arena)
    ((_, segment, _),) = arena.files.values()
    size = segment.size
    with mapped_staging_file(segment.fd, size) as view:
        assert view is None  # not linked into a checkpoint: a save may stage into it any moment
    (link,) = _lend(arena, str(checkpoints))
    with mapped_staging_file(segment.fd, size + 4096) as view:
        assert view is None  # not the file the manifest lists
    with mapped_staging_file(segment.fd, size) as view:
        assert view is not None and view.nbytes == size
    other = tmp_path / "other"
    other.write_bytes(b"x" * size)
    for path in (other, link):
        fd = os.open(path, os.O_RDONLY)
        try:
            if path == link:
                pool.close()  # the arena is unmapped: its files are no longer handed out
            with mapped_staging_file(fd, size) as view:
                assert view is None  # not (or no longer) a staging file of this process
        finally:
            os.close(fd)
