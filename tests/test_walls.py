"""The walls between rooms: which room's code may import which (docs/architecture.md,
"Imports between rooms").

A small ast check rather than import-linter: no dependency, the exceptions sit by
name next to the rule, and it reads the files without importing the package (the
repository root is the package, which import-linter would need installed). Every
import statement counts, those inside functions (lazy imports) too, and so does
``importlib.import_module("splitinfer....")`` with a literal name.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"

#: room -> the other rooms its code may import
ALLOWED: dict[str, frozenset[str]] = {
    "shared": frozenset(),
    "serving": frozenset({"shared"}),
    "partitioner": frozenset({"shared"}),
    "edge": frozenset({"shared", "serving"}),
    "cloud": frozenset({"shared", "serving"}),
    "sim": frozenset({"shared", "edge", "cloud", "partitioner"}),
    "models": frozenset({"shared", "partitioner"}),
}

#: (file, room it imports) -> why the wall has a door there today. Each is a debt with
#: a named way out; test_every_exception_is_still_needed drops one once it is paid.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("edge/profile.py", "partitioner"): (
        "`edge-agent profile` measures with the partitioner's profiler (ONNX Runtime's "
        "profiler mapped back to graph nodes, fused kernels split by FLOPs), so the profile "
        "has the node names --edge-profile reads; the profile format itself is shared/"
    ),
    ("edge/emulate.py", "partitioner"): (
        "a built-in profile's roofline needs each segment node's FLOPs and bytes, which the "
        "partitioner's graph analysis gives; the profiles and the formula are shared/"
    ),
}

#: (module, module it imports inside a function) -> why that lazy import closes a cycle.
#: Each is a debt: split the modules along the idea, or pass the dependency in.
LAZY_CYCLES: dict[tuple[str, str], str] = {
    ("partitioner.cuts", "partitioner.cutsearch"): (
        "CutSpace.count calls the min-cut search's counter, which builds on CutSpace"
    ),
}


def imported_rooms(source: str, path: str = "<src>") -> list[tuple[int, str]]:
    """(line, room) for every ``splitinfer.<room>`` this module imports, anywhere in it.

    ``path`` (relative to the repository root) resolves relative imports.
    """
    package = ["splitinfer", *Path(path).parent.parts]
    found: list[tuple[int, str]] = []

    def note(line: int, dotted: str, names: list[str] | None = None) -> None:
        parts = dotted.split(".")
        if parts[0] != "splitinfer":
            return
        if len(parts) > 1:
            found.append((line, parts[1]))
        else:  # from splitinfer import edge, cloud
            found.extend((line, n) for n in names or [] if n in ALLOWED)

    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                note(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                dotted = ".".join(base + ([node.module] if node.module else []))
            else:
                dotted = node.module or ""
            note(node.lineno, dotted, [a.name for a in node.names])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Attribute, ast.Name))
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            note(node.lineno, node.args[0].value)
    return found


@functools.cache
def crossings() -> dict[tuple[str, str], list[int]]:
    """(file, room) -> lines, for every import of another room in the rooms' code."""
    out: dict[tuple[str, str], list[int]] = {}
    for room in ALLOWED:
        for file in sorted((ROOT / room).rglob("*.py")):
            rel = file.relative_to(ROOT).as_posix()
            for line, other in imported_rooms(file.read_text(encoding="utf-8"), rel):
                if other != room:
                    out.setdefault((rel, other), []).append(line)
    return out


def test_every_import_stays_inside_the_walls() -> None:
    bad = [
        f"{file}:{lines[0]} imports splitinfer.{other} ({file.split('/')[0]} may import "
        f"{', '.join(sorted(ALLOWED[file.split('/')[0]])) or 'nothing of ours'})"
        for (file, other), lines in sorted(crossings().items())
        if other not in ALLOWED.get(file.split("/")[0], frozenset())
        and (file, other) not in EXCEPTIONS
    ]
    assert not bad, "\n".join(bad)


def test_edge_and_cloud_never_import_each_other() -> None:
    # no exception may open this wall
    assert not [k for k in EXCEPTIONS if {k[0].split("/")[0], k[1]} == {"edge", "cloud"}]
    assert not [k for k in crossings() if {k[0].split("/")[0], k[1]} == {"edge", "cloud"}]


def test_every_exception_is_still_needed() -> None:
    stale = sorted(set(EXCEPTIONS) - set(crossings()))
    assert not stale, f"these imports are gone: drop their exceptions (and the doc rows): {stale}"


def test_every_room_is_on_the_map() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == set(ALLOWED), "a new room needs its line in ALLOWED and in the doc"


def test_the_checker_sees_lazy_relative_and_dynamic_imports() -> None:
    source = """
import numpy
import splitinfer.shared.errors
from splitinfer import edge, __version__
from . import costs
from ..cloud import engine

def later():
    from splitinfer.partitioner.profiles import builtin
    importlib.import_module("splitinfer.sim.link")
"""
    # ..cloud from edge/sub/ is splitinfer.edge.cloud; ...cloud is splitinfer.cloud
    assert sorted(imported_rooms(source, "edge/sub/x.py")) == [
        (3, "shared"),
        (4, "edge"),
        (5, "edge"),
        (6, "edge"),
        (9, "partitioner"),
        (10, "sim"),
    ]
    assert imported_rooms("from ...cloud import engine", "edge/sub/x.py") == [(1, "cloud")]


def module_imports(source: str, path: str) -> tuple[set[str], set[str]]:
    """(top-level, lazy) ``splitinfer.`` names a module imports; lazy: inside a function.

    ``from a import b`` counts as ``a`` and as ``a.b`` (``b`` may be a module); imports
    under ``if TYPE_CHECKING:`` do not run and do not count.
    """
    package = ["splitinfer", *Path(path).parent.parts]  # a module's and an __init__'s alike
    top: set[str] = set()
    lazy: set[str] = set()

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                names = [module, *(f"{module}.{a.name}" for a in child.names)]
            (lazy if inside else top).update(n for n in names if n.startswith("splitinfer."))
            visit(child, inside or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(source, path), False)
    return top, lazy


@functools.cache
def module_graph() -> dict[str, tuple[set[str], set[str]]]:
    """Module (``room.mod``) -> (top-level, lazy) modules of ours it imports."""
    files = {}
    for room in ALLOWED:
        for file in (ROOT / room).rglob("*.py"):
            rel = file.relative_to(ROOT)
            dotted = ".".join(rel.with_suffix("").parts)
            files[dotted.removesuffix(".__init__")] = rel.as_posix()
    graph = {}
    for name, rel in files.items():
        top, lazy = module_imports((ROOT / rel).read_text(encoding="utf-8"), rel)
        short = {n.removeprefix("splitinfer.") for n in top} & set(files)
        short_lazy = {n.removeprefix("splitinfer.") for n in lazy} & set(files)
        graph[name] = (short - {name}, short_lazy - short - {name})
    return graph


def lazy_cycles() -> set[tuple[str, str]]:
    """(module, lazily imported module) pairs where the latter imports the former back."""
    graph = module_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            here = todo.pop()
            if here == goal:
                return True
            if here not in seen:
                seen.add(here)
                todo.extend(graph[here][0] | graph[here][1])
        return False

    return {(m, dep) for m, (_, lazy) in graph.items() for dep in lazy if reaches(dep, m)}


def test_no_lazy_import_closes_a_cycle() -> None:
    new = sorted(lazy_cycles() - set(LAZY_CYCLES))
    assert not new, (
        "a function-level import that closes an import cycle (split the modules along "
        f"the idea, or pass the dependency in): {new}"
    )


def test_every_named_lazy_cycle_is_still_there() -> None:
    stale = sorted(set(LAZY_CYCLES) - lazy_cycles())
    assert not stale, f"these cycles are gone: drop them from LAZY_CYCLES: {stale}"


def test_the_cycle_check_sees_a_lazy_import_back() -> None:
    top, lazy = module_imports(
        "from splitinfer.cloud.moe import runtime\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from splitinfer.sim import agents\n"
        "def f():\n    from .config import X\n",
        "cloud/runtime.py",
    )
    assert top == {"splitinfer.cloud.moe", "splitinfer.cloud.moe.runtime"}
    assert lazy == {"splitinfer.cloud.config", "splitinfer.cloud.config.X"}


def _functions_importing(file: str, room: str) -> set[str]:
    """Names of the top-level functions of ``file`` that import ``splitinfer.<room>``."""
    tree = ast.parse((ROOT / file).read_text(encoding="utf-8"), file)
    out = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and any(
            r == room for _, r in imported_rooms(ast.unparse(fn), file)
        ):
            out.add(fn.name)
    return out


def test_the_edge_exceptions_are_one_function_each() -> None:
    # device and node profiles are shared/: loading a profile, emulating a measured one,
    # the profile format all come from there; what is left of each door is one function
    assert _functions_importing("edge/emulate.py", "partitioner") == {"_roofline"}
    assert _functions_importing("edge/profile.py", "partitioner") == {"profile_package"}
    graph = module_graph()
    todo, seen = ["edge.emulate", "edge.profile", "edge.agent", "edge.cli"], set()
    while todo:  # what importing the edge loads: no partitioner module
        here = todo.pop()
        if here not in seen:
            seen.add(here)
            todo.extend(graph[here][0])
    assert not {m for m in seen if m.startswith("partitioner")}


def _doc_table() -> dict[str, set[str]]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Imports between rooms", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for room, may in re.findall(r"^\| `(\w+)/` \| ([^|]*) \|", section, re.M):
        table[room] = set(re.findall(r"`(\w+)`", may)) - {"nothing"}
    return table


def _doc_exceptions() -> set[tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Imports between rooms", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- `(\w+/[\w/]+\.py)` imports `(\w+)`", section, re.M))


def test_the_architecture_doc_draws_the_same_walls() -> None:
    assert _doc_table() == {room: set(may) for room, may in ALLOWED.items()}
    assert _doc_exceptions() == set(EXCEPTIONS)
