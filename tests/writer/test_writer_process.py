"""The writer process: handshake, no torch, health checks, crashes, restarts, parent death."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_same, pid_alive, process_stopped, staging_dirs, wait_for, writers_strike

import ckptd
from ckptd.errors import StorageError, WriterError

pytestmark = pytest.mark.multiprocess


def staged_shard_sizes(root: str) -> list[int]:
    """The sizes of the shard files in the staging directories (the indexes and state file, which
    the trainer writes while the shards are written, are left out)."""
    return [
        os.path.getsize(os.path.join(directory, file_name))
        for directory in staging_dirs(root)
        for file_name in os.listdir(directory)
        if file_name.endswith(".safetensors")
    ]


# The writer freezes (SIGSTOP) just after its first write to the shard of step 2.
FIRST_WRITE_OF_STEP_2 = r"/\.checkpoint-2\.tmp-[^/]+/model-[^/]*\.safetensors$"
BIG_BYTES = 32 * 1024 * 1024


def test_writer_starts_without_torch_and_answers_pings_while_busy(checkpointer):
    health = checkpointer.health_check()
    assert health["writer_pid"] != os.getpid() and health["busy"] is False
    assert checkpointer._writer.info.torch_loaded is False
    with open(f"/proc/{health['writer_pid']}/cmdline", "rb") as f:
        assert b"ckptd.writer.process" in f.read()


def test_writer_killed_mid_write_fails_the_save_and_the_next_save_works(root):
    with writers_strike("write", FIRST_WRITE_OF_STEP_2, whom="stop"):
        ckpt = ckptd.Checkpointer(root, chunk_size="256KiB")
        ckpt.health_check()
    try:
        ckpt.save(1, {"model": {"w": torch.zeros(16)}})
        pid = ckpt.writer_pid
        big = {"w": torch.randn(BIG_BYTES // 4)}
        request = ckpt.async_save(2, {"model": big})
        wait_for(lambda: process_stopped(pid))
        [size] = staged_shard_sizes(root)
        assert 0 < size < BIG_BYTES  # killed mid-file
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WriterError, match="SIGKILL"):
            request.wait(60)
        assert ckpt.steps() == [1]
        wait_for(lambda: staging_dirs(root) == [])
        assert_same(torch.zeros(16), ckpt.load("latest")["model"]["w"])
        # the next save restarts the writer and commits
        ckpt.save(3, {"model": big})
        assert ckpt.writer_pid != pid and ckpt.health_check()["restarts"] == 1
        assert_same(big["w"], ckpt.load(3)["model"]["w"])
    finally:
        ckpt.close(wait=False)


def test_full_disk_reports_a_storage_error_naming_the_file(root):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024 * 1024, hard))  # inherited by the writer
    try:
        ckpt = ckptd.Checkpointer(root)
        ckpt.health_check()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        ckpt.save(1, {"model": {"w": torch.zeros(16)}})
        with pytest.raises(StorageError, match=r"model-00001-of-00001\.safetensors") as info:
            ckpt.save(2, {"model": {"w": torch.zeros(1024 * 1024)}})
        assert info.value.errno is not None
        assert ckpt.steps() == [1] and staging_dirs(root) == []
        assert_same(torch.zeros(16), ckpt.load()["model"]["w"])
    finally:
        ckpt.close(wait=False)


def test_writer_exits_and_abandons_when_the_trainer_is_killed_mid_save(tmp_path):
    root = str(tmp_path / "ckpts")
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, sys, time, torch, ckptd
            ckpt = ckptd.Checkpointer({root!r}, chunk_size="256KiB")
            ckpt.save(1, {{"model": {{"w": torch.ones(8)}}}})
            ckpt.async_save(2, {{"model": {{"w": torch.randn({BIG_BYTES // 4})}}}})
            print(ckpt.writer_pid, flush=True)
            time.sleep(600)
            """
        )
    )
    shm_before = set(os.listdir("/dev/shm"))
    with writers_strike("write", FIRST_WRITE_OF_STEP_2, whom="stop"):  # inherited by the trainer's writer
        trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        writer_pid = int(trainer.stdout.readline())
        wait_for(lambda: process_stopped(writer_pid))
        [size] = staged_shard_sizes(root)
        assert 0 < size < BIG_BYTES  # the trainer dies while its writer is mid-file
        trainer.kill()
        trainer.wait(30)
        os.kill(writer_pid, signal.SIGCONT)
        wait_for(lambda: not pid_alive(writer_pid), timeout=30)
    finally:
        trainer.kill()
    assert set(os.listdir("/dev/shm")) - shm_before == set()
    assert staging_dirs(root) == []
    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [1]
        assert_same(torch.ones(8), ckpt.load()["model"]["w"])


def test_script_without_main_guard_runs_once(tmp_path):
    root = str(tmp_path / "ckpts")
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch, ckptd
            print("TOP-LEVEL RAN", flush=True)
            ckpt = ckptd.Checkpointer({root!r})
            ckpt.async_save(1, {{"model": {{"w": torch.arange(4.0)}}}}).wait(60)
            ckpt.close()
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("TOP-LEVEL RAN") == 1
    with ckptd.Checkpointer(root) as ckpt:
        assert_same(torch.arange(4.0), ckpt.load(1)["model"]["w"])


def test_pending_save_is_finished_at_interpreter_exit_without_close(tmp_path):
    root = str(tmp_path / "ckpts")
    script = tmp_path / "noclose.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch, ckptd
            ckpt = ckptd.Checkpointer({root!r})
            ckpt.async_save(4, {{"model": {{"w": torch.arange(1000.0)}}}})
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [4]
        assert_same(torch.arange(1000.0), ckpt.load()["model"]["w"])


def test_writer_that_cannot_start_is_a_writer_error(root, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    ckpt = ckptd.Checkpointer(root)
    try:
        with pytest.raises(WriterError, match="cannot start"):
            ckpt.save(1, {"model": {"w": torch.zeros(1)}})
        assert ckpt.steps() == []
    finally:
        ckpt.close(wait=False)


def test_a_writer_whose_trainer_is_gone_before_it_says_hello_exits_quietly():
    # close(wait=False) (or a trainer's death) while the writer starts: its first message finds
    # the socket closed; it exits with status 0 and no traceback on stderr, which the trainer
    # would otherwise relay as warnings.
    import socket
    import subprocess

    from ckptd.writer.launch import helper_command, helper_environment

    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent.close()  # the trainer let go before the writer started
    try:
        command = helper_command("ckptd.writer.process", "--fd", str(child.fileno()), "--parent-pid", str(os.getpid()))
        done = subprocess.run(
            command, pass_fds=(child.fileno(),), env=helper_environment(), capture_output=True, text=True, timeout=60
        )
    finally:
        child.close()
    assert done.returncode == 0 and done.stderr == "", done.stderr
