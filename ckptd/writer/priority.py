"""Lower the CPU and I/O priority of background work: the writer process, and the threads of the
trainer process that copy checkpoints to slower tiers.

On Linux both the nice value and the I/O priority belong to a thread (a task), so a thread can
yield to training without a process of its own: :func:`lower_priority` with ``thread=True``
changes only the calling thread.  Elsewhere, or where the kernel refuses, nothing changes (and
a debug line says so): priorities are a courtesy to training, never a condition of a save.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading

__all__ = ["lower_priority"]

logger = logging.getLogger(__name__)

_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BEST_EFFORT = 2


def lower_priority(nice: int = 0, ionice: int | None = None, *, thread: bool = False) -> None:
    """Raise the niceness by ``nice`` and set the best-effort I/O priority ``ionice`` (0-7), of
    the calling thread (``thread=True``, Linux) or of the whole process."""
    if not sys.platform.startswith("linux"):
        if nice and not thread:
            os.nice(nice)
        return
    task = threading.get_native_id() if thread else 0
    if nice:
        try:
            current = os.getpriority(os.PRIO_PROCESS, task)
            os.setpriority(os.PRIO_PROCESS, task, min(19, current + nice))
        except OSError as e:
            logger.debug("ckptd: setpriority failed (%s)", e)
    if ionice is not None:
        _set_io_priority(task, ionice)


def _set_io_priority(task: int, level: int) -> None:
    import ctypes

    number = _IOPRIO_SET.get(platform.machine())
    if number is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    value = (_IOPRIO_CLASS_BEST_EFFORT << 13) | max(0, min(7, level))
    if libc.syscall(number, _IOPRIO_WHO_PROCESS, task, value) != 0:
        logger.debug("ckptd: ioprio_set failed (errno %d)", ctypes.get_errno())
