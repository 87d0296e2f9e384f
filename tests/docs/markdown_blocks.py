"""The fenced code blocks of README.md and docs/*.md, and how each one is run.

The rules (README.md and docs/ follow them; ``tests/docs/test_doc_blocks.py`` runs every block):

- A block runs by its language: ``python`` (also ``py``) in a fresh interpreter (``sys.executable``);
  ``bash``, ``sh``, ``shell`` with ``bash -e``; ``console`` runs its ``$ `` lines with ``bash -e``
  (the other lines are output).  ``text``, ``json`` and the other output languages are not run.
  Every fence names a language, so that no command hides in an unlabelled block.
- Every block stands alone: it runs in an empty temporary working directory of its own, with the
  venv's ``bin`` first on ``PATH`` (``python``, ``ckptd``, ``pip`` are the venv's) and this
  checkout first on ``PYTHONPATH``.  Nothing carries over from an earlier block.
- HTML comments directly above a fence (no blank line between) are its markers, invisible on the
  rendered page:

  - ``<!-- not-run: REASON -->``: not run; the reason is required and becomes the skip reason
    (object-store credentials, cluster recipes, commands that install packages).
  - ``<!-- invisible-code-block: python`` (or ``bash``), code lines, then ``-->``: code run before
    the block, in the same interpreter or shell; it stands in for what the reader brings (a
    model, an optimizer, a checkpoint to read).  The name follows Sybil's invisible code blocks.
  - ``<!-- slow: REASON -->``: the test carries the ``slow`` marker.

- ``pip install`` never runs in a test (it would download): a block that runs it must be marked
  ``not-run``.  The README's install-and-test line is run by ``.ci/run`` from a fresh clone
  instead, and a test checks that ``.ci/run`` holds that line verbatim.

A block's code is laid out at its own line numbers in the script that runs it (blank lines
elsewhere), and the script is named after the Markdown file, so a traceback's ``File
"…/README.md", line 63`` points at line 63 of README.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "REPO",
    "Block",
    "BlockResult",
    "MarkerError",
    "doc_files",
    "parse_file",
    "run_block",
]

REPO = Path(__file__).resolve().parents[2]

PYTHON = frozenset({"python", "py", "python3"})
SHELL = frozenset({"bash", "sh", "shell", "console"})

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_PIP_INSTALL = re.compile(r"\bpip3?\b[^\n#]*\binstall\b")


class MarkerError(ValueError):
    """A marker comment above a fence is malformed (say which file and line)."""


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its code and its markers."""

    file: str  # relative to the repository, e.g. "docs/api.md"
    line: int  # 1-based line of the opening fence
    lang: str  # the info string's first word, lower case ("" if none)
    lines: tuple[tuple[int, str], ...]  # (line number, code) of the body, dedented to the fence
    setup: tuple[tuple[int, str], ...] = ()  # (line number, code) of an invisible code block above
    setup_lang: str = ""
    not_run: str | None = None
    slow: str | None = None

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def code(self) -> str:
        return "\n".join(text for _, text in self.lines)

    @property
    def runner(self) -> str | None:
        """``"python"``, ``"shell"`` or None (an output block)."""
        if self.lang in PYTHON:
            return "python"
        if self.lang in SHELL:
            return "shell"
        return None

    def script(self) -> str:
        """The code to run, each line at its line number in the Markdown file."""
        body = list(self.lines)
        if self.lang == "console":
            body = [(n, text[2:] if text.startswith("$ ") else "") for n, text in body]
        placed = [*self.setup, *body]
        last = placed[-1][0] if placed else 0
        out = [""] * last
        for number, text in placed:
            out[number - 1] = text
        return "\n".join(out) + "\n"

    def installs_packages(self) -> bool:
        return self.runner == "shell" and bool(_PIP_INSTALL.search(self.code))


def doc_files() -> list[Path]:
    """README.md and every docs/*.md, in a fixed order."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def parse_file(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with its markers; a malformed marker raises MarkerError."""
    name = path.relative_to(REPO).as_posix()
    text = path.read_text(encoding="utf-8").split("\n")
    blocks = []
    i = 0
    while i < len(text):
        opened = _FENCE.match(text[i])
        if opened is None:
            i += 1
            continue
        indent, fence = len(opened["indent"].expandtabs()), opened["fence"]
        lang = opened["info"].split()[0].lower() if opened["info"].split() else ""
        start = i
        body = []
        i += 1
        while i < len(text):
            closing = _FENCE.match(text[i])
            if (
                closing
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"]
            ):
                break
            body.append((i + 1, _dedent(text[i], indent)))
            i += 1
        else:
            raise MarkerError(f"{name}:{start + 1}: the fence opened here is never closed")
        i += 1
        blocks.append(_with_markers(name, start + 1, lang, tuple(body), text[:start]))
    return blocks


def _dedent(line: str, indent: int) -> str:
    expanded = line.expandtabs()
    cut = min(indent, len(expanded) - len(expanded.lstrip(" ")))
    return expanded[cut:]


def _with_markers(name: str, line: int, lang: str, body: tuple[tuple[int, str], ...], before: list[str]) -> Block:
    """Read the HTML comments that end on the lines directly above the fence."""
    not_run: str | None = None
    slow: str | None = None
    setup: tuple[tuple[int, str], ...] = ()
    setup_lang = ""
    end = len(before)  # 0-based index one past the comment's last line
    while end > 0 and before[end - 1].strip().endswith("-->"):
        first = end - 1
        while first >= 0 and "<!--" not in before[first]:
            first -= 1
        if first < 0:
            break
        where = f"{name}:{first + 1}"
        head = before[first].split("<!--", 1)[1]
        head = head.rsplit("-->", 1)[0] if first == end - 1 else head
        keyword, colon, value = (part.strip() for part in head.partition(":"))
        if keyword == "not-run":
            if not colon or not value:
                raise MarkerError(f"{where}: `<!-- not-run: REASON -->` needs a reason")
            not_run = value
        elif keyword == "slow":
            slow = value or "slow"
        elif keyword == "invisible-code-block":
            if value not in PYTHON | SHELL or first == end - 1:
                raise MarkerError(
                    f"{where}: write `<!-- invisible-code-block: python` (or bash), the code lines, then `-->`"
                )
            indent = len(before[first]) - len(before[first].lstrip())
            code = [_dedent(text, indent) for text in before[first + 1 : end - 1]]
            code.append(before[end - 1].rstrip()[: -len("-->")])
            dedented = textwrap.dedent("\n".join(code)).split("\n")
            setup = tuple((first + 2 + k, text) for k, text in enumerate(dedented) if text.strip())
            setup_lang = "python" if value in PYTHON else "shell"
        end = first
    block = Block(name, line, lang, body, setup, setup_lang, not_run, slow)
    if block.setup and block.setup_lang != block.runner:
        raise MarkerError(
            f"{block.id}: its invisible code block is {block.setup_lang}, the block is {lang or 'unlabelled'}"
        )
    return block


@dataclass(frozen=True)
class BlockResult:
    returncode: int
    output: str


def run_block(block: Block, workdir: Path, timeout: float = 240.0) -> BlockResult:
    """Run ``block`` in ``workdir`` (empty); its script is written beside it, not in it."""
    scripts = workdir.parent / f"{workdir.name}-script"
    scripts.mkdir()
    script = scripts / Path(block.file).name
    script.write_text(block.script(), encoding="utf-8")
    venv_bin = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_") or k == "CKPTD_TEST_SESSION"}
    env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env["VIRTUAL_ENV"] = os.path.dirname(venv_bin)
    command = [sys.executable, str(script)] if block.runner == "python" else ["bash", "-e", str(script)]
    try:
        done = subprocess.run(
            command,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        output = e.output.decode(errors="replace") if isinstance(e.output, bytes) else (e.output or "")
        return BlockResult(-1, f"{output}\n[timed out after {timeout:.0f} s]")
    return BlockResult(done.returncode, done.stdout)
