"""What the command line prints: exit codes, one-line errors, JSON documents, sizes and progress.

Every command builds a JSON-able result; ``--json`` prints it as one document on stdout, otherwise
the command's text renderer prints it for people.  Errors are one line on stderr (the message and
a hint) and map to the exit codes documented in ``docs/cli.md``.
"""

from __future__ import annotations

import errno as errno_codes
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ForeignFilesError,
    HeldRootInUseError,
    KeyMismatchError,
    ReferencedCheckpointError,
    StorageError,
    UnsafeCheckpointError,
)

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CONFLICT",
    "EXIT_CORRUPT",
    "EXIT_DIFFERS",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_OTHER",
    "EXIT_STORAGE",
    "EXIT_USAGE",
    "JSON_SCHEMA_VERSION",
    "CliError",
    "Failure",
    "Progress",
    "classify",
    "human_size",
    "print_json",
]

EXIT_OK = 0
EXIT_OTHER = 1  # an unexpected error (a bug, or an error ckptd does not classify)
EXIT_USAGE = 2  # bad arguments or options (argparse uses 2 as well)
EXIT_NOT_FOUND = 3  # no such checkpoint, root, file or bucket
EXIT_CORRUPT = 4  # a checkpoint is damaged: bad manifest, missing file, CRC mismatch
EXIT_STORAGE = 5  # the store failed or refused: permission, credentials, network, full disk
EXIT_CONFLICT = 6  # the destination exists, or other checkpoints depend on what is to be removed
EXIT_DIFFERS = 7  # not an error: ``diff`` found the checkpoints different (or could not tell them equal)
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # stdout closed early (``ckptd ls R | head``): 128 + SIGPIPE, as other Unix tools

JSON_SCHEMA_VERSION = 1

_CODE_NAMES = {
    EXIT_OTHER: "other",
    EXIT_USAGE: "usage",
    EXIT_NOT_FOUND: "not_found",
    EXIT_CORRUPT: "corrupt",
    EXIT_STORAGE: "storage",
    EXIT_CONFLICT: "conflict",
    EXIT_DIFFERS: "differs",
    EXIT_INTERRUPTED: "interrupted",
    EXIT_BROKEN_PIPE: "broken_pipe",
}

_HINTS = {
    EXIT_OTHER: "rerun with --debug for the traceback",
    EXIT_USAGE: "see 'ckptd {command} --help'",
    EXIT_NOT_FOUND: "check the path or URL; 'ckptd ls ROOT' lists the committed checkpoints under a root",
    EXIT_CORRUPT: "this checkpoint is damaged: load an earlier step (see 'ckptd ls ROOT')",
    EXIT_STORAGE: (
        "check the URL, the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or "
        '--storage-options \'{"key": ..., "secret": ...}\') and the endpoint (--storage-options endpoint_url)'
    ),
    EXIT_CONFLICT: "pass --overwrite to replace it",
    EXIT_INTERRUPTED: "interrupted",
}


class CliError(Exception):
    """An error the command line raises itself, with its exit code and an optional hint."""

    def __init__(self, message: str, code: int = EXIT_USAGE, hint: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.hint = hint


@dataclass(frozen=True)
class Failure:
    """An exception turned into what the command line reports."""

    code: int
    message: str
    hint: str

    @property
    def name(self) -> str:
        return _CODE_NAMES.get(self.code, "other")

    def line(self, command: str) -> str:
        """The one line printed on stderr."""
        where = f"ckptd {command}" if command else "ckptd"
        return f"{where}: error: {self.message} (hint: {self.hint})"

    def to_json(self) -> dict[str, Any]:
        return {"code": self.name, "exit_code": self.code, "message": self.message, "hint": self.hint}


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def classify(error: BaseException, command: str) -> Failure:
    """The exit code, one-line message and hint for an exception."""
    hint: str | None = None
    if isinstance(error, CliError):
        code, hint = error.code, error.hint
    elif isinstance(error, KeyboardInterrupt):
        code = EXIT_INTERRUPTED
    elif isinstance(error, (CheckpointExistsError, ReferencedCheckpointError, HeldRootInUseError, FileExistsError)):
        code = EXIT_CONFLICT
        if isinstance(error, HeldRootInUseError):
            hint = "stop the trainer that uses it, or pass --force"
        elif isinstance(error, ReferencedCheckpointError):
            hint = "remove the checkpoints that reference it first, or consolidate them ('ckptd consolidate')"
        elif isinstance(error, ForeignFilesError):  # never replaced, --overwrite or not
            hint = "pick another destination, or remove what is there yourself"
    elif isinstance(error, (CheckpointNotFoundError, FileNotFoundError, NotADirectoryError)):
        code = EXIT_NOT_FOUND
    elif isinstance(error, (CorruptCheckpointError, UnsafeCheckpointError)):
        code = EXIT_CORRUPT
    elif isinstance(error, StorageError) and error.errno == errno_codes.ENOENT:
        code = EXIT_NOT_FOUND
        hint = "check the bucket name and the endpoint (--storage-options endpoint_url)"
    elif isinstance(error, (StorageError, OSError)) or _is_cloud_error(error):
        code = EXIT_STORAGE
    elif isinstance(error, (ConfigError, KeyMismatchError)):
        code = EXIT_USAGE
        if isinstance(error, KeyMismatchError):
            hint = "'ckptd info PATH' lists the components and keys"
    else:
        code = EXIT_OTHER
    message = _first_line(str(error)) if not isinstance(error, KeyboardInterrupt) else "interrupted"
    if isinstance(error, OSError) and error.strerror:  # not "[Errno 2] ...: 'path'"
        message = _first_line(error.strerror)
        if error.filename and str(error.filename) not in message:
            message = f"{error.filename}: {message}"
    if code == EXIT_OTHER or not message:
        message = f"{type(error).__name__}: {message}" if message else type(error).__name__
    if _is_cloud_error(error) and "credential" in message.lower():
        hint = "set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass --storage-options with key/secret"
    return Failure(code, message, (hint or _HINTS[code]).replace("{command}", command))


def _is_cloud_error(error: BaseException) -> bool:
    """Errors of the cloud SDKs under fsspec (botocore, google auth...), which are not OSErrors."""
    module = type(error).__module__ or ""
    return module.split(".", 1)[0] in ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp")


def print_json(command: str, body: dict[str, Any], stream: TextIO | None = None) -> None:
    """Print one JSON document: ``{"schema": 1, "command": ..., "ok": ..., **body}``."""
    document = {"schema": JSON_SCHEMA_VERSION, "command": command, "ok": True, **body}
    print(json.dumps(document, default=str), file=stream or sys.stdout, flush=True)


def human_size(nbytes: float) -> str:
    """``5.8 KB``, ``1.0 MiB``-style sizes (binary units, so they add up the way ``du`` shows)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - the loop returns


class Progress:
    """Progress on stderr: a tqdm bar when tqdm is installed, else a simple updating line.

    Shown only when stderr is a terminal and ``--quiet`` was not given (``enabled``).  ``total``
    may be ``None`` (only elapsed time and the running count are shown).
    """

    def __init__(self, label: str, total: int | None, *, enabled: bool, unit: str = "B") -> None:
        self.label = label
        self.total = total
        self.enabled = enabled
        self.count = 0
        self._bar: Any = None
        self._last = 0.0
        self._started = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(
                total=total, desc=label, unit=unit, unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False
            )

    def update(self, amount: int) -> None:
        self.count += amount
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(amount)
            return
        now = time.monotonic()
        if now - self._last >= 0.5:
            self._last = now
            self._line()

    def set(self, count: int) -> None:
        """Set the running count (for progress measured from outside)."""
        self.update(max(0, count - self.count))

    def _line(self) -> None:
        done = human_size(self.count)
        if self.total:
            text = f"{self.label}: {done} of {human_size(self.total)} ({100 * self.count / self.total:.0f}%)"
        else:
            text = f"{self.label}: {done}, {time.monotonic() - self._started:.0f} s"
        sys.stderr.write("\r" + text + " " * 8)
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\r" + " " * 79 + "\r")
            sys.stderr.flush()


@contextmanager
def polled(progress: Progress, measure: Callable[[], int], interval: float = 0.5) -> Iterator[Progress]:
    """Update ``progress`` from ``measure()`` on a background thread while the block runs."""
    if not progress.enabled:
        yield progress
        return
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(interval):
            try:
                progress.set(measure())
            except OSError:
                continue

    thread = threading.Thread(target=poll, name="ckptd-progress", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join()
        progress.close()
