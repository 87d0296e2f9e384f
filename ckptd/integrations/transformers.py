"""Hugging Face Trainer: :class:`CkptdTrainer` saves and resumes its checkpoints through ckptd.

``CkptdTrainer`` (or :class:`CkptdTrainerMixin` before another ``Trainer`` subclass) replaces
``_save_checkpoint``: the model, optimizer, scheduler, grad scaler, RNG states and the trainer
state are snapshotted into ``<output_dir>/checkpoint-<step>/`` and written by the ckptd writer
process while training continues.  Once the checkpoint has committed, ``trainer_state.json``,
``config.json`` and ``generation_config.json`` are written into it (so ``from_pretrained`` and
``resume_from_checkpoint`` find what they expect) and ``save_total_limit`` is applied, never
deleting the latest committed checkpoint nor the best one.  Resuming (``resume_from_checkpoint=True``
or a path) restores all of it; ``load_best_model_at_end`` loads the best checkpoint through ckptd.
Directories written by the stock Trainer still load as before.

Scope: one saving process (single process, or DDP where the main process saves the replicated
state; other ranks' RNG states are not saved).  ``training_args.bin`` (a pickle) is not written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import threading
from typing import Any

from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from ..catalog import remove_checkpoint
from ..checkpointer import Checkpointer
from ..errors import ConfigError
from ..formats.names import MANIFEST_NAME
from ..request import SaveRequest
from ..rng import RNGState

__all__ = ["CkptdTrainer", "CkptdTrainerMixin", "is_ckptd_checkpoint"]

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"


def is_ckptd_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a committed ckptd checkpoint directory."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST_NAME))


def _write_text(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` through a new file of a name nobody could have planted
    (created exclusively, never through a symlink), renamed over it."""
    temporary = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class CkptdTrainerMixin:
    """Checkpointing of a ``transformers.Trainer`` through ckptd (put it first in the bases).

    ``ckptd_options``: keyword arguments of :class:`~ckptd.Checkpointer` (``fsync``,
    ``max_shard_size``...).
    """

    def __init__(self, *args: Any, ckptd_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        options = dict(ckptd_options or {})
        if "keep_last" in options:
            raise ConfigError("CkptdTrainer: use TrainingArguments.save_total_limit, not keep_last")
        self._ckptd_options = {"no_dist": True, **options}
        self._ckptd_checkpointers: dict[str, Checkpointer] = {}
        self._ckptd_pending: list[tuple[SaveRequest, threading.Event]] = []
        self._ckptd_lock = threading.Lock()
        self._ckptd_error: BaseException | None = None
        super().__init__(*args, **kwargs)

    # ---- the Checkpointer ------------------------------------------------------------------

    def _ckptd(self, run_dir: str) -> Checkpointer:
        run_dir = os.path.abspath(run_dir)
        with self._ckptd_lock:
            ckpt = self._ckptd_checkpointers.get(run_dir)
            if ckpt is None:
                ckpt = Checkpointer(run_dir, **self._ckptd_options)
                self._ckptd_checkpointers[run_dir] = ckpt
            return ckpt

    def wait_for_checkpoints(self) -> None:
        """Wait until every checkpoint saved so far committed (and its files and rotation are
        done); raises the first failure."""
        with self._ckptd_lock:
            pending = list(self._ckptd_pending)
        for request, finished in pending:
            request.result()
            finished.wait()  # its side files and rotation
        with self._ckptd_lock:
            self._ckptd_pending = [p for p in self._ckptd_pending if not p[1].is_set()]
            error, self._ckptd_error = self._ckptd_error, None
        if error is not None:
            raise error

    def close_checkpointers(self) -> None:
        """Finish pending saves and stop the writer processes."""
        self.wait_for_checkpoints()
        with self._ckptd_lock:
            checkpointers = list(self._ckptd_checkpointers.values())
            self._ckptd_checkpointers.clear()
        for ckpt in checkpointers:
            ckpt.close()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.wait_for_checkpoints()

    # ---- saving ----------------------------------------------------------------------------

    def _ckptd_state(self) -> dict[str, Any]:
        model = self.accelerator.unwrap_model(self.model)  # type: ignore[attr-defined]
        state: dict[str, Any] = {"model": model}
        if not self.args.save_only_model:  # type: ignore[attr-defined]
            if self.optimizer is not None:  # type: ignore[attr-defined]
                state["optimizer"] = self.optimizer  # type: ignore[attr-defined]
            if self.lr_scheduler is not None:  # type: ignore[attr-defined]
                state["scheduler"] = self.lr_scheduler  # type: ignore[attr-defined]
            scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = RNGState()
        return state

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        step = self.state.global_step  # type: ignore[attr-defined]
        if self.hp_search_backend is None and trial is None:  # type: ignore[attr-defined]
            self.store_flos()  # type: ignore[attr-defined]
        run_dir = os.path.abspath(self._get_output_dir(trial=trial))  # type: ignore[attr-defined]
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        best_step = self.state.best_global_step  # type: ignore[attr-defined]
        if best_step:
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            if best_dir == output_dir or os.path.isdir(best_dir):  # the current save counts though in flight
                self.state.best_model_checkpoint = best_dir  # type: ignore[attr-defined]
        for callback in [*self.callback_handler.callbacks, self.control]:  # type: ignore[attr-defined]
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                stateful = self.state.stateful_callbacks  # type: ignore[attr-defined]
                if isinstance(stateful.get(name), list):
                    stateful[name].append(callback.state())
                else:
                    stateful[name] = callback.state()
        if not self.args.should_save:  # type: ignore[attr-defined]
            return
        # what TrainerState.save_to_json writes, captured now (the state keeps changing)
        trainer_state = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"  # type: ignore[attr-defined]
        unwrapped = self.accelerator.unwrap_model(self.model)  # type: ignore[attr-defined]
        extras = {TRAINER_STATE_NAME: trainer_state}
        config = getattr(unwrapped, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            extras["config.json"] = config.to_json_string()
        generation = getattr(unwrapped, "generation_config", None)
        if generation is not None and callable(getattr(unwrapped, "can_generate", None)) and unwrapped.can_generate():
            extras["generation_config.json"] = generation.to_json_string()
        last_log = self.state.log_history[-1] if self.state.log_history else {}  # type: ignore[attr-defined]
        metrics = {k: v for k, v in last_log.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        # trainer_state.json also lives inside the commit (a crash right after it loses nothing)
        state = {**self._ckptd_state(), "trainer_state": {"json": trainer_state}}
        ckpt = self._ckptd(run_dir)
        request = ckpt.async_save(
            step, state, path=output_dir, overwrite=True, metadata={"format": "transformers.Trainer"}, metrics=metrics
        )
        finished = threading.Event()
        with self._ckptd_lock:
            self._ckptd_pending.append((request, finished))
        limit = self.args.save_total_limit  # type: ignore[attr-defined]
        request.add_done_callback(lambda done: self._after_commit(done, run_dir, extras, limit, finished))

    def _after_commit(
        self, request: SaveRequest, run_dir: str, extras: dict[str, str], limit: int | None, finished: threading.Event
    ) -> None:
        """On the commit thread: the HF side files, then rotation (only after this commit)."""
        try:
            if request.exception() is not None:
                return
            for name, text in extras.items():
                _write_text(os.path.join(request.path, name), text)
            if limit is not None and limit > 0:
                self._rotate(run_dir, limit)
        except Exception as e:  # noqa: BLE001 - raised by wait_for_checkpoints()
            logger.error("ckptd: finishing checkpoint %s failed: %s", request.path, e)
            with self._ckptd_lock:
                self._ckptd_error = e
        finally:
            finished.set()

    def _rotate(self, run_dir: str, limit: int) -> None:
        checkpoints = [  # a symlink is not one of the run's checkpoints: never counted, never deleted through
            p
            for p in sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR, False)
            if is_ckptd_checkpoint(p) and not os.path.islink(p.rstrip(os.sep))
        ]
        if len(checkpoints) <= limit:
            return
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        protected = {checkpoints[-1]} | ({os.path.abspath(best)} if best else set())
        keep = max(limit, len(protected))
        remaining = len(checkpoints)
        storage = self._ckptd(run_dir).storage
        for path in checkpoints:
            if remaining <= keep:
                break
            if os.path.abspath(path) in protected:
                continue
            logger.info("ckptd: deleting %s (save_total_limit=%s)", path, limit)
            remove_checkpoint(storage, path)
            remaining -= 1

    # ---- resuming --------------------------------------------------------------------------

    def _ckptd_load(self, checkpoint: str, into: dict[str, Any], **kwargs: Any) -> None:
        self.wait_for_checkpoints()
        self._ckptd(os.path.dirname(os.path.abspath(checkpoint))).load(os.path.abspath(checkpoint), into, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not is_ckptd_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        target = self.accelerator.unwrap_model(model if model is not None else self.model)  # type: ignore[attr-defined]
        self._ckptd_load(resume_from_checkpoint, {"model": target})
        self._restore_side_files(resume_from_checkpoint)

    def _restore_side_files(self, checkpoint: str) -> None:
        """A crash between the commit and the side files leaves trainer_state.json out: rebuild it."""
        if os.path.isfile(os.path.join(checkpoint, TRAINER_STATE_NAME)):
            return
        ckpt = self._ckptd(os.path.dirname(os.path.abspath(checkpoint)))
        saved = ckpt.load(os.path.abspath(checkpoint), components=["trainer_state"])
        _write_text(os.path.join(checkpoint, TRAINER_STATE_NAME), saved["trainer_state"]["json"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_ckptd_checkpoint(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        into = {}
        if self.optimizer is not None:  # type: ignore[attr-defined]
            into["optimizer"] = self.optimizer  # type: ignore[attr-defined]
        if self.lr_scheduler is not None:  # type: ignore[attr-defined]
            into["scheduler"] = self.lr_scheduler  # type: ignore[attr-defined]
        if into:
            self._ckptd_load(checkpoint, into)
        return None

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_ckptd_checkpoint(checkpoint):
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None:
            self._ckptd_load(checkpoint, {"scaler": scaler})
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_ckptd_checkpoint(checkpoint):
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        self._ckptd_load(checkpoint, {"rng": RNGState()})
        return None

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint  # type: ignore[attr-defined]
        self.wait_for_checkpoints()
        if best is None or not is_ckptd_checkpoint(best):
            return super()._load_best_model()  # type: ignore[misc]
        logger.info("ckptd: loading the best model from %s", best)
        self._ckptd_load(best, {"model": self.accelerator.unwrap_model(self.model)})  # type: ignore[attr-defined]
        return None


class CkptdTrainer(CkptdTrainerMixin, Trainer):
    """A ``transformers.Trainer`` whose checkpoints are saved asynchronously by ckptd."""
