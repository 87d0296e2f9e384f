"""Run a training script in a subprocess, straight through or SIGKILLed mid-run.

The scripts print each finished step on a line of its own; a run to be killed is started with
``--slow`` and killed once it has printed ``kill_after``.  Returns the steps printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import ckptd


def run_script(script: str, *args: str, kill_after: int | None = None) -> list[int]:
    package_root = os.path.dirname(os.path.dirname(ckptd.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [package_root, os.environ.get("PYTHONPATH")] if p))
    command = [sys.executable, script, *args]
    if kill_after is None:
        subprocess.run(command, check=True, env=env, timeout=300, stdout=subprocess.DEVNULL)
        return []
    process = subprocess.Popen([*command, "--slow"], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    steps: list[int] = []
    while not steps or steps[-1] < kill_after:
        line = process.stdout.readline()
        assert line, "the run ended before it could be killed"
        if line.strip().isdigit():
            steps.append(int(line))
    process.send_signal(signal.SIGKILL)
    process.wait(60)
    assert process.returncode == -signal.SIGKILL
    return steps
