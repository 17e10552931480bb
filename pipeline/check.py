"""Stage check: params.yaml is valid, as a whole, before any other stage runs.

Every other stage depends on this stage's output, so plain `dvc repro`, `dvc repro <stage>`,
`dvc exp run -S ...` and queued experiments run it first whenever params.yaml changed at all: an
unknown key, a wrong type, a missing key or an invalid value stops the pipeline here, naming the key,
before any stage runs or any output is touched. The output's bytes are the same for every valid
file, so a valid edit reruns only the stages whose own params changed. No torch for the project's
own models (about a second); a torchvision classifier is looked up in torchvision's registry, with
the input size it needs and the weights it names, and a network of your own must be a train dep.

Reads:  params.yaml
Writes: <out>/params.json (the same bytes for every valid params.yaml)
Run:    python -m pipeline.check --out results/check      (or: dvc repro check)
"""

import argparse
from pathlib import Path

from pipeline import GateError, run
from visionflow.errors import Unavailable
from visionflow.params import Params, Train, load_params, read_file
from visionflow.train import OWN_MODELS, from_torchvision


def network_problem(t: Train, image_size: int) -> str | None:
    """The line refusing train.model / train.pretrained, or None."""
    from visionflow.train import zoo  # torch: only for what is not the project's own

    if zoo.is_import_path(t.model):
        return own_code_problem(t.model)
    problem = zoo.unknown_model(t.model)
    if problem:
        return problem
    if t.pretrained == "imagenet" and t.model != "resnet18":
        return "train.pretrained: imagenet is resnet18's name for its weights: use DEFAULT"
    if t.pretrained and not zoo.is_weights_name(t.pretrained):
        if not Path(t.pretrained).is_file():
            return f"train.pretrained: {t.pretrained} is not a file (a state_dict, or a weights name such as DEFAULT)"
        if problem := untracked(
            "train.pretrained", Path(t.pretrained), where=" (or move it into data/pretrained/)"
        ):
            return problem
    try:
        problem = zoo.size_problem(t.model, image_size, t.pretrained)
    except Unavailable as e:  # an unknown weights name
        return f"train.pretrained: {e}"
    if problem or not t.pretrained:
        return problem
    if zoo.is_weights_name(t.pretrained):  # fetched now: offline is said before train starts
        try:
            zoo.fetch(t.model, t.pretrained)
        except Unavailable as e:
            return f"train.pretrained: {e}"
        return None
    # a file for another architecture, truncated, pickled: said now, not after DVC has
    # deleted the train stage's results
    return zoo.fit_problem(t.model, t.pretrained, zoo.input_size(t.model, image_size, t.pretrained))


def tta_problem(params: Params) -> str | None:
    """The line refusing evaluate.tta for a model with no view but the plain one: its input is the
    whole cached image (no crop to shift) and it never saw a mirrored image (tta.py)."""
    t, size = params.train, params.prepare.image_size
    if not params.evaluate.tta or t.augment.hflip:
        return None
    if t.pretrained and from_torchvision(t.model, t.pretrained):
        from visionflow.train import zoo

        if zoo.input_size(t.model, size, t.pretrained) < size:
            return None
    return (
        f"evaluate.tta: {t.model} takes the whole {size} px cached image (no crop to shift) "
        "and train.augment.hflip is false (no mirror it learnt): there is no view to average; "
        "set train.augment.hflip: true, or evaluate.tta: false"
    )


def untracked(key: str, path: Path, what: str = "", where: str = "") -> str | None:
    """The line refusing a file that train reads but DVC does not track as one of its deps (out
    of the project, or not under a train dep in dvc.yaml): a change to it would rerun nothing."""
    file = path.resolve()
    if not file.is_relative_to(Path.cwd()):
        return f"{key}: {what}{file}, outside the project: DVC cannot track it"
    relative = file.relative_to(Path.cwd())
    deps = ((read_file(Path("dvc.yaml")).get("stages") or {}).get("train") or {}).get("deps") or []
    if not any(relative.is_relative_to(Path(dep)) for dep in deps if isinstance(dep, str)):
        return (
            f"{key}: {relative} is not among the train stage's deps in dvc.yaml: add "
            f"`- {relative}` there{where}, so that DVC reruns train when it changes"
        )
    return None


def own_code_problem(model: str) -> str | None:
    """A network of your own must be a file in the project that the train stage lists as a dep
    (else DVC would not rerun train when it changes), and import."""
    import importlib.util

    from visionflow.train import zoo

    module = model.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except Exception as e:  # a package's __init__ runs here: any error
        spec, why = None, f" ({type(e).__name__}: {e})"
    else:
        why = ""
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        return f"train.model: cannot find module {module} in the project{why}"
    if problem := untracked("train.model", Path(spec.origin), f"{module} is "):
        return problem
    try:  # a module that raises on import: said now, not as a traceback from train
        zoo.builder_of(model)
    except ValueError as e:
        return str(e)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description="Validate params.yaml before any stage runs.")
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    args = parser.parse_args()
    params = load_params()  # raises ParamsError naming every bad key
    if params.train.model not in OWN_MODELS or params.train.pretrained:
        problem = network_problem(params.train, params.prepare.image_size)
        if problem:
            raise GateError(problem)
    problem = tta_problem(params)
    if problem:
        raise GateError(problem)
    t = params.train
    if t.freeze_epochs >= t.epochs:
        print(
            f"check: warning: train.freeze_epochs {t.freeze_epochs} >= train.epochs {t.epochs}: "
            "the backbone never trains, only the new head"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "params.json").write_text('{"params.yaml": "valid"}\n')
    print("check: params.yaml is valid")
    # a gate's failed report beside the stages' folders (results/export.miss.json) was about
    # other params: the stage may now be restored from DVC's run-cache without running
    for stale in sorted(args.out.parent.glob("*.miss.json")):
        stale.unlink()
        print(f"check: removed {stale}: its miss was under other params")


if __name__ == "__main__":
    run(main)
