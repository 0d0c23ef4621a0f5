"""The package's house rules, read from the source with ast: no module reads a private name
(`_x`) that another module defines, and no function runs past MAX_LINES lines. (Ruff holds the
argument count, statements and complexity: pyproject.toml.)"""

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


def _package_findings(check) -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if hits := check(path.read_text()):
            found[str(path.relative_to(PACKAGE.parent))] = hits
    return found


def test_no_module_reads_another_modules_privates():
    assert not _package_findings(privates_read_elsewhere)


def test_no_function_runs_past_the_limit():
    assert not _package_findings(long_functions)


def test_the_checks_find_what_they_forbid():
    planted = "from tunix_train.interop import hf\n\ndef f(x):\n    return hf._SPECS, x._cache\n"
    assert privates_read_elsewhere(planted) == ["4: hf._SPECS", "4: x._cache"]
    own = "class A:\n    def __init__(self):\n        self._n = 1\n\ndef g(a):\n    return a._n\n"
    assert privates_read_elsewhere(own) == []
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def long():\n{body}\n") == [f"long ({MAX_LINES + 1} lines, from line 1)"]
    assert long_functions(f"def short():\n{body.rsplit(chr(10), 1)[0]}\n") == []
