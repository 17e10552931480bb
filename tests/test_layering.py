"""The layering shared/STYLE.md keeps, held against the imports: the library's compute modules
take values (never the params models, the stages, the flows or the app), and its data modules
never import torch, so the ONNX path of predict and the CLI load without it."""

import ast

from tests.helpers import ROOT

DATA = ("data", "decode", "files", "archive", "errors", "faults")
MODEL = (
    "augment",
    "checkpoint",
    "engine",
    "export",
    "health",
    "inference",
    "loading",
    "models",
    "quantize",
    "report",
    "scores",
    "training",
    "viz",
)
APP = ("cli", "doctor", "verify", "runner", "project", "repo", "serve", "sweeps", "watching")


def imported(module: str, at_import: bool = False) -> set[str]:
    """What `module` imports anywhere; with `at_import`, only what importing it loads (not the
    imports inside functions, made on use)."""
    tree = ast.parse((ROOT / "src/visionflow" / f"{module}.py").read_text())
    names = set()
    for node in tree.body if at_import else ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_model_and_data_modules_take_values_not_params_stages_flows_or_the_app():
    banned = {"visionflow.params", "pipeline", "prefect"} | {f"visionflow.{m}" for m in APP}
    for module in DATA + MODEL:
        found = {
            n for n in imported(module) if any(n == b or n.startswith(b + ".") for b in banned)
        }
        assert not found, f"visionflow/{module}.py imports {sorted(found)}"


def test_data_modules_are_torch_free():
    for module in DATA:
        loaded = imported(module, at_import=True)
        torch = {n for n in loaded if n.split(".")[0] in ("torch", "torchvision")}
        assert not torch, f"visionflow/{module}.py imports {sorted(torch)}"


def test_the_library_never_imports_prefect():
    """The flows (pipeline/flows.py) add Prefect to the library's App modules, never the reverse.
    `visionflow doctor` alone reads Prefect's configured API URL (a profile may set it), on use."""
    for path in sorted((ROOT / "src/visionflow").glob("*.py")):
        if path.stem == "doctor":
            assert "prefect" not in {n.split(".")[0] for n in imported("doctor", at_import=True)}
            continue
        found = {n for n in imported(path.stem) if n.split(".")[0] == "prefect"}
        assert not found, f"visionflow/{path.name} imports {sorted(found)}"


def functions(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node, node.end_lineno - node.lineno + 1


def test_functions_fit_on_a_screen_and_the_step_reads_in_one():
    """No function in src/ or pipeline/ over 80 lines (docstring included); the training step,
    `train_one_epoch`, at most 60 lines and 8 parameters (shared/STYLE.md: the two loops a
    reader sees at once)."""
    paths = [*(ROOT / "src/visionflow").glob("*.py"), *(ROOT / "pipeline").glob("*.py")]
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"
        for path in sorted(paths)
        for node, lines in functions(path)
        if lines > 80
    ]
    assert not long, long
    (step, lines), *_ = (
        (node, lines)
        for node, lines in functions(ROOT / "src/visionflow/engine.py")
        if node.name == "train_one_epoch"
    )
    parameters = len(step.args.args) + len(step.args.kwonlyargs)
    assert lines <= 60 and parameters <= 8, (lines, parameters)
