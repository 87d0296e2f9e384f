"""Save statistics: a :class:`SaveStats` record per finished save, summaries, and two sinks.

Every :class:`~ckptd.Checkpointer` owns a :class:`StatsRecorder` (read with
``checkpointer.stats()``); each record also goes to this process's recorder, read with
:func:`summary` (also ``ckptd.save_stats()``), which keeps counting after a Checkpointer is
closed, so its totals only grow (what Prometheus counters need).

Sinks:

* :func:`prometheus_text` renders the process totals in the Prometheus text exposition format;
  :func:`serve_prometheus` serves it at ``/metrics`` from a daemon thread (stdlib ``http.server``,
  no dependency).
* :func:`add_jsonl_sink` appends one JSON object per finished save to a file;
  :func:`add_sink` calls any function with each :class:`SaveStats`.

Torch-free; imports nothing from the save path.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .request import SaveResult

__all__ = [
    "PHASES",
    "PhaseStats",
    "SaveStats",
    "StatsRecorder",
    "StatsSummary",
    "add_jsonl_sink",
    "add_sink",
    "new_recorder",
    "prometheus_text",
    "remove_sink",
    "save_stats",
    "serve_prometheus",
    "summary",
]

logger = logging.getLogger(__name__)

PHASES = ("plan", "wait", "stage", "blocking", "write", "commit", "total")
"""The timed phases of a save, in order (``blocking``: the part ``async_save`` blocked the
caller, plan + wait + stage; ``total``: from ``async_save`` to the commit)."""

_RECENT = 100  # records kept per recorder for ``summary().recent``


@dataclass(frozen=True)
class SaveStats:
    """One finished save (committed, or failed with ``error``)."""

    step: int | None
    path: str
    ok: bool
    bytes_written: int = 0
    bytes_reused: int = 0
    retries: int = 0
    timings: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None
    root: str = ""
    rank: int = 0
    finished_at: float = 0.0  # Unix time

    @property
    def throughput(self) -> float:
        """Bytes written per second of the ``write`` phase (0.0 when nothing was timed)."""
        seconds = self.timings.get("write", 0.0)
        return self.bytes_written / seconds if seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``throughput`` included)."""
        record = asdict(self)
        record["timings"] = dict(self.timings)
        record["throughput"] = self.throughput
        return record

    @classmethod
    def of_result(cls, result: SaveResult, *, root: str = "", rank: int = 0) -> SaveStats:
        """The record of a committed save."""
        return cls(
            step=result.step,
            path=result.path,
            ok=True,
            bytes_written=result.bytes_written,
            bytes_reused=result.bytes_reused,
            retries=result.retries,
            timings=dict(result.timings),
            root=root,
            rank=rank,
            finished_at=time.time(),
        )


@dataclass(frozen=True)
class PhaseStats:
    """One phase over the committed saves: how many were timed, total, mean, max and last (s)."""

    count: int
    total: float
    max: float
    last: float

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass(frozen=True)
class StatsSummary:
    """Totals over many saves.  ``throughput`` is the bytes written per second of write phase
    over all committed saves; ``phases`` covers committed saves only."""

    saves_completed: int = 0
    saves_failed: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    retries: int = 0
    write_seconds: float = 0.0
    phases: Mapping[str, PhaseStats] = field(default_factory=dict)
    last: SaveStats | None = None
    recent: tuple[SaveStats, ...] = ()

    @property
    def throughput(self) -> float:
        return self.bytes_written / self.write_seconds if self.write_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``recent`` left out)."""
        return {
            "saves_completed": self.saves_completed,
            "saves_failed": self.saves_failed,
            "bytes_written": self.bytes_written,
            "bytes_reused": self.bytes_reused,
            "retries": self.retries,
            "write_seconds": self.write_seconds,
            "throughput": self.throughput,
            "phases": {name: {**asdict(p), "mean": p.mean} for name, p in self.phases.items()},
            "last": self.last.as_dict() if self.last else None,
        }


class StatsRecorder:
    """Thread-safe totals of the saves recorded into it, and its most recent records."""

    def __init__(self, root: str = "", rank: int = 0, forward_to: StatsRecorder | None = None) -> None:
        self.root = root
        self.rank = rank
        self._lock = threading.Lock()
        self._forward = forward_to
        self._completed = 0
        self._failed = 0
        self._bytes_written = 0
        self._bytes_reused = 0
        self._retries = 0
        self._write_seconds = 0.0
        self._phases: dict[str, list[float]] = {}  # name -> [count, total, max, last]
        self._recent: collections.deque[SaveStats] = collections.deque(maxlen=_RECENT)

    def record(self, stats: SaveStats) -> None:
        """Count one finished save (and pass it on to the process recorder and the sinks)."""
        with self._lock:
            self._recent.append(stats)
            self._retries += stats.retries
            if not stats.ok:
                self._failed += 1
            else:
                self._completed += 1
                self._bytes_written += stats.bytes_written
                self._bytes_reused += stats.bytes_reused
                self._write_seconds += stats.timings.get("write", 0.0)
                for name, seconds in stats.timings.items():
                    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
                        continue
                    entry = self._phases.setdefault(name, [0, 0.0, 0.0, 0.0])
                    entry[0] += 1
                    entry[1] += seconds
                    entry[2] = max(entry[2], seconds)
                    entry[3] = seconds
        if self._forward is not None:
            self._forward.record(stats)
            _emit(stats)

    def record_result(self, result: SaveResult) -> SaveStats:
        """Record a committed save; returns its record."""
        stats = SaveStats.of_result(result, root=self.root, rank=self.rank)
        self.record(stats)
        logger.info(
            "saved step %s to %s on rank %d: %d bytes written in %.2fs (%.0f B/s), %d retries",
            result.step,
            result.path,
            self.rank,
            result.bytes_written,
            result.timings.get("total", 0.0),
            result.throughput,
            result.retries,
        )
        return stats

    def record_failure(
        self,
        step: int | None,
        path: str,
        error: BaseException,
        *,
        timings: Mapping[str, float] | None = None,
        retries: int = 0,
    ) -> SaveStats:
        """Record a failed save; returns its record."""
        stats = SaveStats(
            step=step,
            path=path,
            ok=False,
            retries=retries,
            timings=dict(timings or {}),
            error=f"{type(error).__name__}: {error}",
            root=self.root,
            rank=self.rank,
            finished_at=time.time(),
        )
        self.record(stats)
        return stats

    def summary(self) -> StatsSummary:
        """The totals so far."""
        with self._lock:
            return StatsSummary(
                saves_completed=self._completed,
                saves_failed=self._failed,
                bytes_written=self._bytes_written,
                bytes_reused=self._bytes_reused,
                retries=self._retries,
                write_seconds=self._write_seconds,
                phases={name: PhaseStats(int(e[0]), e[1], e[2], e[3]) for name, e in self._phases.items()},
                last=self._recent[-1] if self._recent else None,
                recent=tuple(self._recent),
            )


_PROCESS = StatsRecorder()
_sinks: list[Callable[[SaveStats], Any]] = []
_sinks_lock = threading.Lock()


def new_recorder(root: str = "", rank: int = 0) -> StatsRecorder:
    """A recorder for one Checkpointer: its records also count in the process totals and go to
    the sinks."""
    return StatsRecorder(root, rank, forward_to=_PROCESS)


def summary() -> StatsSummary:
    """Totals over every save finished in this process (by any Checkpointer, open or closed)."""
    return _PROCESS.summary()


save_stats = summary  # exported as ``ckptd.save_stats()``


def add_sink(sink: Callable[[SaveStats], Any]) -> Callable[[SaveStats], Any]:
    """Call ``sink(stats)`` for every save finished in this process from now on (on the
    Checkpointer's completion thread: keep it quick).  Its errors are logged, not raised."""
    with _sinks_lock:
        _sinks.append(sink)
    return sink


def remove_sink(sink: Callable[[SaveStats], Any]) -> None:
    """Stop calling a sink added by :func:`add_sink` or :func:`add_jsonl_sink`."""
    with _sinks_lock:
        if sink in _sinks:
            _sinks.remove(sink)


class _JsonLines:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def __call__(self, stats: SaveStats) -> None:
        line = json.dumps(stats.as_dict(), separators=(",", ":"), sort_keys=True) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as out:
            out.write(line)

    def __repr__(self) -> str:
        return f"<jsonl sink {self.path!r}>"


def add_jsonl_sink(path: str | os.PathLike[str]) -> Callable[[SaveStats], Any]:
    """Append one JSON object per finished save (``SaveStats.as_dict()``) to the file at ``path``
    (created if needed); returns the sink, for :func:`remove_sink`."""
    location = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(location), exist_ok=True)
    return add_sink(_JsonLines(location))


def _emit(stats: SaveStats) -> None:
    with _sinks_lock:
        sinks = list(_sinks)
    for sink in sinks:
        try:
            sink(stats)
        except Exception as e:  # noqa: BLE001 - a broken sink must not fail the save
            logger.warning("ckptd stats sink %r failed for step %s: %s", sink, stats.step, e)


# ---- Prometheus ------------------------------------------------------------------------------


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def prometheus_text(stats: StatsSummary | None = None) -> str:
    """The process totals (or ``stats``) in the Prometheus text exposition format (0.0.4)."""
    s = stats if stats is not None else summary()
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

    metric(
        "ckptd_saves_total",
        "counter",
        "Saves finished, by outcome.",
        [('{outcome="completed"}', s.saves_completed), ('{outcome="failed"}', s.saves_failed)],
    )
    metric("ckptd_bytes_written_total", "counter", "Bytes written by committed saves.", [("", s.bytes_written)])
    metric(
        "ckptd_bytes_reused_total",
        "counter",
        "Bytes incremental saves linked or copied from the previous checkpoint instead of writing them.",
        [("", s.bytes_reused)],
    )
    metric("ckptd_storage_retries_total", "counter", "Object-store requests retried by saves.", [("", s.retries)])
    phase_samples: list[tuple[str, float]] = []
    for name in [*PHASES, *sorted(set(s.phases) - set(PHASES))]:
        phase = s.phases.get(name)
        if phase is not None:
            phase_samples.append((f'_sum{{phase="{name}"}}', phase.total))
            phase_samples.append((f'_count{{phase="{name}"}}', phase.count))
    lines.append("# HELP ckptd_save_phase_seconds Time spent in each phase of committed saves.")
    lines.append("# TYPE ckptd_save_phase_seconds summary")
    lines.extend(f"ckptd_save_phase_seconds{labels} {_number(value)}" for labels, value in phase_samples)
    metric(
        "ckptd_write_throughput_bytes_per_second",
        "gauge",
        "Bytes written per second of write phase, over all committed saves.",
        [("", s.throughput)],
    )
    if s.last is not None:
        last = s.last
        metric("ckptd_last_save_step", "gauge", "Step of the last finished save.", [("", last.step or 0)])
        metric("ckptd_last_save_success", "gauge", "1 if the last finished save committed.", [("", int(last.ok))])
        metric(
            "ckptd_last_save_timestamp_seconds",
            "gauge",
            "When the last save finished (Unix time).",
            [("", last.finished_at)],
        )
        metric(
            "ckptd_last_save_seconds",
            "gauge",
            "Phase times of the last finished save.",
            [(f'{{phase="{k}"}}', v) for k, v in last.timings.items()],
        )
    return "\n".join(lines) + "\n"


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/", "/metrics"):
            self.send_error(404, "ckptd serves /metrics")
            return
        body = prometheus_text().encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics request from %s: " + format, self.client_address[0], *args)


def serve_prometheus(port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve :func:`prometheus_text` at ``http://host:port/metrics`` from a daemon thread.

    ``port=0`` picks a free port (read it from ``server.server_address``); stop with
    ``server.shutdown()``.  The default ``host`` keeps the endpoint on loopback: pass
    ``"0.0.0.0"`` for a scraper on another machine.
    """
    server = ThreadingHTTPServer((host, port), _MetricsHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="ckptd-metrics", daemon=True)
    thread.start()
    logger.info("ckptd metrics at http://%s:%d/metrics", *server.server_address[:2])
    return server
