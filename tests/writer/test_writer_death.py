"""A writer that dies while the client waits on it (arena attach) is seen at once, as a WriterError."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from conftest import assert_same, wait_for

import ckptd
from ckptd.errors import WriterError

pytestmark = pytest.mark.multiprocess


def attach_in_thread(ckpt: ckptd.Checkpointer, state: dict) -> tuple[threading.Thread, list[BaseException]]:
    """Call ``prepare`` (allocate an arena and hand it to the writer) on another thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            ckpt.prepare(state)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.timeout(60)  # a hang guard only; the old code waited 60 s here
def test_writer_killed_during_arena_attach_fails_with_a_writer_error_naming_the_signal(root):
    # The attach waits for the writer's answer under the client lock; the old reader thread
    # needed that lock to fail the request, so the attach hung for writer_start_timeout.
    state = {"model": {"w": torch.arange(4096, dtype=torch.float32)}}
    ckpt = ckptd.Checkpointer(root, writer_start_timeout=600)
    try:
        ckpt.health_check()
        pid = ckpt.writer_pid
        os.kill(pid, signal.SIGSTOP)
        thread, errors = attach_in_thread(ckpt, state)
        wait_for(lambda: bool(ckpt._writer._pending))  # the AttachArena request is on its way
        # While the attach waits, a health check is not stuck behind it: the stopped writer
        # simply does not answer its ping in time.
        with pytest.raises(WriterError, match="did not answer a ping"):
            ckpt._writer.ping(timeout=0.5)
        os.kill(pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive(), "the attach still waits for a writer that is dead"
        assert len(errors) == 1 and isinstance(errors[0], WriterError), errors
        assert f"writer process {pid} killed by SIGKILL" in str(errors[0])
        # The next call restarts the writer, attaches the arena again, and saves.
        health = ckpt.health_check()
        assert health["writer_pid"] != pid and health["restarts"] == 1
        ckpt.save(1, state)
        assert_same(state["model"]["w"], ckpt.load(1)["model"]["w"])
    finally:
        ckpt.close(wait=False)


@pytest.mark.timeout(60)
def test_writer_exiting_during_arena_attach_names_its_exit_status(root):
    state = {"model": {"w": torch.ones(1024)}}
    ckpt = ckptd.Checkpointer(root, writer_start_timeout=600)
    try:
        ckpt.health_check()
        pid = ckpt.writer_pid
        os.kill(pid, signal.SIGSTOP)
        thread, errors = attach_in_thread(ckpt, state)
        wait_for(lambda: bool(ckpt._writer._pending))
        os.kill(pid, signal.SIGTERM)  # delivered when it runs again
        os.kill(pid, signal.SIGCONT)
        thread.join(30)
        assert not thread.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], WriterError), errors
        message = str(errors[0])
        assert f"writer process {pid} " in message
        assert "SIGTERM" in message or "exited with status" in message, message
        wait_for(lambda: not ckpt._writer.alive())
        with pytest.raises(WriterError, match="not running"):
            ckpt._writer.ping(timeout=5)
    finally:
        ckpt.close(wait=False)
