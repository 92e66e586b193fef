"""No import cycles in partita: not across layers (test_layering.py checks the direction), and not
inside one layer either, counting every import the layering's static check reads (module level, inside
functions, ``importlib.import_module``, the lazy root) and the imports under ``if TYPE_CHECKING:``.

A function-level or TYPE_CHECKING import runs late or never, so Python does not fail on such a cycle;
but the two modules still cannot be understood, tested or moved apart, which is what the layers are for.

``ALLOWED_CYCLE_EDGES`` lists the imports that close today's cycles, each with its reason in one
line: the user-facing methods of a few records (``Cluster.local``, ``plan.summary``, ``Plan.load``)
that import, when called, the module doing the work. The test fails on an entry no import uses any
more, so the list shrinks as cycles go; a new cycle is never added to it.
"""

from __future__ import annotations

import shutil
import textwrap
from collections import deque
from pathlib import Path

import pytest
from test_layering import PACKAGE_DIR, StaticImport, iter_modules, static_imports

# (importer, imported) -> why the import exists. Each is a method a user calls on a record of
# partita.types, lazily importing the module that does the work; what remains to be removed says so.
ALLOWED_CYCLE_EDGES: dict[tuple[str, str], str] = {
    ("partita.types.cluster", "partita.cost.local_machine"): (
        "Cluster.local() is how users describe this machine; measuring it is cost's, imported when called"
    ),
    ("partita.types.plan", "partita.report.plan"): (
        "plan.summary() is how users print a plan (DESIGN); report renders it from types alone, imported when called"
    ),
    ("partita.types.plan", "partita.types.plan_file"): (
        "Plan.load/plan.save/to_json are the plan file's user API; the codec lives beside Plan, imported when called"
    ),
}

Graph = dict[str, dict[str, list[StaticImport]]]  # importer -> imported -> the imports that make the edge


def import_graph(package_dir: Path, package: str = "partita") -> Graph:
    """Module -> the modules it imports, with every import behind each edge (TYPE_CHECKING ones too)."""
    graph: Graph = {}
    for imp in static_imports(package_dir, package, type_checking=True):
        if imp.importer != imp.imported:  # a package's own name in its __init__: no edge
            graph.setdefault(imp.importer, {}).setdefault(imp.imported, []).append(imp)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: Graph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, as ``[m0, m1, ..., m0]``."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, {})):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if nxt in members and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start} in {component}")


def import_cycles(graph: Graph, allowed: dict[tuple[str, str], str] = ALLOWED_CYCLE_EDGES) -> list[str]:
    """One line per cycle left once the ``allowed`` edges are taken out: each import along one shortest
    cycle of every strongly connected component."""
    kept = {a: {b: imps for b, imps in edges.items() if (a, b) not in allowed} for a, edges in graph.items()}
    lines = []
    for component in strongly_connected(kept):
        cycle = shortest_cycle(kept, component)
        steps = [
            f"{a} -> {b} ({kept[a][b][0].path}:{kept[a][b][0].line}, {kept[a][b][0].how})"
            for a, b in zip(cycle, cycle[1:])
        ]
        lines.append(f"cycle of {len(component)} modules {component}:\n    " + "\n    ".join(steps))
    return lines


def stale_entries(graph: Graph, allowed: dict[tuple[str, str], str] = ALLOWED_CYCLE_EDGES) -> list[tuple[str, str]]:
    """The allowed edges no import makes any more."""
    return sorted(edge for edge in allowed if edge[1] not in graph.get(edge[0], {}))


@pytest.fixture(scope="module")
def partita_imports() -> Graph:
    return import_graph(PACKAGE_DIR)


def test_partita_has_no_import_cycle(partita_imports):
    cycles = import_cycles(partita_imports)
    assert not cycles, (
        "import cycles (every import counts: module level, in functions, under TYPE_CHECKING):\n"
        + "\n".join(cycles)
        + "\nmove the shared code to the module both need, or pass the value in"
    )


def test_every_allowed_cycle_edge_is_still_an_import(partita_imports):
    stale = stale_entries(partita_imports)
    assert not stale, f"ALLOWED_CYCLE_EDGES entries no import makes any more (remove them): {stale}"


# ============================================================================== the detector itself


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


PLANTED = {
    "partita/__init__.py": "",
    "partita/types/__init__.py": "",
    "partita/types/base.py": "",
    "partita/planning/__init__.py": "",
    # a -> b at module level, b -> a inside a function
    "partita/planning/a.py": "from partita.planning import b\n",
    "partita/planning/b.py": """
        import partita.types.base


        def later():
            from partita.planning.a import something
            return something
        """,
    # c -> d under TYPE_CHECKING only, d -> c at module level
    "partita/planning/c.py": """
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from partita.planning.d import D
        """,
    "partita/planning/d.py": "from partita.planning.c import *\nD = 1\n",
    # e -> f -> g -> e, the last step through importlib
    "partita/planning/e.py": "import partita.planning.f\n",
    "partita/planning/f.py": "from . import g\n",
    "partita/planning/g.py": "import importlib\n\n\ndef load():\n    return importlib.import_module('partita.planning.e')\n",
}


def test_cycles_inside_one_layer_are_found_whichever_way_they_import(tmp_path):
    _write(tmp_path, PLANTED)
    graph = import_graph(tmp_path / "partita")
    cycles = import_cycles(graph, allowed={})
    assert len(cycles) == 3, "\n".join(cycles)
    a_b, c_d, e_f_g = cycles
    assert a_b.startswith("cycle of 2 modules ['partita.planning.a', 'partita.planning.b']")
    assert "partita.planning.b -> partita.planning.a (partita/planning/b.py:6, in later())" in a_b, a_b
    assert (
        "partita.planning.c -> partita.planning.d (partita/planning/c.py:5, at module level under TYPE_CHECKING)" in c_d
    )
    assert (
        "partita.planning.g -> partita.planning.e (partita/planning/g.py:5, with importlib.import_module in load())"
        in e_f_g
    )
    assert e_f_g.count(" -> ") == 3, e_f_g
    # an allowed edge takes its cycle out; an allowed edge that no import makes is stale
    allowed = {("partita.planning.b", "partita.planning.a"): "test", ("partita.planning.a", "partita.planning.c"): "x"}
    assert len(import_cycles(graph, allowed)) == 2
    assert stale_entries(graph, allowed) == [("partita.planning.a", "partita.planning.c")]


def test_a_cycle_planted_in_a_copy_of_partita_fails_the_check(tmp_path):
    """In a copy of partita/, one planning module that another imports at module level gets a lazy
    import of that other one back, inside a function: the check names the cycle and the function."""
    copy = tmp_path / "partita"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    graph = import_graph(copy)
    assert not import_cycles(graph), "the copy should be as clean as partita/ (test_partita_has_no_import_cycle)"
    importer, imported = next(
        (a, b)
        for a, edges in sorted(graph.items())
        for b, imps in sorted(edges.items())
        if a.startswith("partita.planning.") and b.startswith("partita.planning.") and imps[0].function is None
    )
    path = iter_modules(copy)[imported]
    with path.open("a") as f:
        f.write(f"\n\ndef _planted():\n    import {importer}\n\n    return {importer}\n")
    cycles = import_cycles(import_graph(copy))
    assert len(cycles) == 1, "\n".join(cycles)
    assert f"{imported} -> {importer} ({path.relative_to(tmp_path)}:" in cycles[0], cycles
    assert "in _planted())" in cycles[0], cycles
