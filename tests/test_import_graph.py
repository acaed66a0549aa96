"""No import circles inside the `deepseek_pd` package.

The graph is built from the source with `ast`, not by importing anything, so a circle that is
dodged at run time (an import inside a function, an `if TYPE_CHECKING:` block) still counts: it is
still two modules that each need the other. Nodes are the modules of every folder that setup.py
installs (deepseek_pd/ as itself, model/ → deepseek_pd.model, ...); an edge is one `import` or
`from ... import` anywhere in a module, relative imports resolved. `from pkg import name` points at
`pkg.name` when that is a module, else at `pkg`. A package's own `__init__` is not an implicit
dependency of its submodules (else every package that re-exports its submodules would be a circle).

A strongly connected component with more than one module is a circle; the test names its modules
and the import lines that close it.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT_PACKAGE = "deepseek_pd"

# Circles that are allowed to stay, as {frozenset of modules: reason}. Each entry must match a
# current component exactly, so a fixed or grown circle makes the test fail until this is updated.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def _mapped_folders() -> tuple[str, ...]:
    """setup.py's MAPPED_FOLDERS, read from its source (importing setup.py would run setup())."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MAPPED_FOLDERS"
                                                 for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no MAPPED_FOLDERS")


def package_modules() -> dict[str, Path]:
    """Every module of the package: dotted name → source file."""
    roots = {ROOT_PACKAGE: REPO / ROOT_PACKAGE}
    roots.update({f"{ROOT_PACKAGE}.{folder}": REPO / folder for folder in _mapped_folders()})
    modules: dict[str, Path] = {}
    for prefix, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([prefix, *parts])] = path
    return modules


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    text: str


def _is_package(module: str, modules: dict[str, Path]) -> bool:
    return modules[module].name == "__init__.py"


def _resolve_base(node: ast.ImportFrom, module: str, modules: dict[str, Path]) -> str:
    """The absolute module `from <base> import ...` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package = module if _is_package(module, modules) else module.rpartition(".")[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise AssertionError(f"{module}: relative import beyond the top package (line {node.lineno})")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _innermost_module(name: str, modules: dict[str, Path]) -> str | None:
    """`name` itself, or its longest prefix that is one of our modules."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_edges(module: str, modules: dict[str, Path]) -> list[Edge]:
    source = modules[module].read_text()
    lines = source.splitlines()
    edges = []
    for node in ast.walk(ast.parse(source, filename=str(modules[module]))):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_innermost_module(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(node, module, modules)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append(submodule if submodule in modules else _innermost_module(base, modules))
        for target in targets:
            if target is not None and target != module:
                edges.append(Edge(module, target, node.lineno, lines[node.lineno - 1].strip()))
    return edges


def strongly_connected(nodes: list[str], edges: list[Edge]) -> list[frozenset[str]]:
    """Tarjan's algorithm, iterative (a deep import chain must not hit the recursion limit)."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for e in edges:
        succ[e.source].append(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(frozenset(component))
    return components


def import_cycles() -> tuple[list[frozenset[str]], list[Edge]]:
    modules = package_modules()
    edges = [e for m in modules for e in import_edges(m, modules)]
    cycles = [c for c in strongly_connected(sorted(modules), edges) if len(c) > 1]
    return sorted(cycles, key=sorted), edges


def _describe(cycle: frozenset[str], edges: list[Edge], modules: dict[str, Path]) -> str:
    inside = sorted({e for e in edges if e.source in cycle and e.target in cycle},
                    key=lambda e: (e.source, e.line))
    rows = [f"  {e.source} -> {e.target}   "
            f"({modules[e.source].relative_to(REPO)}:{e.line}: {e.text})" for e in inside]
    return "circle of " + ", ".join(sorted(cycle)) + ":\n" + "\n".join(rows)


def test_the_graph_sees_the_package():
    """Guard against a vacuous pass: the walker finds the modules and resolves their imports."""
    modules = package_modules()
    assert {"deepseek_pd.cli", "deepseek_pd.model.deepseek", "deepseek_pd.model.moe.dispatcher",
            "deepseek_pd.workers.api.servicer", "deepseek_pd.operator.handlers"} <= set(modules)
    edges = {(e.source, e.target) for m in modules for e in import_edges(m, modules)}
    # An absolute import, a `from package import submodule`, and the package __init__ re-export.
    assert ("deepseek_pd.model.runner", "deepseek_pd.model.deepseek") in edges
    assert ("deepseek_pd.model.moe", "deepseek_pd.model.moe.dispatcher") in edges
    assert ("deepseek_pd.model.attention", "deepseek_pd.model.attention.torch_backend") in edges


def test_cycle_finder_finds_a_circle_through_a_function_level_import(tmp_path):
    """The finder itself on a made-up graph: a -> b at module level, b -> a inside a function."""
    a, b, c = (tmp_path / f"{n}.py" for n in "abc")
    a.write_text("import pkg.b\n")
    b.write_text("def f():\n    from pkg import a\n")
    c.write_text("from . import a\n")
    modules = {"pkg.a": a, "pkg.b": b, "pkg.c": c}
    edges = [e for m in modules for e in import_edges(m, modules)]
    assert {(e.source, e.target) for e in edges} == {("pkg.a", "pkg.b"), ("pkg.b", "pkg.a"),
                                                      ("pkg.c", "pkg.a")}
    cycles = [s for s in strongly_connected(sorted(modules), edges) if len(s) > 1]
    assert cycles == [frozenset({"pkg.a", "pkg.b"})]


def test_no_import_circles():
    modules = package_modules()
    cycles, edges = import_cycles()
    unexpected = [c for c in cycles if c not in KNOWN_CYCLES]
    stale = [c for c in KNOWN_CYCLES if c not in cycles]
    report = "\n\n".join(_describe(c, edges, modules) for c in unexpected)
    assert not unexpected, f"{len(unexpected)} import circle(s) in {ROOT_PACKAGE}:\n{report}"
    assert not stale, f"KNOWN_CYCLES lists circles that no longer exist (remove them): {stale}"


# Layers: a module under a key may import nothing under any of its values (module or package).
# The worker folders are the PD diagram: serve/ builds a worker and knows everything; the two roles
# (prefill/, decode/) know the shared folders but not each other (they meet only through
# transport/); the shared folders (engine/, transport/, group/, api/, metrics/) know no role and
# not serve/; the engine core knows neither the gRPC front, rank groups nor the transports. model/ is the model
# and knows nothing of the workers, the operator or the CLI; the workers and the operator are
# started by the launcher (`up`) and the CLI, and know neither (what they share with the launcher,
# such as deepseek_pd/ports.py, sits below all of them).
_ENTRY_POINTS = (f"{ROOT_PACKAGE}.launcher", f"{ROOT_PACKAGE}.cli", f"{ROOT_PACKAGE}.commands")
_W = f"{ROOT_PACKAGE}.workers"
_ROLES_AND_SERVE = (f"{_W}.prefill", f"{_W}.decode", f"{_W}.serve")
FORBIDDEN_IMPORTS: dict[str, tuple[str, ...]] = {
    # transport/ uses the engine's types (failure codes, scheduler limits); the engine core knows no
    # transport (its config is the roles', workers/transport/worker_config.py)
    f"{_W}.engine": (*_ROLES_AND_SERVE, f"{_W}.api", f"{_W}.group", f"{_W}.transport"),
    f"{_W}.transport": (*_ROLES_AND_SERVE, f"{_W}.api", f"{_W}.group"),
    f"{_W}.metrics": (*_ROLES_AND_SERVE, f"{_W}.api", f"{_W}.group", f"{_W}.transport"),
    f"{_W}.api": (*_ROLES_AND_SERVE, f"{_W}.group", f"{_W}.transport"),
    f"{_W}.group": _ROLES_AND_SERVE,
    f"{_W}.prefill": (f"{_W}.decode", f"{_W}.serve"),
    f"{_W}.decode": (f"{_W}.prefill", f"{_W}.serve"),
    f"{ROOT_PACKAGE}.model": (_W, f"{ROOT_PACKAGE}.operator", *_ENTRY_POINTS),
    _W: _ENTRY_POINTS,
    f"{ROOT_PACKAGE}.operator": _ENTRY_POINTS,
}


# Crossings allowed for now, {(source, target): why}; each must still be an import, so a fixed one fails
# the test until it is removed here.
ALLOWED_CROSSINGS: dict[tuple[str, str], str] = {}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layering_violations(modules: dict[str, Path], edges: list[Edge]) -> list[Edge]:
    """Every import that crosses a line FORBIDDEN_IMPORTS draws."""
    return [e for e in edges for layer, banned in FORBIDDEN_IMPORTS.items()
            if _under(e.source, layer) and any(_under(e.target, b) for b in banned)
            and (e.source, e.target) not in ALLOWED_CROSSINGS]


def test_layering_guard_sees_the_layers():
    """Guard against a vacuous pass: every layer and every banned name is a real module or package."""
    modules = package_modules()
    for layer, banned in FORBIDDEN_IMPORTS.items():
        assert layer in modules, layer
        for name in banned:
            assert name in modules, f"FORBIDDEN_IMPORTS names {name}, which is not a module (renamed?)"


@pytest.mark.parametrize("source, line, target", [
    # the shared engine core importing a role
    ("workers.engine.fake", "from deepseek_pd.workers.decode.engine import DecodeEngine", "workers.decode.engine"),
    # one role importing the other (they meet only through workers/transport)
    ("workers.decode.fake", "from deepseek_pd.workers.prefill import engine", "workers.prefill.engine"),
    # the gRPC front importing the serve entry point
    ("workers.api.fake", "import deepseek_pd.workers.serve.builders", "workers.serve.builders"),
])
def test_layering_finds_a_crossing(tmp_path, source, line, target):
    """The check itself on a made-up module placed in a layer: its one forbidden import is reported."""
    path = tmp_path / "fake.py"
    path.write_text(line + "\n")
    name = f"{ROOT_PACKAGE}.{source}"
    modules = {**package_modules(), name: path}
    edges = import_edges(name, modules)
    assert [(e.source, e.target) for e in layering_violations(modules, edges)] == [(name, f"{ROOT_PACKAGE}.{target}")]


def test_layering_finds_a_worker_reaching_up_into_the_launcher(tmp_path):
    """A worker module importing the launcher (as group_main did for its ports) or the CLI is reported."""
    worker = tmp_path / "worker.py"
    worker.write_text("from deepseek_pd.launcher.cluster import LocalCluster\n"
                      "def f():\n    from deepseek_pd.commands import serve\n")
    modules = {**package_modules(), f"{ROOT_PACKAGE}.workers.fake_worker": worker}
    edges = import_edges(f"{ROOT_PACKAGE}.workers.fake_worker", modules)
    assert [(e.source, e.target) for e in layering_violations(modules, edges)] == [
        (f"{ROOT_PACKAGE}.workers.fake_worker", f"{ROOT_PACKAGE}.launcher.cluster"),
        (f"{ROOT_PACKAGE}.workers.fake_worker", f"{ROOT_PACKAGE}.commands.serve")]


def test_layers_are_kept():
    modules = package_modules()
    edges = [e for m in modules for e in import_edges(m, modules)]
    crossings = layering_violations(modules, edges)
    report = "\n".join(f"  {e.source} -> {e.target}   ({modules[e.source].relative_to(REPO)}:{e.line}: {e.text})"
                       for e in crossings)
    assert not crossings, f"{len(crossings)} import(s) cross a layer line (FORBIDDEN_IMPORTS):\n{report}"
    stale = set(ALLOWED_CROSSINGS) - {(e.source, e.target) for e in edges}
    assert not stale, f"ALLOWED_CROSSINGS lists imports that no longer exist (remove them): {stale}"
