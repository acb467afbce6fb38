"""The package's layers (docs/architecture.md, "Layers"): a module may import its own layer and
the layers below it, never one above, and no two modules may import each other, directly or round
a circle. Read from the source with `ast` (nothing is imported): every import counts, at the top of
a file or inside a function, but for those under `if TYPE_CHECKING:`, which never run (they still
may not point up).
"""
import ast
import pathlib

PACKAGE = "periodic_async"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE

# Lowest first; a module belongs to the first entry that is its name or a package above it.
LAYERS = [
    ("utilities", ["periodic_async", "periodic_async.errors", "periodic_async.lifetime", "periodic_async.netaddr"]),
    ("backend", ["periodic_async.backend", "periodic_async.backend_setup"]),
    ("models", ["periodic_async.models"]),
    ("algo", ["periodic_async.algo"]),
    ("config", ["periodic_async.config"]),
    ("data", ["periodic_async.data"]),
    ("rollout", ["periodic_async.rollout"]),
    ("reward", ["periodic_async.reward"]),
    ("actor", ["periodic_async.actor"]),
    ("memory_plan", ["periodic_async.memory_plan"]),
    ("scheduling", ["periodic_async.scheduling"]),
    ("telemetry", ["periodic_async.telemetry"]),
    ("train", ["periodic_async.train"]),
    ("entry points", ["periodic_async.__main__", "periodic_async.export", "periodic_async.launch"]),
]

# Known upward imports and cycles, each to be removed: (importing module, imported module). None
# today; a new one fails the test.
KNOWN_UPWARD: set = set()
KNOWN_CYCLES: set = set()


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if module == p or (p != PACKAGE and module.startswith(p + ".")):   # the root: itself only
                return i
    raise AssertionError(f"{module}: in no layer; add it to LAYERS here and to docs/architecture.md")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: pathlib.Path, modules: dict) -> list[tuple[str, int, bool]]:
    """(imported module of the package, line, runs: False under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    type_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                type_only.update(id(n) for n in ast.walk(child))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                while name not in modules:          # `import periodic_async.x.y` of a missing y
                    name = name.rpartition(".")[0]
                out[name, node.lineno, id(node) not in type_only] = None
    return list(out)


def _graph():
    modules = _modules()
    return modules, {m: _imports(m, p, modules) for m, p in modules.items()}


def upward_imports(graph, modules) -> list[str]:
    bad = []
    for m, imports in graph.items():
        for target, line, _ in imports:
            if _layer(target) > _layer(m) and (m, target) not in KNOWN_UPWARD:
                bad.append(f"{modules[m].relative_to(ROOT.parent)}:{line}: {m} (layer "
                           f"{LAYERS[_layer(m)][0]}) imports {target} (layer {LAYERS[_layer(target)][0]}, above it)")
    return bad


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), over the imports that run."""
    edges = {m: sorted({t for t, _, runs in imports if runs and t != m}) for m, imports in graph.items()}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    modules, _ = _graph()
    assert len(modules) > 40
    for m in modules:
        _layer(m)


def test_no_module_imports_a_higher_layer():
    modules, graph = _graph()
    bad = upward_imports(graph, modules)
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)


def test_no_import_cycles():
    modules, graph = _graph()
    cycles = [c for c in import_cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    lines = []
    for c in cycles:
        members = set(c)
        lines.append(" <-> ".join(c) + ": " + "; ".join(
            f"{modules[m].relative_to(ROOT.parent)}:{line} imports {t}"
            for m in c for t, line, runs in graph[m] if runs and t in members and t != m))
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_known_exceptions_still_exist():
    """An exception that was removed leaves the lists too, so that it cannot come back unnoticed."""
    modules, graph = _graph()
    edges = {(m, t) for m, imports in graph.items() for t, _, _ in imports}
    assert not KNOWN_UPWARD - edges, f"remove from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - edges)}"
    cycles = {frozenset(c) for c in import_cycles(graph)}
    assert not KNOWN_CYCLES - cycles, f"remove from KNOWN_CYCLES: {[sorted(c) for c in KNOWN_CYCLES - cycles]}"


def test_the_check_sees_an_upward_import_and_a_cycle(tmp_path):
    """The checks fail on the two faults they look for (an import inside a function included)."""
    modules, graph = _graph()
    graph = dict(graph)
    graph["periodic_async.config.loading"] = graph["periodic_async.config.loading"] + [
        ("periodic_async.train.trainer", 99, True)]
    assert ("periodic_async/config/loading.py:99: periodic_async.config.loading (layer config) imports "
            "periodic_async.train.trainer (layer train, above it)") in upward_imports(graph, modules)
    graph["periodic_async.errors"] = graph["periodic_async.errors"] + [("periodic_async.lifetime", 1, True)]
    graph["periodic_async.lifetime"] = graph["periodic_async.lifetime"] + [("periodic_async.errors", 1, True)]
    assert ["periodic_async.errors", "periodic_async.lifetime"] in import_cycles(graph)
    # and the parser finds a relative import inside a function, as `_imports` reads it
    src = tmp_path / "periodic_async" / "config" / "probe.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from ..train import trainer\n")
    assert _imports("periodic_async.config.probe", src, modules) == [("periodic_async.train.trainer", 2, True)]
