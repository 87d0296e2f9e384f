"""Which process a ckptd object belongs to, and what happens to it in a ``fork()`` child.

A Checkpointer, its writer client and its staging pool own threads, a writer process and shared
arenas of the process that created them.  In a child made by ``fork()`` none of their threads
exist, so a lock one of them held at the fork stays held forever and an arena marked busy never
comes back.  Objects registered here get ``forget_after_fork()`` called in the child (fresh
locks, nothing of the parent's), and :func:`check_process` makes their calls there fail at once
with :class:`~ckptd.errors.WriterError` instead of waiting for the parent's state.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import WriterError

__all__ = ["bind_to_process", "check_process", "reset_in_fork_child", "unbind"]

logger = logging.getLogger(__name__)

_FORK_CHILD_RESETS: weakref.WeakSet[Any] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for owner in list(_FORK_CHILD_RESETS):
        try:
            owner.forget_after_fork()
        except Exception:  # never break the child's fork(); its calls raise WriterError anyway
            logger.debug("ckptd: could not reset %r after fork", owner, exc_info=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def reset_in_fork_child(owner: Any) -> None:
    """Call ``owner.forget_after_fork()`` in every child made by ``fork()`` while ``owner`` lives
    (held weakly): the owner's threads do not exist there, so locks they held stay held forever."""
    _FORK_CHILD_RESETS.add(owner)


def bind_to_process(owner: Any) -> Callable[[], None]:
    """Tie ``owner`` to the current process: :func:`reset_in_fork_child`, and ``owner.close()``
    at interpreter exit, in this process only.  Returns the exit hook, for :func:`unbind`."""
    reset_in_fork_child(owner)
    ref, pid = weakref.ref(owner), os.getpid()

    def finish() -> None:
        instance = ref()
        if instance is not None and os.getpid() == pid:
            instance.close()

    atexit.register(finish)
    return finish


def unbind(hook: Callable[[], None]) -> None:
    """Drop the exit hook returned by :func:`bind_to_process` (the owner was closed)."""
    atexit.unregister(hook)


def check_process(owner_pid: int, what: str) -> None:
    """Raise WriterError unless this is process ``owner_pid`` (not a fork() child of it)."""
    if os.getpid() != owner_pid:
        raise WriterError(
            f"this {what} belongs to process {owner_pid} and was inherited by process {os.getpid()} "
            f"through fork(); create a new {what} in the child"
        )
