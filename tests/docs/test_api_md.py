"""docs/api.md agrees with the code: every name of ``ckptd.__all__`` is documented, every signature
api.md writes names real parameters, and every parameter of a documented callable is written.

api.md writes a callable as ``name(params)``: in inline code (`` `load(step="latest", ...)` ``,
tables included) and in its signature listings (python blocks marked not-run).  A name is found
by its receiver (``ckptd.``, ``reader.``, ``st.``, ``request.``...) or, bare, in the namespaces of
the section it appears in.  Items are read as api.md writes them: ``name``, ``name=default``,
``*``, ``*args``, ``**kw`` and ``...`` (more parameters, written elsewhere); an item that is an
expression (``"runs/x"``) makes the mention an example call, whose keywords are still checked.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import pytest
from markdown_blocks import REPO, parse_file

import ckptd

API_MD = REPO / "docs" / "api.md"

# Calls api.md writes that are not ckptd's (builtins, torch, logging, Megatron's own entry points,
# the user's callbacks): their parameters are not ckptd's to check.
FOREIGN = frozenset(
    {
        "asyncio.run",
        "dist_checkpointing.save",
        "logging.getLogger",
        "main",  # the coroutine the asyncio example defines
        "optimizer.step",
        "owned_keys",
        "progress",
        "server.shutdown",
        "sink",
        "slice",
        "torch.load",
        "train_step",  # the training step of the peer-replicas example
    }
)

# Classes of ckptd.__all__ that users get from ckptd rather than build: their constructor is not API.
NOT_BUILT_BY_USERS = {
    "CheckpointInfo": "returned by Checkpointer.checkpoints()",
    "CheckpointReader": "built by CheckpointReader.open()",
    "SaveRequest": "returned by Checkpointer.async_save()",
    "Sharing": "a namespace of constants (Sharing.PER_RANK...)",
}

# Parameters the code has and api.md leaves out on purpose, with the reason.  Each one is a
# question for the code (make it private, or document it), not a licence to skip the docs.
UNDOCUMENTED = {
    (
        "CheckpointReader.open",
        "tuning",
    ): "CheckpointReader.open(tuning=...) takes ckptd.storage.base.StorageTuning, which "
    "ckptd does not export: the Checkpointer passes its own storage settings",
}

_RECEIVERS = {
    "ckpt": "Checkpointer",
    "checkpointer": "Checkpointer",
    "manager": "CheckpointManager",
    "options": "CheckpointerOptions",
    "reader": "CheckpointReader",
    "request": "SaveRequest",
    "st": "ShardedTensor",
    "snapshots": "PeerSnapshots",
    "disk": "Checkpointer",
    "fallback": "Checkpointer",
}

# Bare names are looked up in the namespaces of their section first, then in all of these.
_NAMESPACES = {
    "Checkpointer": ["ckptd.Checkpointer", "ckptd.CheckpointerOptions"],
    "CheckpointManager": ["ckptd.CheckpointManager", "ckptd.CheckpointPolicy"],
    "SaveRequest": ["ckptd.SaveRequest", "ckptd.SaveResult"],
    "Observability": ["ckptd.stats", "ckptd.stats.StatsSummary", "ckptd.stats.SaveStats"],
    "Sharded tensors": ["ckptd", "ckptd.ShardedTensor", "ckptd.dist.sharding", "ckptd.tools.convert"],
    "Seed-compatible": ["ckptd.compat.forgather", "ckptd.compat.modelopt", "ckptd.compat.megatron"],
    "throttle": ["ckptd.Checkpointer", "ckptd.SaveRequest"],
}
_EVERYWHERE = [
    "ckptd",
    "ckptd.Checkpointer",
    "ckptd.SaveRequest",
    "ckptd.stats",
    "ckptd.compat.forgather",
    "ckptd.compat.modelopt",
    "ckptd.compat.megatron",
]


@dataclasses.dataclass(frozen=True)
class Mention:
    name: str  # as written: "reader.read", "async_save"
    items: tuple[str, ...]
    line: int
    section: str

    @property
    def where(self) -> str:
        return f"docs/api.md:{self.line} `{self.name}(...)`"

    @property
    def is_signature(self) -> bool:
        return all(_kind(item)[0] != "expr" for item in self.items)


def _kind(item: str) -> tuple[str, str]:
    """("name" | "keyword" | "star" | "slash" | "varargs" | "varkw" | "more" | "expr", name)."""
    if item == "...":
        return "more", ""
    if item == "*":
        return "star", ""
    if item == "/":
        return "slash", ""
    if m := re.fullmatch(r"\*\*(\w+)", item):
        return "varkw", m[1]
    if re.fullmatch(r"\*(\w+|\(.*\))", item, flags=re.S):
        return "varargs", ""
    if re.fullmatch(r"\w+", item) and not item[0].isdigit():
        return "name", item
    if m := re.fullmatch(r"(\w+)\s*=\s*(.+)", item, flags=re.S):
        return "keyword", m[1]
    return "expr", ""


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start`` (strings skipped), or -1."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _split(args: str) -> tuple[str, ...]:
    items, depth, current, quote = [], 0, [], ""
    for c in args:
        if quote:
            current.append(c)
            if c == quote:
                quote = ""
            continue
        if c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
            continue
        current.append(c)
    if "".join(current).strip():
        items.append("".join(current).strip())
    return tuple(" ".join(item.split()) for item in items)


_CALL = re.compile(r"(?<![\w.])([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*)\(")


def _calls(code: str, first_line: int, section: str) -> Iterator[Mention]:
    for m in _CALL.finditer(code):
        end = _closing(code, m.end() - 1)
        if end < 0:
            continue
        line = first_line + code.count("\n", 0, m.start())
        yield Mention(m[1], _split(code[m.end() : end]), line, section)


def _sections(lines: list[str]) -> list[str]:
    section, out = "", []
    for line in lines:
        if line.startswith("## "):
            section = line[3:].strip()
        out.append(section)
    return out


def mentions() -> list[Mention]:
    """Every ``name(...)`` in api.md's inline code and python blocks."""
    text = API_MD.read_text(encoding="utf-8")
    lines = text.split("\n")
    section_of = _sections(lines)
    found = []
    masked = list(lines)
    for block in parse_file(API_MD):
        end = block.lines[-1][0] + 1 if block.lines else block.line + 1
        for number in range(block.line, end + 1):
            masked[number - 1] = ""
        if block.lang == "python":
            code = "\n".join(re.sub(r"#.*$", "", t) for _, t in block.lines)
            found.extend(_calls(code, block.lines[0][0], section_of[block.line - 1]))
    prose = "\n".join(masked)
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        line = prose.count("\n", 0, span.start(1)) + 1
        found.extend(_calls(span[1], line, section_of[line - 1]))
    return found


def _lookup(path: str) -> Any:
    parts = path.split(".")
    value: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            value = getattr(value, part)
        except AttributeError:
            value = importlib.import_module(".".join(parts[: i + 1]))
    return value


def resolve(mention: Mention) -> Any:
    """The object ``mention`` names, or None."""
    head, _, rest = mention.name.partition(".")
    candidates = []
    if head == "ckptd":
        candidates.append(mention.name)
    elif head in _RECEIVERS and rest:
        candidates.append(f"ckptd.{_RECEIVERS[head]}.{rest}")
    else:
        preferred = [ns for key, spaces in _NAMESPACES.items() if key in mention.section for ns in spaces]
        candidates.extend(f"{ns}.{mention.name}" for ns in [*preferred, *_EVERYWHERE])
    for candidate in candidates:
        try:
            found = _lookup(candidate)
        except (AttributeError, ImportError):
            continue
        if not inspect.ismodule(found):
            return found
    return None


def parameters(obj: Any) -> list[inspect.Parameter]:
    signature = inspect.signature(obj)
    params = list(signature.parameters.values())
    if params and params[0].name in ("self", "cls") and not inspect.isclass(obj):
        params = params[1:]
    return params


def _public(params: list[inspect.Parameter]) -> list[str]:
    named = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in params if p.kind not in named and not p.name.startswith("_")]


def _ckptd_callables() -> list[tuple[Mention, Any]]:
    pairs = []
    for mention in mentions():
        if mention.name in FOREIGN or hasattr(builtins, mention.name):
            continue
        pairs.append((mention, resolve(mention)))
    return pairs


def test_every_public_name_is_documented() -> None:
    text = API_MD.read_text(encoding="utf-8")
    code = " ".join(re.findall(r"`([^`]+)`", text)) + " ".join(b.code for b in parse_file(API_MD))
    missing = [name for name in ckptd.__all__ if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", code)]
    assert not missing, f"ckptd.__all__ names docs/api.md never writes (in code): {missing}"


def test_every_call_names_a_real_callable() -> None:
    unknown = [m.where for m, obj in _ckptd_callables() if obj is None]
    assert not unknown, (
        "docs/api.md writes calls that name nothing in ckptd (fix the name, or add a non-ckptd "
        f"call to FOREIGN in this test): {unknown}"
    )


def test_documented_parameters_exist() -> None:
    problems = []
    for mention, obj in _ckptd_callables():
        if obj is None or not callable(obj):
            continue
        try:
            params = parameters(obj)
        except (TypeError, ValueError):
            continue
        names = {p.name for p in params}
        kinds = {p.kind for p in params}
        takes_any_keyword = inspect.Parameter.VAR_KEYWORD in kinds
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        n_positional = 0
        for item in mention.items:
            kind, name = _kind(item)
            if kind == "keyword" and name not in names and not takes_any_keyword:
                problems.append(f"{mention.where}: no parameter {name!r}; the code has {sorted(names)}")
            elif kind == "name" and mention.is_signature and name not in names:
                problems.append(f"{mention.where}: no parameter {name!r}; the code has {sorted(names)}")
            elif kind == "varkw" and not takes_any_keyword:
                problems.append(f"{mention.where}: written with **{name}, the code takes no **kwargs")
            if kind in ("name", "expr"):
                n_positional += 1
        if n_positional > len(positional) and inspect.Parameter.VAR_POSITIONAL not in kinds:
            problems.append(f"{mention.where}: {n_positional} positional arguments, the code takes {len(positional)}")
    assert not problems, "\n".join(problems)


def _keyword_only_written_positionally(mention: Mention, params: list[inspect.Parameter]) -> list[str]:
    """Names a signature writes before its ``*`` that the code makes keyword-only (and the reverse)."""
    kinds = [_kind(item)[0] for item in mention.items]
    if not mention.is_signature or "more" in kinds or not ({"star", "name"} & set(kinds)):
        return []  # not a signature, or keywords alone (`load(components=["model"])`): sides unknown
    by_name = {p.name: p for p in params}
    after_star = False
    wrong = []
    for item in mention.items:
        kind, name = _kind(item)
        if kind in ("star", "varargs"):
            after_star = True
        if kind in ("name", "keyword") and name in by_name:
            keyword_only = by_name[name].kind == inspect.Parameter.KEYWORD_ONLY
            if keyword_only != after_star:
                wrong.append(name)
    return wrong


def test_signatures_keep_the_codes_keyword_only_marker() -> None:
    problems = []
    for mention, obj in _ckptd_callables():
        if obj is None or not callable(obj):
            continue
        wrong = _keyword_only_written_positionally(mention, parameters(obj))
        if wrong:
            problems.append(f"{mention.where}: {wrong} are on the wrong side of `*`")
    assert not problems, "\n".join(problems)


def _documented_callables() -> list[tuple[Any, list[Mention]]]:
    """Callables api.md writes with a signature at least once, with all their mentions."""
    by_object: dict[int, tuple[Any, list[Mention]]] = {}
    for mention, obj in _ckptd_callables():
        if obj is None or not callable(obj):
            continue
        by_object.setdefault(id(obj), (obj, []))[1].append(mention)
    return [(obj, found) for obj, found in by_object.values() if any(m.is_signature for m in found)]


def test_every_parameter_is_documented() -> None:
    """The other way round: a parameter the code has and api.md never writes for that callable."""
    problems = []
    for obj, found in _documented_callables():
        try:
            params = parameters(obj)
        except (TypeError, ValueError):
            continue
        written = {_kind(item)[1] for m in found for item in m.items}
        name = getattr(obj, "__qualname__", found[0].name)
        missing = [p for p in _public(params) if p not in written and (name, p) not in UNDOCUMENTED]
        if missing:
            problems.append(f"{found[0].where}: {name} also takes {missing}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", [n for n in ckptd.__all__ if callable(getattr(ckptd, n))])
def test_public_callables_have_a_signature_in_api_md(name: str) -> None:
    if name in NOT_BUILT_BY_USERS:
        pytest.skip(f"{name} is {NOT_BUILT_BY_USERS[name]}")
    obj = getattr(ckptd, name)
    documented = [m for m, o in _ckptd_callables() if o is obj and m.is_signature]
    assert documented, f"docs/api.md writes no signature for ckptd.{name}{inspect.signature(obj)}"


def test_options_fields_are_all_documented() -> None:
    """The CheckpointerOptions listing names every field, in the code's order."""
    listing = [m for m, o in _ckptd_callables() if o is ckptd.CheckpointerOptions and m.is_signature]
    assert listing, "docs/api.md lists no CheckpointerOptions(...) signature"
    fields = [f.name for f in dataclasses.fields(ckptd.CheckpointerOptions)]
    written = [_kind(item)[1] for item in max(listing, key=lambda m: len(m.items)).items]
    assert written == fields


def test_the_parser_finds_signatures() -> None:
    """A broken parser would find nothing and pass every test above."""
    names = {m.name for m in mentions()}
    assert {"ckptd.Checkpointer", "async_save", "load", "reader.read", "consolidate"} <= names


def test_every_error_is_in_the_table() -> None:
    text = API_MD.read_text(encoding="utf-8")
    table = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    missing = [name for name in ckptd.errors.__all__ if name not in table]
    assert not missing, f"ckptd.errors classes missing from api.md's error table: {missing}"
