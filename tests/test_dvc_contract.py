"""The promises hold through DVC's own commands: `dvc repro`, `dvc exp run -S`, `dvc exp show`,
`dvc metrics`, `dvc plots`, `dvc push`/`pull`, `dvc exp push`/`pull` (not through our wrappers).

Real DVC in temporary git repos copied from the session's one reproduced project.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from tests.helpers import ROOT, commit, copy_project, env, python_path, sh
from visionflow.ops.project import stage_modules
from visionflow.params import Params, ParamsError, Section, load_params, read_yaml

STAGES = ["check", "prepare", "sanity", "train", "evaluate", "export"]


def ran(result) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", result.stdout)


def outputs(project: Path) -> dict[str, str]:
    """sha256 of every file a stage wrote, and of dvc.lock."""
    files = [project / "dvc.lock"]
    for top in ("results", "data/prepared"):
        files += [f for f in sorted((project / top).rglob("*")) if f.is_file()]
    return {str(f.relative_to(project)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@pytest.fixture(scope="module")
def project(reproduced_base, tmp_path_factory) -> Path:
    """A copy of the reproduced project that this module's tests may change (each puts it back)."""
    return copy_project(reproduced_base, tmp_path_factory.mktemp("contract") / "project")


@pytest.fixture(scope="module")
def viewed(reproduced_base, tmp_path_factory) -> Path:
    """A copy that no test changes, for the commands that only show (they write DVC's scratch)."""
    return copy_project(reproduced_base, tmp_path_factory.mktemp("viewed") / "project")


# --- 1. params are checked wherever DVC would run anything -------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["dvc", "repro"],
        ["dvc", "repro", "train"],
        ["dvc", "exp", "run"],
        ["dvc", "exp", "run", "-S", "train.lerning_rate=0.2"],
    ],
)
def test_a_typo_stops_plain_dvc_before_any_stage(project, command):
    params = (project / "params.yaml").read_text()
    (project / "params.yaml").write_text(params.replace("  lr: ", "  lerning_rate: 0.1\n  lr: "))
    before = outputs(project)
    try:
        result = sh(project, *command, check=False)
        assert result.returncode != 0
        assert "train.lerning_rate: unknown key; did you mean 'lr'?" in result.stderr
        assert ran(result) == ["check"]  # no other stage ran
        assert outputs(project) == before  # and no output, nor dvc.lock, was touched
    finally:
        (project / "params.yaml").write_text(params)
    assert ran(sh(project, "dvc", "repro")) == []


@pytest.mark.slow
def test_a_valid_edit_reruns_only_the_check(project):
    params = (project / "params.yaml").read_text()
    before = outputs(project)
    (project / "params.yaml").write_text("# a comment\n" + params)
    try:
        assert ran(sh(project, "dvc", "repro")) == ["check"]
        after = outputs(project)
        assert {k for k in before if before[k] != after[k]} == {"dvc.lock"}  # the same check output
    finally:
        (project / "params.yaml").write_text(params)
        sh(project, "dvc", "repro")


@pytest.mark.slow
def test_an_appended_key_fails_the_experiment(project):
    result = sh(project, "dvc", "exp", "run", "-S", "+train.epocs=3", check=False)
    assert result.returncode != 0
    assert "train.epocs: unknown key; did you mean 'epochs'?" in result.stderr
    sh(project, "git", "checkout", "HEAD", "--", "params.yaml")
    assert ran(sh(project, "dvc", "repro")) == []


# --- 2. one YAML for the checker and for DVC --------------------------------------------------

SHIPPED = (ROOT / "params.yaml").read_text()
CASES = {  # name: (the file, does our checker accept it)
    "off is a string (YAML 1.2)": (SHIPPED.replace("  amp: auto", "  amp: off"), True),
    "1e-3 is a float": (SHIPPED.replace("  lr: 1.0e-3", "  lr: 1e-3"), True),
    "a boolean is not a number": (SHIPPED.replace("  epochs: 20", "  epochs: true"), False),
    "on is not a boolean": (SHIPPED.replace("  hflip: false", "  hflip: on"), False),
    "a missing section": (
        SHIPPED[: SHIPPED.index("\nsanity:")] + SHIPPED[SHIPPED.index("\ntrain:") :],
        False,
    ),
    "a duplicate key": (SHIPPED.replace("  lr: 1.0e-3", "  lr: 1.0e-3\n  lr: 2.0e-3"), False),
}


@pytest.mark.parametrize("case", CASES)
def test_the_checker_reads_params_as_dvc_does(case, tmp_path):
    from dvc.utils.serialize import YAMLFileCorruptedError, parse_yaml

    text, accepted = CASES[case]
    path = tmp_path / "params.yaml"
    path.write_text(text)
    try:
        dvc_reads = parse_yaml(text, str(path))
    except YAMLFileCorruptedError:
        dvc_reads = None
        with pytest.raises(ParamsError, match="duplicate key"):
            load_params(path)
    if dvc_reads is not None:
        assert read_yaml(path) == dvc_reads  # the same values, types included
    if accepted:
        load_params(path)
    else:
        with pytest.raises(ParamsError):
            load_params(path)


@pytest.mark.slow
def test_dvc_and_the_checker_agree_on_the_same_files(project):
    """Through real `dvc repro check`: what DVC accepts, the check stage accepts, and a file DVC
    refuses (a duplicate key, a missing section that a stage lists) the checker refuses too."""
    shipped = (project / "params.yaml").read_text()
    try:
        for case, (text, accepted) in CASES.items():
            (project / "params.yaml").write_text(text)
            result = sh(project, "dvc", "repro", "check", check=False)
            assert (result.returncode == 0) == accepted, (case, result.stderr)
            if not accepted:
                assert "ERROR" in result.stderr, case
    finally:
        (project / "params.yaml").write_text(shipped)
    sh(project, "dvc", "repro", "check")


def listed_params() -> set[str]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {key for spec in stages.values() for key in spec.get("params", [])}


def test_a_key_is_required_exactly_when_a_stage_lists_it():
    """DVC refuses params.yaml without a key (or a section) that a stage lists, and does not care
    about others: a key is required when it is listed, or a section holding a listed key; a key
    inside a section listed whole (`train`) may have a default (DVC tracks the section by its
    value, so an unknown or changed key in it reruns the stage, whose own check names it)."""
    listed = listed_params()
    assert {"prepare", "sanity", "train", "evaluate", "export"} <= listed  # sections, whole

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            key = prefix + name
            if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
                yield from walk(field.annotation, key + ".")
            yield key, field

    keys = dict(walk(Params))
    assert listed <= set(keys)  # every listed key is a key of the model
    for key, field in keys.items():
        holds_listed = key in listed or any(k.startswith(key + ".") for k in listed)
        if holds_listed:
            assert field.is_required(), key
        elif not any(key.startswith(k + ".") for k in listed):  # outside every listed section
            assert not field.is_required(), key


# --- 3. a stage's code deps are the modules it can load, no more ------------------------------


def project_modules(module: str) -> set[str]:
    """Every project file that importing `module` (pipeline.<stage>) can load, lazy imports too
    (`visionflow.ops.project.stage_modules`, from which tools/stage_deps.py writes dvc.yaml)."""
    return set(stage_modules(ROOT, module.removeprefix("pipeline.")))


LIBRARY = "src/visionflow"


def stage_deps(stage: str) -> list[str]:
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]
    assert f"python -m pipeline.{stage} " in spec["cmd"]
    return spec["deps"]


def code_deps(stage: str) -> set[str]:
    """The stage's deps in src/ and pipeline/."""
    return {d for d in stage_deps(stage) if d.startswith(("src/", "pipeline/"))}


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_depends_on_exactly_the_modules_it_can_load(stage):
    """Derived from the imports, not kept by hand: a module the stage never loads is no dep (a
    comment in it reran train, evaluate and export), one it loads is; no folder (a new file in
    it reran the stage). `tools/stage_deps.py` writes them."""
    deps, loads = code_deps(stage), project_modules(f"pipeline.{stage}")
    assert deps == loads, (
        f"dvc.yaml stages.{stage}: missing {sorted(loads - deps)}, not loaded "
        f"{sorted(deps - loads)}: run tools/stage_deps.py"
    )


def reruns(path: str) -> set[str]:
    """The stages whose deps in dvc.yaml hold `path`: those a change to it reruns."""
    return {stage for stage in STAGES if path in code_deps(stage)}


def test_a_change_in_a_module_reruns_the_stages_that_load_it_and_no_other():
    """Issue #57: one comment in train/tta.py (train never imports it) reran train, evaluate and
    export, one in data/archive.py every stage."""
    assert reruns(f"{LIBRARY}/train/tta.py") == {"evaluate"}
    assert reruns(f"{LIBRARY}/data/archive.py") == {"prepare"}
    assert reruns(f"{LIBRARY}/deploy/export.py") == {"export"}
    assert reruns(f"{LIBRARY}/fit/run.py") == {"train"}
    assert "train" in reruns(f"{LIBRARY}/train/health.py")
    assert reruns(f"{LIBRARY}/deploy/serve.py") == set()
    assert reruns(f"{LIBRARY}/ops/runner.py") == reruns(f"{LIBRARY}/cli.py") == set()


def test_the_resume_key_reads_the_code_in_folder_deps(tmp_path, monkeypatch):
    """Resumable state is keyed by the content of the stage's code deps: a module in a folder dep
    counts, bytecode and an editor's hidden file do not."""
    from pipeline import code_digest

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib/engine.py").write_text("STEP = 1\n")
    (tmp_path / "stage.py").write_text("import lib.engine\n")
    stage = {"cmd": "python -m pipeline.train", "deps": ["stage.py", "lib"]}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": stage}}))
    (tmp_path / "params.yaml").write_text("train: {}\n")
    first = code_digest("train")
    (tmp_path / "lib/__pycache__").mkdir()
    (tmp_path / "lib/__pycache__/engine.cpython-311.pyc").write_bytes(b"bytecode")
    (tmp_path / "lib/.engine.py.swp").write_bytes(b"vim")
    assert code_digest("train") == first
    (tmp_path / "lib/engine.py").write_text("STEP = 2\n")
    assert code_digest("train") != first


def test_the_import_reading_sees_what_python_loads():
    """The reading above is a superset of what a real import of the train stage loads."""
    code = (
        "import sys, pipeline.train; print('\\n'.join(m.__file__ for m in list(sys.modules.values())"
        " if getattr(m, '__file__', None)))"
    )
    env = {**os.environ, "PYTHONPATH": python_path(ROOT, ROOT / "src")}
    loaded = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    files = [Path(f).resolve() for f in loaded]
    ours = {str(f.relative_to(ROOT)) for f in files if f.is_relative_to(ROOT / "pipeline")} | {
        str(f.relative_to(ROOT)) for f in files if f.is_relative_to(ROOT / "src/visionflow")
    }
    assert "src/visionflow/train/health.py" in ours and ours <= project_modules("pipeline.train")


def stale(project: Path) -> set[str]:
    return set(json.loads(sh(project, "dvc", "status", "--json").stdout))


@pytest.mark.slow
def test_a_comment_reruns_the_stages_that_run_its_module_and_bytecode_none(project):
    """Through real `dvc status` (issue #57): a comment in a module a stage does not load leaves
    it clean (train/tta.py reran train, evaluate and export; data/archive.py every stage), one in
    a module it loads makes it stale; the bytecode Python writes when the stages' modules are
    imported, and an editor's swap, backup and auto-save files, make nothing stale."""
    for module, expected in [
        ("train/tta.py", {"evaluate"}),
        ("data/archive.py", {"prepare"}),
        ("train/engine.py", {"train", "evaluate"}),
        ("deploy/serve.py", set()),
    ]:
        path = project / "src/visionflow" / module
        text = path.read_text()
        path.write_text(text + "\n# an edit\n")
        try:
            assert stale(project) == expected, module
        finally:
            path.write_text(text)
    stages = "; ".join(f"import pipeline.{stage}" for stage in STAGES)
    bytecode = {k: v for k, v in env(project).items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", stages], cwd=project, env=bytecode, check=True)
    assert list((project / "src/visionflow/deploy").glob("__pycache__/*.pyc"))
    editors = [
        ".engine.py.swp",
        "engine.py~",
        "#engine.py#",
    ]  # vim's swap, emacs's backup, auto-save
    for name in editors:
        (project / "src/visionflow/train" / name).write_bytes(b"an editor's")
    try:
        assert stale(project) == set()
    finally:
        for junk in (project / "src").rglob("__pycache__"):
            shutil.rmtree(junk)
        for name in editors:
            (project / "src/visionflow/train" / name).unlink()


# --- 4. dvc.lock matches the committed code, and a rerun writes it again ---------------------


def folder_md5(folder: str, tracked: set[str]) -> str:
    """DVC's hash of a code folder, from the files git tracks in it (a clean clone's; bytecode and
    editor files are neither tracked nor hashed): the md5 of its sorted JSON listing, + ".dir"."""
    listing = [
        {"md5": hashlib.md5((ROOT / f).read_bytes()).hexdigest(), "relpath": f[len(folder) + 1 :]}
        for f in tracked
        if Path(f).is_relative_to(folder)
    ]
    listing.sort(key=lambda entry: tuple(entry["relpath"].split("/")))
    return hashlib.md5(json.dumps(listing, sort_keys=True).encode()).hexdigest() + ".dir"


def test_dvc_lock_matches_the_code():
    """Every file and code folder that dvc.lock records (code, params.yaml) has the md5 the lock
    says: a commit that changes a stage without rerunning it fails here, in CI, rather than on a
    user's clone."""
    tracked = set(
        subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    )
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert set(lock) == set(stages), "dvc.lock lacks a stage: run `dvc repro`"
    stale = []
    for name, entry in lock.items():
        for dep in entry["deps"]:
            path = dep["path"]
            if path in tracked and not dep["md5"].endswith(".dir"):
                if hashlib.md5((ROOT / path).read_bytes()).hexdigest() != dep["md5"]:
                    stale.append(f"{name}: {path}")
            elif path.startswith("src/") and folder_md5(path, tracked) != dep["md5"]:
                stale.append(f"{name}: {path}/")
        listed = {d.replace("${prepare.path}", "data/raw") for d in stages[name].get("deps", [])}
        assert {d["path"] for d in entry["deps"]} == listed, f"{name}: deps differ from dvc.yaml"
    assert not stale, f"dvc.lock predates the code; run `dvc repro` and commit dvc.lock: {stale}"


@pytest.mark.slow
def test_dvc_repro_f_reproduces_dvc_lock_and_every_output_byte_for_byte(reproduced_base, tmp_path):
    """The same code, data and params give the same bytes: a forced rerun of every stage leaves
    dvc.lock, every output, `git status` and the DVC cache as they were. Before, train's curves
    and health.json held the run's images/s, epoch seconds, peak memory and data wait, and
    export's latency.json and model card its latency: every run gave train and export new hashes
    in dvc.lock and new copies in the cache. The timings are still written, beside the outputs,
    in results/<stage>.timings/, which DVC neither hashes nor stores."""
    project = copy_project(reproduced_base, tmp_path / "project")

    def cached() -> set[Path]:
        return {f for f in (project / ".dvc/cache").rglob("*") if f.is_file()}

    def hashed(files: dict[str, str]) -> dict[str, str]:
        return {path: sha for path, sha in files.items() if ".timings/" not in path}

    before, cache = outputs(project), cached()
    rerun = sh(project, "dvc", "repro", "-f")
    assert sorted(ran(rerun)) == sorted(STAGES)
    after = outputs(project)
    assert hashed(after) == hashed(before)  # dvc.lock among them
    assert sh(project, "git", "status", "--porcelain").stdout == ""
    assert cached() == cache
    timings = set(after) - set(hashed(after))
    assert {
        "results/train.timings/plots/metrics/train/images_per_s.tsv",
        "results/train.timings/plots/metrics/epoch_seconds.tsv",
        "results/train.timings/health.json",  # the data wait, and the data-bound check
        "results/export.timings/latency.json",
    } <= timings
    latency = json.loads((project / "results/export.timings/latency.json").read_text())
    assert {"onnx", "onnx_int8"} <= set(latency["batch_1"])
    assert set(latency["int8_faster_than_fp32"]) == {"batch_1", "batch_64"}


# --- 5. metrics people compare ----------------------------------------------------------------


def leaves(tree) -> list:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in leaves(value)]
    return [tree]


@pytest.mark.slow
def test_metrics_are_few_and_describe_the_kept_model(viewed):
    shown = json.loads(sh(viewed, "dvc", "metrics", "show", "--json").stdout)
    files = shown[""]["data"]
    numbers = leaves({path: f["data"] for path, f in files.items()})
    assert 10 <= len(numbers) <= 25
    assert all(isinstance(n, (int, float)) for n in numbers)
    train = files["results/train/metrics.json"]["data"]
    meta = torch.load(viewed / "results/train/model.pt", weights_only=True)["meta"]
    assert (train["best_epoch"], train["val_acc"]) == (meta["epoch"], meta["val_accuracy"])
    scores = json.loads((viewed / "results/evaluate/scores.json").read_text())
    assert files["results/evaluate/metrics.json"]["data"]["accuracy"] == scores["accuracy"]
    assert len(scores["per_class"]) == 10  # the details stay in a file


@pytest.mark.slow
@pytest.mark.longest
def test_exp_show_after_two_experiments_fits_160_columns(project):
    sh(project, "dvc", "exp", "run", "-S", "train.lr=1e-2", "-S", "train.epochs=3")
    sh(project, "dvc", "exp", "run", "-S", "sanity.per_class=3")  # one more column: check, sanity
    # what docs/experiments.md warns of: an experiment run in the workspace leaves its values in
    # params.yaml, so the second one ran with the first's lr and epochs too
    params = yaml.safe_load((project / "params.yaml").read_text())
    assert (params["train"]["lr"], params["train"]["epochs"]) == (1e-2, 3)
    assert params["sanity"]["per_class"] == 3 and sh(project, "git", "status", "--porcelain").stdout
    env_columns = {**os.environ, "COLUMNS": "160"}
    table = subprocess.run(
        [str(Path(sys.executable).parent / "dvc"), "exp", "show", "--only-changed", "--no-pager"],
        cwd=project,
        env=env_columns,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sh(project, "git", "checkout", "HEAD", "--", "params.yaml", "dvc.lock")
    sh(project, "dvc", "checkout")
    header = next(line for line in table.splitlines() if "Experiment" in line)
    assert max(len(line) for line in table.splitlines()) <= 160
    for column in (
        "accuracy",
        "macro_f1",
        "top_k_acc",
        "val_acc",
        "train.lr",
        "train.epochs",
        "sanity.per_class",
    ):
        assert re.search(rf"\b{re.escape(column)}\b", header), (column, table)


# --- 6. plots read right ----------------------------------------------------------------------


def field_names(spec) -> list[str]:
    """Every "field" a Vega-Lite spec (or part of one) reads."""
    if isinstance(spec, list):
        return [name for value in spec for name in field_names(value)]
    if not isinstance(spec, dict):
        return []
    own = [spec["field"]] if isinstance(spec.get("field"), str) else []
    return own + [name for value in spec.values() for name in field_names(value)]


@pytest.mark.slow
def test_plots_draw_every_curve_and_read_right(viewed):
    specs = json.loads(sh(viewed, "dvc", "plots", "show", "--json").stdout)["data"]
    vega = {
        name: plots[0]["content"] for name, plots in specs.items() if plots[0]["type"] == "vega"
    }
    assert {"loss", "accuracy", "learning rate", "confusion", "most confused"} <= set(vega)
    assert {"results/evaluate/top_losses.png", "results/sanity/eval_view.png"} <= set(specs)
    layers = [n for n in vega if "grad_norm_layer" in n]
    assert len(layers) == 8  # simple_cnn's four weights and four biases, each a curve
    for name, spec in vega.items():  # Vega reads "a.b" as a nested field: no curve would show
        encoding = spec.get("encoding") or spec["spec"]["encoding"]
        assert all("." not in field for field in field_names(encoding)), name
    lr = vega["learning rate"]["encoding"]["y"]
    assert lr["scale"]["type"] == "log" and lr["axis"]["format"] == ".1e"  # 1e-3, not "0"
    confusion = json.dumps(vega["confusion"])
    assert '"title": "true class"' in confusion and '"title": "predicted class"' in confusion
    x, y = vega["confusion"]["spec"]["encoding"]["x"], vega["confusion"]["spec"]["encoding"]["y"]
    assert (x["field"], y["field"]) == ("predicted", "actual")  # as confusion.png: true on y
    diff = json.loads(sh(viewed, "dvc", "plots", "diff", "HEAD", "--json").stdout)["data"]
    assert set(diff) == set(specs)  # the manual's `dvc plots diff HEAD` draws the same plots


@pytest.mark.slow
def test_parity_differences_survive_dvc_rounding(viewed):
    metrics = json.loads((viewed / "results/export/metrics.json").read_text())
    parity = json.loads((viewed / "results/export/parity.json").read_text())
    worst = max(
        r["max_abs_diff"] for f in ("onnx", "pt2", "torchscript") for r in parity[f].values()
    )
    assert metrics["diff_e6"] == round(worst * 1e6, 4)
    shown = sh(viewed, "dvc", "metrics", "show", "--md").stdout
    assert worst > 0  # ONNX Runtime's kernels round otherwise than eager PyTorch's
    assert f"| {metrics['diff_e6']} " in shown  # not rounded away to 0.0


# --- 7. a DVC remote, end to end --------------------------------------------------------------


@pytest.mark.slow
def test_a_teammate_pulls_results_and_experiments_without_training(reproduced_base, tmp_path):
    """The manual's "Share results": push from one clone, pull into a fresh one, nothing retrains."""
    origin, storage = tmp_path / "origin.git", tmp_path / "dvc-storage"
    first = copy_project(reproduced_base, tmp_path / "first")
    sh(tmp_path, "git", "init", "-q", "--bare", "-b", "main", str(origin))
    sh(first, "git", "remote", "add", "origin", str(origin))
    sh(first, "dvc", "remote", "add", "-d", "storage", str(storage))
    commit(first, "a DVC remote")
    sh(first, "dvc", "push", "--run-cache")
    sh(first, "git", "push", "-q", "origin", "main")

    second = tmp_path / "second"
    sh(tmp_path, "git", "clone", "-q", str(origin), str(second))
    sh(second, "dvc", "pull")
    assert "up to date" in sh(second, "dvc", "status").stdout
    assert ran(sh(second, "dvc", "repro")) == []
    image = tmp_path / "digit.png"
    Image.fromarray(np.load(second / "data/prepared/test_x.npy")[0, ..., 0]).save(image)
    predicted = sh(second, sys.executable, "-m", "visionflow.cli", "predict", "--json", str(image))
    assert json.loads(predicted.stdout)["predictions"][0]["class"] in map(str, range(10))

    sh(first, "dvc", "exp", "run", "-n", "bigger-grid", "-S", "sanity.per_class=12")
    sh(first, "dvc", "exp", "push", "origin", "bigger-grid")
    sh(second, "dvc", "exp", "pull", "origin", "bigger-grid")
    listed = sh(second, "dvc", "exp", "show", "--json").stdout
    assert '"bigger-grid"' in listed
    sh(second, "dvc", "exp", "apply", "bigger-grid")
    assert "up to date" in sh(second, "dvc", "status").stdout  # the results came with it
    assert yaml.safe_load((second / "params.yaml").read_text())["sanity"]["per_class"] == 12
