"""The package's import graph (STYLE habit 1, docs/design.md#tiers): no cycle, and the run-time
edge never reaches the exporter.

The graph is built with ``ast`` from the source files, not by importing them, and counts every
``specsplit`` import a module makes: at the top, inside functions (deferred imports still run),
and under ``if TYPE_CHECKING:`` (type-only imports are included: a cycle through annotations is
still two modules that cannot be understood apart, and the first such import that becomes a
run-time one fails at import time). Importing ``a.b.c`` also runs the packages ``a`` and ``a.b``,
so each module depends on its parent packages too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("edge", "cloud", "shared")  # specsplit.<folder>, mapped from the top-level folders
EXPORTER = "specsplit.edge.export"
# Where building the draft and running it meet: the CLI has the `export` command and exports a
# draft on first use; everything else under edge/ is the run-time edge.
BUILD_AND_RUN = {"specsplit.edge.cli", "specsplit.edge"}


def module_files() -> dict[str, Path]:
    """specsplit module name -> its file (cloud/model_repository is Triton's, not a module)."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).with_suffix("")
            if not all(part.isidentifier() for part in rel.parts):
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(("specsplit", *parts))] = f
    return out


def _target(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The specsplit modules ``module`` imports anywhere in its file, with their parents."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _target(node, module, path.name == "__init__.py")
            if base is None:
                continue
            found.add(base)
            # ``from pkg import name``: name may be a submodule
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
    out = set()
    for name in found:
        parts = name.split(".")
        for i in range(2, len(parts) + 1):  # the module and every parent package below specsplit
            if ".".join(parts[:i]) in known:
                out.add(".".join(parts[:i]))
    out.discard(module)
    return out


@functools.cache
def graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {m: imports_of(m, f, known) for m, f in files.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``g`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (c := visit(n)):
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def reachable(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for n in g.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def test_graph_sees_every_kind_of_import(tmp_path):
    """The builder itself: absolute, relative, deferred and type-only imports, parents too."""
    src = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from specsplit.shared import acceptance\n"
        "from .b import X\n"
        "if TYPE_CHECKING:\n"
        "    from specsplit.cloud.gateway.session import GatewaySession\n"
        "def f():\n"
        "    import specsplit.cloud.capacity\n"
    )
    f = tmp_path / "a.py"
    f.write_text(src)
    known = {
        "specsplit.edge",
        "specsplit.edge.a",
        "specsplit.edge.b",
        "specsplit.shared",
        "specsplit.shared.acceptance",
        "specsplit.cloud",
        "specsplit.cloud.capacity",
        "specsplit.cloud.gateway",
        "specsplit.cloud.gateway.session",
    }
    assert imports_of("specsplit.edge.a", f, known) == known - {"specsplit.edge.a"}


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("layer", ["specsplit.shared"])
def test_shared_imports_neither_side(layer):
    g = graph()
    for m in (m for m in g if m.startswith(layer)):
        bad = {n for n in g[m] if n.startswith(("specsplit.edge", "specsplit.cloud"))}
        assert not bad, f"{m} imports {sorted(bad)}"


def test_run_time_edge_never_reaches_the_exporter():
    g = graph()
    run_time = [
        m
        for m in g
        if m.startswith("specsplit.edge") and not m.startswith(EXPORTER) and m not in BUILD_AND_RUN
    ]
    assert run_time
    bad = {m: sorted(n for n in reachable(g, m) if n.startswith(EXPORTER)) for m in run_time}
    bad = {m: v for m, v in bad.items() if v}
    assert not bad, f"run-time edge modules that import the exporter: {bad}"


MODE_LOOPS = ("lockstep", "cloud_led", "cloud_only")  # one module per session mode, each side


@pytest.mark.parametrize("side", ["specsplit.edge", "specsplit.cloud.gateway"])
def test_no_mode_loop_imports_another(side):
    """Each side's dispatcher (edge.rounds, the servicer's ``_rounds``) owns the mode switch:
    a mode's loop never runs another's (a handover ends the loop with a Handover instead)."""
    g = graph()
    loops = {f"{side}.{name}" for name in MODE_LOOPS}
    assert loops <= set(g), f"mode loop modules moved: {sorted(loops - set(g))}"
    bad = {m: sorted(g[m] & (loops - {m})) for m in loops if g[m] & (loops - {m})}
    assert not bad, f"mode loops that import another mode's loop: {bad}"
