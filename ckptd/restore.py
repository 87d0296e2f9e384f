"""Assign loaded state: into modules (in place, strict/assign), stateful objects and mappings.

Also the tied-parameter helpers of the seed API: :func:`create_sharing_metadata` finds
parameters sharing storage; :func:`retie_parameters` makes them share again after a load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch

from .errors import ConfigError, KeyMismatchError
from .flatten import find_tied_groups, restore_tree, tree_tensor_keys
from .loader import CheckpointReader

__all__ = [
    "create_sharing_metadata",
    "load_into_module",
    "read_components",
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
    verify: bool = False,
) -> set[str]:
    """Load a component into ``module``; returns the module keys that were not loaded.

    Without ``assign``, bytes are read straight into the module's tensors where dtype and layout
    allow (else copied in).  With ``strict``, missing or unexpected keys raise
    :class:`KeyMismatchError` before anything is read.  Tied parameters are re-tied afterwards.
    """
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
            f"missing {_preview(missing)}; unexpected {_preview(unexpected)} (pass strict=False to ignore)"
        )
    if assign:
        loaded = reader.read(component, wanted, device=device, verify=verify)
        module.load_state_dict(loaded, strict=False, assign=True)
    else:
        reader.read(component, wanted, targets={k: tensor_state[k] for k in wanted}, verify=verify)
    groups = [[k for k in group if k in state] for group in reader.tied_groups(component)]
    retie_parameters(module, [g for g in groups if len(g) > 1])
    return set(missing)


def read_components(
    reader: CheckpointReader,
    components: Iterable[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    verify: bool = False,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Every (or the named) component rebuilt as saved: nested state with tensors on ``device``."""
    trees = reader.state_trees(verify=verify)
    names = list(components) if components is not None else list(dict.fromkeys([*reader.components(), *trees]))
    out: dict[str, Any] = {}
    for name in names:
        if name not in trees and name not in reader.components():
            raise KeyMismatchError(
                f"{reader.directory}: no component {name!r} (has {sorted({*trees, *reader.components()})})"
            )
        tree = trees.get(name)
        if tree is None:
            out[name] = reader.read(name, device=device, verify=verify)
            continue
        keys = tree_tensor_keys(tree)
        tensors = reader.read(name, keys, device=device, verify=verify) if keys else {}
        out[name] = restore_tree(tree, tensors, allow_pickle=allow_pickle, where=f"{reader.directory}:{name}")
    return out


def restore_components(
    reader: CheckpointReader,
    into: Mapping[str, Any],
    *,
    strict: bool = True,
    assign: bool = False,
    device: str | torch.device = "cpu",
    verify: bool = False,
    allow_pickle: bool = False,
) -> None:
    """Restore each ``into[name]`` in place from the checkpoint's component ``name``."""
    trees = reader.state_trees(verify=verify)
    known = {*trees, *reader.components()}
    absent = [name for name in into if name not in known]
    if absent:
        raise KeyMismatchError(f"{reader.directory}: no component(s) {absent} in the checkpoint (has {sorted(known)})")
    for name, target in into.items():
        if isinstance(target, torch.nn.Module):
            load_into_module(reader, name, target, strict=strict, assign=assign, device=device, verify=verify)
            extras = _non_tensor_entries(trees.get(name), allow_pickle, f"{reader.directory}:{name}")
            if extras:
                target.load_state_dict(extras, strict=False)
            continue
        value = read_components(reader, [name], device=device, verify=verify, allow_pickle=allow_pickle)[name]
        if callable(getattr(target, "load_state_dict", None)):
            target.load_state_dict(value)
        elif isinstance(target, MutableMapping):
            _update_mapping(target, value)
        else:
            raise ConfigError(
                f"cannot restore component {name!r} into a {type(target).__name__}: "
                "pass an object with load_state_dict() or a mutable mapping"
            )


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
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape:
            with torch.no_grad():
                old.copy_(new)
        elif isinstance(old, MutableMapping) and isinstance(new, Mapping):
            _update_mapping(old, new)
        else:
            target[key] = new


def _preview(keys: list[str], limit: int = 5) -> str:
    if not keys:
        return "none"
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
