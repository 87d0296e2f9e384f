"""A pytest plugin: the suite must leave no writer process behind.

Every process started under the test session inherits ``CKPTD_TEST_SESSION``.  When the session
ends, any writer process carrying this session's mark whose parent is gone (an orphan) or that is
stopped (SIGSTOP) is reported as a failure and then killed, so nothing outlives the suite.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

_MARK = "CKPTD_TEST_SESSION"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(_MARK, uuid.uuid4().hex)


def _writers_of_this_session() -> dict[int, tuple[str, int]]:
    """pid -> (state letter, parent pid) of this session's writer processes."""
    mark = f"{_MARK}={os.environ[_MARK]}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"ckptd.writer.process" not in f.read():
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
    session.config.get_terminal_writer().line(f"writer processes left behind by the tests: {described}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
