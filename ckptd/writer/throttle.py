"""The writer's adaptive I/O throttle: a token bucket every written chunk passes through.

The trainer side (:mod:`ckptd.save.throttle`) watches training steps and sends ``"slower"``
when steps during a write are measurably slower than without one, ``"faster"`` when they are
not, ``"hold"`` in between, and ``"release"`` when nobody trains (``wait()``, ``close()``) or
slowing down did not help (the writer is not what slows training); :data:`QUIET_SECONDS`
without any notice releases the limit too.  The bucket turns those into a rate: ``slower``
halves the current rate (the measured unthrottled throughput at first), never below the
unthrottled throughput divided by :data:`MAX_STRETCH` (nor :data:`MIN_RATE`), ``faster`` raises
it by half, and once it is above twice the unthrottled throughput the limit is lifted.

Why the floor: a slow commit is not a fix.  Without it, a trainer whose step times hover
between the relax and slow-down thresholds kept a halved-twice rate for the whole write: on
the 2-core VM of docs/benchmarks.md, ~40 ms steps ran 1.05x during a 1 GiB save, but the save
took 2.7-3.9 s against 0.57 s for the raw write (the full ``run_all.py`` of 2026-11-29).  A
checkpoint that commits late loses more work on a failure and delays the next save.

The limit that ``slower`` and ``faster`` last set is remembered (:attr:`WriteThrottle.learned_rate`;
``release`` and silence lift the limit but keep it; ``faster`` past the lifting point drops it).
A write request starts at full speed, unless the trainer says it is training (``resume``): then
it starts at the remembered limit, so that the next save does not first slow training down for
the several steps the trainer needs to measure it again (on the 2-core VM of docs/benchmarks.md
a 1 GiB save is written in about 2 s, about as long as the trainer takes to halve the rate
twice).  The trainer judges such a write as one it slowed: ``hold`` keeps the limit alive,
``faster`` raises it when it no longer hurts.  Torch-free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["MAX_STRETCH", "MIN_RATE", "QUIET_SECONDS", "THROTTLE_ACTIONS", "WriteThrottle"]

MIN_RATE = 8 * 1024**2
"""The slowest the throttle ever writes, in bytes per second."""

MAX_STRETCH = 1.5
"""How much longer than unthrottled a throttled write may take: the rate never goes below the
measured unthrottled throughput divided by this."""

THROTTLE_ACTIONS = ("slower", "faster", "hold", "release")

QUIET_SECONDS = 2.0
"""A throttled writer that hears nothing from the trainer for this long lifts its limit: the
trainer sends a notice every few steps while it trains, so silence means nobody is training
(the caller waits for the save, or the loop ended)."""

_SLEEP_SLICE = 0.05  # a throttled writer re-checks should_stop() at least this often
_BURST_SECONDS = 0.1  # how far ahead of the rate a writer may get after a pause


class WriteThrottle:
    """A token bucket shared by the writer's threads; ``rate`` ``None`` means unthrottled."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self.rate: float | None = None
        self.unthrottled_rate: float | None = None  # bytes/s measured while no limit applied
        self.learned_rate: float | None = None  # the limit slower/faster last set (see the module doc)
        self.throttled_seconds = 0.0  # slept so far (all requests)
        self._tokens = 0.0
        self._refilled = clock()
        self._last_chunk: float | None = None
        self._noticed = clock()

    def reset(self, resume: bool = False) -> None:
        """A new write request: at full speed, or with ``resume`` (the trainer is training) at
        :attr:`learned_rate` (full speed when there is none)."""
        with self._lock:
            self._last_chunk = None
            self.rate = self.learned_rate if resume else None
            if self.rate is not None:
                now = self._clock()
                self._tokens = 0.0
                self._refilled = now
                self._noticed = now  # the trainer spoke: training goes on

    def adjust(self, action: str) -> None:
        """Apply ``"slower"``, ``"faster"``, ``"hold"`` or ``"release"`` (anything else is ignored)."""
        with self._lock:
            self._noticed = self._clock()
            if action == "release":
                self.rate = None
            elif action == "slower":
                start = self.rate if self.rate is not None else self.unthrottled_rate
                if start is None:
                    return  # nothing measured yet: the next chunk will tell
                floor = (self.unthrottled_rate or start) / MAX_STRETCH
                self.rate = self.learned_rate = max(MIN_RATE, floor, start / 2)
                self._tokens = 0.0
                self._refilled = self._clock()
            elif action == "faster" and self.rate is not None:
                self.rate *= 1.5
                if self.unthrottled_rate is not None and self.rate > 2 * self.unthrottled_rate:
                    self.rate = None
                self.learned_rate = self.rate

    def consume(self, nbytes: int, should_stop: Callable[[], bool] = lambda: False) -> float:
        """Account for ``nbytes`` just written; sleeps while the bucket is in debt (in slices,
        returning early once ``should_stop()``).  Returns the seconds slept."""
        with self._lock:
            now = self._clock()
            if self.rate is not None and now - self._noticed > QUIET_SECONDS:
                self.rate = None  # nobody trains: write at full speed
            if self.rate is None:
                if self._last_chunk is not None and now > self._last_chunk:
                    measured = nbytes / (now - self._last_chunk)
                    previous = self.unthrottled_rate
                    self.unthrottled_rate = measured if previous is None else 0.7 * previous + 0.3 * measured
                self._last_chunk = now
                return 0.0
            self._last_chunk = None
            rate = self.rate
            self._tokens = min(rate * _BURST_SECONDS, self._tokens + (now - self._refilled) * rate)
            self._refilled = now
            self._tokens -= nbytes
            debt = -self._tokens / rate if self._tokens < 0 else 0.0
        slept = 0.0
        while slept < debt and not should_stop():
            piece = min(_SLEEP_SLICE, debt - slept)
            self._sleep(piece)
            slept += piece
        with self._lock:
            self.throttled_seconds += slept
        return slept
