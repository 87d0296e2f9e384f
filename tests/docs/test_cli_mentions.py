"""Every ``ckptd COMMAND --option`` the README and docs/*.md write exists in the CLI's own parser.

Command lines are read from inline code and from shell and ``text`` blocks: after ``ckptd`` (or
``python -m ckptd``) and its global options, the first word must be a subcommand of
``ckptd.cli.app.build_parser()`` and every ``--option`` one of that subcommand's.  Placeholders
(``ROOT``, ``[--to hf|ckptd]``) are read as the synopsis writes them.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest
from markdown_blocks import REPO, doc_files, parse_file

from ckptd.cli.app import build_parser

_SEPARATORS = re.compile(r"&&|\|\||;| \| ")


def _invocations(text: str) -> Iterator[str]:
    """What follows ``ckptd`` in each command of ``text`` that starts with it."""
    text = text.replace("\\|", "|")  # a pipe escaped in a table cell
    for segment in _SEPARATORS.split(text.split(" #")[0]):
        words = segment.split()
        if words[:1] == ["$"]:
            words = words[1:]
        if words[:2] == ["python", "-m"]:
            words = words[2:]
        if len(words) > 1 and words[0] == "ckptd":
            yield " " + " ".join(words[1:])


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("build_parser() has no subcommands")


def _command_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line, text after `ckptd`) of every invocation in inline code and command blocks."""
    file = REPO / path
    lines = file.read_text(encoding="utf-8").split("\n")
    masked = list(lines)
    for block in parse_file(file):
        end = block.lines[-1][0] + 1 if block.lines else block.line + 1
        for number in range(block.line, end + 1):
            masked[number - 1] = ""
        if block.runner == "shell" or block.lang == "text":
            for number, text in block.lines:
                for rest in _invocations(text):
                    yield number, rest
    prose = "\n".join(masked)
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        line = prose.count("\n", 0, span.start(1)) + 1
        for rest in _invocations(span[1]):
            yield line, rest


def _check(words: list[str], commands: dict[str, argparse.ArgumentParser]) -> str | None:
    global_options = {"--json", "-q", "--quiet", "--debug", "--version", "--storage-options"}
    i = 0
    while i < len(words) and words[i].strip("[]").split("=")[0] in global_options:
        i += 2 if words[i].strip("[]") == "--storage-options" else 1
    if i >= len(words):
        return None
    command = words[i]
    if not re.fullmatch(r"[a-z][a-z-]*", command):
        return None  # a placeholder (COMMAND), or output such as `ckptd X.Y.Z`
    if command not in commands:
        return f"no command {command!r} (the parser has {sorted(commands)})"
    known = set(commands[command]._option_string_actions)
    for word in words[i + 1 :]:
        for part in word.strip("[]").split("|"):
            option = part.split("=")[0].rstrip(",.;:)]")
            if option.startswith("-") and len(option) > 1 and option not in known:
                return f"`ckptd {command}` has no option {option!r}"
    return None


@pytest.mark.parametrize("path", [p.relative_to(REPO).as_posix() for p in doc_files()])
def test_command_lines_match_the_parser(path: str) -> None:
    commands = _subcommands()
    problems = []
    for line, rest in _command_lines(path):
        problem = _check(rest.split(), commands)
        if problem:
            problems.append(f"{path}:{line}: `ckptd{rest}`: {problem}")
    assert not problems, "\n".join(problems)


def test_the_readme_names_every_command() -> None:
    """The README's command list covers the parser (a new command gets its line there)."""
    seen = {rest.split()[0] for _, rest in _command_lines("README.md") if rest.split()}
    missing = sorted(set(_subcommands()) - seen)
    assert not missing, f"README.md's command list lacks {missing}"
