"""The import graph runs one way: every import of a ckptd module points to the same or a lower
layer, and module-level imports form no cycle (function-level imports count for the layers too)."""

from __future__ import annotations

import ast
import pathlib

import ckptd

PACKAGE = pathlib.Path(ckptd.__file__).parent

# Lowest first.  A module may import modules of its own layer or below, never above.
LAYERS: list[tuple[str, ...]] = [
    ("ckptd.errors", "ckptd._version", "ckptd._crc32c"),
    ("ckptd.storage",),
    ("ckptd.options", "ckptd.request", "ckptd.stats"),
    ("ckptd.formats", "ckptd.dist", "ckptd.writer"),
    ("ckptd.catalog", "ckptd.retention", "ckptd.garbage"),
    ("ckptd.save", "ckptd.load", "ckptd.tiers"),
    ("ckptd.checkpointer", "ckptd.rng"),
    (
        "ckptd.compat",
        "ckptd.tools",
        "ckptd.cli",
        "ckptd.manager",
        "ckptd.replicas",
        "ckptd.integrations",
        "ckptd.__main__",
    ),
]


def _layer(module: str) -> int:
    for number, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return number
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(imported ckptd module, imported at module level) for every import in ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name == "ckptd" or name.startswith("ckptd."):
                found.append((name, id(node) in top_level))
    return found


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_no_import_points_to_a_higher_layer() -> None:
    upward = []
    for module, path in _modules().items():
        if module == "ckptd":
            continue  # the lazy public namespace: it names everything, imports nothing eagerly
        for target, _ in _imports(path):
            if target != "ckptd" and _layer(target) > _layer(module):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_module_level_imports_form_no_cycle() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        for target, top in _imports(path):
            if not top:
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]  # `from pkg import name` names a module or a member
            if target != module and target != "ckptd":
                edges.add(target)
        graph[module] = edges
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, trail: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle.extend([*trail, node, nxt])
                return True
            if nxt not in state and visit(nxt, [*trail, node]):
                return True
        state[node] = 2
        return False

    for start in sorted(graph):
        if start not in state and visit(start, []):
            break
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_layers_check_can_fail() -> None:
    """The checker itself: an import from errors up to the checkpointer is reported as upward."""
    assert _layer("ckptd.checkpointer") > _layer("ckptd.errors")
    assert _layer("ckptd.save.saver") > _layer("ckptd.writer.client")


def test_no_module_is_over_450_lines_without_a_reason() -> None:
    long = []
    for module, path in _modules().items():
        lines = path.read_text().splitlines()
        docstring = ast.get_docstring(ast.parse("\n".join(lines))) or ""
        if len(lines) > 450 and "longer than" not in docstring:
            long.append(f"{module}: {len(lines)} lines")
    assert not long, "modules over ~450 lines need a split or a reason in their docstring:\n" + "\n".join(long)
