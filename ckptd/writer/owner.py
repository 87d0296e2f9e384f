"""Which process a ckptd object belongs to, and what happens to it in a ``fork()`` child.

A Checkpointer, its writer client and its staging pool own threads, a writer process and shared
arenas of the process that created them.  In a child made by ``fork()`` none of their threads
exist, so a lock one of them held at the fork stays held forever and an arena marked busy never
comes back.  Objects registered here get ``forget_after_fork()`` called in the child (fresh
locks, nothing of the parent's), and :func:`check_process` makes their calls there fail at once
with :class:`~ckptd.errors.WriterError` instead of waiting for the parent's state.

At interpreter exit the owner is closed (:func:`bind_to_process`), which waits for its pending
saves; :class:`CtrlC` says what Ctrl-C does during that wait.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..errors import WriterError

__all__ = ["CtrlC", "bind_to_process", "check_process", "exiting_on_ctrl_c", "reset_in_fork_child", "unbind"]

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


def bind_to_process(owner: Any, at_exit: Callable[[Any], None] | None = None) -> Callable[[], None]:
    """Tie ``owner`` to the current process: :func:`reset_in_fork_child`, and at interpreter exit
    ``at_exit(owner)`` (default: ``owner.close()``), in this process only.  Returns the exit hook,
    for :func:`unbind`."""
    reset_in_fork_child(owner)
    ref, pid = weakref.ref(owner), os.getpid()

    def finish() -> None:
        instance = ref()
        if instance is not None and os.getpid() == pid:
            if at_exit is None:
                instance.close()
            else:
                at_exit(instance)

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


def exiting_on_ctrl_c() -> bool:
    """True while the interpreter exits because the program ended on an unhandled
    KeyboardInterrupt (its traceback already printed): the user pressed Ctrl-C once already."""
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # last_exc: 3.12+
    return isinstance(last, KeyboardInterrupt)


class CtrlC:
    """What Ctrl-C does while a process waits for its saves to commit (``close()``, and at exit).

    Python's own handler would raise KeyboardInterrupt into the wait: at interpreter exit that
    prints "Exception ignored in atexit callback" and a traceback, and the saves are waited for
    all the same, in silence.  Inside ``with CtrlC(describe, active=...) as ctrl_c:``, when
    ``active`` (saves to wait for), on the main thread and while SIGINT has Python's default
    handler (a handler of the program's own is left alone, and :attr:`armed` stays False):

    1. the first Ctrl-C prints one line to stderr, "ckptd: waiting for <describe()> to
       commit... Ctrl-C again to abandon it"; ``told=True`` prints it on entry instead (the
       Ctrl-C that ended the program was the first);
    2. the next one raises KeyboardInterrupt, from inside the wait: the caller calls
       :meth:`start_waiting` first thing in its ``try`` (a press that came before is raised
       there), and on KeyboardInterrupt abandons its saves and calls :meth:`abandoning`;
    3. after :meth:`stop_waiting` (first thing in its ``finally``: releasing the writer,
       abandoning, bounded work) Ctrl-C is ignored until the block ends, so nothing is left
       half released.

    The lines go to stderr, not to the log: they answer a key the user pressed, and at exit the
    logging may be unconfigured, filtered or shut down.
    """

    abandoned_at_exit = False
    """Set once saves were abandoned during the interpreter's exit: later exit waits (other
    Checkpointers) abandon theirs at once instead of asking again."""

    def __init__(self, describe: Callable[[], str], *, active: bool = True, told: bool = False) -> None:
        self.describe = describe
        self.active = active
        self.told = told
        self.armed = False  # our handler is installed
        self._state = "before"  # then "waiting", then "after"
        self._again = False  # the second Ctrl-C came before the wait began
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        if self.active and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                    self._previous = signal.signal(signal.SIGINT, self._on_sigint)
                    self.armed = True
            except (ValueError, OSError):  # no signals here (an embedded interpreter)
                self.armed = False
        if self.armed and self.told:
            self._say(f"ckptd: waiting for {self.describe()} to commit... Ctrl-C again to abandon it")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.armed:
            signal.signal(signal.SIGINT, self._previous)

    def start_waiting(self) -> None:
        """The interruptible wait begins (raises KeyboardInterrupt if it was asked for already)."""
        self._state = "waiting"
        if self._again:
            raise KeyboardInterrupt

    def stop_waiting(self) -> None:
        """The wait is over: from now on Ctrl-C is ignored until the block ends."""
        self._state = "after"

    def abandoning(self, what: str) -> None:
        """The second Ctrl-C arrived: say what is abandoned."""
        self._say(f"ckptd: abandoning {what} (not committed)")

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self._state == "after":
            return  # bounded work (release, abandon): finish it rather than leave it half done
        if not self.told:
            self.told = True
            self._say(f"ckptd: waiting for {self.describe()} to commit... Ctrl-C again to abandon it")
        elif self._state == "waiting":
            raise KeyboardInterrupt
        else:
            self._again = True  # raised by start_waiting()

    @staticmethod
    def _say(line: str) -> None:
        with contextlib.suppress(Exception):  # a closed or reentered stderr must not break the exit
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
