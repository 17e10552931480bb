"""The fine-tuning recipe (#46): the learning-rate range test (`visionflow lr-find`, `train.lr:
auto`), the one-cycle schedule per step, rates per layer group, BatchNorm while the backbone is
frozen, and the recipe's defaults when `train.pretrained` is set."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from torch import nn

from tests.helpers import (
    ROOT,
    assert_resumes_to_the_baseline,
    copy_project,
    env,
    repro,
    weights,
    write_params,
)

MEAN, STD = torch.tensor([0.5] * 3), torch.tensor([0.25] * 3)


def params_with(train: dict) -> dict:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    return {**raw, "train": {**raw["train"], **train}}


@pytest.mark.slow
@pytest.mark.longest
def test_lr_auto_with_onecycle_records_the_rate_and_resumes_after_a_stop_as_uninterrupted(
    reproduced_base, tmp_path
):
    project = copy_project(reproduced_base, tmp_path / "project")
    write_params(project, {"train": {"lr": "auto", "scheduler": "onecycle", "epochs": 3}})
    whole = repro(project, "-s", "train")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    said = re.search(r"train: train.lr auto: (\S+), the range test's \((\d+) steps", whole.stdout)
    assert said, whole.stdout
    metrics = json.loads((project / "results/train/metrics.json").read_text())
    saved = torch.load(project / "results/train/model.pt", weights_only=True)
    rate = metrics["lr"]
    assert f"{rate:.2e}" == said[1] and saved["meta"]["train"]["lr"] == rate
    assert saved["meta"]["train"]["lr_found"] is True
    curve = json.loads((project / "results/train/live/metrics.json").read_text())
    assert curve["lr"] < rate / 1000  # one cycle, annealed to its end (per step, over 3 epochs)
    baseline = weights(project)

    killed = repro(project, "-f", "-s", "train", fault="train.epoch_end@epoch=2:kill")
    assert killed.returncode != 0
    resumed = assert_resumes_to_the_baseline(project, 2, baseline, "train")  # a new model:
    # its rate and schedule resumed too
    assert f"train.lr auto: {rate:.2e}, the range test's (recorded in " in resumed.stdout
    assert json.loads((project / "results/train/metrics.json").read_text())["lr"] == rate

    # `visionflow lr-find`: the same test on the same model and data, a plot and one line
    found = subprocess.run(
        [sys.executable, "-m", "visionflow.cli", "lr-find"],
        cwd=project,
        env=env(project),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert found.returncode == 0, found.stdout + found.stderr
    line = found.stdout.strip().splitlines()[-1]
    assert line.startswith(f"lr-find: suggested train.lr {rate:.2e} (simple_cnn, "), line
    assert (project / "results/lr_find/lr_find.png").stat().st_size > 0
    curve = json.loads((project / "results/lr_find/lr_find.json").read_text())
    assert curve["suggestion"] == rate and len(curve["rates"]) == int(said[2])

    # --out naming a file: one line before the test, not a traceback after it
    cli = [sys.executable, "-m", "visionflow.cli", "lr-find"]
    bad = subprocess.run(
        [*cli, "--out", "params.yaml"],
        cwd=project,
        env=env(project),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: --out params.yaml is a file: name a folder for lr_find.png and .json"
    )
    # Ctrl-C (to the group, as a terminal sends it): the range test's one line, no traceback;
    # and the cache no longer what params.yaml makes: said before the test runs on it
    write_params(project, {"prepare": {"image_size": 12}})
    started = tmp_path / "started"
    fault = f"stage.start@stage=lr_find:touch={started};stage.start@stage=lr_find:pause=never"
    stopped = subprocess.Popen(
        cli,
        cwd=project,
        env=env(project, fault),
        start_new_session=True,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    while not started.exists():  # the stage reached its start (or died: then it never will)
        assert stopped.poll() is None, stopped.communicate()[1]
        time.sleep(0.05)
    os.killpg(stopped.pid, signal.SIGINT)
    _, err = stopped.communicate(timeout=300)
    assert stopped.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted: stopped at once", err
    assert "lr-find: warning: data/prepared is not what params.yaml and the data make now" in err


class Broken(nn.Module):
    """A network whose loss is never finite: no rate to find."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        return self.fc(x.mean((2, 3))) * float("nan")


def test_a_range_test_that_finds_no_rate_is_one_line_naming_the_key():
    from visionflow.fit.lr_auto import no_rate
    from visionflow.params import parse_params
    from visionflow.train.engine import Split, Step
    from visionflow.train.lr_find import range_test, valley

    x, y = torch.randint(0, 255, (32, 8, 8, 3), dtype=torch.uint8), torch.arange(32) % 4
    model = Broken()
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0)
    split = Split(x, y, MEAN, STD, torch.Generator().manual_seed(0))
    found = range_test(model, optimizer, split, Step(8))
    assert found["suggestion"] is None and found["rates"] == []
    t = parse_params(params_with({"lr": "auto"})).train
    message = no_rate(t, found)
    assert message.startswith("train.lr: auto: the range test found no rate for simple_cnn")
    assert "\n" not in message
    rising = [float(i) for i in range(50)]
    assert valley([10.0**-i for i in range(50)], rising) is None  # never downhill: nothing
    falling = [1.0 / (i + 1) for i in range(30)] + [5.0] * 3
    rates = [10.0 ** (i / 10) for i in range(33)]
    assert valley(rates, falling) == rates[14]  # two thirds of the way down, then half a third


def test_the_suggestion_and_the_plot_leave_out_the_settling_start_and_the_blow_up():
    """#58: fastai's lr_find searches its valley from the test's tenth step to the fifth point
    from its end, and plots without those last points; visionflow searched and plotted all of
    them, its y axis running to 22.5 over a curve that fell from 2.3 (a flat line)."""
    from visionflow.train.lr_find import range_test_figure, suggest, valley

    rates = [1e-7 * 1e8 ** (i / 99) for i in range(86)]
    settling = [3.0 - 0.07 * i for i in range(10)]  # the smoothed loss of the first batches
    flat = [2.3 + 0.001 * (i % 2) for i in range(40)]
    falling = [2.3 - 0.06 * i for i in range(30)]
    losses = settling + flat + falling + [0.5 * 1.6**i for i in range(1, 6)] + [22.5]
    assert valley(rates, losses) == rates[57]  # its stretch begun in the settling start
    assert suggest(rates, losses) == rates[63]  # a third and a half down the fall itself
    result = {"rates": rates, "losses": losses, "suggestion": rates[63]}
    ax = range_test_figure(result, "test").axes[0]
    curve, marked = ax.get_lines()[0], ax.get_lines()[-1]
    assert len(curve.get_xdata()) == len(rates) - 5  # without the blow-up
    assert 3.0 < ax.get_ylim()[1] < 4.0  # the start, what the loss fell from, is the top
    assert list(marked.get_xdata()) == [rates[63]] and marked.get_label() == "suggested 1.23e-02"
    assert any(list(line.get_xdata()) == [rates[63]] * 2 for line in ax.get_lines())  # a rule


def test_the_suggestion_is_fastais_valley_on_fastais_own_curve():
    """Parity with fastai's `lr_find`: its recorded rates and smoothed losses (tests/data, #58's
    photos), and the valley it suggested. The rule before #58 (every point) said 3.98e-4."""
    from visionflow.train.lr_find import suggest

    recorded = json.loads((ROOT / "tests/data/fastai_lr_find.json").read_text())
    assert suggest(recorded["rates"], recorded["losses"]) == pytest.approx(recorded["valley"])


def test_onecycle_steps_per_optimizer_step_and_not_per_epoch():
    from visionflow.train.engine import Split, Step, make_scheduler, step_scheduler, train_one_epoch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = make_scheduler("onecycle", optimizer, 2, 0, 0.5, 1, steps_per_epoch=4)
    x, y = torch.randint(0, 255, (64, 8, 8, 3), dtype=torch.uint8), torch.arange(64) % 4
    split = Split(x, y, MEAN, STD, torch.Generator().manual_seed(0))
    rates = []
    for _ in range(2):
        train_one_epoch(model, optimizer, split, Step(16), scheduler=scheduler)
        step_scheduler(scheduler, 1.0)  # the epoch's: none for a per-step schedule
        rates.append(optimizer.param_groups[0]["lr"])
    assert scheduler.last_epoch == 7  # 2 epochs of 4 steps: the 8th at the last rate
    assert rates[0] > 1e-3 and rates[1] < 1e-6  # at the peak's side, then annealed
    train_one_epoch(model, optimizer, split, Step(16), scheduler=scheduler)  # one epoch too many
    assert scheduler.last_epoch == 7 and optimizer.param_groups[0]["lr"] == rates[1]


def test_rates_per_layer_group_fall_geometrically_from_the_head_and_cover_the_backbone_once():
    from visionflow.fit.setup import parameter_groups
    from visionflow.params import ParamsError, parse_params
    from visionflow.train import zoo

    model = zoo.finetune("resnet18", 3, 4, 32, ([0.5] * 3, [0.25] * 3))
    recipe = {"model": "resnet18", "pretrained": "DEFAULT", "lr": 1e-2}
    t = parse_params(
        params_with(recipe | {"backbone_lr_factor": 0.5, "group_lr_factor": 0.1})
    ).train
    groups = parameter_groups(model, t)
    assert [g["lr"] for g in groups] == pytest.approx([1e-2, 5e-3, 5e-4, 5e-5])
    assert groups[1]["params"][-1] is model.net.layer4[1].bn2.bias  # the last group: the latest
    assert groups[-1]["params"][0] is model.net.conv1.weight  # the smallest rate: the stem
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ParamsError) as e:
            parse_params(params_with(recipe | {"group_lr_factor": bad}))
        assert str(e.value).splitlines()[1].strip().startswith("train.group_lr_factor: Input")
    with pytest.raises(ParamsError, match="train.group_lr_factor is for a torchvision classifier"):
        parse_params(params_with({"group_lr_factor": 0.5}))  # simple_cnn, from scratch
    with pytest.raises(ParamsError, match=r"train.lr: a number > 0, or auto .* not .fast."):
        parse_params(params_with({"lr": "fast"}))


def test_batchnorm_trains_while_the_backbone_is_frozen_unless_train_bn_is_off():
    from visionflow.train import zoo

    torch.manual_seed(0)
    model = zoo.finetune("resnet18", 3, 4, 32, ([0.5] * 3, [0.25] * 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.freeze(True)
    model.train()
    model(torch.rand(4, 3, 32, 32)).sum().backward()
    assert model.net.bn1.training and model.net.bn1.weight.grad is not None  # fastai's train_bn
    assert model.net.conv1.weight.grad is None and model.net.layer1[0].conv1.weight.grad is None
    assert not torch.equal(
        model.state_dict()["net.bn1.running_mean"], before["net.bn1.running_mean"]
    )
    model.zero_grad(set_to_none=True)
    model.load_state_dict(before)
    model.train_bn = False  # train.train_bn: false: the backbone as the weights file has it
    model.freeze(True)
    model.train()
    model(torch.rand(4, 3, 32, 32)).sum().backward()
    assert not model.net.bn1.training and model.net.bn1.weight.grad is None
    assert torch.equal(model.state_dict()["net.bn1.running_mean"], before["net.bn1.running_mean"])


def test_with_pretrained_weights_recipe_auto_makes_the_defaults_the_fine_tuning_recipe():
    """The default (train.recipe auto): with train.pretrained, the keys left at their
    from-scratch defaults take the recipe's values (one-cycle, AdamW with weight decay 0.01, label
    smoothing 0.1: what bench/fastai_peer_bench.py measured best, #58); without it, the digits
    pipeline's defaults as they are."""
    from visionflow.params import FINETUNE, parse_params

    shipped = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]
    assert {k: shipped[k] for k in FINETUNE} == {k: scratch for k, (scratch, _) in FINETUNE.items()}
    assert shipped["recipe"] == "auto"
    digits = parse_params(params_with({})).train  # from scratch: the defaults as they are
    assert {k: getattr(digits, k) for k in FINETUNE} == {k: s for k, (s, _) in FINETUNE.items()}
    tuned = {"model": "mobilenet_v3_small", "pretrained": "data/pretrained/w.pth"}
    t = parse_params(params_with(tuned)).train
    assert {k: getattr(t, k) for k in FINETUNE} == {k: f for k, (_, f) in FINETUNE.items()}
    recipe = (t.label_smoothing, t.scheduler, t.optimizer, t.weight_decay)
    assert recipe == (0.1, "onecycle", "adamw", 0.01)
    assert (t.lr, t.freeze_epochs, t.backbone_lr_factor, t.group_lr_factor) == (1e-3, 0, 1.0, 1.0)
    mine = parse_params(params_with(tuned | {"label_smoothing": 0.2, "scheduler": "cosine"}))
    assert (mine.train.label_smoothing, mine.train.scheduler) == (0.2, "cosine")
    assert mine.train.optimizer == "adamw"  # the keys left alone: the recipe's
    plain = parse_params(params_with(tuned | {"recipe": "scratch"})).train
    assert (plain.label_smoothing, plain.scheduler, plain.freeze_epochs) == (0.0, "plateau", 0)
    assert (plain.optimizer, plain.weight_decay) == ("adam", 0.0)
    asked = parse_params(params_with(tuned | {"recipe": "finetune"})).train
    assert asked.label_smoothing == 0.1
