"""Removing what failed saves wrote, retried in the background while the store is unreachable.

A save that fails on an object store leaves unfinished multipart uploads and objects under its
prefix.  The store being unreachable is the usual cause of the failure, so the first clean-up
attempt often fails too: the path is then retried with backoff on a background thread, and
``drain()`` (called by ``Checkpointer.close()``) keeps trying until a deadline.
"""

from __future__ import annotations

import logging
import threading
import time

from .base import Storage

__all__ = ["Cleanup"]

logger = logging.getLogger(__name__)

_FIRST_DELAY = 0.5
_MAX_DELAY = 10.0


class Cleanup:
    """Discards failed saves' leftovers on ``storage``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def discard(self, path: str) -> None:
        """Remove ``path`` now, or keep retrying in the background if that fails."""
        if self._try(path):
            return
        with self._lock:
            if path not in self._pending:
                self._pending.append(path)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._retry_loop, name="ckptd-cleanup", daemon=True)
                self._thread.start()

    def pending(self) -> list[str]:
        """Paths still waiting to be cleaned up."""
        with self._lock:
            return list(self._pending)

    def drain(self, timeout: float) -> list[str]:
        """Keep retrying until everything is cleaned or ``timeout`` passes; returns what is left."""
        deadline = time.monotonic() + timeout
        delay = _FIRST_DELAY
        while True:
            self._attempt_all()
            left = self.pending()
            if not left or time.monotonic() >= deadline:
                if left:
                    logger.error("ckptd: could not clean up %s; run `ckptd gc` when the store is back", left)
                return left
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, _MAX_DELAY)

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _try(self, path: str) -> bool:
        try:
            self.storage.discard(path)
        except Exception as e:  # noqa: BLE001 - retried later
            logger.warning("ckptd: cleaning up %s failed (%s); will retry", path, e)
            return False
        return True

    def _attempt_all(self) -> None:
        for path in self.pending():
            if self._try(path):
                with self._lock:
                    if path in self._pending:
                        self._pending.remove(path)

    def _retry_loop(self) -> None:
        delay = _FIRST_DELAY
        while not self._closed and self.pending():
            self._wake.wait(delay)
            if self._closed:
                return
            self._attempt_all()
            delay = min(delay * 2, _MAX_DELAY)
