"""Handles for saves in flight: :class:`SaveRequest` and its outcome, :class:`SaveResult`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SaveRequest", "SaveResult"]


@dataclass(frozen=True)
class SaveResult:
    """A committed checkpoint: where it is, the bytes this save wrote (``bytes_reused`` more
    are referenced from earlier checkpoints by an incremental save), how long each phase took
    (seconds: ``plan``, ``wait``, ``stage``, ``blocking``, ``write``, ``commit``, ``total``) and
    how many object-store requests were retried (``retries``)."""

    step: int | None
    path: str
    bytes_written: int
    timings: dict[str, float] = field(default_factory=dict)
    bytes_reused: int = 0
    retries: int = 0

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
    """

    def __init__(self, step: int | None, path: str) -> None:
        self.step = step
        self.path = path
        self.staged = threading.Event()
        self.timings: dict[str, float] = {}
        self._future: Future[SaveResult] = Future()

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveResult:
        """Wait for the commit and return its :class:`SaveResult`; raises the save's error."""
        return self._future.result(timeout)

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Same as :meth:`result`; raises :class:`TimeoutError` if ``timeout`` passes first."""
        return self.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (``None`` on success), waiting up to ``timeout``."""
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[SaveRequest], Any]) -> None:
        """Call ``fn(request)`` when the save finishes (at once if it already has)."""
        self._future.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, SaveResult]:
        return asyncio.wrap_future(self._future).__await__()

    def __repr__(self) -> str:
        state = "pending"
        if self._future.done():
            state = "failed" if self._future.exception() else "committed"
        return f"<SaveRequest step={self.step} {state} path={self.path!r}>"

    # -- used by the Checkpointer --------------------------------------------------------------

    def _set_result(self, result: SaveResult) -> None:
        self._future.set_result(result)

    def _set_exception(self, error: BaseException) -> None:
        self._future.set_exception(error)
