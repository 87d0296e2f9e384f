"""Handles for saves in flight: :class:`SaveRequest` and its outcome, :class:`SaveResult`."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SaveRequest", "SaveResult"]


@dataclass(frozen=True)
class SaveResult:
    """A committed checkpoint: where it is, the bytes this save wrote, how long each phase took
    (seconds: ``plan``, ``wait``, ``stage``, ``blocking``, ``write``, ``commit``, ``total``) and
    how many object-store requests were retried (``retries``).

    An incremental save also holds files it did not write: ``bytes_linked`` (hard links to the
    previous checkpoint's files: no byte read or written) and ``bytes_copied`` (copied where
    links fail, or server-side on object stores: no byte sent from this machine);
    ``bytes_reused`` is their sum.  The checkpoint holds every one of its files either way."""

    step: int | None
    path: str
    bytes_written: int
    timings: dict[str, float] = field(default_factory=dict)
    bytes_reused: int = 0
    retries: int = 0
    bytes_linked: int = 0
    bytes_copied: int = 0

    @property
    def throughput(self) -> float:
        """Bytes written per second of the ``write`` phase (0.0 when nothing was timed)."""
        seconds = self.timings.get("write", 0.0)
        return self.bytes_written / seconds if seconds > 0 else 0.0


class SaveRequest:
    """A save in flight, returned by :meth:`ckptd.Checkpointer.async_save`.

    Behaves like a :class:`concurrent.futures.Future` of a :class:`SaveResult`: ``done()``,
    ``wait(timeout)``, ``result(timeout)``, ``exception(timeout)``, ``add_done_callback(fn)``,
    and ``await request`` in asyncio code.  A failure is raised by ``wait()``/``result()``.
    ``staged`` is set once the state has been copied out of the caller's tensors.

    A blocking ``result()``/``wait()``/``exception()`` on the thread that called ``async_save``
    (the training loop) first lifts the adaptive throttle's limit: nobody trains while that
    thread waits, so the rest of the save is written at full speed.  A wait on any other thread
    (a logger, a clean-up thread) leaves the limit alone, since training may go on meanwhile.
    """

    def __init__(self, step: int | None, path: str) -> None:
        self.step = step
        self.path = path
        self.staged = threading.Event()
        self.timings: dict[str, float] = {}
        self._future: Future[SaveResult] = Future()
        # Running from the start: nobody can cancel() it (asyncio.wrap_future cancels the future it
        # wraps when the awaiting task is cancelled, which would have made the save's outcome
        # impossible to record); the save goes on and commits or fails as if nobody had awaited it.
        self._future.set_running_or_notify_cancel()
        self._saving_thread: int | None = None
        self._release: weakref.WeakMethod[Callable[[], None]] | None = None

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the commit and return its :class:`SaveResult`; raises the save's error."""
        self._before_blocking(timeout)
        return self._future.result(timeout)

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Same as :meth:`result`; raises :class:`TimeoutError` if ``timeout`` passes first."""
        return self.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (``None`` on success), waiting up to ``timeout``."""
        self._before_blocking(timeout)
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[SaveRequest], Any]) -> None:
        """Call ``fn(request)`` when the save finishes (at once if it already has)."""
        self._future.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, SaveResult]:
        """``await request``: the :class:`SaveResult` once committed, without blocking the event
        loop (the loop is woken from the commit thread).  Cancelling the awaiting task stops the
        wait, not the save: it still commits or fails, and ``result()`` tells which."""
        return asyncio.wrap_future(self._future).__await__()

    def __repr__(self) -> str:
        state = "pending"
        if self._future.done():
            state = "failed" if self._future.exception() else "committed"
        return f"<SaveRequest step={self.step} {state} path={self.path!r}>"

    def _before_blocking(self, timeout: float | None) -> None:
        """Lift the throttle's limit if the saving thread is about to block on this save."""
        if self._release is None or self._future.done() or (timeout is not None and timeout <= 0):
            return
        if threading.get_ident() != self._saving_thread:
            return
        release = self._release()  # None once the Checkpointer is gone
        if release is not None:
            release()

    # -- used by the Checkpointer --------------------------------------------------------------

    def _release_on_wait(self, release: Callable[[], None]) -> None:
        """Call ``release`` (a bound method, held weakly) before a blocking wait on this thread."""
        self._saving_thread = threading.get_ident()
        self._release = weakref.WeakMethod(release)

    def _set_result(self, result: SaveResult) -> None:
        self._future.set_result(result)

    def _set_exception(self, error: BaseException) -> None:
        self._future.set_exception(error)
