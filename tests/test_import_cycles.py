"""No import cycles between the modules of router/ and worker/ (docs/architecture.md, "Layout").

import-linter's contracts (pyproject.toml) keep the layers in order package by package; this test is the finer
check: no module may reach itself through imports, counting imports inside functions, which hide a cycle from
Python until the wrong module is imported first. Imports under `if TYPE_CHECKING:` are left out: they name
types for checkers and never run. Each cycle is reported as one strongly connected group with an edge list.
"""

from __future__ import annotations

import grimp

# Cycles allowed for now, each with the reason: none.
ALLOWED: list[frozenset[str]] = []


def _cycles(graph: grimp.ImportGraph) -> list[set[str]]:
    """Strongly connected groups of two or more modules (Tarjan's algorithm, iterative)."""
    modules = sorted(m for m in graph.modules if m.split(".")[0] in ("router", "worker"))
    edges = {m: sorted(d for d in graph.find_modules_directly_imported_by(m) if d in graph.modules
                       and d.split(".")[0] in ("router", "worker")) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            recurse = False
            for j in range(i, len(edges[node])):
                nxt = edges[node][j]
                if nxt not in index:
                    work.append((node, j + 1))
                    work.append((nxt, 0))
                    recurse = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if recurse:
                continue
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return groups


def _describe(graph: grimp.ImportGraph, group: set[str]) -> str:
    lines = []
    for m in sorted(group):
        for d in sorted(graph.find_modules_directly_imported_by(m) & group):
            lines.append(f"  {m} -> {d} (line {graph.get_import_details(importer=m, imported=d)[0]['line_number']})")
    return "\n".join(lines)


def test_no_import_cycles_in_router_or_worker() -> None:
    graph = grimp.build_graph("router", "worker", exclude_type_checking_imports=True, cache_dir=None)
    found = [g for g in _cycles(graph) if frozenset(g) not in ALLOWED]
    assert not found, "import cycles:\n" + "\n\n".join(_describe(graph, g) for g in found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check itself can fail: a graph with a -> b -> c -> a has one cycle of three."""
    graph = grimp.ImportGraph()
    for name in ("router", "router.a", "router.b", "router.c", "router.d"):
        graph.add_module(name)
    for importer, imported in (("router.a", "router.b"), ("router.b", "router.c"), ("router.c", "router.a"),
                               ("router.d", "router.a")):
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="import")
    assert _cycles(graph) == [{"router.a", "router.b", "router.c"}]
