"""The package's house rules, read from the source with ast: no module reads a private name
(`_x`) that another module defines, no function runs past MAX_LINES lines, and nothing outside the
family modules (interop/families/) compares a family, architecture, model_type or image-tower name:
the readers and writers ask the family or the tower's registry. (Ruff holds the argument count,
statements and complexity: pyproject.toml.)"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tunix_train"
MAX_LINES = 100
# A library's private read on purpose, and why.
LIBRARY_PRIVATES = {
    # jax.distributed's cluster detection: which environments jax would recognise (launch/distributed.py)
    "_cluster_types",
}


def _defined(tree: ast.AST) -> set[str]:
    """The names a module defines: its functions, classes, and the names and attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def privates_read_elsewhere(source: str) -> list[str]:
    """`x._name` reads in `source` of a private name it does not define itself (so: another
    module's, or a base class's in another module), as 'line: expression'."""
    tree = ast.parse(source)
    own = _defined(tree)
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in own | LIBRARY_PRIVATES
    ]


def long_functions(source: str) -> list[str]:
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, from line {node.lineno})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]


# what holds a family, GGUF architecture, config.json model_type or image tower's name
NAMED = {"family", "arch", "architecture", "model_type", "encoder"}
FAMILY_MODULES = PACKAGE / "interop" / "families"


def _is_name_holder(node: ast.AST) -> bool:
    """`family`, `cfg.family`, `hf.get("model_type")`, `hf["model_type"]`, `VisionEncoder.gemma4`, ..."""
    if isinstance(node, ast.Name):
        return node.id in NAMED
    if isinstance(node, ast.Attribute):
        return node.attr in NAMED or (isinstance(node.value, ast.Name) and node.value.id == "VisionEncoder")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in NAMED
    return (
        isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in NAMED
    )


def _is_name(node: ast.AST) -> bool:
    """A string (or strings) or a VisionEncoder member."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name(e) for e in node.elts)
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "VisionEncoder"
    )


def name_comparisons(source: str) -> list[str]:
    """Comparisons in `source` of what holds a family's, architecture's or tower's name with a name,
    as 'line: expression'."""
    return [
        f"{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Compare)
        and any(_is_name_holder(o) for o in (node.left, *node.comparators))
        and any(_is_name(o) for o in (node.left, *node.comparators))
    ]


def _package_findings(check, skip: Path | None = None) -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if skip is not None and path.is_relative_to(skip):
            continue
        if hits := check(path.read_text()):
            found[str(path.relative_to(PACKAGE.parent))] = hits
    return found


def test_no_module_reads_another_modules_privates():
    assert not _package_findings(privates_read_elsewhere)


def test_no_function_runs_past_the_limit():
    assert not _package_findings(long_functions)


def test_nothing_outside_the_family_modules_compares_family_or_architecture_names():
    assert not _package_findings(name_comparisons, skip=FAMILY_MODULES)


def test_the_checks_find_what_they_forbid():
    planted = "from tunix_train.interop import hf\n\ndef f(x):\n    return hf._SPECS, x._cache\n"
    assert privates_read_elsewhere(planted) == ["4: hf._SPECS", "4: x._cache"]
    own = "class A:\n    def __init__(self):\n        self._n = 1\n\ndef g(a):\n    return a._n\n"
    assert privates_read_elsewhere(own) == []
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def long():\n{body}\n") == [f"long ({MAX_LINES + 1} lines, from line 1)"]
    assert long_functions(f"def short():\n{body.rsplit(chr(10), 1)[0]}\n") == []
    compared = (
        "def f(cfg, hf, arch, v):\n"
        "    a = cfg.family == 'llama' or arch in ('qwen3moe', 'gemma')\n"
        "    b = hf.get('model_type') != 'gemma3' or v.encoder is VisionEncoder.gemma4\n"
        "    return a, b, cfg.num_layers == 2, cfg.family == other\n"
    )
    assert [hit.split(":")[0] for hit in name_comparisons(compared)] == ["2", "2", "3", "3"]
