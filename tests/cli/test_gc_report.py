"""``ckptd gc`` (and ``collect_garbage``) report what they really removed, and what they could not.

Leftovers on a read-only filesystem used to be reported removed (``"ok": true``) while they were
all still there.  The tests run as root here, which chmod does not stop, so the filesystem is
made read-only for real: the command runs in a private mount namespace (``unshare --user
--map-root-user --mount``, no privileges needed where user namespaces are allowed) in which the
root, or one directory inside a leftover, is a read-only bind mount of itself.  The kernel then
refuses every unlink and rmdir there with EROFS, as on a filesystem mounted read-only; nothing
outside the namespace sees the mount, and it ends with the process.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from cli_helpers import EXIT, REPO

import ckptd
from ckptd.formats.names import host_label

UNSHARE = ("unshare", "--user", "--map-root-user", "--mount")
_MOUNT_READ_ONLY = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'


def _can_mount() -> bool:
    try:
        probe = subprocess.run(
            [*UNSHARE, "sh", "-c", _MOUNT_READ_ONLY, "/tmp", "true"], capture_output=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _can_mount(), reason="no private mount namespaces (unshare --mount) here")


def _read_only(directory: str, *command: str) -> Any:
    """``command`` run where ``directory`` is read-only (a bind mount of itself, made read-only)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [*UNSHARE, "sh", "-c", _MOUNT_READ_ONLY, directory, *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _gc(directory: str, root: str, *options: str) -> Any:
    return _read_only(directory, sys.executable, "-m", "ckptd", "gc", root, *options)


def _root_with_leftovers(tmp_path: Any) -> tuple[str, list[str]]:
    """A root with checkpoint 1 and two leftovers gc removes: another host's old staging
    directory, and one of this host whose process is gone (its lock free)."""
    root = str(tmp_path / "runs")
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": {"w": torch.arange(8, dtype=torch.float32)}})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftovers = [
        os.path.join(root, ".checkpoint-2.tmp-otherhost-1-0a1b2c3d"),
        os.path.join(root, f".checkpoint-3.tmp-{host_label()}-{int(dead.stdout)}-0a1b2c3e"),
    ]
    for path in leftovers:
        os.makedirs(os.path.join(path, "ab"))
        with open(os.path.join(path, "ab", "model-00001-of-00001.safetensors"), "wb") as f:
            f.write(b"\0" * 1000)
    os.utime(leftovers[0], (0, 0))
    return root, leftovers


def _error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr
    line = lines[-1]
    assert line.startswith("ckptd gc: error: ") and "(hint: " in line, stderr
    return line


def test_gc_on_a_read_only_root_says_it_removed_nothing(tmp_path: Any) -> None:
    root, leftovers = _root_with_leftovers(tmp_path)
    out = _gc(root, root, "--json")
    assert out.returncode == EXIT["storage"], (out.stdout, out.stderr)
    document = json.loads(out.stdout)
    assert document["ok"] is False and document["error"]["code"] == "storage"
    assert document["removed"] == [] and document["bytes_freed"] == 0
    assert sorted(item["path"] for item in document["failed"]) == leftovers
    assert all("Read-only file system" in item["error"] for item in document["failed"]), document["failed"]
    assert all(item["kind"] == "staging" for item in document["failed"])
    assert document["kept"] == []
    line = _error_line(out.stderr)
    assert f"could not remove 2 leftovers under {root}" in line and "Read-only file system" in line
    assert all(os.path.isdir(path) for path in leftovers)


def test_gc_text_output_is_one_error_line_and_no_claim(tmp_path: Any) -> None:
    root, leftovers = _root_with_leftovers(tmp_path)
    quiet = _gc(root, root, "--quiet")
    assert quiet.returncode == EXIT["storage"]
    assert quiet.stdout == ""  # neither "removed ..." nor "nothing to remove"
    assert len(quiet.stderr.strip().splitlines()) == 1
    _error_line(quiet.stderr)
    talkative = _gc(root, root)
    assert talkative.returncode == EXIT["storage"] and talkative.stdout == ""
    for path in leftovers:
        assert f"could not remove {path}: " in talkative.stderr
    _error_line(talkative.stderr)
    assert all(os.path.isdir(path) for path in leftovers)


def test_gc_reports_what_it_removed_and_what_it_could_not(tmp_path: Any) -> None:
    """One leftover holds a read-only mount, the other is removed: each reported as it is."""
    root, (stuck, removable) = _root_with_leftovers(tmp_path)
    out = _gc(os.path.join(stuck, "ab"), root, "--json")
    assert out.returncode == EXIT["storage"], (out.stdout, out.stderr)
    document = json.loads(out.stdout)
    assert document["removed"] == [removable] and document["bytes_freed"] == 1000
    (failed,) = document["failed"]
    shard = os.path.join(stuck, "ab", "model-00001-of-00001.safetensors")
    assert failed["path"] == stuck and failed["error"] == f"{shard}: Read-only file system"
    line = _error_line(out.stderr)
    assert f"could not remove {stuck}: {shard}: Read-only file system" in line
    assert not os.path.exists(removable) and os.path.exists(shard)
    assert sorted(os.listdir(root)) == [os.path.basename(stuck), "checkpoint-1"]


def test_collect_garbage_returns_only_what_is_gone(tmp_path: Any) -> None:
    root, leftovers = _root_with_leftovers(tmp_path)
    code = (
        "import json, sys\n"
        "from ckptd.garbage import collect_garbage\n"
        "from ckptd.storage.local import LocalStorage\n"
        "done = collect_garbage(LocalStorage(), sys.argv[1])\n"
        "print(json.dumps([list(done), [[f.path, f.error, f.errno] for f in done.failures]]))\n"
    )
    out = _read_only(root, sys.executable, "-c", code, root)
    assert out.returncode == 0, out.stderr
    removed, failures = json.loads(out.stdout)
    assert removed == []
    assert sorted(path for path, _, _ in failures) == leftovers
    assert {number for _, _, number in failures} == {errno.EROFS}
    assert all(os.path.isdir(path) for path in leftovers)


def test_a_complete_save_that_cannot_be_published_is_reported_and_kept(tmp_path: Any) -> None:
    """A crash after the manifest leaves a complete staging directory, which gc publishes; on a
    read-only root it cannot, and says so instead of claiming anything."""
    root = str(tmp_path / "runs")
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(4, {"model": {"w": torch.arange(8, dtype=torch.float32)}})
    staging = os.path.join(root, ".checkpoint-4.tmp-otherhost-1-0a1b2c3d")
    os.rename(os.path.join(root, "checkpoint-4"), staging)
    os.utime(staging, (0, 0))
    out = _gc(root, root, "--json")
    assert out.returncode == EXIT["storage"], (out.stdout, out.stderr)
    document = json.loads(out.stdout)
    (failed,) = document["failed"]
    assert failed["path"] == staging and document["removed"] == []
    assert failed["error"].startswith(f"kept: recovering {os.path.join(root, 'checkpoint-4')} from it failed (")
    assert "Read-only file system" in failed["error"]
    assert os.listdir(root) == [os.path.basename(staging)]
    with ckptd.Checkpointer(root) as ckpt:  # its start-up collection, on a writable root, publishes it
        assert ckpt.steps() == [4]
