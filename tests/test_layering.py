"""The layering docs/development.md describes, held against the imports and read from the packages, so a
new module is covered by where it lives:

    visionflow/data     image files to pixels, sources, the cache: torch-free
    visionflow/train    the model side: takes values, never the params models, the stages or ops
    visionflow/fit      one training run from the params: the model side's values and its state
    visionflow/deploy   export, inference, serving: the model side's values and files
    visionflow/ops      DVC and processes: torch-free, never the model side
    visionflow/         errors and faults (below all), params (the file), cli (on top)

No module of the library imports the stages (`pipeline`), the flows (`orchestration`) or Prefect
(the flows add it). `orchestration/`, the Prefect side, imports the library and Prefect, never the
stages; no import circle runs through `orchestration/` and `pipeline/`."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import ROOT, python_path

SRC = ROOT / "src"
# what each package may import of visionflow: its own modules and the layers below it
MAY_IMPORT = {
    "data": {"data", "errors", "faults"},
    "train": {"train", "data", "errors", "faults"},
    "fit": {"fit", "train", "data", "ops", "errors", "faults", "params"},
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


def test_the_library_never_imports_the_stages_or_the_flows():
    for module, path in modules().items():
        found = {n for n in imported(path) if n.split(".")[0] in ("pipeline", "orchestration")}
        assert not found, f"{module} imports {sorted(found)}"


def project_modules() -> dict[str, Path]:
    """The modules of `orchestration/` and `pipeline/` by dotted name (a package's __init__ by
    the package's)."""
    found = {}
    for folder in ("orchestration", "pipeline"):
        for path in sorted((ROOT / folder).glob("*.py")):
            name = folder if path.stem == "__init__" else f"{folder}.{path.stem}"
            found[name] = path
    return found


def test_orchestration_imports_the_library_and_prefect_never_the_stages():
    """The flows run the stages through DVC, never by import (one DAG); and like ops/ they never
    import the model side (train/, deploy/: torch), so a flow run that does nothing costs about
    what an empty Prefect flow costs."""
    for module, path in project_modules().items():
        if module.split(".")[0] != "orchestration":
            continue
        names = imported(path)
        found = {n for n in names if n.split(".")[0] == "pipeline"}
        found |= {
            n
            for n in names
            if n.split(".")[:2] in (["visionflow", "train"], ["visionflow", "deploy"])
        }
        found |= {n for n in names if n.split(".")[0] in ("torch", "torchvision")}
        assert not found, f"{module} imports {sorted(found)}"
    assert "prefect" in {n.split(".")[0] for n in imported(ROOT / "orchestration/reproduce.py")}


def test_no_import_circle_among_the_stages_and_the_flows():
    """Following imports (those inside functions too) from any module of `orchestration/` or
    `pipeline/` never leads back to it: each can be read, and loaded, on its own."""
    ours = project_modules()
    graph = {}
    for module, path in ours.items():
        # `from a import b`: an edge to a, and to a.b when b is a module
        graph[module] = {n for n in imported(path) if n in ours} - {module}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        for after in sorted(graph[module]):
            if after in path:
                circles.append(path[path.index(after) :] + [after])
            else:
                visit(after, [*path, after])

    for module in ours:
        visit(module, [module])
    assert not circles, " -> ".join(circles[0])


def test_data_and_ops_are_torch_free():
    for module, path in modules().items():
        if package(module) in TORCH_FREE:
            loaded = imported(path, at_import=True)
            torch = {n for n in loaded if n.split(".")[0] in ("torch", "torchvision")}
            assert not torch, f"{module} imports {sorted(torch)}"


def test_the_library_never_imports_prefect():
    """The flows (orchestration/) add Prefect to the library's ops, never the reverse.
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
    """No function in src/, pipeline/ or orchestration/ over 80 lines (docstring included); the training step,
    `train_one_epoch`, at most 60 lines and 8 parameters (docs/development.md: the two loops a
    reader sees at once)."""
    paths = [*(ROOT / "src/visionflow").rglob("*.py"), *(ROOT / "pipeline").glob("*.py")]
    paths += [*(ROOT / "orchestration").glob("*.py")]
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


def test_prefect_yaml_entrypoints_load_by_path_as_the_flows_the_modules_define():
    """A worker loads a deployment's flow by file path (`orchestration/spread.py:experiment`), as
    a module of its own (`spread`) beside the `orchestration.*` modules it imports: each
    entrypoint is the flow its module defines (the same name and parameters), and no module the
    flows use is loaded twice (once as `orchestration.x`, once as `x` from the folder Prefect
    puts on sys.path), so no state is split between two copies."""
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    entrypoints = [deployment["entrypoint"] for deployment in deployments]
    assert all(e.startswith("orchestration/") for e in entrypoints), entrypoints
    code = """
import importlib, json, sys
from prefect.flows import load_flow_from_entrypoint
found = []
for entrypoint in sys.argv[1:]:
    loaded = load_flow_from_entrypoint(entrypoint)
    path, name = entrypoint.split(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    imported = getattr(module, name)
    found.append([loaded.name == imported.name, loaded.parameters == imported.parameters])
files = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
loaded = tuple(entrypoint.split(":")[0] for entrypoint in sys.argv[1:])  # and imported here
ours = [f for f in files if "/orchestration/" in f and not f.endswith(loaded)]
copies = sorted({f for f in ours if ours.count(f) > 1})
print(json.dumps({"same": found, "copies": copies}))
"""
    env = {**os.environ, "PYTHONPATH": python_path(ROOT, ROOT / "src")}
    result = subprocess.run(
        [sys.executable, "-c", code, *entrypoints],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report == {"same": [[True, True]] * len(entrypoints), "copies": []}, report
