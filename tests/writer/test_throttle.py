"""The writer's adaptive throttle (a token bucket), driven by a fake clock: no wall-clock
assertions, every number below follows from the bucket's arithmetic."""

from __future__ import annotations

import pytest

from ckptd.writer.throttle import MAX_STRETCH, MIN_RATE, QUIET_SECONDS, WriteThrottle

MIB = 1024**2


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _measured(fake: FakeTime, rate: float = 400 * MIB) -> WriteThrottle:
    """A throttle that has seen two chunks written unthrottled at ``rate``."""
    throttle = WriteThrottle(fake.clock, fake.sleep)
    throttle.consume(16 * MIB)
    fake.now += 16 * MIB / rate
    assert throttle.consume(16 * MIB) == 0.0
    return throttle


def test_unthrottled_writes_never_sleep_and_are_measured() -> None:
    fake = FakeTime()
    throttle = _measured(fake)
    assert throttle.rate is None
    assert throttle.unthrottled_rate == pytest.approx(400 * MIB)
    assert fake.slept == []


def test_slower_halves_the_rate_down_to_the_stretch_floor_and_the_bucket_holds_writes_back() -> None:
    fake = FakeTime()
    throttle = _measured(fake)
    floor = 400 * MIB / MAX_STRETCH  # a throttled write takes at most 1.5x as long as unthrottled
    throttle.adjust("slower")  # half the measured 400 MiB/s would be below the floor
    assert throttle.rate == pytest.approx(floor)
    slept = throttle.consume(40 * MIB)  # 0.15 s worth at 266.7 MiB/s, on an empty bucket
    assert slept == pytest.approx(0.15)
    assert throttle.throttled_seconds == pytest.approx(0.15)
    throttle.adjust("hold")  # a notice: keeps the limit alive
    slept = throttle.consume(40 * MIB)
    assert slept == pytest.approx(0.15)  # the rate holds: 40 MiB take 0.15 s again
    throttle.adjust("faster")
    throttle.adjust("faster")  # 600 MiB/s
    throttle.adjust("slower")
    assert throttle.rate == pytest.approx(300 * MIB)  # halved
    throttle.adjust("slower")
    throttle.adjust("slower")
    assert throttle.rate == pytest.approx(floor)  # never below the floor


def test_faster_raises_the_rate_and_lifts_the_limit_past_twice_the_measured_rate() -> None:
    fake = FakeTime()
    throttle = _measured(fake)
    throttle.adjust("slower")  # 266.7 MiB/s
    throttle.adjust("faster")
    assert throttle.rate == pytest.approx(400 * MIB)
    throttle.adjust("faster")
    assert throttle.rate == pytest.approx(600 * MIB)
    throttle.adjust("faster")  # 900 MiB/s > 2 x 400: unthrottled
    assert throttle.rate is None
    throttle.adjust("faster")  # nothing to raise
    assert throttle.rate is None


def test_the_rate_never_goes_below_the_stretch_floor_nor_the_minimum() -> None:
    fake = FakeTime()
    throttle = _measured(fake, rate=20 * MIB)
    for _ in range(10):
        throttle.adjust("slower")
    assert throttle.rate == pytest.approx(20 * MIB / MAX_STRETCH)
    slow = _measured(FakeTime(), rate=4 * MIB)  # its floor (2.7 MiB/s) is below the minimum
    slow.adjust("slower")
    assert slow.rate == MIN_RATE


def test_slower_before_anything_was_measured_is_ignored() -> None:
    throttle = WriteThrottle(FakeTime().clock, FakeTime().sleep)
    throttle.adjust("slower")
    assert throttle.rate is None


def test_release_reset_and_silence_lift_the_limit() -> None:
    fake = FakeTime()
    throttle = _measured(fake)
    throttle.adjust("slower")
    throttle.adjust("release")
    assert throttle.rate is None
    throttle.adjust("slower")
    throttle.reset()  # a new write request starts at full speed
    assert throttle.rate is None
    throttle.adjust("slower")
    fake.now += QUIET_SECONDS + 0.1  # no notice from the trainer: nobody trains
    assert throttle.consume(64 * MIB) == 0.0
    assert throttle.rate is None


def test_a_write_that_resumes_starts_at_the_learned_limit() -> None:
    fake = FakeTime()
    throttle = _measured(fake)
    throttle.adjust("slower")
    throttle.adjust("faster")  # 400 MiB/s: the limit this write ended with
    throttle.reset(resume=True)  # the next write, training goes on
    assert throttle.rate == pytest.approx(400 * MIB)
    assert throttle.consume(40 * MIB) == pytest.approx(0.1)  # held back from its first chunk
    throttle.reset()  # a write while nobody trains: full speed
    assert throttle.rate is None
    throttle.adjust("release")  # wait(): lifts the limit, remembers it
    throttle.reset(resume=True)
    assert throttle.rate == pytest.approx(400 * MIB)
    fake.now += QUIET_SECONDS + 0.1  # silence lifts the limit, remembers it too
    assert throttle.consume(64 * MIB) == 0.0
    throttle.reset(resume=True)
    assert throttle.rate == pytest.approx(400 * MIB)


def test_a_lifted_limit_leaves_nothing_to_resume() -> None:
    fake = FakeTime()
    throttle = _measured(fake)
    throttle.adjust("slower")
    for _ in range(4):
        throttle.adjust("faster")  # 400, 600 MiB/s, then past 2 x 400: lifted
    assert throttle.rate is None and throttle.learned_rate is None
    throttle.reset(resume=True)
    assert throttle.rate is None
    assert WriteThrottle(fake.clock, fake.sleep).learned_rate is None  # nothing learned yet


def test_a_stop_request_ends_the_wait_early() -> None:
    fake = FakeTime()
    throttle = _measured(fake)
    throttle.adjust("slower")
    slept = throttle.consume(2000 * MIB, should_stop=lambda: len(fake.slept) >= 3)
    assert slept == pytest.approx(3 * 0.05)  # three slices, then the stop was seen
