"""Finalize a save: check the write results, write the indexes and state, the manifest last, publish.

Local stores: everything was written into a hidden staging directory; after the manifest is
fsynced the directory is renamed into place and the parent fsynced (the commit point is the
rename).  Object stores: files were written under the final prefix; the manifest object, written
last, is the commit point.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._version import __version__
from ..catalog import ManifestCache, discard_directory, read_manifest
from ..errors import CheckpointExistsError, ForeignFilesError, WriterError
from ..formats.checksum import crc32c, format_crc
from ..formats.manifest import (
    STATE_FORMAT,
    ComponentRecord,
    FileRecord,
    Manifest,
    TensorRecord,
    hf_index,
    state_file_bytes,
    utc_now,
)
from ..formats.names import CLAIM_NAME, MANIFEST_NAME, STATE_NAME, hf_index_name, leftover_name
from ..storage import Storage, liveness
from ..storage.local import LocalStorage

__all__ = [
    "CLAIM_NAME",
    "ComponentInfo",
    "Descriptions",
    "check_destination",
    "check_object_prefix",
    "claim_step",
    "finalize_checkpoint",
    "publish",
    "staging_directory",
    "write_descriptions",
    "write_small_file",
]


logger = logging.getLogger(__name__)


def claim_step(storage: Storage, final_dir: str, *, overwrite: bool, replace_any: bool = False) -> None:
    """Object stores: claim a checkpoint prefix before writing into it (create-only).

    Shard objects are written under their final names, so a second writer of the same step
    would overwrite the first one's shards.  The claim object makes the second writer fail with
    :class:`CheckpointExistsError` before it writes a byte.  It stays with the checkpoint; a
    failed save's clean-up removes it.  With ``overwrite`` the claim is taken unconditionally and
    only then is the old checkpoint unpublished (manifest first), so a claim that fails leaves the
    old checkpoint as it was.

    First, one listing of the prefix (:func:`check_object_prefix`): objects that are not ckptd's
    are refused with :class:`ForeignFilesError` (a failed save's clean-up removes the whole
    prefix, and shards would replace same-named objects), unless ``overwrite`` and ``replace_any``.
    """
    if not (overwrite and replace_any):
        check_object_prefix(storage, final_dir)
    claim = storage.join(final_dir, CLAIM_NAME)
    body = f"{socket.gethostname()} {os.getpid()} {utc_now()}".encode()
    try:
        storage.write_bytes(claim, body, create_only=not overwrite)
    except CheckpointExistsError as e:
        raise CheckpointExistsError(
            f"{final_dir} is being written or was written by another save; pass overwrite=True to replace it"
        ) from e
    if overwrite:
        # Claimed: only now unpublish the old checkpoint, before its objects are replaced.
        storage.remove(storage.join(final_dir, MANIFEST_NAME))


@contextlib.contextmanager
def staging_directory(storage: Storage, final: str, *, overwrite: bool) -> Iterator[str]:
    """Where a checkpoint for ``final`` is written before :func:`publish`: removed if the block
    raises, and its lock released when the block ends.

    Local: a hidden directory beside ``final`` (a name :func:`~ckptd.garbage.collect_garbage`
    knows), created and locked by this process until it is published or discarded.  Object
    stores: ``final`` itself, claimed first (:func:`claim_step`); no lock.
    """
    held: liveness.Hold | None = None
    if storage.local:
        parent, base = os.path.split(final)
        staging = os.path.join(parent, leftover_name(base, "tmp"))
        held = liveness.hold_new_directory(staging, storage.makedirs)
    else:
        claim_step(storage, final, overwrite=overwrite)
        storage.makedirs(final)
        staging = final
    try:
        yield staging
    except BaseException:
        storage.discard(staging)
        raise
    finally:
        if held is not None:
            held.release()


@dataclass(frozen=True)
class ComponentInfo:
    """What the commit needs to know about one component besides its tensors."""

    name: str
    kind: str
    tied: list[list[str]]
    index_metadata: dict[str, Any] | None = None
    sharing: str = "replicated"


def write_small_file(
    storage: Storage, directory: str, name: str, data: bytes, files: dict[str, FileRecord], fsync: bool
) -> None:
    """Write a small file and record its size and checksum."""
    storage.write_bytes(storage.join(directory, name), data, fsync=fsync)
    files[name] = FileRecord(len(data), format_crc(crc32c(data)))


@dataclass(frozen=True)
class Descriptions:
    """The files of a checkpoint that describe its shards (the HF indexes and the state file),
    as written into the staging directory: they depend on the plan only, not on the shard bytes."""

    files: dict[str, FileRecord]
    components: dict[str, ComponentRecord]
    state_file: str | None
    seconds: float


def write_descriptions(
    storage: Storage,
    staging_dir: str,
    *,
    tensors: Mapping[str, Mapping[str, TensorRecord]],
    components: Sequence[ComponentInfo],
    trees: Mapping[str, Any] | None,
    fsync: bool = True,
) -> Descriptions:
    """Write each component's HF index and the state file into ``staging_dir``.

    A save runs this while its shards are still being written, so that the fsyncs of these
    small files (each waits for the journal and the device cache) are not on the way to the
    commit; the manifest, written by :func:`finalize_checkpoint` once the shards are durable,
    stays the commit point."""
    started = time.perf_counter()
    files: dict[str, FileRecord] = {}
    records: dict[str, ComponentRecord] = {}
    for info in components:
        component_tensors = dict(tensors.get(info.name, {}))
        index_name = None
        if component_tensors:
            index_name = hf_index_name(info.name, info.kind)
            weight_map = {key: t.file for key, t in component_tensors.items() if t.is_whole}
            total = sum(t.nbytes for t in component_tensors.values())
            extra = dict(info.index_metadata or {})
            write_small_file(storage, staging_dir, index_name, hf_index(weight_map, total, extra), files, fsync)
        kind = info.kind if component_tensors else "state"
        records[info.name] = ComponentRecord(kind, component_tensors, index_name, info.tied, info.sharing)
    state_file = None
    if trees is not None:
        state_file = STATE_NAME
        write_small_file(storage, staging_dir, STATE_NAME, state_file_bytes(trees), files, fsync)
    return Descriptions(files, records, state_file, time.perf_counter() - started)


def finalize_checkpoint(
    storage: Storage,
    staging_dir: str,
    final_dir: str,
    *,
    step: int | None,
    written: Mapping[str, FileRecord],
    expected_sizes: Mapping[str, int],
    tensors: Mapping[str, Mapping[str, TensorRecord]],
    components: Sequence[ComponentInfo],
    trees: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    timings: dict[str, float] | None = None,
    world_size: int = 1,
    overwrite: bool = False,
    fsync: bool = True,
    described: Descriptions | None = None,
    listed: ManifestCache | None = None,
) -> Manifest:
    """Write indexes, state and manifest into ``staging_dir``, then publish it as ``final_dir``.

    ``described``: the indexes and state file were written already (:func:`write_descriptions`,
    from the same ``tensors``, ``components`` and ``trees``); only the manifest is left.
    ``listed``: the committed manifest is left there with its bytes, so that the next listing
    of the root (retention) does not parse it again."""
    started = time.perf_counter()
    for name, size in expected_sizes.items():
        record = written.get(name)
        if record is None or record.size != size:
            got = "nothing" if record is None else f"{record.size} bytes"
            raise WriterError(f"the writer reported {got} for {name}, expected {size} bytes")
    all_timings = dict(timings or {})
    if described is None:
        described = write_descriptions(
            storage, staging_dir, tensors=tensors, components=components, trees=trees, fsync=fsync
        )
    else:
        all_timings["describe"] = described.seconds  # while the shards were written
    files: dict[str, FileRecord] = {**written, **described.files}
    all_timings["commit"] = time.perf_counter() - started
    manifest = Manifest(
        step=step,
        created_utc=utc_now(),
        world_size=world_size,
        library_version=__version__,
        components=described.components,
        files=files,
        state_file=described.state_file,
        timings=all_timings,
        metadata=dict(metadata or {}),
        metrics=dict(metrics or {}),
    )
    create_only = not storage.local and not overwrite
    data = manifest.to_json()
    storage.write_bytes(storage.join(staging_dir, MANIFEST_NAME), data, fsync=fsync, create_only=create_only)
    publish(storage, staging_dir, final_dir, overwrite=overwrite)
    if listed is not None:
        listed.put(storage.join(final_dir, MANIFEST_NAME), data, manifest)
    return manifest


_SPREAD_DIRECTORY = re.compile(r"^[0-9a-f]{2}$")  # key_layout="spread" subdirectories
_OUR_FILES = frozenset({STATE_NAME, CLAIM_NAME})  # besides shards and indexes
_MAX_STATE_BYTES = 64 << 20  # a larger "state file" is not one of ours: do not read it to find out


def _our_file_name(name: str) -> bool:
    """A name a ckptd save writes in a checkpoint directory (besides the manifest)."""
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json") or name in _OUR_FILES


def _is_our_state_file(data: bytes) -> bool:
    """Whether ``data`` is a ckptd state file (JSON with ``"format": "ckptd-state"``): every save
    writes one, and safetensors files alone do not say whose they are."""
    try:
        body = json.loads(data)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("format") == STATE_FORMAT


def _holds_our_state_file(directory: str) -> bool:
    """Whether ``directory`` holds a ckptd state file (a regular file, not a link)."""
    path = os.path.join(directory, STATE_NAME)
    try:
        if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > _MAX_STATE_BYTES:
            return False
        with open(path, "rb") as f:
            return _is_our_state_file(f.read())
    except OSError:
        return False


def _uncommitted_files_of_ours(directory: str, names: list[str]) -> bool:
    """Whether a manifest-less directory is what an interrupted deletion by an older version left
    (garbage to a save): it holds a ckptd state file, and every other entry is a name a ckptd save
    writes (shards, indexes, the claim; shards in ``key_layout="spread"`` subdirectories).  A
    directory of safetensors files and indexes alone may be anyone's export, and is not taken."""
    if STATE_NAME not in names or not _holds_our_state_file(directory):
        return False
    for name in names:
        path = os.path.join(directory, name)
        if os.path.islink(path):
            return False
        if os.path.isdir(path):
            if not _SPREAD_DIRECTORY.match(name) or not all(n.endswith(".safetensors") for n in os.listdir(path)):
                return False
        elif not _our_file_name(name):
            return False
    return True


def check_object_prefix(storage: Storage, final_dir: str) -> None:
    """Object stores: refuse a prefix holding objects that are not ckptd's (:class:`ForeignFilesError`).

    Free to take: an empty prefix, a checkpoint (a manifest), a save's claim (the create-only
    claim then decides), or ckptd objects without either (a clean-up that was cut short: a ckptd
    state file beside shards and indexes).  One listing request.
    """
    names = storage.list_names(final_dir)
    if not names or MANIFEST_NAME in names or CLAIM_NAME in names:
        return
    if STATE_NAME in names and all(_SPREAD_DIRECTORY.match(n) or _our_file_name(n) for n in names):
        path = storage.join(final_dir, STATE_NAME)  # a store that cannot be read raises StorageError
        if storage.size(path) <= _MAX_STATE_BYTES and _is_our_state_file(storage.read_bytes(path)):
            return
    raise ForeignFilesError(
        f"{final_dir} holds objects that are not a ckptd checkpoint; ckptd writes only into empty "
        "prefixes and its own checkpoints: remove them or pick another path"
    )


def check_destination(final_dir: str, *, overwrite: bool, replace_any: bool = False) -> None:
    """Local: refuse, before any work, a ``final_dir`` that a commit must not replace.

    Free to take: a missing path, an empty directory, or a directory of ckptd files with no
    manifest (an interrupted deletion's leftover: a ckptd state file beside shards and
    indexes).  A ckptd checkpoint (a directory holding a manifest file, valid or not) is
    replaced only with ``overwrite``.  Anything else is someone's files and is never replaced
    (:class:`ForeignFilesError`), unless ``overwrite`` and ``replace_any`` (the command line's
    ``--overwrite`` of an output that is an HF directory).
    """
    if not os.path.lexists(final_dir):
        return
    if os.path.isdir(final_dir) and not os.path.islink(final_dir):
        names = os.listdir(final_dir)
        if MANIFEST_NAME in names:
            if overwrite:
                return
            raise CheckpointExistsError(f"checkpoint {final_dir} already exists; pass overwrite=True to replace it")
        if not names or _uncommitted_files_of_ours(final_dir, names):
            return
    if overwrite and replace_any:
        return
    raise ForeignFilesError(
        f"{final_dir} exists and is not a ckptd checkpoint; ckptd replaces only checkpoints and empty "
        "directories: remove it or pick another path"
    )


def publish(storage: Storage, staging_dir: str, final_dir: str, *, overwrite: bool, replace_any: bool = False) -> None:
    """Make a finished staging directory the checkpoint at ``final_dir``.

    Local: :func:`check_destination` first (an existing checkpoint needs ``overwrite``; other
    files are never replaced unless ``replace_any``).  An empty directory, ckptd files without a
    manifest, a checkpoint whose manifest is not valid, or with ``replace_any`` anything else, is
    removed first.  An overwrite of a checkpoint swaps the two directories in one atomic step
    where the filesystem can (``renameat2(RENAME_EXCHANGE)``), so ``final_dir`` is the old or the
    new checkpoint at every moment; elsewhere the old one is renamed aside to
    ``.<name>.replaced-*`` first (locked by this process until it is removed, so a collection
    leaves it), and :func:`~ckptd.garbage.collect_garbage` completes an overwrite a crash
    interrupted.
    """
    if not isinstance(storage, LocalStorage) or staging_dir == final_dir:
        return
    check_destination(final_dir, overwrite=overwrite, replace_any=replace_any)
    if os.path.lexists(final_dir) and read_manifest(storage, final_dir) is None:
        if os.path.isdir(final_dir) and not os.path.islink(final_dir) and os.listdir(final_dir):
            logger.warning("ckptd: replacing %s: it holds no valid checkpoint", final_dir)
        discard_directory(storage, final_dir)
    if not overwrite or not os.path.lexists(final_dir):
        # rename() replaces nothing but an empty directory: a checkpoint another save published
        # since the checks above makes it fail (CheckpointExistsError), never an exchange.
        storage.publish_directory(staging_dir, final_dir)
        return
    if storage.exchange_directories(staging_dir, final_dir):
        discard_directory(storage, staging_dir, os.path.basename(final_dir))  # now the old checkpoint
        return
    parent, base = os.path.split(final_dir)
    replaced = os.path.join(parent, leftover_name(base, "replaced"))
    with liveness.hold(final_dir):  # locked before it is renamed aside: gc leaves it while we live
        storage.rename_directory(final_dir, replaced)
        try:
            storage.publish_directory(staging_dir, final_dir)
        except BaseException:
            if not os.path.lexists(final_dir):
                storage.rename_directory(replaced, final_dir)  # the old checkpoint stays the committed one
            raise
        storage.remove_tree(replaced)
