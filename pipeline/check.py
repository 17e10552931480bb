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
import subprocess
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
            return missing_weights(t.pretrained)
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


TEMP_COPIES = (".dvc", "tmp", "exps")  # where `dvc exp run --temp` and queued experiments run


def missing_weights(pretrained: str) -> str:
    """The line for a weights file that is not here. An experiment's temporary copy of the
    project (`dvc exp run --temp`, a queued one: under the workspace's .dvc/tmp/exps/) holds only
    what git and DVC track, so a file the workspace has but neither tracks stays behind (#58:
    check said `... is not a file`, beside the file)."""
    path, here = Path(pretrained), Path.cwd().resolve()
    track = f"`dvc add {pretrained}` (and commit {pretrained}.dvc)"
    copies = [i for i in range(len(here.parts)) if here.parts[i : i + 3] == TEMP_COPIES]
    if Path(f"{pretrained}.dvc").is_file():  # tracked, not checked out
        return f"train.pretrained: {pretrained} is tracked by DVC but not here: " + (
            "an experiment that names a stage checks out that stage's deps only: name train, "
            "or no stage"
            if copies
            else f"`dvc checkout {pretrained}` (or `dvc pull {pretrained}`)"
        )
    if copies and not path.is_absolute():
        workspace = Path(*here.parts[: copies[-1]])
        if (workspace / path).is_file():
            return (
                f"train.pretrained: {pretrained} is in the workspace ({workspace}) but not in "
                "this experiment's temporary copy, which holds only what git and DVC track: "
                f"run {track}, then the experiment again"
            )
    inside = not path.is_absolute() and not pretrained.startswith("..")
    return (
        f"train.pretrained: {pretrained} is not a file (a state_dict, or a weights name such as DEFAULT)"
        + (
            f"; an experiment's temporary copy (`dvc exp run --temp`, a queued one) has only what git "
            f"and DVC track: {track} in the workspace"
            if inside
            else ""
        )
    )


def untracked_weights(pretrained: str) -> str | None:
    """The warning for a weights file here that neither git nor DVC tracks (a `.dvc` file for
    it or a folder above it, or git's index): plain `dvc repro` reads it, but `dvc exp run
    --temp`, queued experiments and other clones will not have it. None where git cannot tell
    (no git, not a repository)."""
    file = Path(pretrained).resolve()
    if not file.is_relative_to(Path.cwd().resolve()):
        return None  # outside the project: network_problem refuses it
    relative = file.relative_to(Path.cwd().resolve())
    if any(Path(f"{p}.dvc").is_file() for p in [relative, *relative.parents] if p != Path(".")):
        return None
    try:
        git = subprocess.run(
            ["git", "ls-files", "--error-unmatch", "--", str(relative)],
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if git.returncode != 1:  # 0: tracked; 128: no repository here
        return None
    return (
        f"train.pretrained {relative} is tracked by neither git nor DVC: `dvc exp run --temp`, "
        f"queued experiments and other clones will not have it; `dvc add {relative}` tracks it"
    )


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
    pretrained = params.train.pretrained
    if pretrained and Path(pretrained).is_file():  # not a weights name
        if warning := untracked_weights(pretrained):
            print(f"check: warning: {warning}")
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
