"""A pytest plugin: the suite must leave no writer or keeper process, and no held memory, behind.

Every process started under the test session inherits ``CKPTD_TEST_SESSION``.  When the session
ends, any writer process carrying this session's mark whose parent is gone (an orphan) or that is
stopped (SIGSTOP), and any held-memory keeper of this session still running (they are orphans by
design, and the tests hold for a second or two at most), is reported as a failure and then
killed, so nothing outlives the suite.  Held-memory roots (``shm://``) of the session live under a
base of its own (``CKPTD_HELD_DIR``), removed at the end; anything still in it (a root's files or
the control files of ``.hold/``) is a failure too.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid

import pytest

_MARK = "CKPTD_TEST_SESSION"


_HELD_BASE = "CKPTD_HELD_DIR"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(_MARK, uuid.uuid4().hex)
    if _HELD_BASE not in os.environ:  # like /dev/shm: every user may create their private directory
        base = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp", f"ckptd-tests-{os.environ[_MARK]}")
        os.makedirs(base, exist_ok=True)
        os.chmod(base, 0o1777)
        os.environ[_HELD_BASE] = base


def _writers_of_this_session() -> dict[int, tuple[str, int]]:
    """pid -> (state letter, parent pid) of this session's writer processes."""
    mark = f"{_MARK}={os.environ[_MARK]}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
                if b"ckptd.writer.process" not in command and b"ckptd.writer.keeper" not in command:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(entry)] = (fields[0], int(fields[1]))
    return found


def _leftovers() -> dict[int, tuple[str, int]]:
    me = os.getpid()
    return {pid: info for pid, info in _writers_of_this_session().items() if info[1] != me or info[0] == "T"}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    try:
        _check_processes(session)
    finally:
        _check_held_memory(session)


def _check_held_memory(session: pytest.Session) -> None:
    base = os.environ.get(_HELD_BASE, "")
    if os.path.basename(base) != f"ckptd-tests-{os.environ[_MARK]}" or not os.path.isdir(base):
        return  # a base given from outside is not ours to judge or remove
    held = []
    for directory, _, files in os.walk(base):
        held += [os.path.join(directory, f) for f in files]  # control files (.hold/) included: they go with their root
    shutil.rmtree(base, ignore_errors=True)
    if held:
        shown = ", ".join(sorted(held)[:5])
        session.config.get_terminal_writer().line(f"held memory left behind by the tests: {shown}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _check_processes(session: pytest.Session) -> None:
    if not os.path.isdir("/proc"):
        return
    deadline = time.monotonic() + 15.0  # orphans notice their parent's death within a second or two
    left = _leftovers()
    while left and time.monotonic() < deadline and all(state != "T" for state, _ in left.values()):
        time.sleep(0.2)
        left = _leftovers()
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    described = ", ".join(f"pid {pid} (state {s}, parent {p})" for pid, (s, p) in sorted(left.items()))
    message = f"writer or keeper processes left behind by the tests: {described}"
    session.config.get_terminal_writer().line(message, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
