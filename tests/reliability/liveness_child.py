"""What the liveness tests run in other processes: ``python liveness_child.py <action> <json>``.

* ``gc``: ``ckptd gc ROOT --json`` (``older_than`` optional), after printing one JSON line
  ``{"pid_alive": bool}``: whether process ``watch`` exists as this process sees it (in another
  PID namespace it does not, though it runs).
* ``hold``: lock a new directory ``path`` (as a save does its staging directory); with ``fork``,
  fork a child that waits for stdin to close too.  Prints ``ready <child pid or 0>`` and waits for stdin to
  close.
* ``write_stream``: ``LocalStorage.write_stream(path, ...)`` of two pieces, ``b"a" * 1000`` then
  ``b"b" * 1000``; prints ``writing`` after the first and waits for a line on stdin.
* ``frozen``: ``scenario.main(action, args)`` (or ``convert``), under the OS-call hook armed with
  a ``...|stop`` point (``CKPTD_TEST_KILL``): the process stops itself at that call.  The stop is
  sent to the calling thread (``pthread_kill``), which then stops before it runs on; a stop sent
  to the process may be taken by another thread while the caller makes its next calls.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["main"]


def _gc(args: dict[str, Any]) -> int:
    from ckptd.cli.app import main as cli
    from ckptd.garbage import _pid_alive

    print(json.dumps({"pid_alive": _pid_alive(int(args["watch"]))}), flush=True)
    extra = ["--older-than", str(args["older_than"])] if "older_than" in args else []
    return cli(["gc", args["root"], "--json", *extra])


def _hold(args: dict[str, Any]) -> int:
    from ckptd.storage.liveness import hold_new_directory

    held = hold_new_directory(args["path"], lambda p: os.makedirs(p, exist_ok=True))
    child = 0
    if args.get("fork"):
        started, running = os.pipe()
        child = os.fork()
        if child == 0:  # a DataLoader-style worker, left running if its parent dies: it waits for stdin
            os.write(running, b"1")  # Python's fork hooks have run in this process
            os.read(0, 1)
            os._exit(0)
        os.read(started, 1)
    print(f"ready {child}", flush=True)
    sys.stdin.read()
    held.release()
    return 0


def _write_stream(args: dict[str, Any]) -> int:
    from ckptd.storage.local import LocalStorage

    def pieces() -> Iterator[memoryview]:
        yield memoryview(b"a" * 1000)
        print("writing", flush=True)
        sys.stdin.readline()
        yield memoryview(b"b" * 1000)

    LocalStorage().write_stream(args["path"], pieces())
    return 0


def _convert(args: dict[str, Any]) -> int:
    import ckptd

    ckptd.convert(args["source"], args["destination"])
    return 0


def _frozen(args: dict[str, Any]) -> int:
    import sitecustomize  # the OS-call hook (loaded at start-up: oshook/ is first on PYTHONPATH)

    def stop_here() -> None:
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    sitecustomize._strike = stop_here
    if args["action"] == "convert":
        return _convert(args["args"])
    from scenario import main as scenario

    scenario(args["action"], args["args"])
    return 0


def main(action: str, args: dict[str, Any]) -> int:
    actions = {"gc": _gc, "hold": _hold, "write_stream": _write_stream, "convert": _convert, "frozen": _frozen}
    return actions[action](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
