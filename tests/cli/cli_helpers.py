"""Run the installed ``ckptd`` entry point in a subprocess and check what it printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = str(Path(__file__).resolve().parents[2])

EXIT = {"ok": 0, "other": 1, "usage": 2, "not_found": 3, "corrupt": 4, "storage": 5, "conflict": 6}


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: str | None = None) -> Any:
    """``python -m ckptd ARGS`` with this worktree first on the path."""
    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = REPO + os.pathsep + environment.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "ckptd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=cwd,
    )


def assert_error(out: Any, code: str, *fragments: str) -> str:
    """The run failed with exit code ``code``, one line on stderr naming ``fragments``, no traceback."""
    assert out.returncode == EXIT[code], (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    line = lines[0]
    assert "Traceback" not in out.stderr
    assert ": error: " in line and "(hint: " in line, line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def run_json(*args: str, **kwargs: Any) -> dict[str, Any]:
    """``python -m ckptd ARGS --json``: one JSON document on stdout."""
    out = run(*args, "--json", **kwargs)
    assert out.stdout.count("\n") == 1, out.stdout
    document = json.loads(out.stdout)
    assert isinstance(document, dict)
    document["_exit"] = out.returncode
    document["_stderr"] = out.stderr
    return document
