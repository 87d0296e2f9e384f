"""ModelOpt ``sharded_checkpoint_utils`` (``modelopt.torch.puzzletron.tools``): same names,
signatures and semantics, checked side by side with the real library (tests/compat/test_modelopt_interop.py).

- ``save_sharded_model(model_shard, out_path)``: every rank of the default process group writes
  ``<stem>-0000k-of-0000n<suffix>`` next to ``out_path`` and rank 0 writes ``<out_path>.index.json``
  (an HF index ``from_pretrained`` reads).  The index is written after every rank's file exists.
- ``load_sharded_state_dict(path, keys_to_load=None, device="cpu")``: ``model.safetensors`` if
  present, else the shards of ``model.safetensors.index.json``; only stored keys come back, and
  only those of ``keys_to_load`` (keys not stored are skipped, as in ModelOpt).  Only the shards
  holding a requested key are opened.
- ``is_in_safetensors_format(checkpoint_dir)``: any ``*.safetensors`` file in the directory.
- ``load_state_dict_to_shards`` / ``set_submodule``: as ModelOpt.
- ``create_local_shard_`` / ``create_sharded_model`` / ``load_and_shard_model``: ModelOpt's
  ``descriptor`` argument is replaced by ``owned_keys(model, owned_block_indexes) -> keys``, a
  function naming the state-dict keys a rank keeps (:func:`owned_keys_by_block` builds one for the
  usual ``<layers>.<i>.`` layout).  Unowned tensors are removed from their modules.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..dist.group import rank_failure
from ..errors import ConfigError, KeyMismatchError
from ..formats.names import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
from ..formats.torch_bin import save_bin_bytes
from ..load.reader import CheckpointReader
from ..save.flatten import find_tied_groups
from ..save.tensor_files import write_safetensors_file, write_whole_file
from ..storage import check_file_name
from .forgather import StateDictLike, _location, _state_of, save_shard_index

__all__ = [
    "OwnedKeys",
    "ShardRuntime",
    "create_local_shard_",
    "create_sharded_model",
    "is_in_safetensors_format",
    "load_and_shard_model",
    "load_sharded_state_dict",
    "load_state_dict_to_shards",
    "owned_keys_by_block",
    "save_sharded_model",
    "set_submodule",
]

logger = logging.getLogger(__name__)

OwnedKeys = Callable[[torch.nn.Module, set[int]], Iterable[str]]
"""``owned_keys(model, owned_block_indexes)``: the state-dict keys this rank keeps."""


@dataclass(frozen=True)
class ShardRuntime:
    """What ModelOpt's ``runtime`` namespace carries for loading: this rank's device and dtype."""

    device: torch.device
    dtype: torch.dtype
    global_rank: int
    world_size: int
    is_main_process: bool
    is_last_process: bool


def _group() -> tuple[bool, int, int]:
    """(distributed, rank, world size) of the default process group (1 rank without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(), dist.get_world_size()
    return False, 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if _group()[0]:
        dist.barrier()


def _all_outcomes(outcome: Any) -> list[Any]:
    import torch.distributed as dist

    distributed, _, world = _group()
    if not distributed:
        return [outcome]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, outcome)
    return gathered


# ---- files --------------------------------------------------------------------------------------


def save_sharded_model(model_shard: StateDictLike, out_path: str | os.PathLike[str]) -> None:
    """ModelOpt: each rank writes its shard; rank 0 writes the HF index ``<out_path>.index.json``.

    ``out_path`` is usually ``<dir>/model.safetensors``: rank ``k`` of ``n`` writes
    ``<dir>/model-0000{k+1}-of-0000n.safetensors`` (another suffix: a ``torch.save`` file).
    Without a process group it writes the single shard ``-00001-of-00001``.  Tied tensors are
    stored once (the alias is recorded in the index's ``param_sharing``); ModelOpt's
    ``safetensors`` save refuses them.  A rank that fails makes every rank raise
    :class:`~ckptd.errors.DistributedSaveError`, and no index is written.
    """
    _barrier()
    _, rank, world = _group()
    storage, target = _location(out_path)
    directory, _, name = target.rpartition("/" if not storage.local else os.sep)
    stem, dot, suffix = name.rpartition(".") if "." in name else (name, "", "")
    try:  # from here on, an error on one rank is reported on every rank (none waits forever)
        if not isinstance(model_shard, (torch.nn.Module, dict)):
            raise ConfigError(f"save_sharded_model: unrecognized model shard type {type(model_shard).__name__}")
        state = {k: v.cpu() for k, v in _state_of(model_shard).items()}
        shard_name = check_file_name(f"{stem}-{rank + 1:05d}-of-{world:05d}{dot}{suffix}", directory)
        sharing = find_tied_groups(state)
        aliases = {k for group in sharing for k in group[1:]}
        stored = {k: v for k, v in state.items() if k not in aliases}
        storage.makedirs(directory)
        path = storage.join(directory, shard_name)
        if suffix == "safetensors":
            write_safetensors_file(storage, path, stored)
        else:
            write_whole_file(storage, path, save_bin_bytes(stored))
        outcome: Any = (shard_name, list(stored), sum(t.numel() * t.element_size() for t in stored.values()), sharing)
    except Exception as e:  # noqa: BLE001 - every rank learns which ranks failed
        outcome = f"{type(e).__name__}: {e}"
    outcomes = _all_outcomes(outcome)
    failures = {r: o for r, o in enumerate(outcomes) if isinstance(o, str)}
    if failures:
        raise rank_failure(failures, f"save_sharded_model({target})")
    index_error = ""
    if rank == 0:
        try:
            weight_map = {key: shard for shard, keys, _, _ in outcomes for key in keys}
            metadata: dict[str, Any] = {"total_size": sum(size for _, _, size, _ in outcomes)}
            groups = [group for *_, groups in outcomes for group in groups]
            index = {"metadata": metadata, "weight_map": weight_map}
            if groups:
                metadata["param_sharing"] = groups
            save_shard_index(index, directory, f"{name}.index.json")
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            index_error = f"{type(e).__name__}: {e}"
    failures = {r: o for r, o in enumerate(_all_outcomes(index_error)) if o}
    if failures:
        raise rank_failure(failures, f"save_sharded_model({target}) index")


def _reader(model_name_or_path: str | os.PathLike[str]) -> CheckpointReader:
    """ModelOpt's resolution: ``model.safetensors`` first, then the index; ckptd also reads its own
    checkpoints, ``.bin`` and DCP directories."""
    path = os.fspath(model_name_or_path)
    storage, directory = _location(path)
    if storage.exists(storage.join(directory, SAFETENSORS_INDEX)):
        single = storage.join(directory, SAFETENSORS_SINGLE)
        if storage.exists(single):
            return CheckpointReader.open(single)
    return CheckpointReader.open(path)


def load_sharded_state_dict(
    model_name_or_path: str | os.PathLike[str],
    keys_to_load: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """ModelOpt: the stored tensors of a checkpoint, all or those of ``keys_to_load``.

    Keys not stored (e.g. a tied ``lm_head.weight`` HF leaves out) are skipped, as in ModelOpt;
    only the shards holding requested keys are read.  Tensors land on ``device``.
    """
    reader = _reader(model_name_or_path)
    component = reader.default_component()
    aliases = {k for group in reader.tied_groups(component) for k in group[1:]}
    stored = [k for k in reader.keys(component) if k not in aliases]
    if keys_to_load is not None:
        wanted = set(keys_to_load)
        skipped = wanted.difference(stored)
        if skipped:
            logger.debug("%s: keys not stored, skipped: %s", reader.directory, sorted(skipped)[:5])
        stored = [k for k in stored if k in wanted]
    return reader.read(component, stored, device=device)


def is_in_safetensors_format(checkpoint_dir: str | os.PathLike[str]) -> bool:
    """ModelOpt: True if ``checkpoint_dir`` holds any ``*.safetensors`` file (False if missing)."""
    storage, directory = _location(checkpoint_dir)
    try:
        names = storage.list_names(directory)
    except OSError:  # missing or unreadable: ModelOpt's glob finds nothing either
        return False
    return any(name.endswith(".safetensors") for name in names)


# ---- modules ------------------------------------------------------------------------------------


def set_submodule(model: torch.nn.Module, module_name: str, new_submodule: torch.nn.Module) -> None:
    """ModelOpt: put ``new_submodule`` at the dotted path ``module_name`` of ``model``."""
    parent_name, _, attr = module_name.rpartition(".")
    if not attr:
        raise ConfigError("set_submodule needs a non-empty module name")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new_submodule)


def load_state_dict_to_shards(model_shard: torch.nn.Module, loaded_state_dict: dict | None = None) -> None:
    """ModelOpt: every rank calls it; rank 0 passes the whole ``loaded_state_dict`` and each rank's
    ``model_shard`` gets its own keys (``load_state_dict(..., assign=True)``, strict: a missing key
    raises, except a tied alias whose partner is present, as HF stores a tie once; ModelOpt
    instead lets its dummy modules' keys be missing).

    Under torch.distributed rank 0 gathers each rank's key list and sends each its tensors
    (objects over the default group, as ModelOpt does).  Reading from storage on every rank is
    cheaper: ``load_sharded_state_dict(path, keys_to_load=model_shard.state_dict())``.
    """
    import torch.distributed as dist

    keys = list(model_shard.state_dict())
    distributed, rank, world = _group()
    distributed = distributed and world > 1
    loaded: dict[str, Any] = {}
    if rank == 0:
        if loaded_state_dict is None:
            raise ConfigError("load_state_dict_to_shards: rank 0 must pass loaded_state_dict")
        loaded = {k.replace("_orig_mod.", ""): v for k, v in loaded_state_dict.items()}
    if distributed:
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(keys, gathered, dst=0)
        parts = [{k: loaded[k] for k in wanted if k in loaded} for wanted in gathered] if gathered else None
        received: list[Any] = [None]
        dist.scatter_object_list(received, parts, src=0)
        shard = received[0]
    else:
        shard = {k: loaded[k] for k in keys if k in loaded}
    for group in _tied_keys(model_shard):  # a tie stored once (HF's convention) fills every alias
        present = [k for k in group if k in shard]
        if present:
            shard.update({k: shard[present[0]] for k in group if k not in shard})
    missing, unexpected = model_shard.load_state_dict(shard, strict=False, assign=True)
    if missing or unexpected:
        raise KeyMismatchError(
            f"load_state_dict_to_shards: rank {rank}'s shard got no tensor for {sorted(missing)}"
            + (f" and has no place for {sorted(unexpected)}" if unexpected else "")
            + "; pass a state dict holding every key of every rank's shard"
        )


def _tied_keys(model: torch.nn.Module) -> list[list[str]]:
    """Groups of state-dict keys naming the same parameter or buffer object (meta tensors too)."""
    groups: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(key)
    return [group for group in groups.values() if len(group) > 1]


def _block_index(key: str, prefix: str) -> int | None:
    """``i`` for a key ``<prefix><i>.<rest>``, else None."""
    if not key.startswith(prefix):
        return None
    head = key[len(prefix) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def owned_keys_by_block(layers: str, first: Sequence[str] = (), last: Sequence[str] = ()) -> OwnedKeys:
    """An ``owned_keys`` function for models whose blocks are ``<layers>.<i>.``.

    A rank keeps the keys of its blocks, the keys under the ``first`` prefixes if it owns block
    0, those under ``last`` if it owns the last block, and every other key; a tied alias goes
    with its partner (as ModelOpt keeps the input embedding on the last rank when the output
    embedding is tied to it).  GPT-2: ``owned_keys_by_block("transformer.h",
    first=["transformer.wte", "transformer.wpe"], last=["transformer.ln_f", "lm_head"])``.
    """
    prefix = layers + "."

    def under(key: str, prefixes: Sequence[str]) -> bool:
        return any(key == p or key.startswith(p + ".") for p in prefixes)

    def owned_keys(model: torch.nn.Module, owned_block_indexes: set[int]) -> set[str]:
        state = model.state_dict(keep_vars=True)
        index = {k: _block_index(k, prefix) for k in state}
        blocks = {i for i in index.values() if i is not None}
        if not blocks:
            raise ConfigError(f"owned_keys_by_block: the model has no keys under {prefix!r}<index>.")
        has_first, has_last = min(blocks) in owned_block_indexes, max(blocks) in owned_block_indexes
        keep = set()
        for key in state:
            if index[key] is not None:
                if index[key] in owned_block_indexes:
                    keep.add(key)
            elif under(key, first):
                if has_first:
                    keep.add(key)
            elif not under(key, last) or has_last:
                keep.add(key)
        by_tensor: dict[int, set[str]] = {}
        for key, value in state.items():
            by_tensor.setdefault(id(value), set()).add(key)
        return {alias for key in keep for alias in by_tensor[id(state[key])]}

    return owned_keys


def create_local_shard_(
    model: torch.nn.Module, owned_block_indexes: set[int], owned_keys: OwnedKeys, runtime: Any
) -> torch.nn.Module:
    """ModelOpt, with ``owned_keys`` for the descriptor: remove every parameter and buffer not in
    ``owned_keys(model, owned_block_indexes)`` from its module; returns ``model``.

    (ModelOpt swaps in dummy modules that pass activations through its pipeline runtime; here the
    modules stay, without the tensors this rank does not own.  ``runtime`` is kept for ModelOpt's
    signature and not used.)
    """
    state = model.state_dict(keep_vars=True)
    keep = set(owned_keys(model, set(owned_block_indexes)))
    unknown = keep.difference(state)
    if unknown:
        raise KeyMismatchError(f"create_local_shard_: owned_keys named keys the model does not have: {sorted(unknown)}")
    for key in state:
        if key not in keep:
            module_name, _, attr = key.rpartition(".")
            module = model.get_submodule(module_name)
            module._parameters.pop(attr, None)
            module._buffers.pop(attr, None)
    return model


_AUTO_CLASSES = "AutoModelForCausalLM AutoModelForConditionalGeneration AutoModelForImageTextToText AutoModel".split()


def _build(model_config: Any, trust_remote_code: bool) -> torch.nn.Module:
    """ModelOpt's choice of class: with remote code, the first Auto class the config's ``auto_map``
    names; else ``config.architectures[0]`` if transformers has it; else AutoModelForCausalLM."""
    import transformers

    if trust_remote_code:
        auto_map = getattr(model_config, "auto_map", None) or {}
        auto = next((n for n in _AUTO_CLASSES if n in auto_map), "AutoModelForCausalLM")
        return getattr(transformers, auto).from_config(model_config, trust_remote_code=True)
    architectures = getattr(model_config, "architectures", None) or []
    if architectures and hasattr(transformers, architectures[0]):
        return getattr(transformers, architectures[0])._from_config(model_config)
    return transformers.AutoModelForCausalLM.from_config(model_config)


def create_sharded_model(
    runtime: Any,
    owned_keys: OwnedKeys,
    model_config: Any,
    owned_block_indexes: set[int],
    device: str | torch.device | None = "meta",
    dtype: torch.dtype | None = torch.float32,
    trust_remote_code: bool | None = None,
) -> torch.nn.Module:
    """ModelOpt, with ``owned_keys`` for the descriptor: this rank's part of the transformers
    model of ``model_config`` (class from ``config.architectures``, else AutoModelForCausalLM;
    ``trust_remote_code``: the config's ``auto_map``), built on the meta device; with another
    ``device``, its tensors are allocated (uninitialised) there.  ``trust_remote_code=None`` is
    False (ModelOpt asks its descriptor)."""
    device = torch.device(device) if device is not None else torch.device("meta")
    _barrier()
    with torch.device("meta"):
        model = _build(model_config, bool(trust_remote_code))
        if dtype is not None:
            model.to(dtype)
        create_local_shard_(model, owned_block_indexes, owned_keys, runtime)
    if device.type != "meta":
        empty = {k: torch.empty_like(v, device=device) for k, v in model.state_dict().items()}
        model.load_state_dict(empty, assign=True)
    return model


def _split(count: int, world: int, rank: int) -> set[int]:
    """numpy.array_split's part ``rank`` of ``range(count)`` (the first ``count % world`` parts are longer)."""
    size, extra = divmod(count, world)
    start = rank * size + min(rank, extra)
    return set(range(start, start + size + (1 if rank < extra else 0)))


def load_and_shard_model(
    owned_keys: OwnedKeys,
    checkpoint_path: str | os.PathLike[str],
    owned_block_indexes: set[int] | Literal["auto"] = "auto",
    model_config: Any = None,
    trust_remote_code: bool | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.nn.Module:
    """ModelOpt, with ``owned_keys`` for the descriptor: build this rank's shard and load its
    tensors from ``checkpoint_path``; the shard ends in ``dtype`` (ModelOpt: bfloat16).

    ``"auto"`` splits the blocks over the ranks as ModelOpt does (numpy ``array_split``).  Each
    rank reads only its keys from safetensors checkpoints; other formats are read on rank 0 and
    sent with :func:`load_state_dict_to_shards`.  The device is ``cuda:<local rank>`` when CUDA is
    available, else the CPU.
    """
    import transformers

    _, rank, world = _group()
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))  # ModelOpt: the global rank without it
    runtime = ShardRuntime(
        device=torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu"),
        dtype=dtype,
        global_rank=rank,
        world_size=world,
        is_main_process=rank == 0,
        is_last_process=rank == world - 1,
    )
    path = os.fspath(checkpoint_path)
    if model_config is None:
        model_config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=bool(trust_remote_code))
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_layers = int(text_config.num_hidden_layers)
    if owned_block_indexes == "auto":
        owned_block_indexes = _split(num_layers, world, rank)
    owned = set(owned_block_indexes)
    model_shard = create_sharded_model(runtime, owned_keys, model_config, owned, trust_remote_code=trust_remote_code)
    tied = bool(getattr(model_config, "tie_word_embeddings", False))
    has_first, has_last = 0 in owned, num_layers - 1 in owned
    storage, directory = _location(path)
    if any(storage.exists(storage.join(directory, n)) for n in (SAFETENSORS_SINGLE, SAFETENSORS_INDEX)):
        keys = [*(n for n, _ in model_shard.named_parameters()), *(n for n, _ in model_shard.named_buffers())]
        state = load_sharded_state_dict(path, keys_to_load=keys, device=runtime.device)
        model_shard.load_state_dict(state, strict=False, assign=True)
        del state
    else:
        full = None
        if runtime.is_main_process:
            reader = CheckpointReader.open(path)
            full = reader.read(reader.default_component(), device="cpu")
        load_state_dict_to_shards(model_shard, full)
        del full
        model_shard.to(runtime.device)
    tie_weights = getattr(model_shard, "tie_weights", None)  # transformers' PreTrainedModel methods
    input_embeddings = getattr(model_shard, "get_input_embeddings", None)
    if tied and (has_first or has_last) and callable(tie_weights):
        tie_weights()  # assign=True severed the tie
    if tied and has_last and not has_first and callable(input_embeddings):
        input_embeddings()._parameters.pop("weight", None)  # kept only to tie lm_head
    model_shard.type(runtime.dtype)
    on_meta = [name for name, value in model_shard.named_parameters() if value.device.type == "meta"]
    if on_meta:
        raise KeyMismatchError(f"{path}: rank {rank} could not load {on_meta} (not in the checkpoint)")
    return model_shard
