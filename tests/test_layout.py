"""The package's layout, read from its source with `ast`: imports go down the layers that
`docs/design.md` draws and never sideways across the periphery, no module imports itself back
through others (no cycles), nothing imports the package root, and functions stay short.

These are facts about the source, not the behaviour, kept true by a test so that they stay true.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "multidecode"

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def design_layers() -> tuple[list[tuple[str, set[str]]], set[str]]:
    """The layer table of docs/design.md's "Layout" (bottom to top): [(layer, its module groups)],
    and the layers below its "periphery" rule. A group is a module or package name as the table
    writes it ("engine.py" -> "engine", "models/" -> "models"; the package's "__init__.py" -> "")."""
    text = DESIGN.read_text(encoding="utf-8").split("## Layout", 1)[1]
    table = text.split("```", 2)[1].strip().splitlines()[2:]  # after the header and its rule
    layers, periphery, below_rule = [], set(), False
    for line in table:
        if line.startswith("----"):
            below_rule = True
            continue
        name, modules = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        groups = {token.strip("(),").removesuffix(".py").removesuffix("/")
                  for token in modules.split() if token.strip("(),").endswith((".py", "/"))}
        layers.append((name, {"" if g == "__init__" else g for g in groups}))
        if below_rule:
            periphery.add(name)
    return layers, periphery


LAYERS, PERIPHERY = design_layers()
"""Bottom to top. A module imports from its own layer or below; "" is the package root. Layers
below the table's periphery rule never import each other's groups sideways."""

LONG_FUNCTIONS: dict[str, str] = {}
"""Functions allowed over `MAX_FUNCTION_LINES`, by "module:function", with the reason."""

MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    """Dotted name below the package ("" for the root, "models.vetting", ...) -> file."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def imports_of(name: str) -> set[str]:
    """The package modules `name` imports anywhere in its file (functions and TYPE_CHECKING too)."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [p for p in package if p]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "multidecode":
                target = node.module.removeprefix("multidecode").removeprefix(".")
            else:
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}" if target else alias.name
                found.add(child if child in MODULES else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "multidecode":
                    found.add(alias.name.removeprefix("multidecode").removeprefix("."))
    found.discard(name)
    return found


def group(name: str) -> str:
    return name.split(".")[0]


def layer(name: str) -> int:
    for index, (_, groups) in enumerate(LAYERS):
        if group(name) in groups:
            return index
    raise AssertionError(f"{name} is in no layer: add its group to the layer table of docs/design.md")


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_module_has_a_layer():
    for name in MODULES:
        layer(name)


def test_imports_go_down_and_never_sideways_across_the_periphery():
    wrong = []
    for name, targets in GRAPH.items():
        for target in targets:
            if layer(target) > layer(name):
                wrong.append(f"{name} imports {target} from a layer above ({LAYERS[layer(target)][0]})")
            elif (layer(target) == layer(name) and LAYERS[layer(name)][0] in PERIPHERY
                  and group(target) != group(name)):
                wrong.append(f"{name} imports {target} sideways")
    assert not wrong, "\n".join(sorted(wrong))


def test_nothing_imports_the_package_root():
    assert sorted(name for name, targets in GRAPH.items() if "" in targets) == []


def test_there_are_no_import_cycles():
    """Tarjan's strongly connected components over every import: each must be one module."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert not cycles, cycles


def function_lengths() -> dict[str, int]:
    """"module:function" (nested ones "module:outer.inner") -> lines, from `def` to its end."""
    lengths = {}

    def walk(node, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{module}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                walk(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, module, f"{prefix}{child.name}.")
            else:
                walk(child, module, prefix)

    for name, path in MODULES.items():
        walk(ast.parse(path.read_text(encoding="utf-8")), name, "")
    return lengths


def test_functions_are_short():
    lengths = function_lengths()
    long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
    stale = [name for name in LONG_FUNCTIONS if lengths.get(name, 0) <= MAX_FUNCTION_LINES]
    assert not stale, f"no longer long (drop them from LONG_FUNCTIONS): {stale}"


@pytest.mark.parametrize("mutant, message", [
    ({"engine": {"api"}}, "from a layer above"),
    ({"batch.merged": {"serving.app"}}, "sideways"),
])
def test_the_layer_rules_can_fail(monkeypatch, mutant, message):
    for name, extra in mutant.items():
        monkeypatch.setitem(GRAPH, name, GRAPH[name] | extra)
    with pytest.raises(AssertionError, match=message):
        test_imports_go_down_and_never_sideways_across_the_periphery()


def test_the_cycle_check_can_fail(monkeypatch):
    monkeypatch.setitem(GRAPH, "forest", GRAPH["forest"] | {"engine"})  # engine imports forest
    with pytest.raises(AssertionError, match="engine"):
        test_there_are_no_import_cycles()
