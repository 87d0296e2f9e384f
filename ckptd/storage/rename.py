"""Swapping two directories atomically: ``renameat2(RENAME_EXCHANGE)`` through libc (or the raw
system call where libc lacks the wrapper), for an overwrite that leaves the old or the new
checkpoint in place at every moment.  Torch-free: the writer process imports storage too.
"""

from __future__ import annotations

import ctypes
import errno as errno_codes
import logging
import os
import platform
from collections.abc import Callable

from .base import storage_error

__all__ = ["exchange_paths"]

logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_RENAMEAT2_SYSCALL = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276}
# Errors meaning "this kernel or filesystem cannot exchange": fall back to two renames.
_NO_EXCHANGE = {errno_codes.ENOSYS, errno_codes.EINVAL, errno_codes.ENOTSUP, errno_codes.EOPNOTSUPP}
_renameat2: Callable[[bytes, bytes], int] | None = None
_renameat2_loaded = False


def _load_renameat2() -> Callable[[bytes, bytes], int] | None:
    """``renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)`` through libc, or the raw system
    call where libc lacks the wrapper (glibc < 2.28); ``None`` where neither exists."""
    global _renameat2, _renameat2_loaded
    if _renameat2_loaded:
        return _renameat2
    _renameat2_loaded = True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        _renameat2 = lambda a, b: function(_AT_FDCWD, a, _AT_FDCWD, b, _RENAME_EXCHANGE)  # noqa: E731
        return _renameat2
    number = _RENAMEAT2_SYSCALL.get(platform.machine().lower())
    syscall = getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    syscall.restype = ctypes.c_long

    def raw(a: bytes, b: bytes) -> int:
        return int(
            syscall(
                ctypes.c_long(number),
                ctypes.c_int(_AT_FDCWD),
                ctypes.c_char_p(a),
                ctypes.c_int(_AT_FDCWD),
                ctypes.c_char_p(b),
                ctypes.c_uint(_RENAME_EXCHANGE),
            )
        )

    _renameat2 = raw
    return _renameat2


def exchange_paths(a: str, b: str) -> bool:
    """Swap two existing paths atomically (``renameat2`` with ``RENAME_EXCHANGE``).

    Returns False, having changed nothing, where the platform, kernel or filesystem cannot do it;
    raises :class:`StorageError` for any other failure.
    """
    function = _load_renameat2()
    if function is None:
        return False
    if function(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        logger.debug("ckptd: cannot exchange %s and %s atomically (%s); using two renames", a, b, os.strerror(code))
        return False
    raise storage_error("exchange with", b, OSError(code, os.strerror(code)), code)
