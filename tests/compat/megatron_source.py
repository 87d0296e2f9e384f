"""Running ckptd's Megatron bridge against Megatron-Core's *source* (``CKPTD_MEGATRON_SRC``, a
tree made by ``scripts/megatron_source.sh``, e.g. core_v0.19.0), in spawned processes, so that
``import megatron.core`` finds that tree before the installed ``megatron-core`` wheel.

Nothing here imports Megatron at module level: :func:`use_megatron_source` runs first in every
process that does.  Two workarounds, both only in those processes:

- ``NO_VCS_VERSION=1`` (read by Megatron's own ``package_info.py``): no ``git`` call at import;
- without ``triton`` (CPU-only torch has none), ``import megatron.core`` fails on 0.18 and 0.19:
  its ``__init__`` imports the pipeline schedules, which import the MoE activation "paged stash"
  (``megatron.core.transformer.moe.paged_stash``, GPU only, unrelated to checkpointing), which
  imports Triton (0.18 directly, 0.19 through its ``ops`` kernels) without a guard.  Megatron
  offers no switch for it, so that one module is replaced by one whose every name is a function
  that raises if called (the modules importing it only import functions).  ``triton`` itself is
  not stubbed (torch would take a stub for the real thing).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from typing import Any

ENV = "CKPTD_MEGATRON_SRC"
_TRITON_ONLY = "megatron.core.transformer.moe.paged_stash"


class _NoTritonKernels(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Provides :data:`_TRITON_ONLY` as placeholders (the real module needs triton at import)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname == _TRITON_ONLY else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        def placeholder(name: str) -> Any:
            def unavailable(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError(f"{_TRITON_ONLY}.{name} needs triton (not installed; replaced by ckptd's tests)")

            return unavailable

        module.__getattr__ = placeholder  # type: ignore[attr-defined]


def use_megatron_source(src: str) -> str:
    """Make ``import megatron.core`` load ``src``'s tree in this process; returns its version."""
    if any(name == "megatron" or name.startswith("megatron.") for name in sys.modules):
        raise RuntimeError("megatron is already imported in this process; use a fresh one")
    os.environ["NO_VCS_VERSION"] = "1"
    sys.path.insert(0, src)
    if importlib.util.find_spec("triton") is None:
        sys.meta_path.insert(0, _NoTritonKernels())
    import megatron.core
    from megatron.core import package_info

    where = os.path.realpath(megatron.core.__file__)
    if not where.startswith(os.path.realpath(src) + os.sep):
        raise RuntimeError(f"megatron.core came from {where}, not from {src}")
    return str(package_info.__version__)


def generate_on_rank(rank: int, world: int, root: str, src: str) -> dict[str, Any]:
    """Each of 2 gloo ranks: real ``dist_checkpointing.save`` of the fixture's state with
    Megatron's default strategy into ``root/torch_dist`` and with ckptd's SaveStrategy into
    ``root/ckptd`` (both ``verify_integrity=True`` where Megatron has it: 0.18+), an async save
    through ckptd's strategy into ``root/ckptd_async``; then Megatron's ``load`` of each at
    world size 2."""
    version = use_megatron_source(src)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron_fixtures import mcore_state, stub_cuda_for_megatron_save

    from ckptd.compat import megatron_strategy
    from ckptd.compat.megatron import LoadStrategy, SaveStrategy

    stub_cuda_for_megatron_save()
    integrity = _integrity_kwargs(dist_checkpointing.save)
    out: dict[str, Any] = {
        "integrity": bool(integrity),
        "version": version,
        "has_base": importlib.util.find_spec("megatron.core.dist_checkpointing.strategies.base") is not None,
        "registry": megatron_strategy.HAS_STRATEGY_REGISTRY,
        "save_is_torch_dist": isinstance(SaveStrategy(), TorchDistSaveShardedStrategy),
    }
    dirs = {name: os.path.join(root, name) for name in ("torch_dist", "ckptd", "ckptd_async")}
    for directory in dirs.values():
        os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(mcore_state(rank, world), dirs["torch_dist"], **integrity)
    dist_checkpointing.save(mcore_state(rank, world), dirs["ckptd"], sharded_strategy=SaveStrategy(), **integrity)
    in_process = {"async_strategy": "mcore"} if _accepts(dist_checkpointing.save, "async_strategy") else {}
    request = dist_checkpointing.save(
        mcore_state(rank, world),
        dirs["ckptd_async"],
        sharded_strategy=SaveStrategy(),
        async_sharded_save=True,
        **in_process,
    )
    config = os.path.join(dirs["ckptd_async"], "metadata.json")
    out["async:before"] = os.path.exists(config)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    out["async:finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    out["async:after"] = os.path.exists(config)
    queue.close()
    for name, directory in dirs.items():
        out[f"files:{name}"] = sorted(os.listdir(directory))

    def load(directory: str, strategy: Any = None) -> Any:
        state = mcore_state(rank, world, empty=True)
        return dist_checkpointing.load(state, directory, sharded_strategy=strategy, **integrity)

    out["megatron<-torch_dist"] = load(dirs["torch_dist"])
    out["ckptd<-torch_dist"] = load(dirs["torch_dist"], LoadStrategy())
    out["ckptd<-ckptd"] = load(dirs["ckptd"], LoadStrategy())
    out["ckptd<-ckptd_async"] = dist_checkpointing.load(
        mcore_state(rank, world, empty=True), dirs["ckptd_async"], sharded_strategy=LoadStrategy()
    )
    return out


def load_on_one_rank(rank: int, world: int, root: str, src: str) -> dict[str, Any]:
    """World size 1: Megatron's ``load`` with ckptd's LoadStrategy of what 2 ranks wrote, its
    common-state and metadata readers, and the integrity check on a corrupted copy."""
    use_megatron_source(src)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import mapping
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron_fixtures import whole_layout

    from ckptd.compat.megatron import LoadStrategy

    integrity = _integrity_kwargs(dist_checkpointing.load)
    out: dict[str, Any] = {}
    for name in ("ckptd", "torch_dist"):
        directory = os.path.join(root, name)
        out[f"load:{name}"] = dist_checkpointing.load(
            whole_layout(mapping, megatron=True), directory, sharded_strategy=LoadStrategy(), **integrity
        )
        out[f"common:{name}"] = dist_checkpointing.load_common_state_dict(directory)
        shapes = dist_checkpointing.load_tensors_metadata(directory, LoadStrategy())
        out[f"shapes:{name}"] = {k: tuple(v.global_shape) for k, v in shapes.items()}
    out["megatron:corrupt"] = None
    if not integrity:
        return out
    try:  # Megatron's own check of integrity.json sees what ckptd's sees
        dist_checkpointing.load(
            whole_layout(mapping, megatron=True),
            os.path.join(root, "corrupt"),
            sharded_strategy=LoadStrategy(),
            verify_integrity=True,
        )
    except CheckpointingException as e:
        out["megatron:corrupt"] = str(e)
    return out


def _accepts(fn: Any, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _integrity_kwargs(fn: Any) -> dict[str, Any]:
    """``verify_integrity=True`` where Megatron's ``save``/``load`` take it (0.18+)."""
    return {"verify_integrity": True} if _accepts(fn, "verify_integrity") else {}
