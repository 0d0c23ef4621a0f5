"""The import graph of tunix_train, read from the source with ast: no circle between files, and
imports flow one way, down the layers of LAYERS (entry points, api, train, generate/envs, data,
interop/observe, parallel/compose, model, sharding/checkpoint/platform, config and the leaves);
a unit (a top-level module, or a package with everything in it) may import only units in layers
below its own."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tunix_train"

# The layers, top first. A unit is named without its tunix_train prefix; a package's files are one unit.
LAYERS = (
    ("run", "export", "serve", "plan"),  # entry points: nothing imports them
    ("launch",),  # the launchers, and jax.distributed's set-up that run uses
    ("api",),  # the notebook surface
    ("train",),
    ("rewards", "evaluate"),  # evaluate: lm-eval on a model (its CLI, and training.eval_tasks)
    ("generate", "envs"),
    ("data",),
    ("interop", "observe"),
    ("parallel", "compose"),
    ("model",),
    ("sharding", "checkpoint", "platform"),
    ("config",),
    ("exit_codes", "files", "state", "cpu_devices"),
)
LAYER = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}
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


def _unit(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_every_unit_has_a_layer():
    missing = {_unit(name) for name in MODULES} - set(LAYER) - {""}
    assert not missing, f"add {sorted(missing)} to LAYERS"


def test_imports_flow_one_way():
    """Every import between units goes down LAYERS; the package's own __init__ imports nothing."""
    wrong = [
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        for dep in deps
        if _unit(name) != _unit(dep) and (_unit(name) == "" or LAYER[_unit(dep)] <= LAYER[_unit(name)])
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
        GRAPH["tunix_train.model.layout"].add("tunix_train.model.decoder")  # decoder imports layout
        try:
            test_no_file_imports_itself_through_others()
            raise RuntimeError("missed a circle")
        except AssertionError as err:
            assert "tunix_train.model.decoder" in str(err)
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


MAX_LINES = 500  # a module's; split by concept past it (no exemptions; the docs' own limits: test_docs.py)


def test_no_module_runs_past_the_limit():
    long = {
        name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
