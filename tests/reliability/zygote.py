"""A process that imports torch and ckptd once, then forks one child per crash scenario.

Importing torch takes seconds; a kill-point suite runs dozens of scenarios.  Requests arrive as
JSON lines on stdin (``action``, ``args``, ``kill``, ``record``, ``stderr``); each child starts
a session of its own (so a kill takes its writer process with it and nothing else), installs the
OS-call hook, runs ``scenario.main`` and exits.  The reply, one JSON line on stdout, is the
child's ``waitpid`` status: ``{"exit": code}`` or ``{"signal": number}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import sitecustomize  # the OS-call hook (oshook/ is first on PYTHONPATH)
import torch  # noqa: F401 - loaded once, before any fork
from scenario import main

import ckptd
import ckptd.catalog
import ckptd.tools.consolidate  # noqa: F401

__all__: list[str] = []


def _child(request: dict) -> None:
    os.setsid()
    fd = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)  # stdout is the reply pipe: nothing of the child's may reach it
    os.dup2(fd, 2)
    os.close(fd)
    for name in ("CKPTD_TEST_KILL", "CKPTD_TEST_RECORD", "CKPTD_TEST_FAIL"):
        os.environ.pop(name, None)
        if request.get(name):
            os.environ[name] = request[name]
    sitecustomize.configure()
    try:
        main(request["action"], request["args"])
    except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stderr.flush()
    os._exit(0)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        _, status = os.waitpid(pid, 0)
        reply = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
