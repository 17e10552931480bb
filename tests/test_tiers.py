"""The fast tier covers every module (issue #47): each module of src/visionflow, pipeline/ and
orchestration/ (where it exists) is imported and used, or run (`python -m MODULE`, `-c "import
MODULE"`), by a test that is not marked `slow`, or by the file's own helpers, fixtures and
constants such a test names. Read from the tests' source, so it costs no test run; a module that
only a slow test reaches fails it, naming the module.

A package's `__init__.py` counts when it holds code (pipeline's `run`, say), not when it is a
docstring alone."""

import ast
import re
from pathlib import Path

from tests.helpers import ROOT

FOLDERS = ("src/visionflow", "pipeline", "orchestration")
# Module -> why no fast test of its own reaches it here. Each must still exist.
EXEMPT = {
    "pipeline.flows": "a thin alias of orchestration.reproduce, for `python -m pipeline.flows`",
    "pipeline.experiments": "a thin alias of orchestration.experiments, as pipeline.flows",
}
RUNS = re.compile(r"(?:-m|import|from)\s+([A-Za-z_][\w.]*)")  # a module a command line runs


def modules() -> dict[str, Path]:
    """Every module of the folders by dotted name; a package by its own name when its
    `__init__.py` holds more than a docstring."""
    found = {}
    for folder in FOLDERS:
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")) if base.is_dir() else []:
            parts = path.relative_to(base.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                body = ast.parse(path.read_text()).body
                if not body[1:] and (not body or isinstance(body[0], ast.Expr)):
                    continue
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def slow(node: ast.AST) -> bool:
    """Marked slow: `@pytest.mark.slow`, or `pytestmark = pytest.mark.slow` (or a list with it)."""
    marks = node.value if isinstance(node, ast.Assign) else None
    marks = marks.elts if isinstance(marks, ast.List) else [marks] if marks else []
    marks += getattr(node, "decorator_list", [])
    return any(ast.unparse(mark).endswith("mark.slow") for mark in marks)


def fast_code(tree: ast.Module) -> list[ast.AST]:
    """The fast tests of a test module, and the module's own functions, fixtures and constants
    they name, transitively (a helper only slow tests call is left out)."""
    if any(
        slow(n)
        for n in tree.body
        if isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n.targets[0])
    ):
        return []
    named = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            named[node.name] = node
        elif isinstance(node, ast.Assign):
            named |= {t.id: node for t in node.targets if isinstance(t, ast.Name)}
    todo = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and not slow(node)
    ]
    reached: dict[int, ast.AST] = {}
    while todo:
        node = todo.pop()
        if id(node) in reached:
            continue
        reached[id(node)] = node
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        names |= {a.arg for n in ast.walk(node) if isinstance(n, ast.arguments) for a in n.args}
        todo += [named[name] for name in names if name in named]
    return list(reached.values())


def bindings(node: ast.AST, known: set[str]) -> dict[str, str]:
    """Name -> module for the imports in `node`: `from a import b` binds module a.b where that
    is a module, else module a; `import a.b` binds `a.b` under its dotted name."""
    bound = {}
    for imp in ast.walk(node):
        if isinstance(imp, ast.Import):
            bound |= {alias.asname or alias.name: alias.name for alias in imp.names}
        elif isinstance(imp, ast.ImportFrom) and imp.module and not imp.level:
            for alias in imp.names:
                full = f"{imp.module}.{alias.name}"
                bound[alias.asname or alias.name] = full if full in known else imp.module
    return bound


def used(node: ast.AST) -> set[str]:
    """The names and dotted chains (`a.b.c`) `node` reads."""
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(ast.unparse(n))
    return found


def reached_by(source: str, known: set[str]) -> set[str]:
    """The modules of `known` a test module's fast code imports and uses, or runs."""
    tree = ast.parse(source)
    code = fast_code(tree)
    if not code:
        return set()
    top = bindings(
        ast.Module(
            body=[n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)],
            type_ignores=[],
        ),
        known,
    )
    found = set()
    for node in code:
        names = used(node)
        inner = bindings(node, known)  # imported inside a fast test or helper: run with it
        found |= set(inner.values())
        found |= {module for name, module in top.items() if name in names}
        strings = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
        for text in (s for s in strings if isinstance(s, str)):  # ["-m", "pipeline.train"]
            found |= {text, *RUNS.findall(text)}
    return found & known


def test_every_module_has_a_fast_test_of_its_own():
    known = set(modules())
    reached = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        reached |= reached_by(path.read_text(), known)
    assert set(EXEMPT) <= known, f"exempt but gone: {sorted(set(EXEMPT) - known)}"
    missing = sorted(known - reached - set(EXEMPT))
    assert not missing, f"no test outside the slow tier imports and uses, or runs: {missing}"


def test_a_module_only_slow_tests_use_is_not_reached():
    """The reading itself: imports count where a fast test (or what it names) uses them."""
    known = {"visionflow.ops.runner", "visionflow.ops.repo", "pipeline.train", "pipeline.check"}
    source = """
import pytest
from visionflow.ops import runner, repo

RUN = ["python", "-m", "pipeline.train"]

def helper():
    return repo.locked

@pytest.mark.slow
def test_slow():
    runner.repro(RUN)

def test_fast():
    helper()
    from pipeline.check import main
"""
    assert reached_by(source, known) == {"visionflow.ops.repo", "pipeline.check"}
    marked = "import pytest\npytestmark = pytest.mark.slow\n" + source.split("\n", 2)[2]
    assert reached_by(marked, known) == set()
