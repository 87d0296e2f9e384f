"""Every Python and shell block of README.md and docs/*.md runs (the rules: markdown_blocks.py).

One test per block, named by file and line (``test_block_runs[README.md:56]``); a block marked
``<!-- not-run: REASON -->`` is skipped with that reason, one marked ``<!-- slow: ... -->`` carries
the ``slow`` marker.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_blocks import REPO, Block, MarkerError, doc_files, parse_file, run_block

_OUTPUT_TAIL = 6000


def _blocks() -> list[Block]:
    found = []
    for path in doc_files():
        try:
            found.extend(parse_file(path))
        except MarkerError:
            continue  # test_markers_are_well_formed names it
    return found


def _runnable() -> list[object]:
    params = []
    for block in _blocks():
        if block.runner is None:
            continue
        marks: list[pytest.MarkDecorator] = []
        if block.not_run is not None:
            marks.append(pytest.mark.skip(reason=f"{block.id} not-run: {block.not_run}"))
        if block.slow is not None:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


@pytest.mark.parametrize("block", _runnable())
def test_block_runs(block: Block, tmp_path: Path) -> None:
    if block.installs_packages():
        pytest.fail(
            f"{block.id}: runs `pip install`, which would download in a test; mark it "
            "`<!-- not-run: REASON -->` (tests/docs/markdown_blocks.py has the rules)",
            pytrace=False,
        )
    workdir = tmp_path / "work"
    workdir.mkdir()
    result = run_block(block, workdir)
    if result.returncode != 0:
        output = result.output[-_OUTPUT_TAIL:]
        pytest.fail(
            f"{block.id}: the {block.lang} block exited with {result.returncode}:\n{output}",
            pytrace=False,
        )


def test_markers_are_well_formed() -> None:
    problems = []
    for path in doc_files():
        try:
            parse_file(path)
        except MarkerError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)


def test_every_fence_names_a_language() -> None:
    """An unlabelled fence would hide a command from the runner: say `text` for output."""
    unlabelled = [block.id for block in _blocks() if not block.lang]
    assert not unlabelled, f"fences without a language (use ```text for output, ```bash for commands): {unlabelled}"


def test_blocks_are_found() -> None:
    """The collector sees the README's blocks (a broken parser would run nothing and pass)."""
    readme = [block for block in _blocks() if block.file == "README.md"]
    assert any(block.runner == "python" and block.not_run is None for block in readme)
    assert any(block.runner == "shell" for block in readme)


def test_ci_runs_the_readme_test_command() -> None:
    """The README's install-and-test line is not run here (it installs and runs the whole suite):
    .ci/run runs it verbatim from a fresh clone, and this test keeps the two identical."""
    commands = [
        text.strip()
        for block in _blocks()
        if block.file == "README.md" and block.runner == "shell"
        for _, text in block.lines
        if "python -m pytest" in text and not text.lstrip().startswith("#")
    ]
    assert len(commands) == 1, f"expected one test command in README.md's shell blocks, found {commands}"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert commands[0] in ci, f".ci/run does not run the README's test command verbatim: {commands[0]!r}"
