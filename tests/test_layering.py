"""The layering docs/development.md describes, held against the imports and read from the packages, so a
new module is covered by where it lives:

    visionflow/data     image files to pixels, sources, the cache: torch-free
    visionflow/train    the model side: takes values, never the params models, the stages or ops
    visionflow/deploy   export, inference, serving: the model side's values and files
    visionflow/ops      DVC and processes: torch-free, never the model side
    visionflow/         errors and faults (below all), params (the file), cli (on top)

No module of the library imports the stages (`pipeline`) or Prefect (the flows add it)."""

import ast
from pathlib import Path

from tests.helpers import ROOT

SRC = ROOT / "src"
# what each package may import of visionflow: its own modules and the layers below it
MAY_IMPORT = {
    "data": {"data", "errors", "faults"},
    "train": {"train", "data", "errors", "faults"},
    "deploy": {"deploy", "train", "data", "errors", "faults"},
    "ops": {"ops", "data", "errors", "faults", "params"},
}
TORCH_FREE = ("data", "ops")  # at import: the ONNX path of predict, the CLI, the runner


def modules() -> dict[str, Path]:
    """Every module of the library by dotted name (a package's __init__ by the package's)."""
    found = {}
    for path in sorted((SRC / "visionflow").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def package(module: str) -> str:
    """The layer a module belongs to: its sub-package, or its own name at the top."""
    return module.split(".")[1] if "." in module else ""


def imported(path: Path, at_import: bool = False) -> set[str]:
    """What the file imports anywhere; with `at_import`, only what importing it loads (not the
    imports inside functions, made on use)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body if at_import else ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_every_module_lives_in_a_layer():
    top = {m for m in modules() if "." not in m.removeprefix("visionflow.")} - {"visionflow"}
    layers = {f"visionflow.{p}" for p in MAY_IMPORT}
    assert top - layers == {f"visionflow.{m}" for m in ("cli", "errors", "faults", "params")}


def test_each_layer_imports_only_itself_and_the_layers_below():
    for module, path in modules().items():
        layer = package(module)
        if layer not in MAY_IMPORT:
            continue
        found = {
            n
            for n in imported(path)
            if n.startswith("visionflow.") and n.split(".")[1] not in MAY_IMPORT[layer]
        }
        found |= {n for n in imported(path) if n.split(".")[0] == "pipeline"}
        assert not found, f"{module} ({layer}) imports {sorted(found)}"


def test_data_and_ops_are_torch_free():
    for module, path in modules().items():
        if package(module) in TORCH_FREE:
            loaded = imported(path, at_import=True)
            torch = {n for n in loaded if n.split(".")[0] in ("torch", "torchvision")}
            assert not torch, f"{module} imports {sorted(torch)}"


def test_the_library_never_imports_prefect():
    """The flows (pipeline/flows.py) add Prefect to the library's ops, never the reverse.
    `visionflow doctor` alone reads Prefect's configured API URL (a profile may set it), on use."""
    for module, path in modules().items():
        names = imported(path, at_import=module == "visionflow.ops.doctor")
        found = {n for n in names if n.split(".")[0] == "prefect"}
        assert not found, f"{module} imports {sorted(found)}"


def functions(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node, node.end_lineno - node.lineno + 1


def test_functions_fit_on_a_screen_and_the_step_reads_in_one():
    """No function in src/ or pipeline/ over 80 lines (docstring included); the training step,
    `train_one_epoch`, at most 60 lines and 8 parameters (docs/development.md: the two loops a
    reader sees at once)."""
    paths = [*(ROOT / "src/visionflow").rglob("*.py"), *(ROOT / "pipeline").glob("*.py")]
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
        for path in sorted(paths)
        for node, lines in functions(path)
        if lines > 80
    ]
    assert not long, long
    (step, lines), *_ = (
        (node, lines)
        for node, lines in functions(ROOT / "src/visionflow/train/engine.py")
        if node.name == "train_one_epoch"
    )
    parameters = len(step.args.args) + len(step.args.kwonlyargs)
    assert lines <= 60 and parameters <= 8, (lines, parameters)
