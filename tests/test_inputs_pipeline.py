"""Odd inputs around the pipeline get one line naming the file and what to do, never DVC's words
that name nothing, a traceback, or a silent "up to date": a symlinked params.yaml or dvc.yaml, a
typo under `dvc repro -s train`, an unreadable params.yaml or dvc.yaml, a `prepare.path` that
overlaps an output, a link to nothing among the deps, an empty dvc.lock (issue #29: 4, 9, 12, 13).

Real DVC on copies of the session's reproduced project; the pre-check cases refuse before DVC runs.
"""

import json
import re
import sys
from pathlib import Path

import pytest

from tests.helpers import copy_project, sh

pytestmark = pytest.mark.slow


def visionflow_repro(project: Path, *args: str):
    return sh(project, sys.executable, "-m", "visionflow.cli", "repro", *args, check=False)


def refused(result) -> list[str]:
    """The lines `visionflow repro` refused with (exit 1, DVC never started)."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Running stage" not in result.stdout and "Traceback" not in result.stderr
    return result.stderr.splitlines()


def test_a_symlinked_params_or_dvc_yaml_is_refused_naming_its_target(reproduced_base, tmp_path):
    """Before, a linked params.yaml passed the check, then `dvc exp run --queue -S` lost the edit
    ("Could not apply stash commit"); a linked dvc.yaml made DVC look for params.yaml beside the
    target ("Could not find 'prepare.path'")."""
    project = copy_project(reproduced_base, tmp_path / "project")
    (project / "conf").mkdir()
    (project / "params.yaml").rename(project / "conf/params.yaml")
    (project / "params.yaml").symlink_to("conf/params.yaml")
    with open(project / "conf/params.yaml", "a") as params:
        params.write("# an edit: the check stage reruns\n")
    copy = 'cp --remove-destination "$(readlink -f params.yaml)" params.yaml'

    checked = sh(project, sys.executable, "-m", "visionflow.params", check=False)
    assert checked.returncode == 1
    assert checked.stderr == (
        "error: params.yaml is a symbolic link to conf/params.yaml: DVC needs the file itself; "
        f"replace the link with the file: {copy}\n"
    )
    stage = sh(project, "dvc", "repro", "check", check=False)
    assert stage.returncode != 0
    assert "error: params.yaml is a symbolic link to conf/params.yaml" in stage.stderr
    [line] = refused(visionflow_repro(project))
    assert line.startswith(f"error: {project / 'params.yaml'} is a symbolic link to conf/params")

    (project / "params.yaml").unlink()
    (project / "conf/params.yaml").rename(project / "params.yaml")
    (project / "dvc.yaml").rename(project / "conf/dvc.yaml")
    (project / "dvc.yaml").symlink_to("conf/dvc.yaml")
    [line] = refused(visionflow_repro(project))
    assert f"{project / 'dvc.yaml'} is a symbolic link to conf/dvc.yaml" in line
    assert "cp --remove-destination" in line


def test_a_typo_under_dvc_repro_of_one_stage_is_named_by_the_stage(reproduced_base, tmp_path):
    """Before, `dvc repro -s train` skips `check` and train listed its keys one by one: DVC saw no
    change and said "Data and pipelines are up to date." Now train lists its section whole."""
    project = copy_project(reproduced_base, tmp_path / "project")
    params = (project / "params.yaml").read_text()
    (project / "params.yaml").write_text(params.replace("\n  lr: ", "\n  lrr: 0.1\n  lr: ", 1))
    result = sh(project, "dvc", "repro", "-s", "train", check=False)
    assert result.returncode != 0
    assert re.findall(r"Running stage '(\w+)'", result.stdout) == ["train"]
    assert "train.lrr: unknown key; did you mean 'lr'?" in result.stderr
    assert "train" in json.loads(sh(project, "dvc", "status", "--json").stdout)
    diff = json.loads(sh(project, "dvc", "params", "diff", "--json").stdout)
    assert diff == {"params.yaml": {"train.lrr": {"old": None, "new": 0.1}}}


@pytest.mark.parametrize(
    ("name", "before", "after", "problem"),
    [
        (
            "params.yaml",
            "\n  lr: ",
            "\n\tlr: ",
            "found character '\\t' that cannot start any token",
        ),
        ("params.yaml", "\n  lr: ", "\n  lr: 0.1\n  lr: ", 'found duplicate key "lr"'),
        ("params.yaml", "\n  lr: ", "\n  lr: !!python/name:os.system\n  x: ", "python/name"),
        ("dvc.yaml", "\n  check:\n", "\n  check: [\n", "expected ',' or ']'"),
    ],
)
def test_an_unreadable_params_or_dvc_yaml_is_one_line(
    reproduced_base, tmp_path, name, before, after, problem
):
    """Before, `visionflow repro` (and `make repro`) printed a 20-line traceback: the pre-check read
    the file before the check stage could name it."""
    project = copy_project(reproduced_base, tmp_path / "project")
    text = (project / name).read_text()
    (project / name).write_text(text.replace(before, after, 1))
    [line] = refused(visionflow_repro(project))
    assert line.startswith(f"error: cannot read {project / name}: ") and problem in line
    assert re.search(r" \(line \d+\)$", line)


def test_dvcs_wordless_refusals_are_named_before_it_runs(reproduced_base, tmp_path):
    """A `prepare.path` holding an output (DVC: "Same item(s) are defined as both a dependency and
    an output"), a link to nothing in a class folder (`dvc status`: "unexpected error") and an
    empty dvc.lock ("validation failed / required key not provided"): all three named at once, by
    `visionflow repro` and by the flows' first task; the overlap by the params check too."""
    from orchestration.reproduce import changed

    project = copy_project(reproduced_base, tmp_path / "project")
    params = (project / "params.yaml").read_text()
    (project / "params.yaml").write_text(params.replace("  path: data/raw\n", "  path: data\n"))
    (project / "data/raw/cat").mkdir(parents=True)
    link = project / "data/raw/cat/001.png"
    link.symlink_to("/gone/001.png")
    (project / "dvc.lock").write_text("")

    overlap = (
        "prepare.path: data holds data/prepared (stage prepare's output): DVC refuses a dep that "
        "overlaps an output; point prepare.path at a folder of its own (data/raw, say)"
    )
    dangling = (
        f"{link} is a link to /gone/001.png, which does not exist: DVC cannot hash it; remove the "
        "link, or put its target back"
    )
    empty = (
        f"{project / 'dvc.lock'} is empty or not a DVC lock file (it records no stages): `git "
        "checkout dvc.lock` brings back the committed one, or delete it and DVC reruns every stage"
    )
    lines = [f"{project / 'params.yaml'}: {overlap}", dangling, empty]
    assert refused(visionflow_repro(project)) == [f"error: {line}" for line in lines]
    with pytest.raises(Exception, match=re.escape("; ".join(lines))):
        changed.fn(project)
    checked = sh(project, sys.executable, "-m", "visionflow.params", check=False)
    assert checked.returncode == 1 and f"  {overlap}\n" in checked.stderr
