"""fork() with a save in flight: the child's calls fail at once instead of waiting for the parent's arena."""

from __future__ import annotations

import json
import os
import select
import signal
import time
import traceback

import pytest
import torch
from conftest import assert_same

import ckptd
from ckptd.errors import WriterError

pytestmark = pytest.mark.multiprocess


def in_child(work) -> dict:
    """Run ``work()`` in a fork() child; return what it reported (JSON) through a pipe.

    The child never returns into pytest: it exits with ``os._exit``.  A child that does not
    report within 60 s (the old code hung forever) is killed and the test fails.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        try:
            report = {"ok": work()}
        except BaseException:  # noqa: BLE001 - reported to the parent
            report = {"error": traceback.format_exc()}
        with os.fdopen(write_end, "w") as out:
            out.write(json.dumps(report))
        os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the fork() child did not report within 60 s (it hangs)")
        with os.fdopen(read_end) as source:
            text = source.read()
        read_end = -1
    finally:
        if read_end >= 0:
            os.close(read_end)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    report = json.loads(text)
    assert "error" not in report, report["error"]
    return report["ok"]


def test_checkpointer_inherited_through_fork_refuses_to_save_and_a_new_one_works(tmp_path):
    root = str(tmp_path / "parent")
    state = {"model": {"w": torch.arange(1 << 16, dtype=torch.float32)}}
    ckpt = ckptd.Checkpointer(root, max_in_flight=1)
    try:
        ckpt.save(1, state)
        writer = ckpt.writer_pid
        os.kill(writer, signal.SIGSTOP)  # keep the next save in flight: its arena stays busy
        try:
            request = ckpt.async_save(2, state)
            parent = os.getpid()

            def child() -> dict:
                outcome: dict = {}
                try:
                    ckpt.async_save(3, state)  # used to wait forever for the parent's busy arena
                except WriterError as e:
                    outcome["save"] = str(e)
                try:
                    ckpt.wait()
                except WriterError as e:
                    outcome["wait"] = str(e)
                outcome["loaded"] = ckpt.load(1)["model"]["w"].tolist()[:4]  # reading is fine
                started = time.monotonic()
                ckpt.close()  # returns at once: the parent's saves are the parent's to finish
                outcome["close_seconds"] = time.monotonic() - started
                with ckptd.Checkpointer(str(tmp_path / "child")) as own:
                    own.save(5, {"model": {"w": torch.ones(3)}})
                    outcome["own"] = own.load(5)["model"]["w"].tolist()
                    outcome["own_writer"] = own.writer_pid
                return outcome

            outcome = in_child(child)
        finally:
            os.kill(writer, signal.SIGCONT)
        assert f"this Checkpointer belongs to process {parent}" in outcome["save"], outcome
        assert "create a new Checkpointer in the child" in outcome["save"], outcome
        assert f"belongs to process {parent}" in outcome["wait"], outcome
        assert outcome["loaded"] == [0.0, 1.0, 2.0, 3.0]
        assert outcome["close_seconds"] < 5
        assert outcome["own"] == [1.0, 1.0, 1.0] and outcome["own_writer"] != writer
        # The parent is untouched by its child: its save in flight commits, and the next one too.
        request.wait(60)
        ckpt.save(4, state)
        assert ckpt.steps() == [1, 2, 4] and ckpt.writer_pid == writer
        assert_same(state["model"]["w"], ckpt.load(4)["model"]["w"])
    finally:
        ckpt.close(wait=False)
