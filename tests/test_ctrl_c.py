"""Ctrl-C while a program waits at exit for its pending saves: one line says what it waits for,
a second Ctrl-C abandons them cleanly (nothing committed, staging or objects and multipart
uploads removed, writer gone, arenas released, no traceback from the exit hook).

Real processes: a child trainer starts a save whose writer freezes (SIGSTOP, the OS-call hook of
``tests/reliability/oshook``) at the first write of the shard, so the save is pending for as
long as the test needs; the test sends the SIGINTs, reading the child's output to know when.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
from conftest import assert_same, pid_alive, process_stopped, staging_dirs, wait_for, writers_strike

import ckptd

pytestmark = pytest.mark.multiprocess

WAIT = 120.0  # seconds any one step may take on a loaded machine (a test that works waits far less)
SIZE = 32 * 1024 * 1024  # bytes of the step-2 tensor: 128 writes of 256 KiB
FIRST_WRITE_OF_STEP_2 = r"/\.checkpoint-2\.tmp-[^/]+/model-[^/]*\.safetensors$"
WAITING = "ckptd: waiting for the save of step 2 to commit... Ctrl-C again to abandon it"
ABANDONING = "ckptd: abandoning the save of step 2 (not committed)"

CHILD = textwrap.dedent(
    """
    import atexit, json, logging, os, signal, sys, time
    import torch, ckptd

    # A trainer started from a terminal has Python's own SIGINT handler.  A test runner started in
    # the background (`cmd &` in a script) ignores SIGINT, and its children inherit that: ckptd then
    # rightly leaves Ctrl-C alone, so the trainer puts Python's handler back, as a terminal has it.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    root, size, mode, options = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    writer = []

    def after_close():  # registered first, so it runs after the Checkpointer's exit hook
        with open("/proc/self/maps") as f:
            mapped = "ckptd-arena" in f.read()
        try:
            os.kill(writer[0], 0)
            gone = False
        except ProcessLookupError:
            gone = True
        print(f"released arena_mapped={mapped} writer_gone={gone}", flush=True)

    atexit.register(after_close)
    log = logging.getLogger("ckptd.checkpointer")  # "the exit waits for ...": the test's cue
    log.setLevel(logging.DEBUG)
    log.addHandler(logging.StreamHandler(sys.stdout))
    ckpt = ckptd.Checkpointer(root, chunk_size="256KiB", **options)
    ckpt.save(1, {"model": {"w": torch.ones(8)}})
    torch.manual_seed(0)
    ckpt.async_save(2, {"model": {"w": torch.randn(size // 4)}})
    writer.append(ckpt.writer_pid)
    print("writer", ckpt.writer_pid, flush=True)
    if mode == "interrupted":
        while True:  # training, until Ctrl-C
            time.sleep(0.05)
    """
)


class Child:
    """A trainer process whose stdout and stderr lines are collected as they come."""

    def __init__(self, tmp_path: Any, root: str, mode: str, options: dict[str, Any], strike: tuple[str, str]) -> None:
        script = tmp_path / "trainer.py"
        script.write_text(CHILD)
        with writers_strike(*strike, whom="stop"):  # inherited by the trainer's writer
            self.process = subprocess.Popen(
                [sys.executable, str(script), root, str(SIZE), mode, json.dumps(options)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        self.writer_pid = int(self.line(self.out, "writer ").split()[1])

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def line(self, lines: list[str], text: str, timeout: float = 120.0) -> str:
        def seen() -> bool:
            return any(text in line for line in lines)

        try:
            wait_for(seen, timeout=timeout)
        except AssertionError:
            raise AssertionError(f"no line with {text!r}; stdout: {self.out}, stderr: {self.err}") from None
        return next(line for line in lines if text in line)

    def sigint(self) -> None:
        os.kill(self.process.pid, signal.SIGINT)

    def finish(self, timeout: float = 120.0) -> int:
        code = self.process.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if pid_alive(self.writer_pid):
            os.kill(self.writer_pid, signal.SIGKILL)


def check_abandoned(child: Child, stderr: str) -> None:
    """Exactly one explanation and one abandon line, no traceback of ckptd's, everything released."""
    assert stderr.count("Ctrl-C again to abandon it") == 1, stderr
    assert WAITING in child.err, stderr
    assert child.err.count(ABANDONING) == 1, stderr
    assert "Exception ignored" not in stderr, stderr
    assert "released arena_mapped=False writer_gone=True" in child.out, child.out
    assert not pid_alive(child.writer_pid)
    leftover = [name for name in os.listdir("/dev/shm") if f"-{child.process.pid}-" in name]
    assert leftover == [], leftover


def test_ctrl_c_ends_the_program_then_the_exit_explains_the_wait_and_a_second_ctrl_c_abandons(tmp_path):
    # The user's report: Ctrl-C in the training loop, a traceback, then a silent wait at exit.
    root = str(tmp_path / "ckpts")
    child = Child(tmp_path, root, "interrupted", {}, ("write", FIRST_WRITE_OF_STEP_2))
    try:
        wait_for(lambda: process_stopped(child.writer_pid), timeout=WAIT)
        child.sigint()  # in the training loop: the program ends on KeyboardInterrupt
        child.line(child.err, WAITING)  # at once: that Ctrl-C was the first
        child.sigint()
        child.line(child.err, ABANDONING)  # the writer's socket is shut down by now
        os.kill(child.writer_pid, signal.SIGCONT)  # it abandons the write and removes the staging directory
        code = child.finish()
    finally:
        child.kill()
    stderr = "\n".join(child.err)
    assert code == -signal.SIGINT, stderr  # as Python ends any program on Ctrl-C
    # The only traceback is the program's own KeyboardInterrupt, printed before the exit wait.
    assert stderr.count("Traceback") == 1 and stderr.index("KeyboardInterrupt") < stderr.index(WAITING), stderr
    check_abandoned(child, stderr)
    assert staging_dirs(root) == []
    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [1]


@pytest.mark.slow  # the frozen writer is killed after its grace period (3 s)
def test_ctrl_c_during_the_exit_wait_explains_it_and_a_second_abandons_a_frozen_writer(tmp_path):
    root = str(tmp_path / "ckpts")
    child = Child(tmp_path, root, "exit", {}, ("write", FIRST_WRITE_OF_STEP_2))
    try:
        wait_for(lambda: process_stopped(child.writer_pid), timeout=WAIT)
        child.line(child.out, "the exit waits for the save of step 2")  # the program has ended
        assert child.err == []  # a normal exit waits without a word, as before
        child.sigint()
        child.line(child.err, WAITING)
        child.sigint()  # the writer stays frozen: it is killed, the trainer removes the save
        code = child.finish()
    finally:
        child.kill()
    stderr = "\n".join(child.err)
    assert code == 0, stderr  # the program's own exit status (an exit hook cannot change it)
    assert "Traceback" not in stderr, stderr
    check_abandoned(child, stderr)
    assert staging_dirs(root) == []
    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [1]


def test_one_ctrl_c_during_the_exit_wait_lets_the_save_commit(tmp_path):
    root = str(tmp_path / "ckpts")
    child = Child(tmp_path, root, "exit", {}, ("write", FIRST_WRITE_OF_STEP_2))
    try:
        wait_for(lambda: process_stopped(child.writer_pid), timeout=WAIT)
        child.line(child.out, "the exit waits for the save of step 2")
        child.sigint()
        child.line(child.err, WAITING)
        os.kill(child.writer_pid, signal.SIGCONT)
        code = child.finish()
    finally:
        child.kill()
    stderr = "\n".join(child.err)
    assert code == 0, stderr
    assert child.err == [WAITING], stderr
    assert "released arena_mapped=False writer_gone=True" in child.out, child.out
    assert not pid_alive(child.writer_pid)
    torch.manual_seed(0)
    expected = torch.randn(SIZE // 4)
    with ckptd.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [1, 2]
        assert_same(expected, ckpt.load(2, verify=True)["model"]["w"])


@pytest.mark.slow
@pytest.mark.objectstore
def test_ctrl_c_twice_at_exit_aborts_the_multipart_upload_on_s3(tmp_path, s3):
    pytest.importorskip("s3fs")
    root = s3.url("run")
    options = {"storage_options": s3.options()}
    # frozen before its first part: the multipart upload is open
    child = Child(tmp_path, root, "interrupted", options, ("http", r"^PUT /[^ ]*/checkpoint-2/model-00001"))
    try:
        wait_for(lambda: process_stopped(child.writer_pid), timeout=WAIT)
        assert len(s3.uploads()) == 1
        child.sigint()
        child.line(child.err, WAITING)
        child.sigint()  # the frozen writer is killed; the trainer aborts the upload and deletes the claim
        code = child.finish()
    finally:
        child.kill()
    stderr = "\n".join(child.err)
    assert code == -signal.SIGINT, stderr
    assert stderr.count("Traceback") == 1, stderr  # the program's own KeyboardInterrupt
    check_abandoned(child, stderr)
    assert s3.uploads() == [], "multipart uploads left open"
    assert s3.keys("run/checkpoint-2/") == []
    with ckptd.Checkpointer(root, **options) as ckpt:
        assert ckpt.steps() == [1]


# ---- the same in this process: an explicit close(), and a ``with`` block ended by Ctrl-C ----------


@pytest.fixture
def python_sigint() -> Any:
    """Python's own SIGINT handler in this process, as a program started from a terminal has it
    (a test runner started in the background ignores SIGINT: ckptd would rightly leave it alone)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def frozen_save(root: str, python_sigint: Any) -> Any:
    """A Checkpointer whose save of step 2 is pending: its writer froze at its first write."""
    with writers_strike("write", FIRST_WRITE_OF_STEP_2, whom="stop"):
        ckpt = ckptd.Checkpointer(root, chunk_size="256KiB")
        ckpt.health_check()
    ckpt.save(1, {"model": {"w": torch.ones(8)}})
    request = ckpt.async_save(2, {"model": {"w": torch.randn(SIZE // 4)}})
    pid = ckpt.writer_pid
    wait_for(lambda: process_stopped(pid), timeout=WAIT)
    try:
        yield ckpt, request, pid
    finally:
        ckpt.close(wait=False)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def press_ctrl_c(stderr: Any, times: int, writer_pid: int) -> threading.Thread:
    """From another thread: Ctrl-C once our handler is installed, again after each line it
    prints, then let the frozen writer go on once the abandon is announced."""

    def press() -> None:
        try:
            wait_for(lambda: signal.getsignal(signal.SIGINT) is not signal.default_int_handler, timeout=WAIT)
            for _ in range(times):
                if "Ctrl-C again" not in stderr.getvalue():
                    os.kill(os.getpid(), signal.SIGINT)
                    wait_for(lambda: "Ctrl-C again" in stderr.getvalue(), timeout=WAIT)
                else:
                    os.kill(os.getpid(), signal.SIGINT)
            wait_for(lambda: ABANDONING in stderr.getvalue(), timeout=WAIT)
        finally:  # whatever happened, the frozen writer goes on: the wait in close() ends, never hangs
            os.kill(writer_pid, signal.SIGCONT)

    thread = threading.Thread(target=press, daemon=True)
    thread.start()
    return thread


def test_close_explains_ctrl_c_and_a_second_abandons_the_saves_then_raises(frozen_save, root, monkeypatch):
    import io

    ckpt, request, pid = frozen_save
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    presser = press_ctrl_c(stderr, 2, pid)
    with pytest.raises(KeyboardInterrupt):
        ckpt.close()
    presser.join(WAIT)
    assert stderr.getvalue().splitlines() == [WAITING, ABANDONING]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    with pytest.raises(ckptd.errors.WriterError, match="abandoned by Ctrl-C"):
        request.result(0)
    wait_for(lambda: not pid_alive(pid), timeout=WAIT)
    with open("/proc/self/maps") as f:
        assert "ckptd-arena" not in f.read()
    assert staging_dirs(root) == []
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == [1]


def test_a_with_block_ended_by_ctrl_c_explains_at_once_and_the_next_ctrl_c_abandons(frozen_save, root, monkeypatch):
    import io

    ckpt, request, pid = frozen_save
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    presser = press_ctrl_c(stderr, 1, pid)  # the line is there already: this one abandons
    with pytest.raises(KeyboardInterrupt), ckpt:
        raise KeyboardInterrupt  # Ctrl-C in the training loop inside `with Checkpointer(...)`
    presser.join(WAIT)
    assert stderr.getvalue().splitlines() == [WAITING, ABANDONING]
    assert request.done() and request.exception() is not None
    wait_for(lambda: not pid_alive(pid), timeout=WAIT)
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == [1]


def test_close_without_wait_abandons_the_save_in_flight_and_keeps_the_last_checkpoint(frozen_save, root):
    # ``close(wait=False)`` does not finish the save in flight: the writer is told to drop it, so
    # once it goes on it removes the save's staging directory and exits instead of committing.
    ckpt, request, pid = frozen_save
    closer = threading.Thread(target=ckpt.close, kwargs={"wait": False}, daemon=True)
    closer.start()
    try:
        wait_for(lambda: not closer.is_alive() or ckpt._abandoned is not None, timeout=WAIT)
    finally:
        os.kill(pid, signal.SIGCONT)  # healthy again, in the middle of the save's write
    closer.join(WAIT)
    assert not closer.is_alive()
    with pytest.raises(ckptd.errors.WriterError, match="closed with wait=False; nothing was committed"):
        request.result(0)
    wait_for(lambda: not pid_alive(pid), timeout=WAIT)
    assert staging_dirs(root) == []
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == [1]
        assert_same({"model": {"w": torch.ones(8)}}, again.load(1))


def test_close_without_wait_kills_a_writer_that_stays_stuck_and_cleans_up_its_save(frozen_save, root):
    ckpt, request, pid = frozen_save
    ckpt.close(wait=False)  # the writer never goes on: it is killed, and its save's files removed
    assert not pid_alive(pid)
    with pytest.raises(ckptd.errors.WriterError, match="closed with wait=False"):
        request.result(0)
    assert staging_dirs(root) == []
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == [1]


FIRST_WRITE_OF_STEP_1 = r"/\.checkpoint-1\.tmp-[^/]+/model-[^/]*\.safetensors$"


def test_a_save_waiting_for_a_slot_when_close_without_wait_comes_ends_and_commits_nothing(root, monkeypatch):
    # With one arena, async_save(2) waits for save 1's; close(wait=False) from another thread
    # abandons save 1, so save 2 gets the slot: it must then be refused or fail, never be queued
    # behind the completion thread's end (its request would never finish).
    with writers_strike("write", FIRST_WRITE_OF_STEP_1, whom="stop"):
        ckpt = ckptd.Checkpointer(root, max_in_flight=1, chunk_size="256KiB")
        ckpt.health_check()
    first = ckpt.async_save(1, {"model": {"w": torch.randn(SIZE // 4)}})
    pid = ckpt.writer_pid
    wait_for(lambda: process_stopped(pid), timeout=WAIT)
    outcome: dict[str, Any] = {}
    start = ckpt._saver.start

    def start_then_linger(*args: Any, **kwargs: Any) -> Any:
        job = start(*args, **kwargs)
        time.sleep(1.0)  # a thread switch at the worst moment: close() runs on before this save is queued
        return job

    monkeypatch.setattr(ckpt._saver, "start", start_then_linger)

    def second() -> None:
        try:
            outcome["request"] = ckpt.async_save(2, {"model": {"w": torch.randn(SIZE // 4)}})
        except Exception as e:  # noqa: BLE001 - the assertions below look at it
            outcome["error"] = e

    starting = threading.Thread(target=second, daemon=True)
    starting.start()
    try:
        time.sleep(0.5)
        assert starting.is_alive(), "the second save waits for the only arena"
        closer = threading.Thread(target=ckpt.close, kwargs={"wait": False}, daemon=True)
        closer.start()
        wait_for(lambda: ckpt._abandoned is not None, timeout=WAIT)
    finally:
        os.kill(pid, signal.SIGCONT)
    closer.join(WAIT)
    starting.join(WAIT)
    assert not closer.is_alive() and not starting.is_alive()
    with pytest.raises(ckptd.errors.WriterError, match="wait=False"):
        first.result(0)
    if "request" in outcome:  # queued before the close took its list: failed like the first
        with pytest.raises(ckptd.errors.WriterError):
            outcome["request"].result(30)
    else:
        assert isinstance(outcome["error"], ckptd.errors.CkptdError), outcome
    assert staging_dirs(root) == []
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == []


def test_a_second_close_returns_once_the_first_has_cleaned_up(frozen_save, root):
    ckpt, request, pid = frozen_save
    closer = threading.Thread(target=ckpt.close, kwargs={"wait": False}, daemon=True)
    closer.start()
    wait_for(lambda: ckpt._closed, timeout=WAIT)
    ckpt.close()  # the frozen writer is killed by the first close; this one waits for it
    assert request.done() and not pid_alive(pid)
    assert staging_dirs(root) == []
    closer.join(WAIT)


def test_close_without_wait_gives_an_idle_stuck_writer_seconds_not_the_full_timeout(root, monkeypatch):
    import ckptd.checkpointer as checkpointer_module

    monkeypatch.setattr(checkpointer_module, "_ABANDON_WRITER_SECONDS", 0.5)
    ckpt = ckptd.Checkpointer(root)
    ckpt.save(1, {"model": {"w": torch.ones(8)}})
    pid = ckpt.writer_pid
    os.kill(pid, signal.SIGSTOP)  # stuck, nothing pending: close(wait=False) has nothing to wait for
    closer = threading.Thread(target=ckpt.close, kwargs={"wait": False}, daemon=True)
    closer.start()
    closer.join(15)  # the writer's full timeout is 30 s
    try:
        assert not closer.is_alive(), "close(wait=False) waited for a stuck writer's answer"
        assert not pid_alive(pid)
    finally:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        closer.join(WAIT)
    with ckptd.Checkpointer(root) as again:
        assert again.steps() == [1]
