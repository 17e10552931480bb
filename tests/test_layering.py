"""The layering shared/STYLE.md keeps, held against the imports: the library's compute modules
take values (never the params models, the stages, the flows or the app), and its data modules
never import torch, so the ONNX path of predict and the CLI load without it."""

import ast

from tests.conftest import ROOT

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
    "report",
    "scores",
    "viz",
)
APP = ("cli", "doctor", "verify", "runner", "project", "serve")


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
