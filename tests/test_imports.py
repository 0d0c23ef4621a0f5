"""The import graph of tunix_train, read from the source with ast: no circle between files, and
imports flow one way (launch/api -> train -> generate/data/interop/observe -> parallel -> model ->
sharding/config)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tunix_train"

# package (or module) -> the packages it must not import
FORBIDDEN = {
    "tunix_train.model": ("tunix_train.parallel", "tunix_train.generate", "tunix_train.train"),
    "tunix_train.generate": ("tunix_train.train",),
    "tunix_train": ("tunix_train.plan",),  # the planner is a command-line tool: nothing imports it
}
MESH_WORDS = ("shard_map", "all_to_all", "ppermute")  # what the model leaves to tunix_train.parallel


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The tunix_train modules `name` imports, anywhere in the file (inside functions too), and the
    packages whose inits that runs; `from pkg import sub` counts as importing pkg.sub where sub is
    a module."""
    path = MODULES[name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                package = name if path.name == "__init__.py" else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}".rstrip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    # importing a.b.c first runs the inits of a and a.b: edges to them too (not to the importer's
    # own packages, already running when it runs)
    own = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)}
    found |= {m.rsplit(".", i)[0] for m in found for i in range(1, m.count(".") + 1)}
    return {m for m in found if m in MODULES and m != name and m not in own}


GRAPH = {name: _imports(name) for name in MODULES}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_no_file_imports_itself_through_others():
    """Depth-first search for a cycle between files; the error names it."""
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(name, trail):
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycle = trail[trail.index(dep) :] + [dep]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, trail + [dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_imports_flow_one_way():
    wrong = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        for dep in deps
        for package, banned in FORBIDDEN.items()
        if _within(name, package)
        for b in banned
        if _within(dep, b) and not _within(name, b)
    ]
    assert not wrong, wrong


def test_the_model_names_no_mesh_collective():
    found = [
        f"{path.name}: {word}"
        for name, path in MODULES.items()
        if _within(name, "tunix_train.model")
        for word in MESH_WORDS
        if word in path.read_text()
    ]
    assert not found, found


def test_the_checker_sees_a_circle_and_a_forbidden_import():
    """The checks above can fail: on today's graph with one made-up edge each."""
    saved = {k: set(v) for k, v in GRAPH.items()}
    try:
        GRAPH["tunix_train.model.layout"].add("tunix_train.model.gemma")  # gemma imports layout
        try:
            test_no_file_imports_itself_through_others()
            raise RuntimeError("missed a circle")
        except AssertionError as err:
            assert "tunix_train.model.gemma" in str(err)
        GRAPH.update({k: set(v) for k, v in saved.items()})
        GRAPH["tunix_train.generate.engine"].add("tunix_train.train.init")
        try:
            test_imports_flow_one_way()
            raise RuntimeError("missed a forbidden import")
        except AssertionError as err:
            assert "tunix_train.generate.engine imports tunix_train.train.init" in str(err)
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


LONG = 450  # lines: a smell to look at, not a target


def test_long_files_say_why_and_the_performance_page_stays_current():
    """A module past LONG lines says at its top why it is one file (splitting it would scatter one
    concept), in its docstring's "One file:" sentence; docs/performance.md holds the current figures
    and knobs in at most 150 lines (history goes to performance-history.md)."""
    unexplained = {
        name: n
        for name, path in MODULES.items()
        if (n := len((text := path.read_text()).splitlines())) > LONG
        and "One file:" not in (ast.get_docstring(ast.parse(text)) or "")
    }
    assert not unexplained, unexplained
    assert len((PACKAGE.parent / "docs" / "performance.md").read_text().splitlines()) <= 150
