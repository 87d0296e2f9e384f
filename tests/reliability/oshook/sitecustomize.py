"""Loaded by every Python process of a reliability test (this folder is put first on PYTHONPATH).

It wraps the OS calls a save makes (rename, link, unlink, rmdir, mkdir, fsync, write, and
``os.open`` with ``O_CREAT``, logged as ``create``) and, driven by environment variables that
only the tests set, either

* ``CKPTD_TEST_RECORD=<file>``: appends ``<pid> <thread> <op> <path> [<path2>]`` for every call (fd
  calls are named by the file the fd refers to), or
* ``CKPTD_TEST_KILL=<op>|<regex>|<n>|<before|after>[|<whom>]``: SIGKILLs the whole process group
  (the trainer and its writer process) at the ``n``-th call of ``op`` on a path matching
  ``regex``, before or after the call.  ``whom`` narrows that: ``self`` SIGKILLs only the process
  making the call (a writer dying alone), ``stop`` SIGSTOPs it (frozen at an exact point, for the
  test to inspect and then kill or continue).  ``op`` ``http`` matches the request line of an HTTP request sent
  on a socket (``PUT /bucket/run/checkpoint-2/checkpoint_manifest.json HTTP/1.1``): the
  object-store kill points.

and, independently, ``CKPTD_TEST_FAIL=<op>|<regex>|<errno>`` fails every ``op`` call on a path
matching ``regex`` with that errno, without making it (a filesystem that refuses hard links:
``link|.|18`` is EXDEV everywhere).

The library has no test hooks: crashes happen at the system-call boundary, as a power cut or
``kill -9`` would strike.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading

_original = {
    name: getattr(os, name)
    for name in ("rename", "replace", "link", "unlink", "rmdir", "mkdir", "fsync", "fdatasync", "write", "pwrite")
}
_OP_OF = {
    "rename": "rename",
    "replace": "rename",
    "link": "link",
    "unlink": "unlink",
    "rmdir": "rmdir",
    "mkdir": "mkdir",
    "fsync": "fsync",
    "fdatasync": "fsync",
    "write": "write",
    "pwrite": "write",
}
_FD_CALLS = {"fsync", "fdatasync", "write", "pwrite"}
_original_open = os.open


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd:{fd}"


def _arg_path(value: object, dir_fd: int | None) -> str:
    path = os.fsdecode(value) if isinstance(value, (str, bytes, os.PathLike)) else str(value)
    if dir_fd is not None and not os.path.isabs(path):
        return os.path.join(_fd_path(dir_fd), path)
    return os.path.abspath(path)


_state: dict[str, object] = {"op": "", "when": "", "whom": "group", "regex": re.compile("$^"), "left": 0, "log": -1}
_failing: dict[str, object] = {"op": "", "regex": re.compile("$^"), "errno": 0}


def configure() -> None:
    """Read ``CKPTD_TEST_KILL`` / ``CKPTD_TEST_RECORD`` (again) and wrap the OS calls if either is
    set: run at start-up, and by a process forked from a pre-loaded one (see ``zygote.py``)."""
    kill = os.environ.get("CKPTD_TEST_KILL")
    record = os.environ.get("CKPTD_TEST_RECORD")
    fail = os.environ.get("CKPTD_TEST_FAIL")
    if fail:
        op, pattern, code = fail.split("|")
        _failing.update(op=op, regex=re.compile(pattern), errno=int(code))
    if kill:
        op, pattern, count, when, *whom = kill.split("|")
        if whom and whom[0] not in ("group", "self", "stop"):
            raise ValueError(f"CKPTD_TEST_KILL: unknown target {whom[0]!r} (group, self or stop)")
        _state.update(op=op, regex=re.compile(pattern), left=int(count), when=when, whom=whom[0] if whom else "group")
    if record:
        _state["log"] = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    if kill or record or fail:
        for name in _original:
            setattr(os, name, _wrap(name))
        os.open = _wrap_open(_original_open)
        _wrap_sockets()


_HTTP = re.compile(rb"^(GET|PUT|POST|DELETE|HEAD) [^ ]+ HTTP/1")


def _decide(op: str, paths: list[str]) -> bool:
    """Log the call; True when it is the one to die at."""
    log = _state["log"]
    if log >= 0 and not paths[0].startswith(("pipe:", "socket:", "/dev/")):
        thread = threading.current_thread().name.replace(" ", "_")
        line = f"{os.getpid()} {thread} {op} {' '.join(paths)}\n".encode()
        _original["write"](log, line)
    hit = op == _state["op"] and _state["left"] > 0 and any(_state["regex"].search(p) for p in paths)
    if hit:
        _state["left"] -= 1
        hit = _state["left"] == 0
    return hit


def _strike() -> None:
    whom = _state["whom"]
    if whom == "self":
        os.kill(os.getpid(), signal.SIGKILL)
    elif whom == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once the test sends SIGCONT
    else:
        os.killpg(os.getpgid(0), signal.SIGKILL)


def _run_at(hit: bool, call):  # type: ignore[no-untyped-def]
    """Make ``call()``, dying before or after it when ``hit`` (the kill point) says so."""
    if hit and _state["when"] == "before":
        _strike()
    result = call()
    if hit:
        _strike()
    return result


def _wrap_sockets() -> None:
    for name in ("send", "sendall"):
        real = getattr(socket.socket, name)

        def wrapper(self, data, *args, _real=real):  # type: ignore[no-untyped-def]
            head = bytes(memoryview(data)[:300])
            match = _HTTP.match(head)
            hit = bool(match) and _decide("http", [head.split(b"\r\n", 1)[0].decode("latin-1")])
            return _run_at(hit, lambda: _real(self, data, *args))

        setattr(socket.socket, name, wrapper)


def _wrap(name: str):  # type: ignore[no-untyped-def]
    real = _original[name]
    op = _OP_OF[name]

    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        if name in _FD_CALLS:
            paths = [_fd_path(args[0])]
        elif op in ("rename", "link"):
            paths = [
                _arg_path(args[0], kwargs.get("src_dir_fd")),
                _arg_path(args[1], kwargs.get("dst_dir_fd")),
            ]
        else:
            paths = [_arg_path(args[0], kwargs.get("dir_fd"))]
        if op == _failing["op"] and any(_failing["regex"].search(p) for p in paths):
            code = int(_failing["errno"])
            raise OSError(code, os.strerror(code), paths[0])
        return _run_at(_decide(op, paths), lambda: real(*args, **kwargs))

    wrapper.__name__ = real.__name__
    wrapper.__doc__ = real.__doc__
    return wrapper


def _wrap_open(real):  # type: ignore[no-untyped-def]
    """``os.open``: calls with ``O_CREAT`` are the ``create`` operation (of a new or existing file)."""

    def wrapper(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not flags & os.O_CREAT:
            return real(path, flags, *args, **kwargs)
        hit = _decide("create", [_arg_path(path, kwargs.get("dir_fd"))])
        return _run_at(hit, lambda: real(path, flags, *args, **kwargs))

    wrapper.__name__ = real.__name__
    wrapper.__doc__ = real.__doc__
    return wrapper


configure()
