"""The writer's StagingGate: reads of a pipelined request wait for exactly the bytes they need."""

from __future__ import annotations

import threading

import pytest

from ckptd.errors import WriterError
from ckptd.storage import Stopped
from ckptd.writer.gate import StagingGate, chunk_gate


def never() -> bool:
    return False


def wait_in_thread(gate: StagingGate, end: int) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def run() -> None:
        try:
            gate.wait(end, "model-00001-of-00001.safetensors", never)
            outcome.append("ready")
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_wait_returns_only_once_the_watermark_covers_its_end():
    gate = StagingGate(100)
    gate.wait(100, "f", never)  # already staged: no wait
    assert gate.waits == 0
    thread, outcome = wait_in_thread(gate, 300)
    gate.advance(200)
    thread.join(0.3)
    assert thread.is_alive() and outcome == []
    gate.advance(150)  # never moves back
    gate.advance(300)
    thread.join(10)
    assert outcome == ["ready"]
    assert gate.waits == 1


def test_a_complete_gate_never_waits():
    gate = StagingGate(None)
    assert gate.complete
    gate.wait(1 << 40, "f", never)
    gate = StagingGate(0)
    gate.advance(-1)
    assert gate.complete
    gate.wait(1 << 40, "f", never)


def test_a_staging_error_fails_the_waiting_read_naming_the_file():
    gate = StagingGate(0)
    thread, outcome = wait_in_thread(gate, 4096)
    gate.advance(-1, "RuntimeError: device lost")
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], WriterError)
    assert "model-00001-of-00001.safetensors" in str(outcome[0]) and "device lost" in str(outcome[0])
    with pytest.raises(WriterError):
        gate.wait(1, "f", never)  # even bytes that were staged: the request is abandoned


def test_should_stop_ends_a_wait_with_stopped():
    gate = StagingGate(0)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopped):
        gate.wait(10, "f", stop.is_set)


def test_the_chunk_gate_needs_each_chunks_end_and_the_files_end_last():
    gate = StagingGate(1100)
    before_chunk = chunk_gate(gate, 1000, 250, 100, "f", never)
    assert before_chunk() is False  # chunk 0: arena[1000:1100] is staged
    waiter = threading.Thread(target=before_chunk, daemon=True)  # chunk 1 needs 1200
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()
    gate.advance(1200)
    waiter.join(10)
    assert not waiter.is_alive()
    last = threading.Thread(target=before_chunk, daemon=True)  # chunk 2 needs 1250, not 1300
    gate.advance(1250)
    last.start()
    last.join(10)
    assert not last.is_alive()
    assert gate.waits == 1
