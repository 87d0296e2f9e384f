"""The storage contract (:mod:`ckptd.storage.base`), checked the same way on every backend.

Each case runs on local files, ``memory://``, S3 (moto on loopback) and GCS (the emulator on
loopback), each time on a fresh root (the ``storage_place`` fixture in ``conftest.py``).
"""

from __future__ import annotations

import errno
import mmap
import re

import pytest
from conftest import StoragePlace

from ckptd.catalog import checkpoint_dir_name, latest_checkpoint, list_checkpoints, staging_dir_name
from ckptd.errors import CheckpointExistsError, ConfigError, MissingFileError, StorageError
from ckptd.formats.checksum import crc32c, format_crc
from ckptd.formats.manifest import FileRecord
from ckptd.formats.names import MANIFEST_NAME
from ckptd.save.commit import CLAIM_NAME, claim_step, finalize_checkpoint
from ckptd.storage import (
    Deleting,
    Listing,
    ObjectWriter,
    Publishing,
    RangeReading,
    Stopped,
    Storage,
    storage_for,
)

PATTERN = bytes((i * 7 + 3) % 251 for i in range(10_000))


def write_view(place: StoragePlace, path: str, data: bytes, chunk_size: int = 4096) -> list[int]:
    """``write_view`` with a small chunk size; returns the progress reports."""
    progress: list[int] = []
    place.storage.write_view(
        path,
        memoryview(data),
        fsync=True,
        chunk_size=chunk_size,
        should_stop=lambda: False,
        on_progress=progress.append,
    )
    return progress


def test_every_backend_implements_every_protocol(storage_place: StoragePlace):
    storage = storage_place.storage
    for protocol in (ObjectWriter, RangeReading, Publishing, Listing, Deleting, Storage):
        assert isinstance(storage, protocol), f"{type(storage).__name__} lacks part of {protocol.__name__}"
    assert isinstance(storage.supports_write_at, bool)
    assert isinstance(storage.local, bool)
    storage.check_access(storage_place.root)


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"x", PATTERN], ids=["empty", "one-byte", "10kB"])
def test_write_bytes_then_read_bytes(storage_place: StoragePlace, data: bytes):
    path = storage_place.path("blob.bin")
    storage_place.storage.write_bytes(path, data)
    assert storage_place.storage.read_bytes(path) == data
    assert storage_place.storage.size(path) == len(data)


def test_write_bytes_replaces_an_existing_file(storage_place: StoragePlace):
    path = storage_place.path("blob.bin")
    storage_place.storage.write_bytes(path, PATTERN)
    storage_place.storage.write_bytes(path, b"short")
    assert storage_place.storage.read_bytes(path) == b"short"


def test_write_stream_joins_the_pieces(storage_place: StoragePlace):
    path = storage_place.path("streamed.bin")
    pieces = [memoryview(PATTERN[:1000]), memoryview(b""), memoryview(PATTERN[1000:])]
    assert storage_place.storage.write_stream(path, iter(pieces)) == len(PATTERN)
    assert storage_place.storage.read_bytes(path) == PATTERN
    assert storage_place.storage.list_names(storage_place.root) == ["streamed.bin"]  # no temporary left


def test_write_stream_of_page_aligned_pieces_then_an_unaligned_tail(storage_place: StoragePlace):
    """Local files write aligned pieces with O_DIRECT and the rest buffered: the bytes are the
    same whatever the path (pieces of one reused buffer, as a promotion to a local tier gives)."""
    data = bytes(range(256)) * (3 * 4096 // 256) + b"tail"
    buffer = memoryview(mmap.mmap(-1, 8192))  # page-aligned, like the promoter's pieces

    def pieces():
        for start in range(0, len(data), 8192):
            chunk = buffer[: min(8192, len(data) - start)]
            chunk[:] = data[start : start + len(chunk)]
            yield chunk

    path = storage_place.path("aligned.bin")
    assert storage_place.storage.write_stream(path, pieces()) == len(data)
    assert storage_place.storage.read_bytes(path) == data
    assert storage_place.storage.list_names(storage_place.root) == ["aligned.bin"]


def test_write_stream_whose_pieces_fail_leaves_no_file(storage_place: StoragePlace):
    path = storage_place.path("broken.bin")

    def pieces():
        yield memoryview(PATTERN[:4096])
        raise RuntimeError("the producer failed")

    with pytest.raises(RuntimeError, match="the producer failed"):
        storage_place.storage.write_stream(path, pieces())
    assert not storage_place.storage.exists(path)
    assert storage_place.storage.list_names(storage_place.root) == []


def test_write_view_whose_progress_callback_fails_leaves_no_file(storage_place: StoragePlace):
    path = storage_place.path("broken.bin")

    def on_progress(n: int) -> None:
        raise RuntimeError("progress failed")

    with pytest.raises(RuntimeError, match="progress failed"):
        storage_place.storage.write_view(
            path, memoryview(PATTERN), fsync=True, chunk_size=4096, should_stop=lambda: False, on_progress=on_progress
        )
    assert not storage_place.storage.exists(path)
    assert storage_place.storage.list_names(storage_place.root) == []


@pytest.mark.parametrize("data", [b"", PATTERN], ids=["empty", "10kB"])
def test_write_view_writes_the_whole_view_and_reports_progress(storage_place: StoragePlace, data: bytes):
    path = storage_place.path("shard.bin")
    progress = write_view(storage_place, path, data)
    assert sum(progress) == len(data)
    assert storage_place.storage.read_bytes(path) == data


def test_write_view_asked_to_stop_raises_stopped_and_leaves_no_file(storage_place: StoragePlace):
    path = storage_place.path("stopped.bin")
    storage_place.storage.write_bytes(storage_place.path("other.bin"), b"kept")
    with pytest.raises(Stopped):
        storage_place.storage.write_view(
            path, memoryview(PATTERN), fsync=True, chunk_size=4096, should_stop=lambda: True, on_progress=lambda n: None
        )
    assert not storage_place.storage.exists(path)
    assert storage_place.storage.list_names(storage_place.root) == ["other.bin"]


# ---- ranged reads --------------------------------------------------------------------------


def test_ranged_reads_at_any_offset(storage_place: StoragePlace):
    path = storage_place.path("ranges.bin")
    storage_place.storage.write_bytes(path, PATTERN)
    reader = storage_place.storage.open_reader(path)
    try:
        assert reader.size == len(PATTERN)
        assert reader.read(0, 16) == PATTERN[:16]
        assert reader.read(1234, 777) == PATTERN[1234:2011]
        assert reader.read(len(PATTERN) - 1, 1) == PATTERN[-1:]  # the last byte
        assert reader.read(len(PATTERN), 0) == b""  # zero-length, at the end
        assert reader.read(500, 0) == b""
        assert reader.read(0, len(PATTERN)) == PATTERN

        into = bytearray(100)
        reader.read_into(len(PATTERN) - 100, memoryview(into))
        assert bytes(into) == PATTERN[-100:]
        reader.read_into(7, memoryview(bytearray(0)))  # zero-length buffer
    finally:
        reader.close()


def test_read_many_fills_every_buffer_whatever_the_order(storage_place: StoragePlace):
    path = storage_place.path("ranges.bin")
    storage_place.storage.write_bytes(path, PATTERN)
    wanted = [(9000, 1000), (0, 10), (10, 10), (5000, 0), (4096, 4), (9999, 1), (100, 3000)]
    buffers = [bytearray(length) for _, length in wanted]
    words = bytearray(64)  # a typed view (32-bit words), as tensors' buffers are
    reader = storage_place.storage.open_reader(path)
    try:
        reader.read_many(
            [(offset, memoryview(b)) for (offset, _), b in zip(wanted, buffers, strict=True)]
            + [(2000, memoryview(words).cast("I"))]
        )
    finally:
        reader.close()
    for (offset, length), buffer in zip(wanted, buffers, strict=True):
        assert bytes(buffer) == PATTERN[offset : offset + length], (offset, length)
    assert bytes(words) == PATTERN[2000:2064]


def test_reading_past_the_end_is_a_storage_error(storage_place: StoragePlace):
    path = storage_place.path("short.bin")
    storage_place.storage.write_bytes(path, PATTERN[:100])
    reader = storage_place.storage.open_reader(path)
    try:
        with pytest.raises(StorageError) as info:
            reader.read(90, 20)
        assert not isinstance(info.value, FileNotFoundError)
        assert "short.bin" in str(info.value)
    finally:
        reader.close()


def test_reading_a_file_removed_after_it_was_opened(storage_place: StoragePlace):
    path = storage_place.path("vanishing.bin")
    storage_place.storage.write_bytes(path, PATTERN)
    reader = storage_place.storage.open_reader(path)
    try:
        storage_place.storage.remove(path)
        try:
            data = reader.read(0, 5)
        except MissingFileError as e:  # object stores: the object is gone
            assert "vanishing.bin" in str(e)
        else:  # POSIX: an open file stays readable after unlink
            assert storage_place.storage.local and data == PATTERN[:5]
    finally:
        reader.close()


# ---- create-only writes --------------------------------------------------------------------


def test_create_only_write_succeeds_when_absent(storage_place: StoragePlace):
    path = storage_place.path(MANIFEST_NAME)
    storage_place.storage.write_bytes(path, b"first", create_only=True)
    assert storage_place.storage.read_bytes(path) == b"first"


def test_create_only_write_is_refused_when_present(storage_place: StoragePlace):
    if storage_place.backend == "gcs":
        pytest.skip(
            "gcp-storage-emulator ignores the ifGenerationMatch=0 precondition gcsfs sends for create-only "
            "writes (real GCS answers 412, which gcsfs raises as FileExistsError)"
        )
    path = storage_place.path(MANIFEST_NAME)
    storage_place.storage.write_bytes(path, b"first")
    # Different bytes: S3 takes a refusal of the very same bytes as its own retried write.
    with pytest.raises(CheckpointExistsError, match=re.escape(MANIFEST_NAME)):
        storage_place.storage.write_bytes(path, b"second", create_only=True)
    assert storage_place.storage.read_bytes(path) == b"first"


# ---- listing -------------------------------------------------------------------------------


def test_list_names_sizes_and_exists_agree(storage_place: StoragePlace):
    storage = storage_place.storage
    directory = storage_place.path("dir")
    storage.makedirs(directory)
    storage.makedirs(storage.join(directory, "sub"))
    storage.write_bytes(storage.join(directory, "b.bin"), b"")
    storage.write_bytes(storage.join(directory, "a.bin"), b"abc")
    storage.write_stream(storage.join(directory, "c.json"), [memoryview(b"{}")])
    storage.write_bytes(storage.join(directory, "sub", "deep.bin"), b"12345")

    assert storage.list_names(directory) == ["a.bin", "b.bin", "c.json", "sub"]
    assert storage.sizes(directory) == {"a.bin": 3, "b.bin": 0, "c.json": 2}
    assert storage.list_names(storage_place.root) == ["dir"]
    assert storage.exists(directory) and storage.exists(storage.join(directory, "a.bin"))
    assert storage.exists(storage.join(directory, "b.bin"))  # an empty file exists too
    missing = storage.join(directory, "nothing")
    assert not storage.exists(missing)
    assert storage.list_names(missing) == [] and storage.sizes(missing) == {}
    assert storage.list_names(storage.join(directory, "a.bin")) == []  # a file has nothing under it


def test_listing_shows_only_committed_checkpoints(storage_place: StoragePlace):
    storage, root = storage_place.storage, storage_place.root

    def save(step: int, *, commit: bool) -> str:
        """Write a checkpoint the way a save does: claim or stage, a shard, then (maybe) commit."""
        final = storage.join(root, checkpoint_dir_name(step))
        staging = storage.join(root, staging_dir_name(step)) if storage.local else final
        if not storage.local:
            claim_step(storage, final, overwrite=False)
        storage.makedirs(staging)
        shard = b"tensor bytes %d" % step
        write_view(storage_place, storage.join(staging, "model.safetensors"), shard)
        if commit:
            record = FileRecord(len(shard), format_crc(crc32c(shard)))
            finalize_checkpoint(
                storage,
                staging,
                final,
                step=step,
                written={"model.safetensors": record},
                expected_sizes={"model.safetensors": len(shard)},
                tensors={},
                components=[],
                trees={"extra": {"step": step}},
            )
        return staging

    save(1, commit=True)
    in_progress = save(2, commit=False)  # staged (local) or claimed (object store), no manifest
    save(3, commit=True)
    abandoned = storage.join(root, checkpoint_dir_name(4))  # a final name whose manifest is gone
    storage.makedirs(abandoned)
    storage.write_bytes(storage.join(abandoned, "model.safetensors"), b"partial")

    names = storage.list_names(root)
    assert base(in_progress) in names and checkpoint_dir_name(4) in names  # present, yet not listed:
    assert [info.step for info in list_checkpoints(storage, root)] == [1, 3]
    latest = latest_checkpoint(storage, root)
    assert latest is not None and latest.step == 3
    assert latest.manifest.files["model.safetensors"].size == len(b"tensor bytes 3")
    if not storage.local:
        assert CLAIM_NAME in storage.list_names(in_progress)

    storage.remove(storage.join(root, checkpoint_dir_name(3), MANIFEST_NAME))  # un-commit step 3
    assert [info.step for info in list_checkpoints(storage, root)] == [1]


def base(path: str) -> str:
    return path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]


# ---- deleting ------------------------------------------------------------------------------


def test_remove_remove_tree_and_discard(storage_place: StoragePlace):
    storage = storage_place.storage
    one = storage_place.path("one.bin")
    storage.write_bytes(one, b"1")
    storage.remove(one)
    assert not storage.exists(one)

    for name, delete in (("tree", storage.remove_tree), ("failed", storage.discard)):
        directory = storage_place.path(name)
        storage.makedirs(storage.join(directory, "nested"))
        storage.write_bytes(storage.join(directory, "a.bin"), b"a")
        storage.write_bytes(storage.join(directory, "nested", "b.bin"), b"b")
        delete(directory)
        assert not storage.exists(directory)
        assert not storage.exists(storage.join(directory, "nested", "b.bin"))
    assert storage.list_names(storage_place.root) == []


def test_deleting_what_is_missing_succeeds(storage_place: StoragePlace):
    storage = storage_place.storage
    missing = storage_place.path("never-written")
    storage.remove(missing)
    storage.remove_tree(missing)
    storage.discard(missing)
    storage.remove(storage.join(missing, "inside.bin"))
    assert storage.list_names(storage_place.root) == []


# ---- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["read_bytes", "size", "open_reader"])
def test_a_missing_file_is_a_missing_file_error(storage_place: StoragePlace, call: str):
    path = storage_place.path("absent.bin")
    with pytest.raises(MissingFileError) as info:
        getattr(storage_place.storage, call)(path)
    error = info.value
    assert isinstance(error, FileNotFoundError) and isinstance(error, StorageError)
    assert error.errno == errno.ENOENT
    assert "absent.bin" in str(error)


# ---- write_at ------------------------------------------------------------------------------


def test_write_at_is_supported_or_refused_as_declared(storage_place: StoragePlace):
    storage = storage_place.storage
    path = storage_place.path("shared.bin")
    half = len(PATTERN) // 2

    def write_at(offset: int, data: bytes) -> None:
        storage.write_at(
            path,
            offset,
            memoryview(data),
            fsync=True,
            chunk_size=4096,
            should_stop=lambda: False,
            on_progress=lambda n: None,
        )

    if storage.supports_write_at:
        write_at(half, PATTERN[half:])  # the second rank's half first
        write_at(0, PATTERN[:half])
        assert storage.read_bytes(path) == PATTERN
    else:
        with pytest.raises(ConfigError, match=r"shared\.bin"):
            write_at(0, PATTERN[:half])
        assert not storage.exists(path)


# ---- publishing ----------------------------------------------------------------------------


def test_publish_directory_commits_in_one_step(storage_place: StoragePlace):
    storage = storage_place.storage
    final = storage_place.path(checkpoint_dir_name(1))
    if storage.local:
        staging = storage_place.path(staging_dir_name(1))
        storage.makedirs(staging)
        storage.write_bytes(storage.join(staging, "a.bin"), b"a")
        storage.publish_directory(staging, final)
        assert storage.read_bytes(storage.join(final, "a.bin")) == b"a"
        assert not storage.exists(staging)
        again = storage_place.path(staging_dir_name(1))
        storage.makedirs(again)
        storage.write_bytes(storage.join(again, "a.bin"), b"b")
        with pytest.raises(CheckpointExistsError, match=checkpoint_dir_name(1)):
            storage.publish_directory(again, final)
        assert storage.read_bytes(storage.join(final, "a.bin")) == b"a"
    else:
        storage.write_bytes(storage.join(final, "a.bin"), b"a")
        storage.publish_directory(final, final)  # written in place: nothing to do
        assert storage.read_bytes(storage.join(final, "a.bin")) == b"a"
        with pytest.raises(ConfigError):
            storage.publish_directory(storage_place.path("elsewhere"), final)


# ---- access ----------------------------------------------------------------------------------


def test_check_access_of_a_missing_bucket_names_it(storage_place: StoragePlace):
    if storage_place.backend in ("local", "memory"):
        pytest.skip("local files and memory:// have no buckets (check_access creates the root)")
    scheme = storage_place.root.split("://", 1)[0]
    url = f"{scheme}://no-such-bucket-{storage_place.root.rsplit('/', 1)[-1]}/run"
    with pytest.raises(StorageError, match="bucket") as info:
        storage_for(url, storage_place.options).check_access(url)
    assert info.value.errno == errno.ENOENT
    assert "no-such-bucket" in str(info.value)
