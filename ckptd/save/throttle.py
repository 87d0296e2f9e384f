"""The trainer's half of the adaptive I/O throttle: watch training steps, tell the writer.

With ``Checkpointer(...)`` (``throttle=True``, the default) a :class:`StepMonitor` times the training steps (a
global optimizer step pre-hook, or :meth:`~ckptd.Checkpointer.mark_step` for loops without a
torch optimizer).  Intervals between steps while no save is being written form the baseline
(the median of the last :data:`BASELINE_STEPS`).  While a save is written, each
:data:`WINDOW_STEPS` steps are compared with it: a median above ``limit`` (1.10x) tells the
writer to slow down (it halves its rate, see :mod:`ckptd.writer.throttle`; twice when the
median is more than twice as far over 1.0 as the limit, e.g. 1.2x for 1.10x), one below
``relax`` (1.03x) lets it speed up again, and in between "hold" keeps the limit (only after a
"slower": an unthrottled writer is told nothing).  A "slower" after which neither of the next
two windows is at least 3% faster (the first may still hold writes issued at the old rate; it
gets a "hold") shows the writer is not what slows training (another process, the data loader):
the limit is released and that save is left alone.  A throttled writer that hears nothing for a
while (nobody trains) lifts the limit by itself.  The step that spans the start of a write (it
holds the ``async_save`` call) is not counted.

The writer remembers the limit it was last given.  A save whose write starts while training goes
on (a step began less than :data:`~ckptd.writer.throttle.QUIET_SECONDS` before) starts at that
limit (:meth:`StepMonitor.writing_started` says so), and its steps are judged as after a
"slower": "hold" keeps the limit alive, "faster" raises it.  Any other save starts at full
speed.  ``wait()``, ``close()`` and a blocking ``result()`` of a save on the thread that called
``async_save`` release the limit, since nobody trains while they wait.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..writer.throttle import QUIET_SECONDS

__all__ = ["BASELINE_STEPS", "WINDOW_STEPS", "StepMonitor"]

BASELINE_STEPS = 16
WINDOW_STEPS = 4
_MIN_BASELINE = 4  # steps without a save needed before any decision
_HELPED = 0.97  # after a "slower", a window must be at least 3% faster to go on
_GRACE_WINDOWS = 1  # windows after a "slower" that may be no faster before the writer is let go


class StepMonitor:
    """Times training steps and sends ``"slower"`` / ``"faster"`` to the writer (``send``)."""

    def __init__(
        self,
        send: Callable[[str], None],
        *,
        limit: float = 1.10,
        relax: float = 1.03,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._send = send
        self.limit = limit
        self.relax = relax
        self._clock = clock
        self._lock = threading.Lock()
        self._baseline: deque[float] = deque(maxlen=BASELINE_STEPS)
        self._window: list[float] = []
        self._last: float | None = None
        self._writing = 0
        self._slowed = False  # "slower" was sent during the current write
        self._slowed_at: float | None = None  # the step-time ratio that made the last "slower"
        self._unhelped = 0  # windows since the last "slower" that were not faster than it
        self._gave_up = False  # slowing down did not help this write: leave it alone
        self._limited = False  # a "slower" was ever sent: the writer may have a limit to resume
        self._released = True  # the writer holds no limit this side set: a "release" would do nothing
        self.sent: deque[str] = deque(maxlen=256)  # the last actions sent, in order
        self._hook: Any = None

    def install(self) -> None:
        """Time every torch optimizer step from now on (one global pre-hook)."""
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._hook = register_optimizer_step_pre_hook(lambda *_: self.step())

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def writing_started(self) -> bool:
        """A save's write began (the completion thread).  Returns whether training goes on (a
        baseline was measured and a step began less than ``QUIET_SECONDS`` ago): the writer
        then starts at the limit it learned in earlier saves."""
        with self._lock:
            last = self._last
            training = (
                last is not None and len(self._baseline) >= _MIN_BASELINE and self._clock() - last < QUIET_SECONDS
            )
            self._writing += 1
            # A write that resumes the writer's limit is judged as a slowed one ("hold" keeps the
            # limit alive: a writer that hears nothing lifts it).  Only a "slower" sets a limit.
            self._slowed = training and self._limited
            self._released = not self._slowed  # the writer resumes its learned limit, or runs at full speed
            self._slowed_at = None
            self._unhelped = 0
            self._gave_up = False
            self._window.clear()
            self._last = None  # the step in progress holds the async_save call: not counted
        return training

    def writing_finished(self) -> None:
        with self._lock:
            self._writing = max(0, self._writing - 1)
            if not self._writing:
                self._released = True  # no write in progress: nothing is held back
            self._window.clear()
            self._last = None  # the step in progress overlapped the write: not a baseline step

    def step(self) -> None:
        """One training step began (the optimizer pre-hook, or ``mark_step()``)."""
        actions: list[str] = []
        with self._lock:
            now = self._clock()
            last, self._last = self._last, now
            if last is None:
                return
            interval = now - last
            if not self._writing:
                self._baseline.append(interval)
                return
            self._window.append(interval)
            if len(self._baseline) < _MIN_BASELINE or len(self._window) < WINDOW_STEPS:
                return
            ratio = statistics.median(self._window) / statistics.median(self._baseline)
            self._window.clear()
            if self._gave_up:
                return
            if ratio > self.limit and self._slowed_at is not None and ratio > self._slowed_at * _HELPED:
                if self._unhelped < _GRACE_WINDOWS:
                    # Not faster yet: the writes in flight when the rate fell still go at full speed.
                    actions = ["hold"]
                    self._unhelped += 1
                else:
                    # Slowing the writer down did not make the steps faster: it is not the cause.
                    actions = ["release"]
                    self._gave_up = True
            elif ratio > self.limit:
                # Steps more than twice as far over the limit's margin: halve the rate twice.
                far = ratio - 1 > 2 * (self.limit - 1)
                actions = ["slower", "slower"] if far else ["slower"]
                self._slowed = self._limited = True
                self._slowed_at = ratio
                self._unhelped = 0
            elif ratio < self.relax and self._slowed:
                actions = ["faster"]
            elif self._slowed:
                actions = ["hold"]  # still training, rate about right: keeps the limit alive
            if actions:
                self._released = actions[-1] == "release"
        for action in actions:
            self.sent.append(action)
            self._send(action)

    def release(self) -> None:
        """Lift the limit (the caller waits for the save: nobody trains meanwhile).  Sends
        nothing when no limit can be in effect: none was set, or it was lifted already.  The step
        in progress ends here: a write that starts while the caller waits starts at full speed."""
        with self._lock:
            self._last = None
            if self._released:
                return
            self._released = True
        self.sent.append("release")
        self._send("release")
