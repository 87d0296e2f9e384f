"""Lightning: :class:`CkptdCheckpointIO`, a ``CheckpointIO`` plugin that saves through ckptd.

``Trainer(plugins=[CkptdCheckpointIO()])``: every checkpoint Lightning writes (``ModelCheckpoint``
with ``every_n_train_steps`` / ``save_top_k`` / ``monitor``, ``trainer.save_checkpoint``) becomes a
ckptd checkpoint *directory* at the ``.ckpt`` path Lightning chose, saved asynchronously (the
training step continues while the writer process writes); rotation goes through
:meth:`~CkptdCheckpointIO.remove_checkpoint` and ``trainer.fit(ckpt_path=...)`` through
:meth:`~CkptdCheckpointIO.load_checkpoint`, which also reads ordinary ``torch.save`` files.

Layout: the module weights (``checkpoint["state_dict"]``) are the ``model`` component (HF-style
safetensors); everything else (``epoch``, ``global_step``, ``loops``, ``callbacks``,
``optimizer_states``, ``lr_schedulers``, ``hyper_parameters``...) is the ``trainer`` component:
tensors in safetensors, the rest in ckptd's tagged JSON (tuples, int keys, sets, dtypes survive).
No pickle is used unless asked: values JSON cannot hold (e.g. a custom object in
``hyper_parameters``) raise :class:`~ckptd.errors.UnsupportedValueError` naming the entry; list
those top-level entries in ``pickle_keys=("hyper_parameters",)`` to pickle them, and only them
(loading unpickles only those entries of checkpoints you trust).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO

from ..catalog import read_manifest, remove_checkpoint
from ..checkpointer import Checkpointer
from ..errors import ConfigError, UnsafeCheckpointError, UnsupportedValueError
from ..request import SaveRequest
from ..storage import normalize_location

__all__ = ["CkptdCheckpointIO"]

logger = logging.getLogger(__name__)

_MODEL = "model"
_TRAINER = "trainer"
_PICKLED = "__ckptd_pickled__"


class CkptdCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` saving asynchronously through ckptd.

    Args:
        pickle_keys: top-level checkpoint entries stored pickled (scoped opt-in, see the module
            docstring); everything else must be storable without pickle.
        **checkpointer_options: keyword arguments of :class:`~ckptd.Checkpointer` (``fsync``,
            ``max_shard_size``, ``storage_options``...).  One Checkpointer is made per checkpoint
            directory (the folder holding the ``.ckpt`` paths); it saves from this process alone
            (Lightning calls the plugin on global rank zero only).
    """

    def __init__(self, *, pickle_keys: Iterable[str] = (), **checkpointer_options: Any) -> None:
        super().__init__()
        if "keep_last" in checkpointer_options:
            raise ConfigError("CkptdCheckpointIO: retention is ModelCheckpoint's (save_top_k), not keep_last")
        self.pickle_keys = frozenset(pickle_keys)
        self._options = {"no_dist": True, **checkpointer_options}
        self._checkpointers: dict[str, Checkpointer] = {}
        self._pending: dict[str, SaveRequest] = {}
        self._generations: dict[str, int] = {}
        self._removals: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _checkpointer(self, directory: str) -> Checkpointer:
        with self._lock:
            ckpt = self._checkpointers.get(directory)
            if ckpt is None:
                ckpt = Checkpointer(directory, **self._options)
                self._checkpointers[directory] = ckpt
            return ckpt

    @staticmethod
    def _location(path: Any) -> str:
        return normalize_location(os.fspath(path))

    # ---- CheckpointIO ----------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Snapshot ``checkpoint`` and return; the directory at ``path`` appears when committed."""
        if storage_options is not None:
            raise TypeError(
                f"CkptdCheckpointIO.save_checkpoint does not take storage_options (got {storage_options!r}); "
                "pass Checkpointer options to CkptdCheckpointIO(...)"
            )
        location = self._location(path)
        state = {_MODEL: checkpoint.get("state_dict", {}), _TRAINER: self._trainer_state(checkpoint)}
        step = int(checkpoint.get("global_step", 0))
        ckpt = self._checkpointer(_parent(location))
        try:
            request = ckpt.async_save(step, state, path=location, overwrite=True, metadata={"format": "lightning"})
        except UnsupportedValueError as e:
            raise UnsupportedValueError(
                f"{e} (saving Lightning checkpoint {location}: convert that value, or store its top-level entry "
                "pickled with CkptdCheckpointIO(pickle_keys=(...,)) if you trust the checkpoints)"
            ) from e
        with self._lock:
            self._pending[location] = request
            self._generations[location] = self._generations.get(location, 0) + 1
        request.add_done_callback(lambda done: self._forget(location, done))

    def _trainer_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        trainer: dict[str, Any] = {}
        pickled: dict[str, bytes] = {}
        for key, value in checkpoint.items():
            if key == "state_dict":
                continue
            if key in self.pickle_keys:
                pickled[key] = pickle.dumps(value)
            else:
                trainer[key] = value
        if pickled:
            trainer[_PICKLED] = pickled
        return trainer

    def _forget(self, location: str, request: SaveRequest) -> None:
        with self._lock:
            if self._pending.get(location) is request:
                del self._pending[location]

    def wait(self, path: Any | None = None) -> None:
        """Wait until the save to ``path`` (or every pending save) committed; raises its failure."""
        with self._lock:
            if path is None:
                requests = list(self._pending.items())
            else:
                location = self._location(path)
                found = self._pending.get(location)
                requests = [(location, found)] if found is not None else []
        for location, request in requests:
            request.result()
            self._forget(location, request)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a ckptd checkpoint directory back into Lightning's dict (a plain ``torch.save``
        file is read with ``torch.load``, ``weights_only`` as given; ``None``, Lightning's
        default, is ``True``: arbitrary pickle only when the caller asks for it)."""
        location = self._location(path)
        self.wait(location)
        if os.path.isfile(location):
            safe = True if weights_only is None else bool(weights_only)
            return torch.load(location, map_location=map_location, weights_only=safe)
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        ckpt = self._checkpointer(_parent(location))
        loaded = ckpt.load(location, device=device)
        trainer = dict(loaded.get(_TRAINER, {}))
        pickled = trainer.pop(_PICKLED, {})
        for key, blob in pickled.items():
            if key not in self.pickle_keys:
                raise UnsafeCheckpointError(
                    f"{location}: entry {key!r} is pickled; pass CkptdCheckpointIO(pickle_keys=({key!r},)) "
                    "only if you trust this checkpoint"
                )
            trainer[key] = pickle.loads(blob)
        return {**trainer, "state_dict": loaded.get(_MODEL, {})}

    def remove_checkpoint(self, path: Any) -> None:
        """Delete a checkpoint once every save started so far has committed (ModelCheckpoint
        rotates right after starting the newer save): on a background thread, so training
        goes on; a save to the same path started later cancels the deletion."""
        location = self._location(path)
        with self._lock:
            waiting = [r for r in self._pending.values() if not r.done()]
            generation = self._generations.get(location, 0)
        if not waiting:
            self._remove_now(location)
            return
        thread = threading.Thread(
            target=self._remove_after, args=(location, waiting, generation), name="ckptd-lightning-remove", daemon=True
        )
        with self._lock:
            self._removals.append(thread)
        thread.start()

    def _remove_after(self, location: str, waiting: list[SaveRequest], generation: int) -> None:
        for request in waiting:
            if request.exception() is not None:
                logger.warning("ckptd: a save failed before %s was to be removed; keeping it", location)
                return
        with self._lock:
            if self._generations.get(location, 0) != generation:
                return  # saved again since the removal was asked for
        try:
            self._remove_now(location)
        except Exception as e:  # noqa: BLE001 - a leftover checkpoint is not worth failing training
            logger.error("ckptd: removing %s failed: %s", location, e)

    def _remove_now(self, location: str) -> None:
        if os.path.isfile(location):
            os.remove(location)
            return
        ckpt = self._checkpointer(_parent(location))
        if read_manifest(ckpt.storage, location) is not None or ckpt.storage.exists(location):
            remove_checkpoint(ckpt.storage, location)

    def teardown(self) -> None:
        """Finish pending saves and removals and close the Checkpointers (Lightning calls it at
        the end of fit)."""
        try:
            self.wait()
        finally:
            with self._lock:
                removals, self._removals = self._removals, []
            for thread in removals:
                thread.join()
            with self._lock:
                checkpointers = list(self._checkpointers.values())
                self._checkpointers.clear()
            for ckpt in checkpointers:
                ckpt.close()
            self._pending.clear()


def _parent(location: str) -> str:
    return location.rstrip("/").rsplit("/", 1)[0] if "://" in location else os.path.dirname(location)
