"""torchtitan: :class:`CkptdCheckpointManager`, a ``BaseCheckpointManager`` saving through ckptd.

torchtitan (0.3) builds its checkpoint manager from ``config.checkpoint`` and calls
``save(curr_step, last_step)``, ``load(step=-1)``, ``maybe_wait_for_staging()``,
``maybe_wait_for_saving()`` and ``close()``.  This manager keeps that contract and torchtitan's
policies (``interval``, ``enable_first_step_checkpoint``, ``last_save_model_only`` with
``export_dtype``, ``keep_latest_k``, ``exclude_from_loading``, ``load_only``, ``load_step``) but
writes ckptd checkpoints (``<folder>/checkpoint-<step>/``: HF-style safetensors shards, DTensor
pieces written by their owners and resharded on load) instead of DCP's ``step-N/``.

``async_mode``: ``"disabled"`` waits for each commit; ``"async"`` returns after the copy into the
staging arena (``staging="blocking"``); ``"async_with_pinned_mem"`` also overlaps the copy with the
next forward/backward (``staging="background"``: the next optimizer step waits for it).
Not supported: ``initial_load_path`` of a DCP or HF checkpoint (load those with torchtitan's own
manager once, then save with this one) and ``last_save_in_hf`` (refused at construction).
RNG states are not saved unless listed in ``states`` (``{"rng": ckptd.RNGState()}``), as with DCP.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

from ..errors import ConfigError
from ..manager import CheckpointManager, CheckpointPolicy
from ..request import SaveRequest

__all__ = ["STAGING_FOR_ASYNC_MODE", "CkptdCheckpointManager"]

logger = logging.getLogger(__name__)

STAGING_FOR_ASYNC_MODE = {"disabled": "blocking", "async": "blocking", "async_with_pinned_mem": "background"}
_EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class CkptdCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, backed by a :class:`~ckptd.manager.CheckpointManager`."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_mode: str = "disabled"
        """``"disabled"``, ``"async"`` or ``"async_with_pinned_mem"`` (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
        **checkpointer_options: Any,
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: SaveRequest | None = None
        if config.async_mode not in STAGING_FOR_ASYNC_MODE:
            raise ConfigError(
                f"checkpoint.async_mode must be one of {sorted(STAGING_FOR_ASYNC_MODE)}, got {config.async_mode!r}"
            )
        if config.last_save_in_hf:
            raise ConfigError(
                "checkpoint.last_save_in_hf is not supported by the ckptd manager (its checkpoints are already "
                "safetensors, under torchtitan's key names); convert them with the sd_adapter"
            )
        self.config = config
        self.async_mode = config.async_mode
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        if self.states[DATALOADER] is None:
            del self.states[DATALOADER]
        folder = config.folder if not base_folder else f"{base_folder.rstrip('/')}/{config.folder}"
        self.folder = folder
        keep = config.keep_latest_k or None
        self._manager = CheckpointManager(
            folder,
            CheckpointPolicy(every_steps=config.interval, keep_last=keep),
            staging=STAGING_FOR_ASYNC_MODE[config.async_mode],
            **checkpointer_options,
        )
        self._last: SaveRequest | None = None
        logger.info("ckptd: torchtitan checkpoints under %s (async_mode=%s)", folder, config.async_mode)

    # ---- BaseCheckpointManager hooks -------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self._wait_for_saving_if_any()
        if last_step and self.config.last_save_model_only:
            dtype = _EXPORT_DTYPES[self.config.export_dtype]
            model = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.states[MODEL].state_dict().items()}
            self._manager.save(curr_step, {"model": model}).result()  # the final export is synchronous
            return True
        request = self._manager.save(curr_step, dict(self.states))
        self._last = request
        if self.async_mode == "disabled":
            request.result()
        else:
            self.save_future = request
        return True

    def _wait_for_saving_if_any(self) -> None:
        if self.save_future is not None:
            self._wait_for_saving()

    def _wait_for_saving(self) -> None:
        request, self.save_future = self.save_future, None
        if request is not None:
            request.result()

    def _maybe_wait_for_staging(self) -> None:
        if self._last is not None:
            self._last.staged.wait()

    def _load(self, step: int = -1) -> bool:
        step = self.config.load_step if step == -1 else step
        if step == -1:
            latest = self._manager.latest()
            if latest is None:
                if self.config.initial_load_path:
                    raise ConfigError(
                        f"initial_load_path {self.config.initial_load_path!r}: the ckptd manager loads only ckptd "
                        "checkpoints; convert it with torchtitan's own CheckpointManager first"
                    )
                return False
            step = latest
        saved = set(self._manager.checkpointer.manifest(step).components)
        excluded = set(self.config.exclude_from_loading)
        into = {k: v for k, v in self.states.items() if k not in excluded and k in saved}
        model_only = saved == {"model"}
        if model_only:
            into = {"model": self.states[MODEL]}
        self._manager.load(step, into=into)
        logger.info("ckptd: loaded step %s (%s)", step, ", ".join(sorted(into)))
        return True

    def _close(self) -> None:
        if hasattr(self, "_manager"):
            self._manager.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
