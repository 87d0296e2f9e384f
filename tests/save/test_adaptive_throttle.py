"""The adaptive I/O throttle end to end: real optimizer steps timed by the hook, a real writer
process that slows down when told, and a checkpoint that is still whole and exact."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from conftest import assert_same

import ckptd
from ckptd.errors import ConfigError
from ckptd.options import CheckpointerOptions
from ckptd.writer.throttle import QUIET_SECONDS


def _model_and_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the weights stay as saved
    payload = {f"block{i}": torch.randn(4 * 1024 * 1024) for i in range(8)}  # 128 MiB to write
    return model, optimizer, {"model": model, "payload": payload}


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, pause: float) -> None:
    loss = model(torch.ones(2, 8)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # timed by the throttle's optimizer pre-hook
    time.sleep(pause)


def _paced_by(ckpt: ckptd.Checkpointer, gates: dict[str, str | threading.Event]) -> dict[str, list[float | None]]:
    """Hold the background copy of ``block<i>`` until the throttle has sent the action
    ``gates[block]`` (or until that event is set): the save lasts as long as the decisions the
    test waits for, on a fast disk or a loaded machine alike (the writer writes each block as
    its copy lands; a block counts as staged once the hook after its copy returns).  Returns, per
    action waited for, the writer's limit right after it was sent (a ping is answered after the
    notices sent before it)."""
    sent = ckpt._steps.sent
    limits: dict[str, list[float | None]] = {}

    def after_copy(component: str, key: str) -> None:
        gate = gates.get(key)
        if gate is None:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
            gate.is_set() if isinstance(gate, threading.Event) else gate in sent
        ):
            time.sleep(0.002)
        if isinstance(gate, str):
            limits.setdefault(gate, []).append(ckpt.health_check()["write_rate"])

    ckpt._pool.after_copy = after_copy
    return limits


def _written(ckpt: ckptd.Checkpointer, nbytes: int) -> None:
    """Wait until the writer has written ``nbytes`` (it then knows its unthrottled rate)."""
    deadline = time.monotonic() + 60
    while ckpt.health_check()["bytes_written"] < nbytes:
        assert time.monotonic() < deadline, "the writer wrote nothing"
        time.sleep(0.002)


def _baseline(ckpt: ckptd.Checkpointer, pause: float) -> None:
    for _ in range(12):
        ckpt.mark_step()  # steps without a save: the baseline
        time.sleep(pause)


# Steps are marked by hand in the tests that stage in the background (optimizer.step() would wait
# for the copy they hold).  That the writer really sleeps under a limit is tests/writer/
# test_throttle.py's (a fake clock); here, that the trainer's decisions reach it.


def test_slowed_training_throttles_the_writer_until_that_does_not_help(tmp_path: Any) -> None:
    _, _, state = _model_and_state()
    with ckptd.Checkpointer(str(tmp_path), chunk_size="1MiB") as ckpt:  # the throttle is on by default
        ckpt.prepare(state)
        _baseline(ckpt, 0.002)
        # Blocks 0-1 are written at once (the writer measures its rate on block 0), blocks 2-6
        # once "slower" was sent, block 7 once the limit was given up.
        limits = _paced_by(ckpt, {"block1": "slower", "block6": "release"})
        request = ckpt.async_save(1, state, staging="background")
        _written(ckpt, 16 * 1024 * 1024)
        while not request.done():
            # Training is slowed while the save is written (as interference would): 5x.
            ckpt.mark_step()
            time.sleep(0.010)
        request.result()
        # The steps stay slow whatever the writer does (the sleep is not its doing): "slower"
        # (again if a window happened to be 3% faster, as sleeps jitter on a busy machine), a
        # "hold" for the window after it, then, since it did not help, the limit is released
        # for the rest of the save.
        sent = list(ckpt._steps.sent)
        assert "release" in sent, sent
        first_release = sent.index("release")
        assert sent[0] == "slower" and set(sent[:first_release]) == {"slower", "hold"}, sent
        assert sent[first_release - 1] == "hold", sent
        assert limits["slower"][0] is not None, "the writer took the limit"
        assert limits["release"] == [None], "and gave it up"
        assert_same(ckpt.load(1, into=None)["payload"], state["payload"])


def test_the_next_save_while_training_starts_at_the_learned_limit(tmp_path: Any) -> None:
    _, _, state = _model_and_state()
    with ckptd.Checkpointer(str(tmp_path), throttle=True, chunk_size="1MiB") as ckpt:
        ckpt.prepare(state)
        _baseline(ckpt, 0.002)
        limits = _paced_by(ckpt, {"block1": "slower", "block6": "release"})
        first = ckpt.async_save(1, state, staging="background")
        _written(ckpt, 16 * 1024 * 1024)
        while "slower" not in ckpt._steps.sent:
            ckpt.mark_step()
            time.sleep(0.010)  # slowed while the write goes on
        ckpt.wait()  # "release": the rest is written at full speed; the limit is remembered
        sent = list(ckpt._steps.sent)
        assert sent[-1] == "release" and set(sent[:-1]) == {"slower"}, sent
        assert limits["slower"][0] is not None and ckpt.health_check()["write_rate"] is None
        assert first.result().step == 1
        _baseline(ckpt, 0.002)
        ckpt._steps.sent.clear()
        sampled = threading.Event()
        _paced_by(ckpt, {"block6": sampled})  # held until the test has seen the writer's limit
        second = ckpt.async_save(2, state, staging="background")
        rates = []  # the writer's limit while the trainer has asked nothing during this save
        while not second.done():
            if not ckpt._steps.sent:
                rates.append(ckpt.health_check()["write_rate"])
                if rates[-1] is not None:
                    sampled.set()
            ckpt.mark_step()
            time.sleep(0.002)
        second.result()
        assert any(rate is not None for rate in rates), (rates, list(ckpt._steps.sent))
        assert_same(ckpt.load(2, into=None)["payload"], state["payload"])
        ckpt._pool.after_copy = None
        time.sleep(QUIET_SECONDS + 0.2)  # no step for a while: nobody trains
        ckpt._steps.sent.clear()
        third = ckpt.async_save(3, state)
        assert "throttled" not in third.result().timings  # full speed
        assert list(ckpt._steps.sent) == []


def test_wait_releases_the_limit_so_the_save_finishes_at_full_speed(tmp_path: Any) -> None:
    _, _, state = _model_and_state()
    with ckptd.Checkpointer(str(tmp_path), throttle=True, chunk_size="1MiB") as ckpt:
        ckpt.prepare(state)
        for _ in range(12):
            ckpt.mark_step()
            time.sleep(0.004)
        # The last block is copied only once wait() has sent "release": the save is still being
        # written when the limit is lifted, however fast the disk.
        _paced_by(ckpt, {"block6": "release"})
        request = ckpt.async_save(1, state, staging="background")
        while "slower" not in ckpt._steps.sent:
            ckpt.mark_step()
            time.sleep(0.020)
        assert not request.done()
        ckpt.wait()  # sends "release": the rest of the save is not held back
        assert ckpt._steps.sent[-1] == "release"
        assert request.result().path.endswith("checkpoint-1")
        assert_same(ckpt.load(1, into=None)["payload"], state["payload"])


def test_a_blocking_result_on_the_saving_thread_lifts_the_limit(tmp_path: Any) -> None:
    _, _, state = _model_and_state()
    with ckptd.Checkpointer(str(tmp_path), throttle=True, chunk_size="1MiB") as ckpt:
        ckpt.prepare(state)
        for _ in range(12):
            ckpt.mark_step()  # the baseline: 2 ms steps, no save
            time.sleep(0.002)
        copied = threading.Event()
        ckpt._pool.after_copy = lambda component, key: key == "block3" and copied.wait(60)  # holds the save
        # Background staging: the writer writes what is copied; the save stays pending until released.
        # (Steps are marked by hand: optimizer.step() would wait for the copy it must not overtake.)
        request = ckpt.async_save(1, state, staging="background")
        for _ in range(40):
            if "slower" in ckpt._steps.sent:
                break
            ckpt.mark_step()
            time.sleep(0.010)  # training slowed while the save is written
        assert "slower" in ckpt._steps.sent and not request.done(), list(ckpt._steps.sent)
        ckpt._steps.sent.clear()
        timed_out: list[str] = []

        def wait_elsewhere() -> None:  # a logger or clean-up thread: training may go on meanwhile
            try:
                request.result(timeout=0.2)
            except TimeoutError:
                timed_out.append("result")

        other = threading.Thread(target=wait_elsewhere)
        other.start()
        other.join()
        assert timed_out == ["result"] and list(ckpt._steps.sent) == []
        with pytest.raises(TimeoutError):
            request.result(timeout=0)  # a poll, not a wait
        assert list(ckpt._steps.sent) == []
        with pytest.raises(TimeoutError):
            request.exception(timeout=0.1)  # the thread that saved blocks: nobody trains
        assert list(ckpt._steps.sent) == ["release"]
        copied.set()
        result = request.result()
        assert list(ckpt._steps.sent) == ["release"]  # lifted already
        assert result.step == 1
        assert_same(ckpt.load(1, into=None)["payload"], state["payload"])


def test_without_throttle_nothing_is_timed_or_held_back(tmp_path: Any) -> None:
    model, optimizer, state = _model_and_state()
    with ckptd.Checkpointer(str(tmp_path), throttle=False, chunk_size="1MiB") as ckpt:
        assert ckpt._steps is None
        ckpt.mark_step()  # a no-op with throttle=False
        request = ckpt.async_save(1, state)
        while not request.done():
            _step(model, optimizer, 0.020)
        assert "throttled" not in request.result().timings
        assert ckpt.health_check()["throttled_seconds"] == 0.0


def test_throttle_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_THROTTLE", "1")
    assert CheckpointerOptions.from_env().throttle is True
    monkeypatch.setenv("CKPTD_THROTTLE", "off")
    assert CheckpointerOptions.from_env().throttle is False
    monkeypatch.setenv("CKPTD_THROTTLE", "sometimes")
    with pytest.raises(ConfigError, match="CKPTD_THROTTLE"):
        CheckpointerOptions.from_env()


def test_a_save_while_nobody_trains_is_never_held_back_by_the_default_throttle(tmp_path: Any) -> None:
    _, _, state = _model_and_state()
    assert CheckpointerOptions().throttle is True
    with ckptd.Checkpointer(str(tmp_path), chunk_size="1MiB") as ckpt:
        assert ckpt._steps is not None  # the default times optimizer steps
        for step in (1, 2):
            result = ckpt.async_save(step, state).result()
            assert "throttled" not in result.timings
        assert list(ckpt._steps.sent) == []  # no steps: the writer is told nothing
        assert ckpt.health_check()["throttled_seconds"] == 0.0
        assert_same(ckpt.load(2, into=None)["payload"], state["payload"])
