"""DCP's ``.metadata`` read with an allowlist, never with arbitrary pickle.

torch writes a DCP checkpoint's ``.metadata`` with ``pickle.dump`` and reads it back with a plain
``pickle.load`` (``FileSystemReader.read_metadata``), so a crafted ``.metadata`` runs whatever
its ``__reduce__`` names.  Here it is read by a restricted unpickler instead: the pure-Python
``pickle._Unpickler`` with its opcode table rebuilt from an allowlist, so every opcode that can
import or call something is ours to check:

* ``GLOBAL``/``STACK_GLOBAL`` resolve only exact names from :func:`_allowed_globals` (DCP's
  metadata classes, the filesystem reader's ``_StorageInfo``, the save-plan classes Megatron
  keeps in ``all_local_plans``, ``torch.Size``, torch dtypes, layouts and memory formats,
  ``torch.serialization._get_layout``, ``pathlib`` paths, ``set``/``frozenset``/``OrderedDict``);
  nothing is imported and no dotted attribute is walked.
* ``REDUCE``/``NEWOBJ``/``NEWOBJ_EX`` call only those globals (identity check, with argument
  rules for the enums and builtins), never an object built from the file.
* ``BUILD`` fills only instances of the allowed classes: a class's own ``__setstate__``
  (``TensorProperties``), else plain attribute names (no dunders); never a class object.
* ``APPEND(S)``/``SETITEM(S)``/``ADDITEMS`` act only on real lists, dicts and sets; ``INST``,
  ``OBJ``, persistent ids, the extension registry and out-of-band buffers are refused.

torch's own ``weights_only`` unpickler is not used: it reads only the opcodes of protocol 2
(``torch.save``'s), while DCP pickles ``.metadata`` with Python's default protocol (4: frames,
``MEMOIZE``, ``STACK_GLOBAL``), and it admits tensor rebuilds and storage persistent ids that
metadata never holds.

A file that needs anything else raises :class:`~ckptd.errors.UnsafeCheckpointError` naming it
(it asks for code to run: the same class as a ``.bin`` that ``weights_only`` refuses), as does
one whose data files are not plain names inside the directory (as for manifests); one that is
not a pickle of DCP ``Metadata`` raises :class:`~ckptd.errors.CorruptCheckpointError`.
:func:`safe_reader` gives torch a ``FileSystemReader``/``FsspecReader`` whose ``read_metadata``
goes through here, since ``torch.distributed.checkpoint.load`` reads ``.metadata`` again itself.
The pure-Python unpickler is 2-3x slower than ``_pickle`` (24 MB of metadata, 160k chunks: about
13 s against 5 s on a shared 2-core machine, much of both in building the dataclasses).

The module is longer than the usual ~450 lines: the opcode handlers and the allowlist they check
against are one security boundary, read and reviewed together.
"""

from __future__ import annotations

import enum
import functools
import os
import pathlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch

from ..errors import CkptdError, CorruptCheckpointError, UnsafeCheckpointError
from ..storage import check_file_name

__all__ = [
    "read_metadata",
    "safe_reader",
    "unpickle_metadata",
]


class _Refused(pickle.UnpicklingError):
    """An opcode asked for something outside the allowlist (reported as unsafe, not corrupt)."""


class _LegacyMegatronPlan:
    """Stands in for ``megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan``, which
    older Megatron-Core versions pickled into ``all_local_plans`` (Megatron keeps an empty class
    of that name for the same reason): its attributes are filled by ``BUILD``, nothing else."""


def _global_names(module: str, values: Mapping[str, Any], kind: type) -> dict[tuple[str, str], Any]:
    return {(module, name): value for name, value in values.items() if isinstance(value, kind)}


@functools.cache
def _allowed_globals() -> dict[tuple[str, str], Any]:
    """(module, name) as the pickle names it -> the object it stands for."""
    import torch.distributed.checkpoint.filesystem as filesystem
    import torch.distributed.checkpoint.metadata as metadata
    import torch.distributed.checkpoint.planner as planner

    classes: list[Any] = [getattr(filesystem, "_StorageInfo", None)]
    classes += [getattr(metadata, name, None) for name in _METADATA_CLASSES]
    classes += [getattr(planner, name, None) for name in _PLAN_CLASSES]
    allowed: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in classes if c is not None}
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    names = vars(torch)
    for kind in (torch.dtype, torch.layout, torch.memory_format):
        allowed.update(_global_names("torch", names, kind))
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 pickles paths from pathlib._local
        allowed[(module, "PosixPath")] = pathlib.PosixPath
        allowed[(module, "PurePosixPath")] = pathlib.PurePosixPath
        allowed[(module, "PureWindowsPath")] = pathlib.PureWindowsPath
        allowed[(module, "WindowsPath")] = pathlib.PureWindowsPath  # a checkpoint_id saved on Windows
    allowed[("builtins", "set")] = set
    allowed[("builtins", "frozenset")] = frozenset
    allowed[("collections", "OrderedDict")] = OrderedDict
    allowed[("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")] = _LegacyMegatronPlan
    return allowed


_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
)
_PLAN_CLASSES = ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData", "WriteItemType")


def _buildable(value: Any) -> bool:
    """Classes whose instances BUILD may fill: DCP's dataclasses and the Megatron stand-in (not
    enums, paths, torch.Size or the builtin containers)."""
    return (
        isinstance(value, type)
        and not issubclass(value, enum.Enum)
        and (value is _LegacyMegatronPlan or value.__module__.startswith("torch.distributed.checkpoint."))
    )


def _no_arguments(args: tuple[Any, ...], kwargs: dict[Any, Any]) -> bool:
    return not args and not kwargs


def _one_value(args: tuple[Any, ...], kwargs: dict[Any, Any]) -> bool:
    return len(args) == 1 and not kwargs


def _one_sequence(args: tuple[Any, ...], kwargs: dict[Any, Any]) -> bool:
    return not kwargs and (not args or (len(args) == 1 and type(args[0]) in (list, tuple, set, frozenset)))


def _one_string(args: tuple[Any, ...], kwargs: dict[Any, Any]) -> bool:
    return len(args) == 1 and type(args[0]) is str and not kwargs


def _strings(args: tuple[Any, ...], kwargs: dict[Any, Any]) -> bool:
    return not kwargs and all(type(a) is str for a in args)


def _named(args: tuple[Any, ...], kwargs: dict[Any, Any]) -> bool:
    return all(type(k) is str for k in kwargs)


def _argument_rule(target: Any) -> Callable[[tuple[Any, ...], dict[Any, Any]], bool]:
    """The arguments an allowed callable may be given: enums a member's value (never the
    functional API, which builds a class), ``OrderedDict`` nothing (its items come by
    SETITEMS), sequences for ``torch.Size``/``set``/``frozenset``, strings for
    ``_get_layout`` and paths; DCP's dataclasses their fields."""
    if isinstance(target, enum.EnumMeta):
        return _one_value
    if target is OrderedDict:
        return _no_arguments
    if target in (set, frozenset, torch.Size):
        return _one_sequence
    if target is torch.serialization._get_layout:
        return _one_string
    if isinstance(target, type) and issubclass(target, pathlib.PurePath):
        return _strings
    return _named


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with every code-running opcode checked against the allowlist."""

    stack: list[Any]  # the base class's own state and helper (typeshed does not list them)
    pop_mark: Callable[[], list[Any]]

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self._allowed = _allowed_globals()
        self._callables = {id(v): v for v in self._allowed.values() if callable(v)}
        self._rules = {key: _argument_rule(v) for key, v in self._callables.items()}
        self._types = {id(v) for v in self._callables.values() if isinstance(v, type)}
        self._buildable = {id(v) for v in self._callables.values() if _buildable(v)}
        self._plain_keys: set[tuple[Any, ...]] = set()  # BUILD states already checked (one per class)

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise _Refused(f"global {module}.{name} is not one of DCP's metadata classes")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {str(pid)[:80]!r} (a torch.save-style reference)")

    def _call(self, target: Any, args: Any, kwargs: Any, opcode: str) -> Any:
        if id(target) not in self._callables or self._callables[id(target)] is not target:
            raise _Refused(f"{opcode} of {type(target).__name__} {str(target)[:80]!r}, which is not an allowed global")
        if type(args) is not tuple or type(kwargs) is not dict or not self._rules[id(target)](args, kwargs):
            raise _Refused(f"{opcode} of {target!r} with arguments it is not given in DCP metadata")
        return target(*args, **kwargs)

    def _new(self, cls: Any, args: Any, kwargs: Any) -> Any:
        if id(cls) not in self._types or self._callables[id(cls)] is not cls:
            raise _Refused(f"NEWOBJ of {str(cls)[:80]!r}, which is not an allowed class")
        if type(args) is not tuple or type(kwargs) is not dict or not self._rules[id(cls)](args, kwargs):
            raise _Refused(f"NEWOBJ of {cls!r} with arguments it is not given in DCP metadata")
        return cls.__new__(cls, *args, **kwargs)

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], args, {}, "REDUCE")

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, {})

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, kwargs)

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        kind = type(inst)
        if id(kind) not in self._buildable:
            raise _Refused(f"BUILD of a {kind.__qualname__}, which is not an allowed class")
        setstate = getattr(kind, "__setstate__", None)  # the class's own: never one from the file
        if setstate is not None:
            setstate(inst, state)
            return
        slots = None
        if type(state) is tuple and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is not None and not self._plain(part):
                raise _Refused(f"BUILD of a {kind.__qualname__} with a state that is not plain attribute names")
        if state:
            inst.__dict__.update(state)
        for key, value in (slots or {}).items():
            object.__setattr__(inst, key, value)  # frozen dataclasses too, as dataclasses do

    def _plain(self, state: Any) -> bool:
        """A dict of attribute names, none a dunder (checked once per distinct key tuple)."""
        if type(state) is not dict:
            return False
        keys = tuple(state)
        if keys in self._plain_keys:
            return True
        if not all(type(k) is str and not k.startswith("__") for k in keys):
            return False
        self._plain_keys.add(keys)
        return True

    def _container(self, kinds: tuple[type, ...], opcode: str) -> Any:
        target = self.stack[-1]
        if type(target) not in kinds:
            raise _Refused(f"{opcode} on a {type(target).__name__}")
        return target

    def _load_append(self) -> None:
        value = self.stack.pop()
        self._container((list,), "APPEND").append(value)

    def _load_appends(self) -> None:
        items = self.pop_mark()
        self._container((list,), "APPENDS").extend(items)

    def _load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._container((dict, OrderedDict), "SETITEM")[key] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._container((dict, OrderedDict), "SETITEMS")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _load_additems(self) -> None:
        items = self.pop_mark()
        self._container((set,), "ADDITEMS").update(items)

    def _refuse(self) -> None:
        raise _Refused("an opcode that calls or fetches objects DCP metadata never holds (INST, OBJ, EXT or a buffer)")

    def _invalid(self) -> None:
        raise pickle.UnpicklingError("a byte that is no pickle opcode")


_SAFE_OPCODES = (
    # framing, stack and memo
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
    # constants
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
    "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    # containers built from the stack
    "EMPTY_LIST", "LIST", "EMPTY_DICT", "DICT", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "EMPTY_SET", "FROZENSET",
    # names: resolved by find_class (the allowlist)
    "GLOBAL", "STACK_GLOBAL",
    # persistent ids: the base handlers call persistent_load, which refuses
    "PERSID", "BINPERSID",
)  # fmt: skip
_CHECKED_OPCODES: dict[str, Callable[[_MetadataUnpickler], None]] = {
    "REDUCE": _MetadataUnpickler._load_reduce,
    "NEWOBJ": _MetadataUnpickler._load_newobj,
    "NEWOBJ_EX": _MetadataUnpickler._load_newobj_ex,
    "BUILD": _MetadataUnpickler._load_build,
    "APPEND": _MetadataUnpickler._load_append,
    "APPENDS": _MetadataUnpickler._load_appends,
    "SETITEM": _MetadataUnpickler._load_setitem,
    "SETITEMS": _MetadataUnpickler._load_setitems,
    "ADDITEMS": _MetadataUnpickler._load_additems,
}


def _dispatch() -> dict[int, Callable[..., None]]:
    """The opcode table: the base class's handler for plain data opcodes, ours for the checked
    ones, a refusal for the other opcodes (INST, OBJ, EXT1/2/4, buffers; PERSID and BINPERSID
    reach :meth:`~_MetadataUnpickler.persistent_load`, which refuses), and "not a pickle" for
    bytes that are no opcode."""
    base = pickle._Unpickler.dispatch
    table: dict[int, Callable[..., None]] = dict.fromkeys(range(256), _MetadataUnpickler._invalid)
    for code in base:
        table[code] = _MetadataUnpickler._refuse
    for name in _SAFE_OPCODES:
        code = getattr(pickle, name)[0]
        table[code] = base[code]
    for name, handler in _CHECKED_OPCODES.items():
        table[getattr(pickle, name)[0]] = handler
    return table


_MetadataUnpickler.dispatch = _dispatch()


def unpickle_metadata(stream: IO[bytes], where: str) -> Any:
    """DCP ``Metadata`` from ``stream`` (the ``.metadata`` file at ``where``) through the
    allowlist, then checked to be what torch's filesystem reader expects."""
    try:
        loaded = _MetadataUnpickler(stream).load()
    except _Refused as e:
        raise UnsafeCheckpointError(
            f"{where}: refused to unpickle this DCP metadata: {e}; ckptd admits only DCP's own metadata classes "
            "and runs no other code from a checkpoint (a file torch did not write, or a newer DCP: report it)"
        ) from e
    except CkptdError:
        raise
    except Exception as e:  # truncated or garbled pickle: assorted types
        raise CorruptCheckpointError(f"{where}: not a readable DCP metadata pickle ({type(e).__name__}: {e})") from e
    _check_metadata(loaded, where)
    return loaded


def _check_metadata(metadata: Any, where: str) -> None:
    """What the readers rely on: typed entries, and data files that are plain names here."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: not DCP metadata as torch writes it ({what})")

    def shape(value: Any) -> bool:
        return isinstance(value, tuple) and all(type(n) is int and n >= 0 for n in value)

    if type(metadata) is not Metadata:
        raise bad(f"holds a {type(metadata).__name__}, not a Metadata")
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(entries) is not dict:
        raise bad("state_dict_metadata is not a dict")
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            raise bad(f"entry name {fqn!r} is not a string")
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            raise bad(f"entry {fqn!r} is a {type(entry).__name__}")
        properties, size, chunks = (getattr(entry, a, None) for a in ("properties", "size", "chunks"))
        if type(properties) is not TensorProperties or not isinstance(getattr(properties, "dtype", None), torch.dtype):
            raise bad(f"tensor {fqn!r} has no dtype")
        if not shape(size) or type(chunks) is not list:
            raise bad(f"tensor {fqn!r} has no shape or chunk list")
        for chunk in chunks:
            if type(chunk) is not ChunkStorageMetadata or not (shape(chunk.offsets) and shape(chunk.sizes)):
                raise bad(f"tensor {fqn!r} has a malformed chunk")
    storage = getattr(metadata, "storage_data", None)
    if type(storage) is not dict:
        raise bad("storage_data is not a dict of data file locations")
    for info in storage.values():
        if type(info) is not _StorageInfo or type(info.relative_path) is not str:
            raise bad(f"a data location is a {type(info).__name__}")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0:
            raise bad(f"{info.relative_path}: offset/length are not byte counts")
        check_file_name(info.relative_path, where)


def read_metadata(reader: Any, where: str, rank: int | None = None) -> Any:
    """What torch's ``FileSystemReader.read_metadata`` returns, unpickled through the allowlist:
    ``reader`` is a torch filesystem reader, ``where`` its directory (for messages)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = reader._get_metadata_path(rank)
    name = os.path.basename(os.fspath(path))
    with reader.fs.create_stream(path, "rb") as stream:
        metadata = unpickle_metadata(
            stream, f"{where.rstrip('/')}/{name}" if "://" in where else os.path.join(where, name)
        )
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


@functools.cache
def _reader_class(local: bool) -> type:
    """torch's local or fsspec reader with ``read_metadata`` replaced by :func:`read_metadata`."""
    base: type[Any]
    if local:
        from torch.distributed.checkpoint import FileSystemReader

        base = FileSystemReader
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        base = FsspecReader

    class SafeMetadataReader(base):
        """A torch DCP reader whose ``.metadata`` goes through ckptd's allowlist.  torch turns a
        failed ``read_metadata`` into a bare ``AssertionError``: ``ckptd_error`` keeps ours."""

        ckptd_where = ""
        ckptd_error: CkptdError | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return read_metadata(self, self.ckptd_where, kwargs.get("rank"))
            except CkptdError as e:
                if self.ckptd_error is None:
                    self.ckptd_error = e
                raise

    SafeMetadataReader.__qualname__ = f"SafeMetadataReader[{base.__name__}]"
    return SafeMetadataReader


def safe_reader(directory: str, *, local: bool, storage_options: Mapping[str, Any] | None = None) -> Any:
    """A torch ``FileSystemReader`` (local) or ``FsspecReader`` (URLs) for ``directory`` whose
    ``read_metadata`` never unpickles outside the allowlist (``torch.distributed.checkpoint.load``
    calls it itself)."""
    cls = _reader_class(local)
    reader = cls(directory) if local else cls(directory, **dict(storage_options or {}))
    reader.ckptd_where = directory
    return reader
