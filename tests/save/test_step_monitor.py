"""The trainer's side of the adaptive throttle: which notices step times produce (fake clock)."""

from __future__ import annotations

from ckptd.save.throttle import StepMonitor
from ckptd.writer.throttle import QUIET_SECONDS


class Steps:
    """Feeds a StepMonitor steps of given lengths on a fake clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sent: list[str] = []
        self.monitor = StepMonitor(self.sent.append, clock=lambda: self.now)

    def run(self, count: int, seconds: float) -> None:
        for _ in range(count):
            self.monitor.step()
            self.now += seconds


def test_slowed_steps_during_a_write_ask_for_a_slower_writer() -> None:
    steps = Steps()
    steps.run(10, 0.010)  # baseline: 10 ms steps, no save
    steps.monitor.writing_started()
    steps.run(5, 0.0115)  # 1.15x: the first step spans the save call and is not counted
    assert steps.sent == ["slower"]


def test_steps_far_over_the_limit_halve_the_rate_twice() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(5, 0.0125)  # 1.25x: more than twice the 10% margin over the baseline
    assert steps.sent == ["slower", "slower"]


def test_steps_within_the_limit_send_nothing_while_unthrottled() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(20, 0.0105)  # 1.05x: under the 1.10x limit
    assert steps.sent == []


def test_slowing_down_goes_on_while_it_helps() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(5, 0.020)  # 2.0x: far over, twice
    steps.run(4, 0.015)  # 1.5x: better, still far over
    steps.run(4, 0.0115)  # 1.15x: better again, over the limit
    assert steps.sent == ["slower"] * 5


def test_a_slowdown_the_writer_does_not_cause_is_left_alone() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(5, 0.020)  # 2.0x
    steps.run(4, 0.020)  # no better after "slower": writes issued before it may still be in flight
    assert steps.sent == ["slower", "slower", "hold"]
    steps.run(4, 0.020)  # no better in the second window either: not the writer's doing
    steps.run(12, 0.020)  # nothing more for this save
    assert steps.sent == ["slower", "slower", "hold", "release"]
    steps.monitor.writing_finished()
    steps.monitor.writing_started()  # the next save is judged afresh
    steps.run(5, 0.020)
    assert steps.sent == ["slower", "slower", "hold", "release", "slower", "slower"]


def test_a_slowdown_that_helps_one_window_late_goes_on() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(5, 0.0125)  # 1.25x: "slower" twice
    steps.run(4, 0.0125)  # no better yet (the writes in flight): "hold"
    steps.run(4, 0.0108)  # 1.08x: better, within the limit: "hold" keeps the limit
    steps.run(4, 0.0100)  # 1.0x: "faster"
    assert steps.sent == ["slower", "slower", "hold", "hold", "faster"]


def test_after_slowing_down_hold_then_faster() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(5, 0.0115)
    steps.run(4, 0.0105)  # in the band: keep the limit alive
    steps.run(4, 0.0100)  # back to the baseline: speed up
    assert steps.sent == ["slower", "hold", "faster"]


def test_steps_outside_writes_only_feed_the_baseline() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.run(10, 0.050)  # slow, but no save is being written
    assert steps.sent == []
    steps.monitor.writing_started()
    steps.monitor.writing_finished()
    steps.run(10, 0.100)
    assert steps.sent == []


def test_no_decision_without_a_baseline() -> None:
    steps = Steps()
    steps.run(2, 0.010)  # too few steps to know the normal step time
    steps.monitor.writing_started()
    steps.run(10, 0.050)
    assert steps.sent == []


def test_a_write_that_starts_while_training_goes_on_says_so() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(5, 0.0115)  # the writer learns a limit
    steps.monitor.writing_finished()
    steps.run(10, 0.010)
    steps.now += 0.5  # the step in progress holds the async_save call (its copy)
    assert steps.monitor.writing_started() is True  # the writer resumes its learned limit
    steps.run(5, 0.0105)  # in the band: the resumed limit is kept alive, as after a "slower"
    steps.run(4, 0.0100)  # back to the baseline: raise it
    assert steps.sent == ["slower", "hold", "faster"]
    steps.monitor.writing_finished()


def test_a_write_after_a_pause_in_training_or_without_a_baseline_starts_at_full_speed() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.now += QUIET_SECONDS + 0.1  # nobody trained for a while (evaluation, the end of the run)
    assert steps.monitor.writing_started() is False
    steps.monitor.writing_finished()
    fresh = Steps()
    fresh.run(2, 0.010)  # too few steps to say training goes on
    assert fresh.monitor.writing_started() is False


def test_release_is_sent_only_while_a_limit_can_be_in_effect() -> None:
    steps = Steps()
    steps.monitor.release()
    assert steps.sent == []  # no "slower" was ever sent: the writer has no limit to lift
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(5, 0.0125)
    steps.monitor.release()
    steps.monitor.release()  # lifted already
    assert steps.sent == ["slower", "slower", "release"]
    assert list(steps.monitor.sent) == ["slower", "slower", "release"]
    steps.monitor.writing_finished()
    steps.run(10, 0.010)
    assert steps.monitor.writing_started() is True  # training goes on: the writer resumes its limit
    steps.monitor.release()
    assert steps.sent == ["slower", "slower", "release", "release"]


def test_no_release_after_the_monitor_gave_the_writer_up() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(13, 0.0125)  # slowed whatever the writer does: "slower", "hold", then given up
    assert steps.sent[-1] == "release"
    sent = list(steps.sent)
    steps.monitor.release()
    assert steps.sent == sent


def test_a_wait_before_the_write_starts_keeps_that_write_at_full_speed() -> None:
    steps = Steps()
    steps.run(10, 0.010)
    steps.monitor.writing_started()
    steps.run(5, 0.0125)
    steps.monitor.writing_finished()  # the writer keeps its learned limit for later saves
    steps.run(10, 0.010)  # training goes on: a write starting now would resume that limit
    steps.monitor.release()  # the loop waits for a save whose write has not started yet
    assert steps.sent == ["slower", "slower"]  # no write in progress: nothing to lift
    assert steps.monitor.writing_started() is False  # nobody trains: it starts at full speed
