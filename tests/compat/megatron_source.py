"""Running ckptd's Megatron bridge against Megatron-Core's *source* (``CKPTD_MEGATRON_SRC``, a
tree made by ``scripts/megatron_source.sh``, e.g. core_v0.19.0), in spawned processes, so that
``import megatron.core`` finds that tree before the installed ``megatron-core`` wheel.

Nothing here imports Megatron at module level: :func:`use_megatron_source` runs first in every
process that does.  Two workarounds, both only in those processes:

- ``NO_VCS_VERSION=1`` (read by Megatron's own ``package_info.py``): no ``git`` call at import;
- without ``triton`` (CPU-only torch has none), 0.19's ``import megatron.core`` fails: its
  ``__init__`` imports the pipeline schedules, which import a Triton kernel module for MoE
  activation stashing (``megatron.core.transformer.moe.ops.paged_stash``, GPU only, unrelated to
  checkpointing) unconditionally.  Megatron offers no switch for it, so that one module is
  replaced by placeholders that raise if called.  ``triton`` itself is not stubbed (torch would
  take a stub for the real thing).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

ENV = "CKPTD_MEGATRON_SRC"
_TRITON_ONLY = "megatron.core.transformer.moe.ops.paged_stash"


class _NoTritonKernels(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Provides :data:`_TRITON_ONLY` as placeholders (the module needs triton at import)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname == _TRITON_ONLY else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        def unavailable(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{_TRITON_ONLY} needs triton (not installed; replaced by ckptd's tests)")

        module.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
        module.paged_stash_copy_kernel = unavailable  # type: ignore[attr-defined]
        module.paged_stash_pop_kernel = unavailable  # type: ignore[attr-defined]


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
    ``root/ckptd`` (both ``verify_integrity=True``), an async save through ckptd's strategy into
    ``root/ckptd_async``; then Megatron's ``load`` of each at world size 2."""
    version = use_megatron_source(src)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron_fixtures import mcore_state, stub_cuda_for_megatron_save

    from ckptd.compat import megatron_strategy
    from ckptd.compat.megatron import LoadStrategy, SaveStrategy

    stub_cuda_for_megatron_save()
    out: dict[str, Any] = {
        "version": version,
        "has_base": importlib.util.find_spec("megatron.core.dist_checkpointing.strategies.base") is not None,
        "registry": megatron_strategy.HAS_STRATEGY_REGISTRY,
        "save_is_torch_dist": isinstance(SaveStrategy(), TorchDistSaveShardedStrategy),
    }
    dirs = {name: os.path.join(root, name) for name in ("torch_dist", "ckptd", "ckptd_async")}
    for directory in dirs.values():
        os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(mcore_state(rank, world), dirs["torch_dist"], verify_integrity=True)
    dist_checkpointing.save(
        mcore_state(rank, world), dirs["ckptd"], sharded_strategy=SaveStrategy(), verify_integrity=True
    )
    request = dist_checkpointing.save(
        mcore_state(rank, world),
        dirs["ckptd_async"],
        sharded_strategy=SaveStrategy(),
        async_sharded_save=True,
        async_strategy="mcore",
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
        return dist_checkpointing.load(state, directory, sharded_strategy=strategy, verify_integrity=True)

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

    out: dict[str, Any] = {}
    for name in ("ckptd", "torch_dist"):
        directory = os.path.join(root, name)
        out[f"load:{name}"] = dist_checkpointing.load(
            whole_layout(mapping, megatron=True), directory, sharded_strategy=LoadStrategy(), verify_integrity=True
        )
        out[f"common:{name}"] = dist_checkpointing.load_common_state_dict(directory)
        shapes = dist_checkpointing.load_tensors_metadata(directory, LoadStrategy())
        out[f"shapes:{name}"] = {k: tuple(v.global_shape) for k, v in shapes.items()}
    try:  # Megatron's own check of integrity.json sees what ckptd's sees
        dist_checkpointing.load(
            whole_layout(mapping, megatron=True),
            os.path.join(root, "corrupt"),
            sharded_strategy=LoadStrategy(),
            verify_integrity=True,
        )
        out["megatron:corrupt"] = None
    except CheckpointingException as e:
        out["megatron:corrupt"] = str(e)
    return out
