"""docs/cli.md agrees with the command line: commands and options with the argument parser, exit
codes with ``ckptd.cli.output``, and the ``--json`` schemas with what the commands print."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_helpers import REPO, run_json

import ckptd
from ckptd.cli import output
from ckptd.cli.app import build_parser

CLI_MD = Path(REPO) / "docs" / "cli.md"
_GLOBAL_SECTION = "## Global options"
_FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def _text() -> str:
    return CLI_MD.read_text()


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _global_options() -> set[str]:
    return _options(build_parser()) - {"-h", "--help"}


def _command_rows() -> dict[str, str]:
    """The synopsis cell of each row of the command table: ``{"ls": "ls ROOT", ...}``."""
    rows = {}
    for line in _text().splitlines():
        match = re.match(r"^\| `([a-z-]+)([^`]*)` \|", line)
        if match:
            rows[match.group(1)] = match.group(1) + match.group(2)
    return rows


def _section(title: str) -> str:
    text = _text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def test_every_command_and_option_of_the_parser_is_in_the_command_table():
    rows = _command_rows()
    commands = _subcommands()
    assert sorted(rows) == sorted(commands), "commands in docs/cli.md's table != the parser's"
    for name, parser in commands.items():
        documented = set(_FLAG.findall(rows[name]))
        own = _options(parser) - _global_options() - {"-h", "--help"}
        assert own <= documented, f"{name}: options missing from docs/cli.md's table: {sorted(own - documented)}"
        assert documented <= own, f"{name}: docs/cli.md names options the parser lacks: {sorted(documented - own)}"


def test_every_global_option_is_documented():
    section = _section(_GLOBAL_SECTION)
    documented = set(_FLAG.findall(section))
    assert _global_options() <= documented, sorted(_global_options() - documented)


def test_every_option_the_page_mentions_exists():
    """Any ``--flag`` anywhere on the page is an option of some command or a global option."""
    known = _global_options().union(*(_options(p) for p in _subcommands().values()))
    mentioned = {flag for flag in re.findall(r"`[^`]*`", _text()) for flag in _FLAG.findall(flag)}
    mentioned = {flag for flag in mentioned if flag.startswith("--")}
    assert mentioned <= known, f"docs/cli.md mentions options no parser defines: {sorted(mentioned - known)}"


def test_exit_codes_match_the_constants():
    table = {}
    for line in _section("## Errors and exit codes").splitlines():
        match = re.match(r"^\| (\d+) \| `?([a-z_]+)`? \|", line)
        if match:
            table[int(match.group(1))] = match.group(2)
    constants = {value: name for name, value in vars(output).items() if name.startswith("EXIT_")}
    assert sorted(table) == sorted(constants), "exit codes in docs/cli.md != the EXIT_* constants"
    names = {output.EXIT_OK: "ok", **output._CODE_NAMES}
    assert table == names


def test_the_checker_sees_a_wrong_table():
    """The parsing above finds what it checks (so the tests cannot pass on an empty page)."""
    assert len(_command_rows()) >= 10
    assert "--keep-last" in _FLAG.findall(_command_rows()["demo"])
    assert "--allow-non-model" in _FLAG.findall(_command_rows()["export-hf"])


# ---- the --json schemas ------------------------------------------------------------------------


def _schema_block(command: str) -> str:
    """The schema documented for ``command``: the paragraph or ```json block after "`command`:"."""
    section = _section("## JSON output")
    match = re.search(rf"^`{re.escape(command)}`(?:, `[a-z-]+`)*:\s", section, re.M)
    assert match, f"no schema for {command} in docs/cli.md"
    rest = section[match.end() :].lstrip("\n")
    if rest.startswith("```json"):
        return rest[: rest.index("```", 3)]
    return rest.split("\n\n", 1)[0]


_FREE_FORM = {"metadata", "metrics", "timings", "dtypes"}  # keys chosen by the user or the data


def _fields(value: Any) -> set[str]:
    """Every key of a JSON document, nested objects and the objects in arrays included."""
    if isinstance(value, dict):
        return set(value).union(*(_fields(v) for k, v in value.items() if k not in _FREE_FORM))
    if isinstance(value, list):
        return set().union(*(_fields(v) for v in value))
    return set()


@pytest.fixture(scope="module")
def documented_run(tmp_path_factory):
    """A root with two checkpoints and a leftover of an interrupted save."""
    root = str(tmp_path_factory.mktemp("docs") / "runs")
    with ckptd.Checkpointer(root) as ckpt:
        model = torch.nn.Linear(4, 4)
        ckpt.save(1, {"model": model, "progress": {"step": 1}}, metrics={"loss": 1.0})
        with torch.no_grad():
            model.weight.add_(1)
        ckpt.save(2, {"model": model, "progress": {"step": 2}})
    leftover = os.path.join(root, ".checkpoint-000003.tmp-otherhost-1-abcd")
    os.makedirs(leftover)
    os.utime(leftover, (0, 0))
    return root


@pytest.mark.parametrize("command", ["ls", "info", "verify", "diff", "gc"])
def test_json_schemas_name_every_field_the_commands_print(documented_run, command):
    root = documented_run
    first, second = (os.path.join(root, f"checkpoint-{step}") for step in (1, 2))
    args = {"ls": [root], "info": [second], "verify": [second], "diff": [first, second], "gc": [root]}[command]
    document = run_json(command, *args)
    emitted = _fields({k: v for k, v in document.items() if not k.startswith("_")})
    if command == "ls":
        assert document["leftovers"] and "collectable" in emitted  # every leftover field is in the run
    if command == "diff":
        assert document["changed"]
    documented = set(re.findall(r'"([a-z_0-9]+)":', _schema_block(command)))
    missing = emitted - {"schema", "command", "ok"} - documented
    assert not missing, f"{command}: fields missing from docs/cli.md's schema: {sorted(missing)}"
