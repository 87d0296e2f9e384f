"""Accelerate: state hooks so ``accelerator.save_state()`` / ``load_state()`` save models through ckptd.

``register_ckptd_hooks(accelerator)`` registers a save-state and a load-state pre-hook.  On
``save_state(output_dir)`` the save hook snapshots every prepared model (unwrapped) into a ckptd
checkpoint at ``<output_dir>/ckptd_models/`` (HF-style safetensors, tied weights once) and removes
the models' weights from Accelerate's list, so Accelerate writes no model files of its own; the
writer process writes them while training continues.  On ``load_state(input_dir)`` the load hook
waits for a save still in flight there, restores the models from that checkpoint in place and
removes them from Accelerate's list.  Directories without ``ckptd_models/`` load as before.

Accelerate's hooks can take over the model weights only: optimizer, scheduler, scaler, sampler
and RNG states are still written by Accelerate itself (``optimizer.bin``, ``random_states_0.pkl``...).
Only the main process saves (models are replicated under DDP); every process loads.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ..checkpointer import Checkpointer
from ..errors import ConfigError
from ..formats.names import MANIFEST_NAME
from ..request import SaveRequest

__all__ = ["MODELS_DIR", "CkptdStateHooks", "register_ckptd_hooks"]

logger = logging.getLogger(__name__)

MODELS_DIR = "ckptd_models"


def _component(index: int) -> str:
    return "model" if index == 0 else f"model_{index}"


class CkptdStateHooks:
    """The registered hooks of one Accelerator (see the module docstring).

    Args:
        accelerator: an ``accelerate.Accelerator``.
        **checkpointer_options: keyword arguments of :class:`~ckptd.Checkpointer`.  One
            Checkpointer is made per parent folder of the ``output_dir`` values saved to (the
            save is staged there and renamed into ``output_dir``).
    """

    def __init__(self, accelerator: Any, **checkpointer_options: Any) -> None:
        if "keep_last" in checkpointer_options:
            raise ConfigError("ckptd accelerate hooks: use ProjectConfiguration(total_limit=...), not keep_last")
        self.accelerator = accelerator
        self._options = {"no_dist": True, **checkpointer_options}
        self._checkpointers: dict[str, Checkpointer] = {}
        self._pending: dict[str, SaveRequest] = {}
        self._lock = threading.Lock()
        self._handles = [
            accelerator.register_save_state_pre_hook(self._save_hook),
            accelerator.register_load_state_pre_hook(self._load_hook),
        ]

    def _checkpointer(self, parent: str) -> Checkpointer:
        with self._lock:
            ckpt = self._checkpointers.get(parent)
            if ckpt is None:
                ckpt = Checkpointer(parent, **self._options)
                self._checkpointers[parent] = ckpt
            return ckpt

    def _save_hook(self, models: list[Any], weights: list[Any], output_dir: str) -> None:
        path = os.path.join(os.path.abspath(output_dir), MODELS_DIR)
        state = {_component(i): self.accelerator.unwrap_model(model) for i, model in enumerate(models)}
        weights.clear()  # Accelerate writes no model files: ckptd does
        if not state or not self.accelerator.is_main_process:
            return
        ckpt = self._checkpointer(os.path.dirname(os.path.abspath(output_dir)))
        step = int(getattr(self.accelerator, "save_iteration", 0) or 0)
        request = ckpt.async_save(step, state, path=path, overwrite=True, metadata={"format": "accelerate"})
        with self._lock:
            self._pending[path] = request
        logger.debug("ckptd: saving %d model(s) of accelerator state to %s", len(state), path)

    def _load_hook(self, models: list[Any], input_dir: str) -> None:
        path = os.path.join(os.path.abspath(input_dir), MODELS_DIR)
        self.wait(path)
        if not os.path.isfile(os.path.join(path, MANIFEST_NAME)):
            return  # not saved through ckptd: Accelerate loads its own files
        ckpt = self._checkpointer(os.path.dirname(os.path.abspath(input_dir)))
        into = {_component(i): self.accelerator.unwrap_model(model) for i, model in enumerate(models)}
        ckpt.load(path, into=into)
        models.clear()  # restored: Accelerate must not look for its own model files

    def wait(self, path: str | None = None) -> None:
        """Wait for the model save into ``path`` (or all of them) to commit; raises its failure."""
        with self._lock:
            if path is None:
                requests = list(self._pending.values())
                self._pending.clear()
            else:
                found = self._pending.pop(path, None)
                requests = [found] if found is not None else []
        for request in requests:
            request.result()

    def remove(self) -> None:
        """Unregister the hooks, finish pending saves and stop the writer processes."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        try:
            self.wait()
        finally:
            with self._lock:
                checkpointers = list(self._checkpointers.values())
                self._checkpointers.clear()
            for ckpt in checkpointers:
                ckpt.close()


def register_ckptd_hooks(accelerator: Any, **checkpointer_options: Any) -> CkptdStateHooks:
    """Route the model weights of ``accelerator.save_state()`` / ``load_state()`` through ckptd;
    returns the hooks (call ``.wait()`` before reading a checkpoint elsewhere, ``.remove()`` at the end)."""
    return CkptdStateHooks(accelerator, **checkpointer_options)
