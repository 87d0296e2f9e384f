"""The writer's side of a streamed save (ckptd.writer.ring): what it reads from the ring, and what
it tells the trainer it no longer needs.  A freed offset too high lets the copy overwrite bytes
not yet written (a silently wrong checkpoint), so each way a reader frees is checked here."""

from __future__ import annotations

import threading

import pytest

from ckptd.errors import WriterError
from ckptd.storage import Stopped
from ckptd.writer.gate import StagingGate
from ckptd.writer.ring import RingArena

SIZE = 64


def ring_holding(logical: bytes, start: int, *, gate: StagingGate | None = None) -> tuple[RingArena, list[int]]:
    """A ring of SIZE bytes holding ``logical`` at logical offset ``start`` (wrapping)."""
    memory = bytearray(SIZE)
    for i, byte in enumerate(logical):
        memory[(start + i) % SIZE] = byte
    told: list[int] = []
    ring = RingArena(memoryview(memory), gate, should_stop=lambda: False, on_freed=told.append, notice_bytes=1)
    return ring, told


def test_a_slice_across_the_ring_end_reads_the_logical_bytes_in_order():
    data = bytes(range(100, 140))
    ring, _ = ring_holding(data, 50)  # logical 50..90: ring places 50..63 then 0..25
    for copying in (False, True):
        reader = ring.reader(50, len(data), "f", copying=copying)
        assert bytes(reader[0:40]) == data
        assert bytes(reader[10:30]) == data[10:30]
        assert bytes(reader) == data
        reader.close()


def test_spans_never_cross_the_ring_end_and_cover_the_file():
    data = bytes(range(40))
    ring, _ = ring_holding(data, 50)
    spans = [bytes(s) for s in ring.reader(50, 40, "f", copying=False).spans(8)]
    assert [len(s) for s in spans] == [8, 6, 8, 8, 8, 2]  # 50..58..64 | 0..8..16..24..26
    assert b"".join(spans) == data


def test_a_sequential_reader_frees_a_slice_only_when_it_asks_for_the_next():
    ring, told = ring_holding(bytes(48), 16)
    reader = ring.reader(16, 48, "f", copying=False)
    reader[0:16]
    assert told == [16]  # nothing below the file was needed; its first slice is in use
    reader[16:32]
    assert told == [16, 32]
    reader.close()
    assert told == [16, 32, 64]


def test_copying_readers_free_only_what_was_copied_without_a_gap():
    ring, told = ring_holding(bytes(60), 0)
    reader = ring.reader(0, 60, "f", copying=True)  # uploads ask for parts in any order
    reader[20:40]
    reader[40:60]
    assert told == []  # part 0..20 is not copied yet: the ring still holds it for the writer
    reader[0:20]
    assert told == [60]


def test_the_lowest_reader_of_every_file_holds_the_ring():
    ring, told = ring_holding(bytes(60), 0)
    write = ring.reader(0, 30, "a", copying=False)
    crc = ring.reader(0, 30, "a", copying=False)
    later = ring.reader(30, 30, "b", copying=False)  # registered now, though it starts later
    write[0:10]
    write[10:20]
    assert told == []  # the checksum has read nothing yet
    list(crc.spans(30))
    crc.close()
    assert told == [10]
    write.close()
    assert told == [10, 30]  # the next file's readers are still at its start
    later.close()
    assert told == [10, 30, 60]


def test_a_reader_waits_for_staged_bytes_and_stops_when_staging_fails():
    gate = StagingGate(0)
    ring, _ = ring_holding(bytes(range(32)), 0, gate=gate)
    reader = ring.reader(0, 32, "model-00001.safetensors", copying=False)
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(bytes(reader[0:16])))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and not got  # nothing is staged yet
    gate.advance(16)
    thread.join(10)
    assert got == [bytes(range(16))]
    gate.advance(-1, "RuntimeError: boom")
    with pytest.raises(WriterError, match=r"model-00001\.safetensors was not written.*boom"):
        reader[16:32]


def test_a_reader_stops_waiting_when_the_writer_stops():
    stop = threading.Event()
    ring = RingArena(
        memoryview(bytearray(SIZE)), StagingGate(0), should_stop=stop.is_set, on_freed=lambda upto: None, notice_bytes=1
    )
    reader = ring.reader(0, 16, "f", copying=True)
    stop.set()
    with pytest.raises(Stopped):
        reader[0:16]


def test_no_slice_is_larger_than_the_ring():
    ring, _ = ring_holding(bytes(SIZE), 0)
    with pytest.raises(WriterError, match="cannot read 80 bytes at once"):
        ring.reader(0, 100, "f", copying=True)[0:80]
