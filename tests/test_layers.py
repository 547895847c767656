"""The package's layers point down (docs/architecture.md, "Package layers").

``lint-imports`` checks the contracts in pyproject.toml (the sub-packages' order); this
file runs it, so ``make test`` fails on an upward import even where ``make lint`` was
skipped, and checks what a layers contract cannot see: import circles among modules of
one sub-package, and imports of the package root. Imports inside functions count: grimp
records every import statement wherever it is.
"""

from __future__ import annotations

import itertools
import pathlib
import shutil
import subprocess
import sys

import grimp  # the dev extra (make test installs it), as import-linter
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Known circles, each a set of modules, allowed until the change named beside it lands
#: (none today; an entry must name the change that removes it).
KNOWN_CYCLES: list[set[str]] = []


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("torch_topg")


def _strongly_connected(graph) -> list[set[str]]:
    """The import graph's strongly connected components of more than one module
    (Tarjan's algorithm, iterative)."""
    succ = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = 0
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(succ[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(succ[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.add(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _describe(graph, component: set[str]) -> str:
    """One circle through the component: a -> b -> ... -> a, with the import lines."""
    first = min(component)
    back = next(b for b in sorted(graph.find_modules_directly_imported_by(first)) if b in component)
    chain = graph.find_shortest_chain(importer=back, imported=first) or (back, first)
    path = [first, *chain]
    steps = []
    for a, b in itertools.pairwise(path):
        lines = [d["line_number"] for d in graph.get_import_details(importer=a, imported=b)]
        steps.append(f"{a} -> {b} (line {', '.join(map(str, lines))})")
    return "\n  ".join(steps)


def test_no_import_cycles(graph):
    cycles = [c for c in _strongly_connected(graph) if c not in KNOWN_CYCLES]
    report = "\n".join(f"circle:\n  {_describe(graph, c)}" for c in cycles)
    assert not cycles, report


def test_known_cycles_still_exist(graph):
    """An entry of KNOWN_CYCLES whose circle is gone is removed from the list."""
    components = _strongly_connected(graph)
    for known in KNOWN_CYCLES:
        assert known in components, f"{sorted(known)} no longer a circle: drop it"


def test_nothing_imports_the_package_root(graph):
    """``torch_topg/__init__.py`` imports the sub-packages (the public names); a module
    importing it back reaches every layer. Only the command line may."""
    importers = set(graph.find_modules_that_directly_import("torch_topg"))
    assert importers <= {"torch_topg.__main__"}, sorted(importers)


def test_import_linter_contracts():
    exe = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "importlinter.cli"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
