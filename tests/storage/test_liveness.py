"""The liveness lock of hidden leftovers (``ckptd.storage.liveness``), on real files.

flock locks belong to open file descriptions, so two opens in one process compete like two
processes do; the tests with several processes are in tests/reliability/test_gc_liveness.py.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

from ckptd.errors import StorageError
from ckptd.storage.liveness import claim, hold, hold_new_directory, is_held


def test_a_claim_excludes_every_other_until_released(tmp_path: Any) -> None:
    leftover = tmp_path / ".checkpoint-1.tmp-host-1-ab"
    leftover.mkdir()
    assert is_held(str(leftover)) is False
    first = claim(str(leftover))
    assert first is not None and first.locked
    assert claim(str(leftover)) is None  # a second collection leaves it alone
    assert is_held(str(leftover)) is True
    first.release()
    first.release()  # idempotent
    assert is_held(str(leftover)) is False


def test_files_are_locked_too_and_missing_paths_are_no_ones(tmp_path: Any) -> None:
    temporary = tmp_path / ".model.safetensors.tmp-0a"
    temporary.write_bytes(b"x")
    with hold(str(temporary)) as held:
        assert held.locked and is_held(str(temporary)) is True
    assert is_held(str(temporary)) is False
    assert is_held(str(tmp_path / "gone")) is None
    assert claim(str(tmp_path / "gone")) is None


def test_links_and_fifos_cannot_tell(tmp_path: Any) -> None:
    """Never opened (a FIFO would block, a link leads elsewhere): the caller decides by name."""
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / ".checkpoint-1.tmp-host-1-ab"
    link.symlink_to(target)
    fifo = tmp_path / ".checkpoint-2.tmp-host-1-ab"
    os.mkfifo(fifo)
    with hold(str(target)):
        for path in (link, fifo):
            assert is_held(str(path)) is None
            unknown = claim(str(path))
            assert unknown is not None and not unknown.locked
            unknown.release()


def test_hold_gives_up_after_its_timeout_naming_the_path(tmp_path: Any) -> None:
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    with hold(str(checkpoint)), pytest.raises(StorageError, match="checkpoint-2: another process held its lock"):
        hold(str(checkpoint), timeout=0)
    with pytest.raises(StorageError, match="gone"):
        hold(str(tmp_path / "gone"))


def test_a_new_directory_removed_before_its_lock_is_made_again(tmp_path: Any) -> None:
    """A collection may find the new directory unlocked between its creation and its lock, claim
    it and remove it: the directory is made again and locked (here the collection acts inside
    the creation call, at exactly that moment)."""
    staging = str(tmp_path / ".checkpoint-3.tmp-host-1-ab")
    calls = []

    def make(path: str) -> None:
        os.makedirs(path, exist_ok=True)
        calls.append(os.stat(path).st_ino)
        if len(calls) == 1:
            collection = claim(path)
            assert collection is not None and collection.locked
            shutil.rmtree(path)
            collection.release()

    with hold_new_directory(staging, make) as held:
        assert held.locked and len(calls) == 2
        assert is_held(staging) is True
        assert os.stat(staging).st_ino == calls[1]
    assert is_held(staging) is False


def test_a_new_directory_claimed_by_a_collection_waits_for_it(tmp_path: Any) -> None:
    """The collection still holds its claim when the save tries the lock: the save waits until
    the collection has removed the directory and let go, then makes it again."""
    staging = str(tmp_path / ".checkpoint-4.tmp-host-1-ab")
    collection: list[Any] = []

    def make(path: str) -> None:
        if len(collection) == 1:  # the save came back: the collection finishes its work
            shutil.rmtree(path)
            collection[0].release()
            collection.append(None)
        os.makedirs(path, exist_ok=True)
        if not collection:
            collection.append(claim(path))

    with hold_new_directory(staging, make) as held:
        assert held.locked and len(collection) == 2
        assert is_held(staging) is True
