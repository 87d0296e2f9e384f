"""Assign loaded state: into modules (in place, strict/assign), stateful objects and mappings.

Also the tied-parameter helpers of the seed API: :func:`create_sharing_metadata` finds
parameters sharing storage; :func:`retie_parameters` makes them share again after a load.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import torch

from ..dist.sharding import is_dtensor
from ..errors import ConfigError, KeyMismatchError
from ..formats.torch_dtypes import dtype_from_name
from ..save.flatten import find_tied_groups, restore_tree, tensor_leaves, tree_tensor_keys
from .inline_verify import VerifyMode
from .reader import CheckpointReader, PendingRead, preview

__all__ = [
    "read_keys",
    "create_sharing_metadata",
    "load_into_module",
    "read_components",
    "reads_everything",
    "resolve_component",
    "restore_components",
    "retie_parameters",
]


def create_sharing_metadata(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter/buffer names of ``model`` that share the same tensor (tied weights)."""
    state = model.state_dict(keep_vars=True)
    return find_tied_groups({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})


def retie_parameters(module: torch.nn.Module, sharing_metadata: Iterable[Iterable[str]]) -> None:
    """Make every name of each group refer to the first name's parameter (or buffer) again."""
    for group in sharing_metadata:
        names = list(group)
        if len(names) < 2:
            continue
        source = _resolve(module, names[0])
        if source is None:
            raise KeyMismatchError(f"cannot re-tie: module has no parameter or buffer {names[0]!r}")
        for name in names[1:]:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if isinstance(source, torch.nn.Parameter):
                setattr(owner, attr, source)
            else:
                owner.register_buffer(attr, source)


def _resolve(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    owner_name, _, attr = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_name) if owner_name else module
    except AttributeError:
        return None
    value = getattr(owner, attr, None)
    return value if isinstance(value, torch.Tensor) else None


def load_into_module(
    reader: CheckpointReader,
    component: str,
    module: torch.nn.Module,
    *,
    strict: bool = True,
    assign: bool = False,
    device: str | torch.device = "cpu",
    verify: VerifyMode = False,
) -> set[str]:
    """Load a component into ``module``; returns the module keys that were not loaded.

    Without ``assign``, bytes are read straight into the module's tensors where dtype and layout
    allow (else copied in).  With ``strict``, missing or unexpected keys raise
    :class:`KeyMismatchError` before anything is read.  Tied parameters are re-tied afterwards.
    """
    pending, apply = _plan_module(reader, component, module, strict=strict, assign=assign, device=device, verify=verify)
    reader.run([pending])
    return apply()


def _plan_module(
    reader: CheckpointReader,
    component: str,
    module: torch.nn.Module,
    *,
    strict: bool,
    assign: bool,
    device: str | torch.device,
    verify: VerifyMode,
) -> tuple[PendingRead, Callable[[], set[str]]]:
    """:func:`load_into_module` in two halves: the planned read, and what to do once it is read."""
    state = module.state_dict()
    tensor_state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    available = set(reader.keys(component))
    own_ties = {key: group for group in find_tied_groups(tensor_state) for key in group}
    wanted = [k for k in tensor_state if k in available]
    missing = [k for k in tensor_state if k not in available and not any(o in available for o in own_ties.get(k, ()))]
    unexpected = sorted(available - set(state))
    if strict and (missing or unexpected):
        raise KeyMismatchError(
            f"{reader.directory}: checkpoint does not match the module: "
            f"missing {preview(missing)}; unexpected {preview(unexpected)} (pass strict=False to ignore)"
        )
    assigning = assign and not any(is_dtensor(t) for t in tensor_state.values())
    if assigning:
        pending = reader.plan(component, wanted, device=device, verify=verify)
    else:
        pending = reader.plan(component, wanted, targets={k: tensor_state[k] for k in wanted}, verify=verify)

    def apply() -> set[str]:
        loaded = pending.result()
        if assigning:
            _check_shapes(loaded, tensor_state, reader.directory)
            _alias_own_ties(loaded, own_ties)
            module.load_state_dict(loaded, strict=False, assign=True)
        groups = [[k for k in group if k in state] for group in reader.tied_groups(component)]
        retie_parameters(module, [g for g in groups if len(g) > 1])
        return set(missing)

    return pending, apply


def _check_shapes(loaded: Mapping[str, Any], state: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse (as the in-place path does) a loaded tensor whose shape is not its module tensor's:
    ``load_state_dict(assign=True)`` would raise torch's ``RuntimeError`` instead."""
    for key, value in loaded.items():
        expected = state.get(key)
        if isinstance(value, torch.Tensor) and expected is not None and value.shape != expected.shape:
            raise KeyMismatchError(
                f"size mismatch for {key!r}: checkpoint {where} has shape {tuple(value.shape)}, "
                f"the module has {tuple(expected.shape)}"
            )


def _alias_own_ties(loaded: dict[str, torch.Tensor], own_ties: Mapping[str, list[str]]) -> None:
    """Give every member of the module's own tied groups the tensor loaded for one of them.

    A checkpoint that stores a tied weight once (HF dedups ``lm_head.weight`` behind
    ``embed_tokens.weight``) and records no ``param_sharing`` leaves the other names out of
    ``loaded``; assigning only the stored name would leave its aliases holding their old
    values.  The aliases get the same tensor (same storage), as HF and Forgather loads do.
    """
    for key, group in own_ties.items():
        if key in loaded:
            continue
        source = next((k for k in group if k in loaded), None)
        if source is not None:
            loaded[key] = loaded[source]


def resolve_component(reader: CheckpointReader, name: str, rank: int, groups: Mapping[str, int] | None = None) -> str:
    """The stored component behind a requested name: ``rng`` is ``rng@rank3`` on rank 3 when it
    was saved per rank, ``model@group4`` for a per-group save whose group leader is rank 4."""
    known = set(reader.components()) | set(reader.state_trees())
    if name in known:
        return name
    for qualified in (f"{name}@rank{rank}", f"{name}@group{(groups or {}).get(name, -1)}"):
        if qualified in known:
            return qualified
    variants = sorted(k for k in known if k.startswith(f"{name}@"))
    if variants:
        raise KeyMismatchError(
            f"{reader.directory}: component {name!r} was saved per rank or per group ({', '.join(variants[:4])}...) "
            f"and has no copy for rank {rank}"
        )
    logical = sorted({k.split("@", 1)[0] for k in known})
    raise KeyMismatchError(f"{reader.directory}: no component {name!r} (has {logical})")


def _logical_names(reader: CheckpointReader, rank: int) -> list[str]:
    names: list[str] = []
    for stored in [*reader.components(), *reader.state_trees()]:
        logical, _, qualifier = stored.partition("@")
        if qualifier and qualifier != f"rank{rank}" and not qualifier.startswith("group"):
            continue
        if logical not in names:
            names.append(logical)
    return names


def reads_everything(
    reader: CheckpointReader,
    rank: int,
    into: Mapping[str, Any] | None,
    components: Iterable[str] | None,
    keys: Iterable[str] | None,
) -> bool:
    """Whether a load asks for every component of the checkpoint (this rank's copies): no
    ``keys``, and ``components``/``into`` absent or naming them all."""
    if keys is not None:
        return False
    chosen = into if into is not None else components
    return chosen is None or set(_logical_names(reader, rank)) <= set(chosen)


def read_components(
    reader: CheckpointReader,
    components: Iterable[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    verify: VerifyMode = False,
    allow_pickle: bool = False,
    rank: int = 0,
    groups: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Every (or the named) component rebuilt as saved: nested state with whole tensors on
    ``device`` (sharded tensors are assembled); per-rank components are this ``rank``'s copy."""
    trees = reader.state_trees(verify=verify)
    names = list(components) if components is not None else _logical_names(reader, rank)
    out: dict[str, Any] = {}
    for name in names:
        stored = resolve_component(reader, name, rank, groups)
        out[name] = _read_value(reader, stored, trees.get(stored), {}, device, verify, allow_pickle)
    return out


def _read_value(
    reader: CheckpointReader,
    stored: str,
    tree: Any,
    targets: Mapping[str, Any],
    device: str | torch.device,
    verify: VerifyMode,
    allow_pickle: bool,
) -> Any:
    pending, finish = _plan_value(reader, stored, tree, targets, device, verify, allow_pickle)
    reader.run([pending] if pending is not None else [])
    return finish()


def _plan_value(
    reader: CheckpointReader,
    stored: str,
    tree: Any,
    targets: Mapping[str, Any],
    device: str | torch.device,
    verify: VerifyMode,
    allow_pickle: bool,
) -> tuple[PendingRead | None, Callable[[], Any]]:
    """:func:`_read_value` in two halves: the planned read, and the value rebuilt once read."""
    if tree is None:
        pending = reader.plan(stored, device=device, targets=targets, verify=verify)
        return pending, pending.result
    keys = tree_tensor_keys(tree)
    keyset = set(keys)
    wanted = {k: t for k, t in targets.items() if k in keyset}
    planned = reader.plan(stored, keys, device=device, targets=wanted, verify=verify) if keys else None

    def finish() -> Any:
        tensors = planned.result() if planned is not None else {}
        return restore_tree(tree, tensors, allow_pickle=allow_pickle, where=f"{reader.directory}:{stored}")

    return planned, finish


def restore_components(
    reader: CheckpointReader,
    into: Mapping[str, Any],
    *,
    strict: bool = True,
    assign: bool = False,
    device: str | torch.device = "cpu",
    verify: VerifyMode = False,
    allow_pickle: bool = False,
    rank: int = 0,
    groups: Mapping[str, int] | None = None,
) -> None:
    """Restore each ``into[name]`` in place from the checkpoint's component ``name``.

    Tensors the target already holds are filled in place (only their own piece for DTensors and
    :class:`~ckptd.ShardedTensor`, whatever layout the checkpoint was saved in); an optimizer
    with no state yet gets state shaped and sharded like its parameters.
    """
    trees = reader.state_trees(verify=verify)
    stored_names = {name: resolve_component(reader, name, rank, groups) for name in into}
    for name, target in into.items():
        if not isinstance(target, torch.nn.Module) and not (
            callable(getattr(target, "load_state_dict", None)) or isinstance(target, MutableMapping)
        ):
            raise ConfigError(
                f"cannot restore component {name!r} into a {type(target).__name__}: "
                "pass an object with load_state_dict() or a mutable mapping"
            )
    # Plan every component, read all their bytes in one pass, then assign in order.
    pending: list[PendingRead] = []
    applies: list[Callable[[], None]] = []
    for name, target in into.items():
        stored = stored_names[name]
        if isinstance(target, torch.nn.Module):
            planned, after = _plan_module(
                reader, stored, target, strict=strict, assign=assign, device=device, verify=verify
            )
            pending.append(planned)
            where = f"{reader.directory}:{stored}"
            applies.append(_module_apply(target, after, trees.get(stored), allow_pickle, where))
            continue
        targets = tensor_leaves(name, target)
        if isinstance(target, torch.optim.Optimizer):
            targets = {**_optimizer_state_targets(reader, stored, target), **targets}
        if reader.kind == "dcp":  # no ckptd tree: the structure comes from DCP's own paths
            applies.append(_value_apply(target, functools.partial(_dcp_value, reader, stored, target, targets, device)))
            continue
        value_plan, finish = _plan_value(reader, stored, trees.get(stored), targets, device, verify, allow_pickle)
        if value_plan is not None:
            pending.append(value_plan)
        applies.append(_value_apply(target, finish))
    reader.run(pending)
    for apply in applies:
        apply()


def _module_apply(
    module: torch.nn.Module, after: Callable[[], set[str]], tree: Any, allow_pickle: bool, where: str
) -> Callable[[], None]:
    def apply() -> None:
        after()
        extras = _non_tensor_entries(tree, allow_pickle, where)
        if extras:
            module.load_state_dict(extras, strict=False)

    return apply


def _value_apply(target: Any, finish: Callable[[], Any]) -> Callable[[], None]:
    def apply() -> None:
        value = finish()
        if callable(getattr(target, "load_state_dict", None)):
            target.load_state_dict(value)
        else:
            _update_mapping(target, value)

    return apply


_OPTIMIZER_STATE_KEY = re.compile(r"^state\.(\d+)\.(.+)$")


def _dcp_value(reader: CheckpointReader, stored: str, target: Any, targets: Mapping[str, Any], device: Any) -> Any:
    """A DCP component nested as saved (DCP writes dict keys as strings: an optimizer's
    ``state`` keys are turned back into the parameter ids ``load_state_dict`` matches)."""
    tensors = reader.read(stored, device=device, targets=targets)
    value = reader.read_dcp_nested(stored, tensors)
    if isinstance(target, torch.optim.Optimizer) and isinstance(value, dict) and isinstance(value.get("state"), dict):
        value["state"] = {int(k) if str(k).isdigit() else k: v for k, v in value["state"].items()}
    return value


def _optimizer_state_targets(reader: CheckpointReader, component: str, optimizer: Any) -> dict[str, Any]:
    """Targets for an optimizer's saved per-parameter state, shaped and sharded like the
    parameters it belongs to (so Adam moments saved at N ranks load at M ranks)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    targets: dict[str, Any] = {}
    for key in reader.keys(component):
        match = _OPTIMIZER_STATE_KEY.match(key)
        if not match or int(match.group(1)) >= len(params):
            continue
        param = params[int(match.group(1))]
        record = reader.record(component, key)
        if record is None or tuple(record.shape) != tuple(param.shape):
            continue
        dtype = dtype_from_name(record.dtype)
        if is_dtensor(param):
            from torch.distributed.tensor import DTensor

            local = torch.empty(param.to_local().shape, dtype=dtype, device=param.to_local().device)
            targets[key] = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            )
        else:
            targets[key] = torch.empty(param.shape, dtype=dtype, device=param.device)
    return targets


def _non_tensor_entries(tree: Any, allow_pickle: bool, where: str) -> dict[str, Any]:
    if not isinstance(tree, dict) or tree.get("__ckptd__") is not None:
        return {}
    plain = {k: v for k, v in tree.items() if not (isinstance(v, dict) and v.get("__ckptd__") in ("tensor", "ndarray"))}
    if not plain:
        return {}
    return dict(restore_tree(plain, {}, allow_pickle=allow_pickle, where=where))


def _update_mapping(target: MutableMapping[Any, Any], value: Any) -> None:
    if not isinstance(value, Mapping):
        raise ConfigError(f"cannot restore a {type(value).__name__} into a mapping")
    for key, new in value.items():
        old = target.get(key)
        if new is old:
            continue  # a sharded or tensor target, filled in place
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape:
            with torch.no_grad():
                old.copy_(new)
        elif isinstance(old, MutableMapping) and isinstance(new, Mapping):
            _update_mapping(old, new)
        else:
            target[key] = new


def read_keys(
    reader: CheckpointReader,
    keys: Iterable[str],
    *,
    device: Any,
    verify: VerifyMode,
    rank: int,
    groups: dict[str, int],
) -> dict[str, Any]:
    """``{component: {key: tensor}}`` for qualified keys (``"model.layers.0.weight"``: component,
    dot, key), reading only the shards that hold them."""
    wanted: dict[str, list[str]] = {}
    names = sorted({c.split("@", 1)[0] for c in reader.components()}, key=len, reverse=True)
    for qualified in keys:
        component = next((n for n in names if qualified.startswith(n + ".")), None)
        if component is None:
            raise ConfigError(
                f"key {qualified!r} must start with a component name and a dot (components: {sorted(names)})"
            )
        wanted.setdefault(component, []).append(qualified[len(component) + 1 :])
    return {
        c: reader.read(resolve_component(reader, c, rank, groups), ks, device=device, verify=verify)
        for c, ks in wanted.items()
    }
