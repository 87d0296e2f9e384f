"""Checkpoints written by torch_checkpointing (meta-pytorch, 0.1): which file holds each item.

torch_checkpointing's ``CheckpointManager.save(path, {"model": ..., "optimizer": ..., "step":
...})`` writes each item by default as ``<item>_<rank>.pt`` (``torch.save`` of the item's value:
a state dict, an optimizer's, a plain number) into a ``tmp_`` sibling that is renamed onto
``path`` when every rank is done: the rename is its commit, there is no marker file.  When an
item declares a resharder, rank 0 also writes ``metadata.pkl``: ``pickle.dumps`` of
``DistributedMetadata.to_dict()``, plain dicts, lists, tuples, strings and numbers giving the
world size, each item's per-rank file (``rank_to_layout_info``: ``None`` for the default name,
else a ``file_path`` and a serialization format) and each tensor's sharding (DTensor placements).

torch_checkpointing reads ``metadata.pkl`` with a plain ``pickle.loads``.  ckptd never does: it
is read here by an unpickler that knows only plain data (no opcode that imports or calls
anything is executed; one in the file is :class:`~ckptd.errors.UnsafeCheckpointError`), and
every ``file_path`` it names must be a plain name inside the checkpoint directory.  The ``.pt``
files are read by torch with ``weights_only=True`` (:mod:`ckptd.formats.torch_bin`).

What is read: one item per component, its tensors under their dotted paths
(``state.0.exp_avg``), from a save at one rank or one whose items are replicated on every rank
(rank 0's file is read); ``TorchSerialization`` and ``SafetensorsSerialization`` items.  Items
sharded across ranks (DTensor ``Shard`` placements), several ranks without ``metadata.pkl`` to
say how, and JSON/raw items are refused or skipped with a message saying so.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from ..errors import CorruptCheckpointError, ShardingError, UnsafeCheckpointError
from ..storage import check_file_name

__all__ = ["METADATA_FILE", "ItemFile", "is_torch_checkpointing", "item_files", "read_plain_pickle"]

logger = logging.getLogger(__name__)

METADATA_FILE = "metadata.pkl"
_DEFAULT_FILE = re.compile(r"^(?P<item>.+)_(?P<rank>\d+)\.pt$")
_FORMATS = {"TorchSerialization": "torch", "SafetensorsSerialization": "safetensors"}
_SKIPPED_FORMATS = ("JsonSerialization", "RawSerialization")


@dataclass(frozen=True)
class ItemFile:
    """Where an item's tensors are: ``file`` (relative to the checkpoint) in ``format``
    (``"torch"``: a ``torch.save`` file; ``"safetensors"``: tensors under dotted keys)."""

    item: str
    file: str
    format: str


def is_torch_checkpointing(names: Iterable[str]) -> bool:
    """True if a directory listing looks like a torch_checkpointing checkpoint (``metadata.pkl``
    or ``<item>_<rank>.pt`` files).  Detection tries every other format first."""
    return any(name == METADATA_FILE or _DEFAULT_FILE.match(name) for name in names)


# ---- metadata.pkl: plain data only ----------------------------------------------------------


class _Refused(pickle.UnpicklingError):
    """An opcode that would import or call something."""


class _PlainDataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with only the opcodes of plain data in its table: constants,
    strings, bytes, lists, tuples, dicts, sets and the memo.  ``GLOBAL``, ``REDUCE``, ``BUILD``,
    ``NEWOBJ``, ``INST``, ``OBJ``, persistent ids and extensions are refused before they act, so
    nothing is imported, called or constructed but builtin containers."""

    def _refuse(self) -> None:
        raise _Refused("it asks to import or call an object (torch_checkpointing writes plain data only)")

    def _invalid(self) -> None:
        raise pickle.UnpicklingError("a byte that is no pickle opcode")


_PLAIN_OPCODES = (
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
    "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
    "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
    "EMPTY_LIST", "LIST", "APPEND", "APPENDS", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_SET", "ADDITEMS", "FROZENSET",
)  # fmt: skip


def _plain_dispatch() -> dict[int, Any]:
    base = pickle._Unpickler.dispatch
    table: dict[int, Any] = dict.fromkeys(range(256), _PlainDataUnpickler._invalid)
    for code in base:
        table[code] = _PlainDataUnpickler._refuse
    for name in _PLAIN_OPCODES:
        code = getattr(pickle, name)[0]
        table[code] = base[code]
    return table


_PlainDataUnpickler.dispatch = _plain_dispatch()


def read_plain_pickle(stream: IO[bytes], where: str) -> Any:
    """A pickle of plain data (``where`` names it in errors); anything else is refused unrun."""
    try:
        return _PlainDataUnpickler(stream).load()
    except _Refused as e:
        raise UnsafeCheckpointError(
            f"{where}: refused to unpickle: {e}; ckptd reads only plain data from torch_checkpointing's "
            "metadata.pkl and never runs code from a checkpoint (if you trust this file, load it with "
            "torch_checkpointing itself and save it again with ckptd)"
        ) from e
    except Exception as e:  # truncated or garbled pickle: assorted types
        raise CorruptCheckpointError(f"{where}: not a readable metadata pickle ({type(e).__name__}: {e})") from e


# ---- which file holds each item --------------------------------------------------------------


def _default_files(names: Iterable[str]) -> dict[str, dict[int, str]]:
    """``{item: {rank: file}}`` of the ``<item>_<rank>.pt`` files in a listing."""
    found: dict[str, dict[int, str]] = {}
    for name in names:
        match = _DEFAULT_FILE.match(name)
        if match:
            found.setdefault(match["item"], {})[int(match["rank"])] = name
    return found


def _mapping(value: Any, what: str, where: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: {what} is not a mapping (not torch_checkpointing metadata?)")
    return value


def _replicated(sharding: Any) -> bool:
    """True if a ``ShardingMetadata`` dict says every rank holds the whole tensor."""
    if not isinstance(sharding, dict):
        return False
    kind, data = sharding.get("type"), sharding.get("data")
    if not isinstance(data, dict):
        return False
    if kind == "DTensorShardingMetadata":
        placements = data.get("placements")
        return isinstance(placements, list) and all(
            isinstance(p, dict) and p.get("type") == "Replicate" for p in placements
        )
    if kind == "default_tensor_v1":
        shape, sizes, offsets = data.get("global_shape"), data.get("local_sizes"), data.get("global_offsets")
        whole = isinstance(sizes, list) and len(sizes) == 1 and sizes[0] == shape
        return whole and isinstance(offsets, list) and len(offsets) == 1 and not any(offsets[0])
    return False


def _sharded_paths(item: Mapping[Any, Any], where: str) -> list[str]:
    """The nested paths (as torch_checkpointing writes them, JSON lists) of tensors that are not
    whole on every rank."""
    paths = _mapping(item.get("nested_path_to_metadata", {}), "nested_path_to_metadata", where)
    sharded = []
    for path, groups in paths.items():
        entries = groups if isinstance(groups, list) else []
        if not entries or not all(isinstance(g, dict) and _replicated(g.get("sharding_metadata")) for g in entries):
            sharded.append(str(path))
    return sorted(sharded)


def _layout_file(item: str, layout: Any, where: str) -> ItemFile | None:
    """The file of ``item`` that a ``rank_to_layout_info`` entry names (``None`` for a JSON or
    raw item, which holds no tensors)."""
    layout = _mapping(layout, f"the layout of item {item!r}", where)
    file_path, serialization = layout.get("file_path"), layout.get("serialization_format")
    if not isinstance(file_path, str) or not isinstance(serialization, dict):
        raise CorruptCheckpointError(f"{where}: the layout of item {item!r} has no file_path/serialization_format")
    check_file_name(file_path, f"{where} (item {item!r})")
    kind = serialization.get("type")
    if kind in _SKIPPED_FORMATS:
        logger.debug("%s: item %r is %s, which holds no tensors: not read", where, item, kind)
        return None
    if kind not in _FORMATS:
        raise CorruptCheckpointError(f"{where}: item {item!r} has an unknown serialization format {kind!r}")
    return ItemFile(item, file_path, _FORMATS[kind])


def item_files(names: Iterable[str], metadata: bytes | None, directory: str) -> dict[str, ItemFile]:
    """The file to read for each item of the checkpoint listing ``names`` (``metadata``: the
    bytes of its ``metadata.pkl``, if it has one).  Raises :class:`~ckptd.errors.ShardingError`
    for items whose tensors are split across ranks (ckptd does not reassemble them)."""
    listed = list(names)
    defaults = _default_files(listed)
    where = f"{directory}/{METADATA_FILE}"
    items: dict[str, Mapping[Any, Any]] = {}
    world_size = 1
    if metadata is not None:
        body = _mapping(read_plain_pickle(io.BytesIO(metadata), where), "metadata.pkl", where)
        raw_items = _mapping(body.get("metadata"), "'metadata'", where)
        items = {str(k): _mapping(v, f"item {k!r}", where) for k, v in raw_items.items()}
        size = body.get("world_size", 1)
        if type(size) is not int or size < 1:
            raise CorruptCheckpointError(f"{where}: world_size {size!r} is not a positive integer")
        world_size = size
    out: dict[str, ItemFile] = {}
    for item in sorted(set(defaults) | set(items)):
        ranks = set(defaults.get(item, {}))
        described = items.get(item)
        layouts = _mapping(described.get("rank_to_layout_info", {}), "rank_to_layout_info", where) if described else {}
        if world_size > 1 or len(ranks) > 1:
            if described is None:
                raise ShardingError(
                    f"{directory}: item {item!r} was saved by {max(len(ranks), world_size)} ranks and no "
                    f"{METADATA_FILE} says how its tensors are placed; ckptd reads torch_checkpointing items saved "
                    "at one rank or replicated (declared with a resharder); load it with torch_checkpointing"
                )
            sharded = _sharded_paths(described, where)
            if sharded:
                raise ShardingError(
                    f"{directory}: item {item!r} has tensors sharded across {world_size} ranks ({sharded[:3]}); "
                    "ckptd reads replicated torch_checkpointing items only: load this checkpoint with "
                    "torch_checkpointing (it reshards) and save it with ckptd"
                )
        layout = layouts.get(0)
        if layout is not None:
            found = _layout_file(item, layout, where)
            if found is not None:
                out[item] = found
            continue
        if 0 not in ranks:
            raise CorruptCheckpointError(f"{directory}: item {item!r} has no rank 0 file ({item}_0.pt)")
        out[item] = ItemFile(item, defaults[item][0], "torch")
    if not out:
        raise CorruptCheckpointError(f"{directory}: a torch_checkpointing checkpoint with no tensor items")
    return out
