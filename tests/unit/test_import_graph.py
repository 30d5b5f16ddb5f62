"""The library stands on its own, and its modules form no cycle. Read from the source with
`ast` (nothing is imported): every `import` and `from ... import` in every module counts,
whether at module level, inside a function or under `if TYPE_CHECKING:`, since a cycle hidden
by a late import is still a cycle.

- `easerve` imports nothing from `hasctl`, `services`, `bench` or `tests`;
- outside `easerve/sim`, no `easerve` module imports `easerve.sim` (serving code does not
  depend on the simulator; what they share lives in `easerve.policy`);
- `easerve.policy` depends on no layer above it (the stages, their RPC, transports, wire
  format, partition mechanisms or the simulator): those import the policies, not the reverse;
- no cycle among the modules of `easerve`, nor among those of `hasctl`;
- no private name (`_x`) is imported from another module of `easerve` or `hasctl`, nor read
  through a module imported whole (`codec._raw`).

An edge goes to the module an import names: `from a.b import c` points at `a.b.c` when that is
a module, else at `a.b`. A package's `__init__` is a module like the others (a submodule that
imports its package's names depends on the `__init__`)."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOREIGN_TO_LIBRARY = ("hasctl", "services", "bench", "tests")
ABOVE_POLICY = ("easerve.stages", "easerve.rpc", "easerve.transport", "easerve.wire", "easerve.partition",
                "easerve.sim", "easerve.client")


@dataclass(frozen=True)
class Edge:
    source: str   # importing module, dotted
    target: str   # imported module, dotted
    line: int
    names: tuple[str, ...]  # for `from X import a, b`: the names taken; for a module: its attributes read

    def where(self) -> str:
        return f"{self.source}:{self.line} -> {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(package: str) -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


ALL_MODULES: dict[str, Path] = {}
for _pkg in ("easerve", "hasctl"):
    ALL_MODULES.update(modules_of(_pkg))


def _absolute(source: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = source.split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def edges_of(source: str, path: Path) -> list[Edge]:
    """Every import in the module, wherever it stands in the file. A module bound to a name
    (`import a.b as m`, `from a import b`) has the attributes read through that name as its
    edge's names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}  # local name -> the module of ours it is bound to
    out: list[tuple[str, int, list[str], str | None]] = []  # target, line, names, bound as
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, node.lineno, [], alias.asname))
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(source, path, node)
            plain: list[str] = []
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in ALL_MODULES:
                    out.append((submodule, node.lineno, [], alias.asname or alias.name))
                else:
                    plain.append(alias.name)
            if plain:
                out.append((target, node.lineno, plain, None))
    for target, _line, _names, name in out:
        if name is not None and target in ALL_MODULES:
            bound[name] = target
    read: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            read.setdefault(bound[node.value.id], set()).add(node.attr)
    edges = [Edge(source, target, line, tuple(names) if names or name is None else tuple(sorted(read.get(target, ()))))
             for target, line, names, name in out]
    # importing a.b.c first runs the package a.b's __init__ (unless it is running already: a
    # package of the importing module itself)
    for target, line, _names, _name in out:
        parts = target.split(".")
        for k in range(1, len(parts)):
            pkg = ".".join(parts[:k])
            if pkg in ALL_MODULES and pkg != target and not _within(source, pkg):
                edges.append(Edge(source, pkg, line, ()))
    return edges


def graph_of(package: str) -> dict[str, list[Edge]]:
    return {name: edges_of(name, path) for name, path in modules_of(package).items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself), each sorted; Tarjan's algorithm, iterative."""
    succ = {m: sorted({e.target for e in es if e.target in graph}) for m, es in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
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
            if i < len(succ[node]):
                work.append((node, i + 1))
                nxt = succ[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in succ[node]:
                    found.append(sorted(component))
    return sorted(found)


def _describe(graph: dict[str, list[Edge]], component: list[str]) -> str:
    members = set(component)
    inside = [e.where() for m in component for e in graph[m] if e.target in members]
    return " <-> ".join(component) + "\n    " + "\n    ".join(sorted(set(inside)))


EASERVE = graph_of("easerve")
HASCTL = graph_of("hasctl")


@pytest.mark.parametrize("package,graph", [("easerve", EASERVE), ("hasctl", HASCTL)])
def test_no_import_cycle(package, graph):
    assert len(graph) > 20, f"{package}: too few modules found under {ROOT / package}"
    found = cycles(graph)
    assert not found, f"import cycles in {package}:\n" + "\n".join(
        _describe(graph, c) for c in found)


def test_library_imports_nothing_from_the_cli_services_bench_or_tests():
    bad = [e.where() for es in EASERVE.values() for e in es
           if any(_within(e.target, p) for p in FOREIGN_TO_LIBRARY)]
    assert not bad, "easerve imports outside the library:\n" + "\n".join(bad)


def test_serving_code_does_not_import_the_simulator():
    bad = [e.where() for m, es in EASERVE.items() if not _within(m, "easerve.sim")
           for e in es if _within(e.target, "easerve.sim")]
    assert not bad, "easerve modules outside easerve.sim import it:\n" + "\n".join(bad)


def test_policy_depends_on_no_layer_above_it():
    bad = [e.where() for m, es in EASERVE.items() if _within(m, "easerve.policy")
           for e in es if any(_within(e.target, p) for p in ABOVE_POLICY)]
    assert not bad, "easerve.policy imports a layer above it:\n" + "\n".join(bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_imported_across_modules():
    bad = []
    for graph in (EASERVE, HASCTL):
        for es in graph.values():
            for e in es:
                if e.target not in ALL_MODULES:
                    continue
                taken = [n for n in e.names if _private(n)]
                if _private(e.target.rsplit(".", 1)[-1]) or taken:
                    bad.append(f"{e.where()} {', '.join(taken)}".rstrip())
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_the_cycle_search_finds_a_drawn_cycle():
    """The search itself, on graphs drawn by hand: a two-module cycle, and none once it is cut."""
    a = [Edge("p.a", "p.b", 1, ("x",))]
    b = [Edge("p.b", "p.a", 3, ("_y",))]
    assert cycles({"p.a": a, "p.b": b, "p.c": []}) == [["p.a", "p.b"]]
    assert cycles({"p.a": a, "p.b": [], "p.c": []}) == []
