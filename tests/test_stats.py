"""Save statistics: SaveResult timings/bytes/retries, Checkpointer.stats(), the process summary,
the Prometheus text and endpoint, the JSON-lines sink — all from real saves."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

import pytest
import torch

import ckptd
import ckptd.stats
from ckptd.stats import SaveStats, StatsRecorder

PHASES = ("plan", "wait", "stage", "blocking", "write", "commit", "total")
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[^"]*"\})? (\S+)$')


def _state(n: int = 4096) -> dict[str, Any]:
    return {"model": {"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64)}}


def _check_result(result: ckptd.SaveResult, expected_bytes: int) -> None:
    assert result.bytes_written >= expected_bytes
    for phase in PHASES:
        assert phase in result.timings, phase
        assert result.timings[phase] >= 0.0
    assert result.timings["total"] >= result.timings["blocking"]
    assert result.throughput == pytest.approx(result.bytes_written / result.timings["write"])
    assert result.retries == 0


@pytest.mark.parametrize("where", ["local", "memory"])
def test_stats_of_real_saves(tmp_path, where):
    root = str(tmp_path / "ckpts") if where == "local" else f"memory://stats-{tmp_path.name}"
    before = ckptd.save_stats()
    state = _state()
    tensor_bytes = 4096 * 4 + 7 * 8
    with ckptd.Checkpointer(root) as ckpt:
        first = ckpt.save(1, state)
        second = ckpt.save(2, state)
        _check_result(first, tensor_bytes)
        _check_result(second, tensor_bytes)
        with pytest.raises(ckptd.errors.CheckpointExistsError):
            ckpt.save(2, state)  # local: refused by async_save; object stores: by the claim
        summary = ckpt.stats()
    assert summary.saves_completed == 2
    assert summary.saves_failed == (0 if where == "local" else 1)
    assert summary.bytes_written == first.bytes_written + second.bytes_written
    assert summary.retries == 0
    assert summary.phases["write"].count == 2
    assert summary.phases["total"].total == pytest.approx(first.timings["total"] + second.timings["total"])
    assert summary.phases["commit"].last == second.timings["commit"]
    assert summary.throughput == pytest.approx(summary.bytes_written / summary.write_seconds)
    assert [r.step for r in summary.recent if r.ok] == [1, 2]
    assert json.loads(json.dumps(summary.as_dict()))["saves_completed"] == 2
    after = ckptd.save_stats()  # the process totals include these saves (and stay after close)
    assert after.saves_completed - before.saves_completed == 2
    assert after.bytes_written - before.bytes_written == summary.bytes_written


def test_failed_save_is_counted(tmp_path):
    # On object stores an existing step is refused by the create-only claim, in the completion
    # thread: the save fails after async_save returned.
    with ckptd.Checkpointer(f"memory://failed-{tmp_path.name}") as ckpt:
        ckpt.save(1, _state())
        ckpt.save(2, _state())
        later = ckpt.async_save(2, _state())
        with pytest.raises(ckptd.errors.CheckpointExistsError):
            later.wait()
        summary = ckpt.stats()
    assert summary.saves_completed == 2
    assert summary.saves_failed == 1
    failed = summary.recent[-1]
    assert not failed.ok and failed.step == 2
    assert failed.error is not None and "CheckpointExistsError" in failed.error
    assert failed.bytes_written == 0
    assert failed.timings["total"] >= failed.timings["blocking"] > 0
    assert summary.bytes_written == sum(r.bytes_written for r in summary.recent if r.ok)


def test_prometheus_text_and_endpoint(tmp_path):
    with ckptd.Checkpointer(tmp_path / "ckpts") as ckpt:
        result = ckpt.save(5, _state())
    text = ckptd.stats.prometheus_text()
    helps: set[str] = set()
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helps.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        else:
            match = _SAMPLE.match(line)
            assert match, f"not an exposition-format sample: {line!r}"
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
            base = re.sub(r"_(sum|count)$", "", match.group(1))
            assert base in types, f"{line!r} has no TYPE line"
    assert helps == set(types)
    assert types["ckptd_saves_total"] == "counter"
    assert types["ckptd_save_phase_seconds"] == "summary"
    assert types["ckptd_last_save_step"] == "gauge"
    summary = ckptd.save_stats()
    assert samples['ckptd_saves_total{outcome="completed"}'] == summary.saves_completed >= 1
    assert samples["ckptd_bytes_written_total"] == summary.bytes_written >= result.bytes_written
    assert samples["ckptd_last_save_step"] == 5
    assert samples['ckptd_last_save_seconds{phase="write"}'] == pytest.approx(result.timings["write"])
    assert samples['ckptd_save_phase_seconds_count{phase="commit"}'] == summary.phases["commit"].count

    server = ckptd.stats.serve_prometheus(0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            assert answer.status == 200
            assert answer.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = answer.read().decode()
        assert 'ckptd_saves_total{outcome="completed"}' in body
        assert "# TYPE ckptd_bytes_written_total counter" in body
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
        assert missing.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_jsonl_sink_writes_one_line_per_save(tmp_path):
    log = tmp_path / "logs" / "saves.jsonl"
    sink = ckptd.stats.add_jsonl_sink(log)
    try:
        with ckptd.Checkpointer(tmp_path / "ckpts") as ckpt:
            results = [ckpt.save(step, _state()) for step in (1, 2, 3)]
    finally:
        ckptd.stats.remove_sink(sink)
    lines = log.read_text().splitlines()
    assert len(lines) == 3
    records = [json.loads(line) for line in lines]
    for record, result in zip(records, results, strict=True):
        assert record["step"] == result.step and record["ok"] is True
        assert record["bytes_written"] == result.bytes_written
        assert record["timings"] == pytest.approx(result.timings)
        assert record["throughput"] == pytest.approx(result.throughput)
        assert record["root"] == str(tmp_path / "ckpts") and record["rank"] == 0
    with ckptd.Checkpointer(tmp_path / "more") as ckpt:
        ckpt.save(1, _state())
    assert len(log.read_text().splitlines()) == 3  # removed: no more lines


def test_a_broken_sink_does_not_fail_the_save(tmp_path, caplog):
    def broken(stats: SaveStats) -> None:
        raise RuntimeError("sink down")

    ckptd.stats.add_sink(broken)
    try:
        with caplog.at_level("WARNING", logger="ckptd"), ckptd.Checkpointer(tmp_path / "ckpts") as ckpt:
            assert ckpt.save(1, _state()).step == 1
    finally:
        ckptd.stats.remove_sink(broken)
    assert any("sink down" in r.getMessage() and r.name.startswith("ckptd") for r in caplog.records)


def test_recorder_is_thread_safe():
    import threading

    recorder = StatsRecorder()
    record = SaveStats(step=1, path="p", ok=True, bytes_written=10, retries=1, timings={"write": 0.5})

    def many() -> None:
        for _ in range(500):
            recorder.record(record)

    threads = [threading.Thread(target=many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary = recorder.summary()
    assert summary.saves_completed == 2000
    assert summary.bytes_written == 20000
    assert summary.retries == 2000
    assert summary.phases["write"].count == 2000
    assert summary.throughput == pytest.approx(20.0)


def test_s3_retries_are_counted(s3, proxy):
    is_part = lambda m, p: m == "PUT" and "partNumber=" in p  # noqa: E731
    is_manifest = lambda m, p: m == "PUT" and "checkpoint_manifest" in p  # noqa: E731
    state = {"model": {"w": torch.randn(2 * 1024 * 1024)}}  # 8 MiB: a multipart upload of 5 MiB parts
    with ckptd.Checkpointer(s3.url(), storage_options=s3.options(proxy.url), part_size="5MiB") as ckpt:
        clean = ckpt.save(1, state)
        proxy.inject("503", 1, is_part)  # in the writer process
        proxy.inject("503", 1, is_manifest)  # in this process, at the commit
        retried = ckpt.save(2, state)
        summary = ckpt.stats()
    assert clean.retries == 0
    assert retried.retries == 2
    assert summary.retries == 2
    assert summary.saves_completed == 2
    assert sorted(kind for kind, _, _ in proxy.injected) == ["503", "503"]
