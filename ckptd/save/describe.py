"""What each rank contributes to a save's plan.

A rank flattens its state into components (named per rank or per group where the sharing
pattern asks for it) and describes every tensor it holds as a :class:`~ckptd.save.plan.LocalTensor`,
in a :class:`Payload`.  :mod:`ckptd.save.exchange` sends the coordinator digests of it (and the
descriptions the coordinator does not know yet).  A rank that cannot describe its state reports
its error instead, so every rank raises instead of hanging, and every rank raises the same type
(:func:`planning_failure`): a :class:`~ckptd.errors.DistributedSaveError` naming the failed ranks
and their causes (on a failed rank, its own exception is the ``__cause__``), unless all ranks
failed alike with a ckptd error, which each rank then raises.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..dist.grid import Grid
from ..dist.group import DistContext, Sharing, group_leader, normalize_sharing, rank_failure
from ..errors import CheckpointExistsError, CkptdError, ConfigError
from ..formats.names import staging_dir_name
from ..formats.torch_dtypes import TORCH_DTYPES, dtype_name
from ..storage import Storage
from .flatten import FlatComponent, Placement, flatten_component
from .plan import LocalTensor

__all__ = ["Describer", "Payload", "planning_failure"]


@dataclass(frozen=True)
class Payload:
    """What one rank contributes to the plan (its descriptions, its components' non-tensor
    state; on the coordinator the save's staging directory)."""

    rank: int
    locals: tuple[LocalTensor, ...] = ()
    trees: dict[str, Any] = field(default_factory=dict)
    tied: dict[str, list[list[str]]] = field(default_factory=dict)
    sharing: dict[str, str] = field(default_factory=dict)
    token: str = ""
    staging: str = ""
    last_committed: str | None = None  # the save an incremental save may reuse files of
    error: tuple[str, str] | None = None  # (exception type name, message)
    coordinates: tuple[tuple[int, ...], ...] = ()  # this rank's place in each mesh its grids number


class Describer:
    """This rank's side of planning: flatten, describe."""

    def __init__(self, storage: Storage, root: str, dist: DistContext | None) -> None:
        self.storage = storage
        self.root = root
        self.dist = dist
        self.rank = dist.rank if dist else 0
        self._patterns: dict[str, str] = {}  # stored component name -> sharing pattern
        self._described: dict[str, list[LocalTensor]] = {}  # component name -> last descriptions

    @property
    def is_coordinator(self) -> bool:
        return self.dist is None or self.dist.is_coordinator

    def flatten(
        self,
        state: Mapping[str, Any],
        sharing: Mapping[str, Any],
        allow_pickle: bool,
        frozen: Mapping[str, Iterable[str]] | None = None,
    ) -> list[FlatComponent]:
        """The components this rank stores (``GLOBAL`` ones on the coordinator only), with the
        tensors ``frozen`` names (glob patterns per component) marked frozen."""
        if not isinstance(state, Mapping) or not state:
            raise ConfigError("state must be a non-empty mapping of component names to state")
        unknown = set(sharing) - set(state)
        if unknown:
            raise ConfigError(f"sharing names components that are not in the state: {sorted(unknown)}")
        flats = []
        for name, value in state.items():
            pattern, group = normalize_sharing(sharing.get(name, Sharing.REPLICATED))
            if pattern == Sharing.GLOBAL and not self.is_coordinator:
                continue
            flat = flatten_component(name, value, allow_pickle=allow_pickle)
            patterns = list((frozen or {}).get(name, ()))
            if patterns:
                declared = {k for k in flat.tensors if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
                flat = dataclasses.replace(flat, frozen=flat.frozen | declared)
            if pattern == Sharing.PER_RANK and self.dist is not None:
                flat = dataclasses.replace(flat, name=f"{name}@rank{self.rank}")
            elif pattern == Sharing.PER_GROUP and self.dist is not None:
                flat = dataclasses.replace(flat, name=f"{name}@group{group_leader(group)}")
            self._patterns[flat.name] = pattern
            flats.append(flat)
        return flats

    def payload(self, flats: list[FlatComponent], step: int, last_committed: str | None) -> Payload:
        """This rank's :class:`Payload` for ``flats``; the coordinator's also carries the save's
        token and (local stores) its staging directory."""
        locals_: list[LocalTensor] = []
        trees: dict[str, Any] = {}
        tied: dict[str, list[list[str]]] = {}
        sharing: dict[str, str] = {}
        described: dict[str, list[LocalTensor]] = {}
        # Symbolic descriptions (grids) where several ranks may write one file: a row-sharded
        # DTensor is then one entry every rank writes its rows of (object stores store chunks).
        meshes: dict[Any, tuple[int, ...]] | None = None
        if self.dist is not None and self.dist.world_size > 1 and self.storage.local:
            meshes = {}
        for flat in flats:
            described[flat.name] = _describe(flat, self._described.get(flat.name), meshes)
        if meshes and _mixes_grids_and_boxes(described.values()):
            # A sharded tensor with explicit boxes (a Shard(1) DTensor, a ShardedTensor) makes each
            # rank's layout its own, and a grid tensor would then be planned whole by every rank:
            # the whole state is described by boxes, as without grids (O(ranks x tensors) planning).
            meshes = None
            described = {flat.name: _describe(flat) if flat.placements else described[flat.name] for flat in flats}
        for flat in flats:
            descriptions = described[flat.name]
            locals_.extend(descriptions)
            qualified = "@" in flat.name
            if self.is_coordinator or qualified:
                trees[flat.name] = flat.tree
                tied[flat.name] = flat.tied
                sharing[flat.name] = self._patterns.get(flat.name, Sharing.REPLICATED)
        self._described = described
        token = secrets.token_hex(8) if self.is_coordinator else ""
        staging = ""
        if self.is_coordinator and self.storage.local:
            staging = self.storage.join(self.root, staging_dir_name(step))
        coordinates = tuple(meshes.values()) if meshes else ()
        return Payload(
            self.rank, tuple(locals_), trees, tied, sharing, token, staging, last_committed, coordinates=coordinates
        )


def _describe(
    flat: FlatComponent,
    previous: list[LocalTensor] | None = None,
    meshes: dict[Any, tuple[int, ...]] | None = None,
) -> list[LocalTensor]:
    """A :class:`LocalTensor` per tensor of ``flat``: the ``previous`` save's ones when they still
    describe it (see :func:`_unchanged`), so a warm save builds no new objects per tensor.  With
    ``meshes`` (mesh -> this rank's coordinate, filled in order of first use), DTensors placed by
    ``Shard``/``Replicate`` get a :class:`~ckptd.dist.grid.Grid`."""
    if previous is not None and _unchanged(flat, previous):
        return previous
    out = []
    for key, tensor in flat.tensors.items():
        dtype = dtype_name(tensor.dtype, f"{flat.name}.{key}")
        placement = flat.placements.get(key)
        if placement is None:
            out.append(LocalTensor.whole(flat.name, key, dtype, tuple(tensor.shape), key in flat.frozen))
        else:
            out.append(
                LocalTensor(
                    flat.name,
                    key,
                    dtype,
                    placement.global_shape,
                    placement.offset,
                    tuple(tensor.shape),
                    sharded=True,
                    main=placement.main,
                    frozen=key in flat.frozen,  # FSDP/TP pieces of a frozen base: linked by incremental saves
                    grid=_grid(placement, meshes),
                )
            )
    return out


def _mixes_grids_and_boxes(described: Iterable[list[LocalTensor]]) -> bool:
    """Whether some sharded tensors got a grid and others explicit boxes."""
    kinds = {t.grid is not None for descriptions in described for t in descriptions if t.sharded}
    return len(kinds) == 2


def _grid(placement: Placement, meshes: dict[Any, tuple[int, ...]] | None) -> Grid | None:
    """The placement's grid, its mesh numbered in ``meshes`` (None: no grids, no mesh, or pieces
    that are not row blocks: those keep explicit boxes)."""
    grid = placement.grid
    if meshes is None or grid is None or not grid.rows_only:
        return None
    known = meshes.setdefault(placement.mesh, placement.coordinate)
    if known != placement.coordinate:  # equal meshes, different coordinates: not one mesh after all
        return None
    return dataclasses.replace(grid, mesh=list(meshes).index(placement.mesh))


def _unchanged(flat: FlatComponent, previous: list[LocalTensor]) -> bool:
    """Whether ``previous`` describes ``flat``'s unsharded tensors exactly: same keys in the same
    order, dtypes, shapes and frozen flags.  Comparing costs a fraction of building new
    descriptions, and the objects the reuse does not allocate spare the garbage collector (30,000
    new descriptions per save made it traverse the whole heap about once per save)."""
    if not previous or flat.placements or len(previous) != len(flat.tensors):
        return False
    frozen = flat.frozen
    for old, (key, tensor) in zip(previous, flat.tensors.items(), strict=True):
        if old.key != key or old.shape != tensor.shape or old.frozen != (key in frozen):
            return False
        if TORCH_DTYPES.get(old.dtype) is not tensor.dtype:
            return False
    return True


def planning_failure(
    errors: dict[int, tuple[str, str]], world_size: int, own_error: BaseException | None
) -> BaseException:
    """The error every rank raises (the same type on all: they all see the same payloads)."""
    if len({kind for kind, _ in errors.values()}) == 1:
        kind, message = next(iter(errors.values()))
        if kind == "CheckpointExistsError":
            return CheckpointExistsError(message)
        if len(errors) == world_size and isinstance(own_error, CkptdError):
            return own_error  # every rank failed alike (bad arguments everywhere): its own error
    return rank_failure({r: f"{kind}: {message}" for r, (kind, message) in errors.items()}, "planning the save")
