"""A long-lived helper thread that takes work even while the interpreter exits."""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["SideThread"]

_T = TypeVar("_T")


class SideThread:
    """One long-lived daemon thread that runs the calls given to it, in order.

    Unlike a ``ThreadPoolExecutor`` it still takes work while the interpreter exits: the saves
    that :meth:`~ckptd.Checkpointer.close` finishes from its exit handler submit work too, after
    ``concurrent.futures`` has stopped accepting any."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, function: Callable[..., _T], *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        self._calls.put((future, functools.partial(function, *args, **kwargs)))
        return future

    def close(self) -> None:
        """Run what was submitted, then stop the thread."""
        self._calls.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            _call(*item)
            del item  # holding no finished call while waiting: its objects may be collected


def _call(future: Future[Any], call: Callable[[], Any]) -> None:
    """Run ``call`` unless ``future`` was cancelled; its result or exception goes to ``future``."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(call())
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        future.set_exception(e)
