"""The parser, the global options and the error handling shared by every command.

Global options (``--json``, ``--quiet``, ``--debug``, ``--storage-options``) are accepted before
or after the subcommand.  A command returns a JSON-able result; ``--json`` prints it as one
document, otherwise the command's renderer prints text.  Any exception becomes one line on
stderr and an exit code (see :mod:`ckptd.cli.output` and ``docs/cli.md``); ``--debug`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from .._version import __version__
from .output import EXIT_BROKEN_PIPE, EXIT_OK, EXIT_USAGE, CliError, Failure, classify, print_json

__all__ = ["Context", "Result", "build_parser", "main", "non_negative_float", "non_negative_int", "positive_int"]

_GLOBAL_DEFAULTS: dict[str, Any] = {"json": False, "quiet": False, "debug": False, "storage_options": {}}


class Context:
    """What a command needs besides its arguments: output mode and storage options."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json = bool(args.json)
        self.quiet = bool(args.quiet)
        self.debug = bool(args.debug)
        self.storage_options: dict[str, Any] = dict(args.storage_options)

    @property
    def progress(self) -> bool:
        """Whether progress may be drawn: stderr is a terminal and neither --quiet nor --json."""
        return not self.quiet and not self.json and sys.stderr.isatty()

    def say(self, line: str) -> None:
        """A line of text output (suppressed by --json; --quiet keeps results, drops chatter)."""
        if not self.json:
            print(line, flush=True)

    def note(self, line: str) -> None:
        """A side remark on stderr (suppressed by --quiet and --json)."""
        if not self.quiet and not self.json:
            print(line, file=sys.stderr, flush=True)

    def warn(self, line: str) -> None:
        """A warning on stderr (kept with --quiet; in --json output warnings are part of the document)."""
        if not self.json:
            print(f"warning: {line}", file=sys.stderr, flush=True)


Result = tuple[dict[str, Any], Callable[[dict[str, Any], Context], None], int]
"""What a command returns: its JSON body, the function printing it as text, and the exit code."""


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (message + hint) with the usage exit code."""

    def error(self, message: str) -> NoReturn:
        raise CliError(message, EXIT_USAGE, f"see '{self.prog} --help'")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--storage-options is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--storage-options must be a JSON object")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = _number(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = _number(text, int, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = _number(text, float, "a number")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of 0 or more, got {text}")
    return value


def _number(text: str, kind: Callable[[str], Any], what: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def _global_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("global options (before or after the command)")
    group.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
    group.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress, no side remarks"
    )
    group.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and logs")
    group.add_argument(
        "--storage-options",
        type=_json_object,
        default=argparse.SUPPRESS,
        metavar="JSON",
        help='fsspec options for URLs, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    group.add_argument("--version", action="version", version=f"ckptd {__version__}")


def build_parser() -> argparse.ArgumentParser:
    """The ``ckptd`` parser with every subcommand."""
    from . import demo, describe, diff, memory, roots, transform

    parser = _Parser(
        prog="ckptd",
        description="Asynchronous, crash-safe PyTorch checkpoints. Exit codes: 0 ok, 1 other, 2 usage, "
        "3 not found, 4 corrupt, 5 storage, 6 conflict, 7 differs (diff), 141 output pipe closed (see "
        "docs/cli.md).",
    )
    _global_options(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_text, description=help_text)
        _global_options(command)
        return command

    demo.register(add)
    roots.register(add)
    describe.register(add)
    diff.register(add)
    transform.register(add)
    memory.register(add)
    return parser


@contextmanager
def _cli_logging(debug: bool, quiet: bool) -> Iterator[None]:
    """``ckptd`` log records on stderr for the length of a command (DEBUG with --debug, only
    errors with --quiet), then the logger as it was (``main`` may be called in-process)."""
    logger = logging.getLogger("ckptd")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.DEBUG if debug else logging.ERROR if quiet else logging.WARNING)
    logger.propagate = False
    try:
        yield
    finally:
        logger.handlers[:] = saved[0]
        logger.setLevel(saved[1])  # (setLevel also clears the loggers' cached levels)
        logger.propagate = saved[2]


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    """The subcommands' names."""
    return {
        name for action in parser._actions if isinstance(action, argparse._SubParsersAction) for name in action.choices
    }


def _guess_flags(argv: Sequence[str], commands: set[str]) -> tuple[str, bool, bool]:
    """Command name (``""`` when none is given yet), --json and --debug from raw arguments, for
    errors raised while parsing.  The command is the first argument that is no option and no
    option's value (``--storage-options '{bad json' ls R`` is ``ls``), if it names a command."""
    command = ""
    value_next = False
    for arg in argv:
        if value_next:
            value_next = False
        elif arg == "--":
            break
        elif arg.startswith("-"):
            value_next = arg == "--storage-options"  # the one global option that takes a value
        else:
            command = arg if arg in commands else ""
            break
    return command, "--json" in argv, "--debug" in argv


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ckptd`` console script and of ``python -m ckptd``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    command, as_json, debug = _guess_flags(argv, _commands(parser))
    try:
        args = parser.parse_args(argv)
        for name, default in _GLOBAL_DEFAULTS.items():
            if not hasattr(args, name):
                setattr(args, name, default)
        command, as_json, debug = args.command, args.json, args.debug
        context = Context(args)
        with _cli_logging(context.debug, context.quiet):
            result = args.func(args, context)
        if result is None:
            return EXIT_OK
        body, render, code = result
        if context.json:
            print_json(command, body)
        else:
            render(body, context)
        return int(code)
    except BrokenPipeError:
        return _broken_pipe()
    except SystemExit as e:  # --help / --version
        return int(e.code or 0) if isinstance(e.code, int) or e.code is None else EXIT_USAGE
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the one top-level handler: every error becomes one line
        failure = classify(e, command or "")
        try:
            _report(failure, command, as_json, e if debug else None)
        except BrokenPipeError:
            return _broken_pipe()
        return failure.code


def _broken_pipe() -> int:
    """stdout was closed early (``ckptd ls R | head -1``): stop quietly, as a Unix tool killed by
    SIGPIPE does.  What is still buffered goes to /dev/null, so the interpreter's last flush
    prints no "Exception ignored" message (the Python docs' recipe for SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no stdout file descriptor (in-process callers): nothing to flush
        pass
    return EXIT_BROKEN_PIPE


def _report(failure: Failure, command: str, as_json: bool, error: BaseException | None) -> None:
    if error is not None:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    print(failure.line(command), file=sys.stderr, flush=True)
    if as_json:
        body = {"schema": 1, "command": command, "ok": False, "error": failure.to_json()}
        print(json.dumps(body), flush=True)


if __name__ == "__main__":  # pragma: no cover - python -m ckptd.cli.app
    sys.exit(main())
