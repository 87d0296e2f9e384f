"""Reading the checkpoints :func:`ckptd.compat.megatron.load` accepts, and which one a
directory is: ckptd's own Megatron-style save (a ckptd checkpoint with ``common``, ``sharded``
and ``sharded_objects`` components), Megatron's ``torch_dist`` (``metadata.json``,
``common.pt``, torch DCP files: read by torch's own DCP reader, its ``.metadata`` through
:mod:`ckptd.load.dcp_metadata`'s allowlist) and Megatron with ckptd's
``SaveStrategy`` (``metadata.json``, ``common.pt`` and ckptd's sharded part in ``ckptd/``).
``common.pt`` and DCP's pickled entries are decoded with ``torch.load(weights_only=True)`` only.

What differs between Megatron-Core versions is found in the directory, not in a version string:
the common state is ``common.pt`` (up to 0.18, and with ckptd's ``SaveStrategy``) or, when there
is none, the ``"common_state"`` sharded object inside the ``torch_dist`` files (0.19); an
``integrity.json`` (0.18+, ``save(..., verify_integrity=True)``) is checked by
:func:`verify_integrity` before values are read.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import os
import pathlib
import pickle
import re
import stat
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from ..dist.sharding import ShardedTensor
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, UnsafeCheckpointError
from ..formats.json_files import json_limit, parse_json
from ..formats.torch_dtypes import dtype_from_name
from ..load.assign import read_components
from ..load.reader import CheckpointReader
from ..storage import is_local
from .megatron_mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    apply_factories,
    apply_factory_merges,
    is_sharded,
    leaves,
    map_leaves,
    prune,
)

__all__ = [
    "CKPTD_BACKEND",
    "CKPTD_SUBDIR",
    "COMMON_FILE",
    "COMMON_STATE_KEY",
    "INTEGRITY_FILE",
    "MEGATRON_CONFIG",
    "MegatronCheckpoint",
    "TensorInfo",
    "load_sharded_parts",
    "megatron_backend",
    "open_megatron_checkpoint",
    "tensor_infos",
    "verify_integrity",
]

COMPONENTS = ("common", "sharded", "sharded_objects")
_COMMON, _SHARDED, _OBJECTS = COMPONENTS


@dataclass(frozen=True)
class TensorInfo:
    """A stored tensor's dtype and global shape (what :func:`load_tensors_metadata` returns)."""

    dtype: torch.dtype
    shape: tuple[int, ...]


MEGATRON_CONFIG = "metadata.json"  # Megatron's record of the backends, written last
COMMON_FILE = "common.pt"  # Megatron's non-sharded state (torch.save)
CKPTD_BACKEND = "ckptd"  # sharded_backend of checkpoints written through SaveStrategy
CKPTD_SUBDIR = "ckptd"  # where SaveStrategy commits the sharded part inside checkpoint_dir
COMMON_STATE_KEY = "common_state"  # Megatron 0.19+: the common state as a ShardedObject of this key
INTEGRITY_FILE = "integrity.json"  # Megatron 0.18+: SHA-256 of every top-level file, written after metadata.json
_COMMON_STATE_ENTRY = f"{COMMON_STATE_KEY}/shard_0_1"  # its (only) piece's DCP entry
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HASH_CHUNK = 8 << 20
_DATA_FILE = re.compile(r"(.*\.distcp|\.metadata|common\.pt|metadata\.json)")


def megatron_backend(checkpoint_dir: str | os.PathLike[str]) -> str | None:
    """``sharded_backend`` of a directory written by Megatron's ``dist_checkpointing.save``
    (``torch_dist``; ``ckptd`` through :class:`SaveStrategy`), None for other directories."""
    path = os.path.join(os.fspath(checkpoint_dir), MEGATRON_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        config = parse_json(f.read(), path, "Megatron checkpoint config")
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if not isinstance(backend, str):
        raise CorruptCheckpointError(f"{path}: no 'sharded_backend' string; not a Megatron checkpoint config")
    return backend


class MegatronCheckpoint:
    """A checkpoint ``load`` can read: ckptd's own (``save`` above), Megatron ``torch_dist`` (DCP
    files + ``common.pt``, read by torch's DCP reader) or Megatron with ckptd's strategy
    (``common.pt`` + ckptd's sharded part in ``ckptd/``)."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str], verify: bool | None = False) -> None:
        directory = os.fspath(checkpoint_dir)
        self.backend = megatron_backend(directory) if is_local(directory) else None
        if self.backend is not None and verify is not False:  # None: when integrity.json is there
            verify_integrity(directory, required=bool(verify))
        if self.backend is None:
            self.reader = CheckpointReader.open(directory, require_manifest=True)
            if _COMMON not in self.reader.state_trees() and _SHARDED not in self.reader.components():
                raise CheckpointNotFoundError(
                    f"{self.reader.directory}: not written by ckptd.compat.megatron.save (no {_COMMON!r} component) "
                    f"nor by Megatron (no {MEGATRON_CONFIG}); load it with ckptd.Checkpointer.load"
                )
            self.tensors = _SHARDED
        elif self.backend == CKPTD_BACKEND:
            self.reader = CheckpointReader.open(os.path.join(directory, CKPTD_SUBDIR), require_manifest=True)
            self.tensors = _SHARDED
        elif self.backend == "torch_dist":
            self.reader = CheckpointReader.open(directory)
            if self.reader.kind != "dcp":
                raise CorruptCheckpointError(f"{directory}: metadata.json says torch_dist but there is no .metadata")
            self.tensors = "model"
        else:
            raise ConfigError(
                f"{directory}: Megatron sharded backend {self.backend!r} is not readable by ckptd "
                "(torch_dist and ckptd are); convert it with Megatron first"
            )
        self.directory = directory
        self._objects: dict[str, Any] | None = None

    def tensor_keys(self) -> list[str]:
        return self.reader.keys(self.tensors) if self.tensors in self.reader.components() else []

    def common(self) -> dict[str, Any]:
        if self.backend is None:
            trees = self.reader.state_trees()
            return dict(read_components(self.reader, [_COMMON])[_COMMON]) if _COMMON in trees else {}
        path = os.path.join(self.directory, COMMON_FILE)
        if self.backend == "torch_dist" and not os.path.lexists(path):
            if _COMMON_STATE_ENTRY not in self.reader.dcp_layout().skipped:
                return {}
            with _common_safe_globals():  # Megatron 0.19: torch.save([common]) as a DCP entry
                stored = self.reader.read_dcp_objects([_COMMON_STATE_ENTRY])[_COMMON_STATE_ENTRY]
            if not (isinstance(stored, list) and len(stored) == 1 and isinstance(stored[0], dict)):
                raise CorruptCheckpointError(
                    f"{self.directory}: DCP entry {_COMMON_STATE_ENTRY!r} is not [dict] (Megatron's common state)"
                )
            return stored[0]
        return _load_common_file(path)

    def object_keys(self) -> list[str]:
        if self.backend == "torch_dist":
            return [fqn for fqn in self.reader.dcp_layout().skipped if "/shard_" in fqn and fqn != _COMMON_STATE_ENTRY]
        return list(self.objects())

    def objects(self, wanted: list[str] | None = None) -> dict[str, Any]:
        """Stored sharded objects' data by unique key."""
        if self.backend == "torch_dist":  # Megatron: torch.save([data]) per piece, as DCP bytes
            keys = self.object_keys() if wanted is None else [k for k in wanted if k in set(self.object_keys())]
            read = self.reader.read_dcp_objects(keys)
            return {k: v[0] if isinstance(v, list) and v else v for k, v in read.items()}
        if self._objects is None:
            names = [n for n in self.reader.state_trees() if n == _OBJECTS or n.startswith(f"{_OBJECTS}@")]
            found: dict[str, Any] = {}
            for name in names:
                found.update(read_components(self.reader, [name])[name] or {})
            self._objects = {k: v["data"] for k, v in found.items()}
        return self._objects


_COMMON_SAFE_CLASSES = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath]


@contextlib.contextmanager
def _common_safe_globals() -> Iterator[None]:
    """``torch.load(weights_only=True)`` that also accepts :data:`_COMMON_SAFE_CLASSES`."""
    # only the classes not allowed yet: the context manager removes what it was given on exit,
    # and must not take away what Megatron registered for the whole process
    allowed = set(map(id, torch.serialization.get_safe_globals()))
    with torch.serialization.safe_globals([c for c in _COMMON_SAFE_CLASSES if id(c) not in allowed]):
        yield


def _load_common_file(path: str) -> dict[str, Any]:
    """Megatron's ``common.pt`` with ``torch.load(weights_only=True)`` (never arbitrary pickle);
    ``argparse.Namespace``, ``types.SimpleNamespace`` and ``pathlib.PosixPath`` are allowed too:
    Megatron-LM keeps its ``args`` there (Megatron registers the same classes)."""
    if not os.path.isfile(path):
        return {}
    try:
        with _common_safe_globals():
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: holds objects that torch.load(weights_only=True) refuses ({e}); ckptd does not unpickle "
            "arbitrary objects: keep the common state to plain values, or load it with Megatron"
        ) from e
    except Exception as e:  # truncated zip, bad magic...
        raise CorruptCheckpointError(f"{path}: cannot read Megatron's common state ({type(e).__name__}: {e})") from e
    if not isinstance(loaded, dict):
        raise CorruptCheckpointError(f"{path}: expected a dict, found a {type(loaded).__name__}")
    return loaded


def verify_integrity(checkpoint_dir: str | os.PathLike[str], required: bool = False) -> bool:
    """Check a Megatron directory against its ``integrity.json`` (Megatron-Core 0.18+,
    ``save(..., verify_integrity=True)``: ``{"algorithm": "sha256", "files": {name: hex}}``).

    Every listed file is hashed, opened relative to the directory without following symlinks;
    a name that is not a plain file name of the directory (``..``, a ``/``), a symlink, a hash
    that differs, a missing file, or a checkpoint data file the manifest does not list raises
    :class:`~ckptd.errors.CorruptCheckpointError` (:class:`~ckptd.errors.UnsafeCheckpointError`
    for names and symlinks that point elsewhere).  Returns whether there was a manifest;
    ``required`` makes its absence a :class:`~ckptd.errors.CheckpointNotFoundError`."""
    directory = os.fspath(checkpoint_dir)
    where = os.path.join(directory, INTEGRITY_FILE)
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointNotFoundError(f"{directory}: cannot open the checkpoint directory ({e})") from e
    try:
        try:
            manifest = _read_in_dir(dir_fd, directory, INTEGRITY_FILE, limit=json_limit(None))
        except FileNotFoundError as e:
            if required:
                raise CheckpointNotFoundError(
                    f"{where} does not exist: save with verify_integrity=True (Megatron-Core 0.18+) to check it"
                ) from e
            return False
        files = _integrity_files(parse_json(manifest, where, "Megatron integrity manifest"), where)
        problems = []
        for name, expected in files.items():
            try:
                digest = _sha256_in_dir(dir_fd, directory, name)
            except FileNotFoundError:
                problems.append(f"{name}: missing")
                continue
            if digest != expected:
                problems.append(f"{name}: SHA-256 {digest[:16]}..., integrity.json says {expected[:16]}...")
        unlisted = sorted(n for n in os.listdir(dir_fd) if _DATA_FILE.fullmatch(n) and n not in files)
        problems += [f"{name}: not listed in integrity.json" for name in unlisted]
    finally:
        os.close(dir_fd)
    if problems:
        raise CorruptCheckpointError(
            f"{directory}: {len(problems)} file(s) differ from {INTEGRITY_FILE}: " + "; ".join(problems)
        )
    return True


def _integrity_files(manifest: Any, where: str) -> dict[str, str]:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpointError(f"{where}: expected {{'algorithm': 'sha256', 'files': {{name: hash}}}}")
    algorithm = manifest.get("algorithm", "sha256")
    if algorithm != "sha256":
        raise CorruptCheckpointError(f"{where}: hash algorithm {algorithm!r} is not supported (sha256 is)")
    files: dict[str, str] = {}
    for name, digest in manifest["files"].items():
        if name in ("", ".", "..", INTEGRITY_FILE) or "/" in name or "\0" in name or os.sep in name:
            raise UnsafeCheckpointError(
                f"{where}: lists {name!r}, not a file name inside the checkpoint directory; refusing to read it"
            )
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise CorruptCheckpointError(f"{where}: the hash of {name!r} is not 64 hex digits")
        files[name] = digest
    return files


def _open_in_dir(dir_fd: int, directory: str, name: str) -> BinaryIO:
    """A regular file directly inside the opened directory, never through a symlink
    (FileNotFoundError when there is none)."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeCheckpointError(f"{path} is a symlink: refusing to follow it out of the checkpoint") from e
        raise CorruptCheckpointError(f"{path}: cannot open it ({e})") from e
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise CorruptCheckpointError(f"{path} is not a regular file: refusing to read it")
    return f


def _read_in_dir(dir_fd: int, directory: str, name: str, limit: int) -> bytes:
    with _open_in_dir(dir_fd, directory, name) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            path = os.path.join(directory, name)
            raise CorruptCheckpointError(f"{path} ({size} bytes) exceeds the {limit}-byte limit")
        return f.read(limit + 1)


def _sha256_in_dir(dir_fd: int, directory: str, name: str) -> str:
    digest = hashlib.sha256()
    with _open_in_dir(dir_fd, directory, name) as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tensor_infos(opened: MegatronCheckpoint) -> dict[str, TensorInfo]:
    if opened.reader.kind == "dcp":
        layout = opened.reader.dcp_layout()
        fqns = layout.components.get(opened.tensors, {})
        return {key: TensorInfo(layout.dtypes[fqn], layout.shapes[fqn]) for key, fqn in fqns.items()}
    records = opened.reader.locate(opened.tensors) if opened.tensor_keys() else {}
    return {key: TensorInfo(dtype_from_name(r.dtype), tuple(r.shape)) for key, r in records.items()}


def load_sharded_parts(opened: MegatronCheckpoint, sharded_state_dict: dict[str, Any]) -> Any:
    """The sharded part of ``load``: the tree of ``sharded_state_dict`` with every sharded leaf
    replaced by its loaded value (plain leaves dropped)."""
    built = apply_factories(sharded_state_dict)
    pieces = [leaf for leaf in leaves(built) if isinstance(leaf, ShardedTensor)]
    for piece in pieces:
        piece.init_data()
    rounds: list[dict[str, ShardedTensor]] = []  # a key asked for twice (two pieces) is read once per piece
    for piece in pieces:
        free = next((r for r in rounds if piece.key not in r), None)
        if free is None:
            rounds.append(free := {})
        free[piece.key] = piece
    for targets in rounds:
        opened.reader.read(opened.tensors, list(targets), targets=targets)
    wanted = [leaf.unique_key for leaf in leaves(built) if isinstance(leaf, ShardedObject)]
    objects = opened.objects(wanted) if wanted else {}

    def value(leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            return leaf.data
        if isinstance(leaf, LocalNonpersistentObject):
            return leaf.unwrap()
        if isinstance(leaf, ShardedObject):
            if leaf.unique_key not in objects:
                raise CheckpointNotFoundError(f"{opened.directory}: no sharded object {leaf.unique_key!r}")
            return objects[leaf.unique_key]
        return leaf

    only_sharded = prune(built, lambda leaf: not is_sharded(leaf))  # plain values come from the checkpoint
    return apply_factory_merges(map_leaves(only_sharded, value), sharded_state_dict)


def open_megatron_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> MegatronCheckpoint:
    """The checkpoint in ``checkpoint_dir``, whichever of the three kinds it is."""
    return MegatronCheckpoint(checkpoint_dir)
