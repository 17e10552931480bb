"""Fine-tuning torchvision's classifiers (zoo.py): by name, from pretrained weights, with the
weights' preprocessing, a frozen backbone first, and networks of your own; through plain DVC."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from torch import nn

from tests.helpers import ROOT, TINY, copy_project, sh, write_params
from visionflow.deploy.report import training_line

HEAD = ("classifier.3.weight", "classifier.3.bias")  # mobilenet_v3_small's: the new one


def photos(root: Path, per_class: int = 12) -> None:
    """Three classes of RGB photos that differ in colour and texture."""
    rng = np.random.default_rng(0)
    for c, name in enumerate(("cat", "dog", "fox")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            base = np.zeros((6, 8, 3))
            base[..., c] = 200
            noise = rng.integers(0, 56, size=(6, 8, 3))
            small = Image.fromarray((base + noise).astype(np.uint8))
            small.resize((80, 60), Image.Resampling.BICUBIC).save(root / name / f"{i}.jpg")


def epoch_state(project: Path, epoch: int) -> dict:
    """The model of an epoch's checkpoint, of the newest training configuration."""
    found = max(
        project.glob(f"checkpoints/train/*/epoch-{epoch:04d}.pt"), key=lambda p: p.stat().st_mtime
    )
    return torch.load(found, weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.longest
def test_a_pretrained_mobilenet_trains_its_new_head_alone_then_all_of_it_under_plain_dvc(
    reproduced_base, tmp_path
):
    from torchvision.models import get_model

    project = copy_project(reproduced_base, tmp_path / "project")
    photos(project / "data/photos")
    torch.manual_seed(1)  # "pretrained": any weights in torchvision's layout, 1000 classes
    weights = get_model("mobilenet_v3_small").state_dict()
    torch.save(weights, project / "data/pretrained/mnv3.pth")
    prepare = {"source": "imagefolder", "path": "data/photos", "image_size": 64, "color": "rgb"}
    prepare |= {"min_per_class": 2, "val_fraction": 0.25, "test_fraction": 0.25}
    train = {"model": "mobilenet_v3_small", "pretrained": "data/pretrained/mnv3.pth"}
    train |= {"freeze_epochs": 1, "epochs": 1, "batch_size": 8, "backbone_lr_factor": 0.1}
    train |= {"scheduler": "none"}  # the rates below as set; one-cycle's would not extend it
    write_params(project, {"prepare": prepare, "train": train})
    out = sh(project, "dvc", "repro", "train").stdout  # the recipe, train_bn
    assert "train: the network sees a 56 px centre crop of the 64 px cache" in out
    # what the recipe set (params.yaml says otherwise) is said, in model.pt and the model card too
    recipe = {"label_smoothing": 0.1, "optimizer": "adamw", "weight_decay": 0.01}
    said = ", ".join(f"train.{k} {v}" for k, v in recipe.items())
    assert f"train: the fine-tuning recipe sets {said} (train.recipe: scratch keeps" in out
    assert (  # 80x60 photos: their centre square, then ImageNet's crop
        "train: warning: at evaluation the network sees 57% of each photo on average "
        "(prepare.fit: crop keeps 75% of each photo, then the 56 px centre crop 77% of the 64 px "
        "cache)"
    ) in out
    assert re.search(r"epoch   1/1 \(frozen: head only\) .* lr 1\.00e-03 backbone frozen ", out)
    assert (project / "results/sanity/eval_view.png").is_file()
    saved = torch.load(project / "results/train/model.pt", weights_only=True)
    trained = {k.removeprefix("net."): v for k, v in saved["state_dict"].items()}
    bn = [
        n
        for n, m in get_model("mobilenet_v3_small").named_modules()
        if isinstance(m, nn.BatchNorm2d)
    ]
    norms = {k for k in weights if k.rpartition(".")[0] in bn}  # BatchNorm's weights, statistics
    for key, value in weights.items():  # frozen: but BatchNorm, which trains (train.train_bn)
        if key not in HEAD and key not in norms:
            assert torch.equal(trained[key], value), key
    moved = [
        k for k in norms if k.endswith("running_mean") and not torch.equal(trained[k], weights[k])
    ]
    assert moved  # (torchvision's momentum 0.01 for this network: small steps, but steps)
    assert trained[HEAD[0]].shape == (3, 1024) and not torch.equal(trained[HEAD[1]], torch.zeros(3))
    meta = saved["meta"]
    assert meta["network"]["input_size"] == 56  # ImageNet's 224 of 256, of a 64 px cache
    assert meta["mean"] == [0.485, 0.456, 0.406] and meta["network"]["weights"] == "mnv3.pth"
    assert meta["train"]["recipe"] == recipe
    card = training_line(meta)
    assert "recipe (train.recipe) set the optimizer, weight decay, label smoothing." in card
    assert "The new head alone for 1 epoch. The backbone's last layer group at lr x 0.1," in card
    report = json.loads((project / "results/train/health.json").read_text())
    assert not any("dead ReLUs" in m for m in report["messages"])  # of a backbone that is frozen

    write_params(project, {"train": {"epochs": 2}})
    out = sh(project, "dvc", "repro", "train").stdout
    assert "extending the recorded 1-epoch run to 2 epochs" in out
    second = epoch_state(project, 2)
    first_conv = "net.features.0.0.weight"
    assert not torch.equal(second[first_conv], weights[first_conv.removeprefix("net.")])
    curves = project / "results/train/live/metrics.json"
    lrs = json.loads(curves.read_text())
    assert lrs["lr_backbone"] == pytest.approx(lrs["lr"] * 0.1)  # both groups, both logged
    backbone = (project / "results/train/live/plots/metrics/lr_backbone.tsv").read_text()
    assert [float(row.split()[-1]) for row in backbone.splitlines()[1:]][0] == 0  # frozen: rests
    assert re.search(r"epoch   2/2  .* backbone 1\.00e-04 ", out)
    # resumed == uninterrupted across the frozen epochs, every piece of the state: in process,
    # tests/test_run.py (a third fine-tuning run here cost about 20 s of the full tier)

    write_params(project, {"evaluate": {"tta": True}})  # the crops ImageNet's weights allow
    out = sh(project, "dvc", "repro", "evaluate").stdout
    metrics = json.loads((project / "results/evaluate/metrics.json").read_text())
    scores = json.loads((project / "results/evaluate/scores.json").read_text())
    assert scores["tta"]["views"] == "5 views: centre + 4 corner crops"
    assert metrics["tta_acc"] == scores["tta"]["accuracy"] and "accuracy" in metrics
    assert f"with TTA (5 views: centre + 4 corner crops) {metrics['tta_acc']:.4f}" in out
    confused = json.loads((project / "results/evaluate/most_confused.json").read_text())
    assert [c["count"] for c in confused] == sorted((c["count"] for c in confused), reverse=True)
    assert (project / "results/evaluate/top_losses.png").is_file()


UNKNOWN_MODEL = (
    "train.model: unknown model 'resnet5O'; did you mean resnet50? (the project's simple_cnn, "
    "small_resnet, resnet18, any of torchvision's classifiers: torchvision.models.list_models(), "
    "or package.module:Name)"
)


@pytest.mark.slow
def test_an_unknown_model_stops_dvc_repro_at_check_in_one_line(reproduced_base, tmp_path):
    """The line below, as `dvc repro` shows it: from the check stage, before anything is
    deleted, and no traceback."""
    project = copy_project(reproduced_base, tmp_path / "project")
    write_params(project, {"train": {"model": "resnet5O"}})
    result = sh(project, "dvc", "repro", "check", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors, result.stderr
    assert errors[0] == f"error: {UNKNOWN_MODEL}"
    assert "Traceback" not in result.stderr + result.stdout


def test_unknown_names_and_sizes_are_one_line_from_check(tmp_path, monkeypatch):
    """The check stage's lines, asked in this process of the tests' params (the test above
    runs one through `dvc repro`)."""
    from pipeline.check import network_problem
    from visionflow.params import Train

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    write_params(tmp_path, TINY)
    base = yaml.safe_load((tmp_path / "params.yaml").read_text())["train"]
    assert network_problem(Train(**{**base, "model": "resnet5O"}), 8) == UNKNOWN_MODEL
    cases = {  # (model, pretrained, prepare.image_size): the line's start
        ("vit_b_16", "DEFAULT", 64): "train.model: vit_b_16 takes 224 px inputs only; "
        "prepare.image_size 64 gives it 56 px: set prepare.image_size to 256",
        ("inception_v3", "", 64): "train.model: inception_v3 needs inputs of at least 75 px",
        ("swin_t", "", 128): "train.model: swin_t needs inputs of at least 224 px",
        ("efficientnet_b0", "IMAGENET1K_V9", 64): "train.pretrained: efficientnet_b0 has no "
        "weights 'IMAGENET1K_V9'; it has DEFAULT, IMAGENET1K_V1",  # DEFAULT once
        ("convnext_tiny", "DEFAULT", 64): None,
    }
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # convnext's weights, fetched
    fetched = tmp_path / "torch/hub/checkpoints/convnext_tiny-983f1562.pth"
    fetched.parent.mkdir(parents=True)
    fetched.touch()
    for (model, pretrained, size), words in cases.items():
        train = Train(**{**base, "model": model, "pretrained": pretrained})
        problem = network_problem(train, size)
        assert (problem or "").startswith(words or ""), problem
        assert (problem is None) == (words is None), problem
    from pipeline.check import tta_problem
    from visionflow.params import load_params

    params = load_params(tmp_path / "params.yaml")  # 8 px, no flips

    def tta(**train):
        evaluate = params.evaluate.model_copy(update={"tta": True})
        train = params.train.model_copy(update=train)
        return tta_problem(params.model_copy(update={"evaluate": evaluate, "train": train}))

    assert tta(model="simple_cnn") == (  # no crop, no flip: nothing to average
        "evaluate.tta: simple_cnn takes the whole 8 px cached image (no crop to shift) and "
        "train.augment.hflip is false (no mirror it learnt): there is no view to average; set "
        "train.augment.hflip: true, or evaluate.tta: false"
    )
    flips = params.train.augment.model_copy(update={"hflip": True})
    assert tta(model="simple_cnn", augment=flips) is None
    assert tta(model="mobilenet_v3_small", pretrained="DEFAULT") is None  # 7 px crops of 8
    assert tta(model="mobilenet_v3_small", pretrained="") is not None  # from scratch: no crop


@pytest.mark.slow
def test_a_weights_name_offline_fails_in_one_line_naming_the_file_to_fetch(
    reproduced_base, tmp_path
):
    project = copy_project(reproduced_base, tmp_path / "project")
    model = (project / "results/train/model.pt").read_bytes()
    write_params(project, {"train": {"model": "mobilenet_v3_small", "pretrained": "DEFAULT"}})
    env_offline = "https_proxy=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9"
    result = sh(
        project, "sh", "-c", f"TORCH_HOME={tmp_path}/torch {env_offline} dvc repro train",
        check=False,
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors, result.stderr
    assert errors[0].startswith("error: train.pretrained: cannot download MobileNet_V3_Small")
    assert (
        f"put it at {tmp_path}/torch/hub/checkpoints/mobilenet_v3_small-047dcff4.pth" in errors[0]
    )
    assert "Traceback" not in result.stderr
    # said by check, before DVC removed the train stage's results to run it
    assert "Running stage 'train'" not in result.stdout, result.stdout
    assert (project / "results/train/model.pt").read_bytes() == model
    # resnet18 from a file that is not a state_dict: said by check too (it was said by train,
    # after DVC had deleted its results)
    (project / "data/pretrained/r18.pth").write_bytes(b"PK\x03\x04 cut short")
    write_params(project, {"train": {"model": "resnet18", "pretrained": "data/pretrained/r18.pth"}})
    result = sh(project, "dvc", "repro", "train", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith(
        "error: train.pretrained: data/pretrained/r18.pth is not a loadable state_dict"
    ), result.stderr
    assert "Running stage 'train'" not in result.stdout, result.stdout
    assert (project / "results/train/model.pt").read_bytes() == model


NETS = """
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, in_channels, num_classes, image_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.fc(self.conv(x).relu().mean((2, 3)))


class Wrong(torch.autograd.Function):  # a backward that is not the forward's derivative
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class BadGrad(Tiny):
    def forward(self, x):
        return Wrong.apply(super().forward(x))
"""


@pytest.mark.slow
@pytest.mark.longest
def test_a_network_of_your_own_is_a_dep_and_gets_its_gradients_checked(reproduced_base, tmp_path):
    project = copy_project(reproduced_base, tmp_path / "project")
    (project / "mynets.py").write_text(NETS)
    write_params(project, {"train": {"model": "mynets:Tiny", "epochs": 1}})
    result = sh(project, "dvc", "repro", "train", check=False)
    assert "error: train.model: mynets.py is not among the train stage's deps" in result.stderr
    dvc_yaml = (project / "dvc.yaml").read_text()
    anchor = "      - pipeline/train.py\n"  # in the train stage's deps alone
    (project / "dvc.yaml").write_text(dvc_yaml.replace(anchor, anchor + "      - mynets.py\n", 1))
    sh(project, "dvc", "repro", "train")
    report = json.loads((project / "results/train/health.json").read_text())
    assert report["gradient_check"]["passed"] is True
    assert report["gradient_check"]["max_relative_error"] < 1e-4
    model = (project / "results/train/model.pt").read_bytes()
    raising = "raise RuntimeError('mynets needs a GPU')\n" + NETS
    (project / "mynets.py").write_text(raising)  # a module that raises on import
    write_params(project, {"train": {"model": "mynets:BadGrad"}})
    result = sh(project, "dvc", "repro", "train", check=False)
    said = "error: train.model: cannot import mynets:BadGrad (RuntimeError: mynets needs a GPU)"
    assert said in result.stderr.splitlines() and "Traceback" not in result.stderr, result.stderr
    assert "Running stage 'train'" not in result.stdout  # said by check: train's results stay
    assert (project / "results/train/model.pt").read_bytes() == model
    (project / "mynets.py").write_text(NETS)
    result = sh(project, "dvc", "repro", "train", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: train.model: mynets:BadGrad fails the gradient check")
    (project / "mynets.py").write_text(raising)  # a train dep, not check's: train says it
    result = sh(project, "dvc", "repro", "train", check=False)
    assert "Running stage 'train'" in result.stdout and "Running stage 'check'" not in result.stdout
    assert said in result.stderr.splitlines() and "Traceback" not in result.stderr, result.stderr


def test_weights_load_from_safetensors_and_a_file_for_another_network_names_its_keys(tmp_path):
    from safetensors.torch import save_file
    from torchvision.models import get_model

    from visionflow.errors import Unavailable
    from visionflow.train import zoo

    torch.manual_seed(0)
    weights = get_model("squeezenet1_1").state_dict()  # the head is a 1x1 convolution here
    save_file(weights, tmp_path / "sq.safetensors")
    model = zoo.finetune(
        "squeezenet1_1", 1, 5, 40, ([0.5] * 3, [0.25] * 3), str(tmp_path / "sq.safetensors")
    )
    assert model.head == {"classifier.1.weight", "classifier.1.bias"}
    mine = model.net.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in weights.items() if k not in model.head)
    assert model(torch.zeros(2, 1, 48, 48)).shape == (2, 5)  # one channel in, a 40 px crop
    torch.save(get_model("resnet18").state_dict(), tmp_path / "r18.pth")
    with pytest.raises(Unavailable, match=r"does not fit squeezenet1_1: missing features.0.bias"):
        zoo.finetune("squeezenet1_1", 3, 5, 40, ([0.5] * 3, [0.25] * 3), str(tmp_path / "r18.pth"))


class RunsCode:
    """A pickle that calls a function when it is loaded (here a harmless one)."""

    def __reduce__(self):
        return (print, ("this ran",))


def test_weights_files_as_users_save_them_load_or_are_refused_by_check_in_one_line(
    tmp_path, monkeypatch
):
    import argparse

    from safetensors.torch import save_file
    from torchvision.models import get_model

    from pipeline.check import network_problem
    from visionflow.errors import Unavailable
    from visionflow.params import Train
    from visionflow.train import zoo

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    net = get_model("squeezenet1_1")
    weights = net.state_dict()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    args = argparse.Namespace(  # its output_dir is a Path when given one in code
        model="squeezenet1_1", lr=0.1, epochs=90, weights=None, amp=True, output_dir=Path("out")
    )
    torch.save(  # as torchvision's references/classification/train.py writes checkpoint.pth
        {
            "model": weights,
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 30).state_dict(),
            "epoch": 3,
            "args": args,
            "model_ema": torch.optim.swa_utils.AveragedModel(net).state_dict(),
            "scaler": torch.amp.GradScaler("cpu").state_dict(),
        },
        "reference.pth",
    )
    ddp = nn.Module()  # DDP keeps the network as `.module`; torch.compile as `._orig_mod`
    ddp.module = net
    torch.save(torch.compile(ddp).state_dict(), "compiled_ddp.pth")  # _orig_mod.module.*
    save_file({f"module.{k}": v for k, v in weights.items()}, "ddp.safetensors")
    save_file(weights, "safetensors_named.pth")  # no pickle in it, whatever its name
    for name in ("reference.pth", "compiled_ddp.pth", "ddp.safetensors", "safetensors_named.pth"):
        loaded = zoo.read_weights(name)
        assert loaded.keys() == weights.keys(), name
        assert all(torch.equal(loaded[k], weights[k]) for k in loaded), name
    torch.save(net, "whole.pth")  # the whole model, pickled: never unpickled
    with pytest.raises(
        Unavailable,
        match=r"^whole.pth holds pickled Python objects \(torchvision.models.squeezenet.SqueezeNet\), "
        r"which are not loaded \(they can run code\): save model.state_dict\(\) instead$",
    ):
        zoo.read_weights("whole.pth")
    torch.save({"model": weights, "hook": RunsCode()}, "runs_code.pth")
    torch.save(get_model("resnet18").state_dict(), "r18.pth")
    Path("truncated.pth").write_bytes(Path("r18.pth").read_bytes()[:5000])
    Path("empty.pth").touch()
    base = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]
    # a file train reads must be one of its deps: else a change to it reruns nothing
    Path("other").mkdir()
    shutil.copy("r18.pth", "other/r18.pth")
    shutil.copy("r18.pth", tmp_path.parent / "outside.pth")
    listed = [p.name for p in tmp_path.glob("*.*")]
    Path("dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {"cmd": "", "deps": listed}}}))
    cases = {  # before any stage runs (DVC deletes a stage's results as it starts it)
        ("resnet18", "other/r18.pth"): "train.pretrained: other/r18.pth is not among the train "
        "stage's deps in dvc.yaml: add `- other/r18.pth` there (or move it into data/pretrained/)",
        ("resnet18", str(tmp_path.parent / "outside.pth")): "train.pretrained: "
        f"{tmp_path.parent.resolve() / 'outside.pth'}, outside the project: DVC cannot track it",
        ("squeezenet1_1", "reference.pth"): None,
        ("squeezenet1_1", "compiled_ddp.pth"): None,
        ("squeezenet1_1", "ddp.safetensors"): None,
        ("squeezenet1_1", "r18.pth"): "train.pretrained: r18.pth does not fit squeezenet1_1: "
        "missing features.0.bias",
        ("squeezenet1_1", "whole.pth"): "train.pretrained: whole.pth holds pickled Python objects",
        ("resnet18", "r18.pth"): None,  # resnet18 from a file is torchvision's: the same checks
        ("resnet18", "reference.pth"): "train.pretrained: reference.pth does not fit resnet18: "
        "missing bn1.bias",
        (
            "resnet18",
            "truncated.pth",
        ): "train.pretrained: truncated.pth is not a loadable state_dict",
        ("resnet18", "whole.pth"): "train.pretrained: whole.pth holds pickled Python objects",
        ("resnet18", "empty.pth"): "train.pretrained: empty.pth is empty (0 bytes)",
        ("resnet18", "runs_code.pth"): "train.pretrained: runs_code.pth holds pickled Python "
        "objects (print)",
    }
    for (model, name), words in cases.items():
        problem = network_problem(Train(**{**base, "model": model, "pretrained": name}), 64)
        assert (problem or "").startswith(words or ""), (model, name, problem)
        assert (problem is None) == (words is None), (model, name, problem)


def test_a_weights_file_that_git_and_dvc_leave_untracked_is_named_with_its_dvc_add(
    tmp_path, monkeypatch
):
    """#58: `dvc exp run --temp` copies only what git and DVC track: the README's offline weights
    file, left untracked in data/pretrained/, stayed behind, and check said `... is not a file`
    beside it. Now check says what to `dvc add`, in the temporary copy and where the file is."""
    from pipeline.check import network_problem, untracked_weights
    from visionflow.params import Train

    base = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]
    weights = "data/pretrained/r18.pth"
    train = Train(**{**base, "model": "resnet18", "pretrained": weights})
    workspace = tmp_path / "project"
    (workspace / "data/pretrained").mkdir(parents=True)
    (workspace / weights).write_bytes(b"weights")
    temporary = workspace / ".dvc/tmp/exps/tmpk2j8e1ab"  # where DVC makes a --temp copy
    temporary.mkdir(parents=True)
    monkeypatch.chdir(temporary)
    assert network_problem(train, 64) == (
        f"train.pretrained: {weights} is in the workspace ({workspace.resolve()}) but not in this "
        "experiment's temporary copy, which holds only what git and DVC track: run `dvc add "
        f"{weights}` (and commit {weights}.dvc), then the experiment again"
    )
    (temporary / "data/pretrained").mkdir(parents=True)  # tracked by DVC, not checked out
    (temporary / f"{weights}.dvc").write_text("outs:\n- path: r18.pth\n")
    assert network_problem(train, 64) == (
        f"train.pretrained: {weights} is tracked by DVC but not here: an experiment that names "
        "a stage checks out that stage's deps only: name train, or no stage"
    )
    (temporary / f"{weights}.dvc").unlink()
    (workspace / weights).unlink()  # gone from the workspace too: not a file, and what to track
    assert network_problem(train, 64) == (
        f"train.pretrained: {weights} is not a file (a state_dict, or a weights name such as "
        "DEFAULT); an experiment's temporary copy (`dvc exp run --temp`, a queued one) has only "
        f"what git and DVC track: `dvc add {weights}` (and commit {weights}.dvc) in the workspace"
    )

    monkeypatch.chdir(workspace)  # where the file is: tracked by neither, or by one of them
    (workspace / weights).write_bytes(b"weights")
    assert untracked_weights(weights) is None  # no git repository: nothing to tell
    sh(workspace, "git", "init", "-q")
    assert untracked_weights(weights) == (
        f"train.pretrained {weights} is tracked by neither git nor DVC: `dvc exp run --temp`, "
        f"queued experiments and other clones will not have it; `dvc add {weights}` tracks it"
    )
    (workspace / f"{weights}.dvc").write_text("outs:\n- path: r18.pth\n")
    assert untracked_weights(weights) is None
    (workspace / f"{weights}.dvc").unlink()
    sh(workspace, "git", "add", weights)
    assert untracked_weights(weights) is None


def test_a_weights_name_resumes_only_the_weights_it_names_today(tmp_path, monkeypatch):
    """A weights name is fingerprinted by the file torchvision resolves it to: DEFAULT is
    IMAGENET1K_V2 for resnet50 today, and a torchvision release that points it elsewhere must
    not resume checkpoints fine-tuned from the old weights."""
    from visionflow.fit.resume import run_of
    from visionflow.params import parse_params

    monkeypatch.chdir(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())

    def weights_of(pretrained: str) -> str | None:
        train = {**raw["train"], "model": "resnet50", "pretrained": pretrained}
        return run_of(parse_params({**raw, "train": train}), tmp_path, "code")["hashes"][
            "pretrained weights"
        ]

    assert weights_of("DEFAULT") == weights_of("IMAGENET1K_V2") == "resnet50-11ad3fa6.pth"
    assert weights_of("IMAGENET1K_V1") == "resnet50-0676ba61.pth"


def test_a_frozen_backbone_keeps_its_batchnorm_statistics_and_gets_no_gradients():
    from visionflow.train import zoo

    torch.manual_seed(0)
    model = zoo.finetune("resnet18", 3, 4, 32, ([0.5] * 3, [0.25] * 3))
    model.train_bn = False  # train.train_bn: false (true: tests/test_recipe.py)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.freeze(True)
    model.train()
    model(torch.rand(4, 3, 32, 32)).sum().backward()
    assert model.training and not model.net.bn1.training and model.net.fc.weight.grad is not None
    assert all(p.grad is None for p in model.backbone())
    assert torch.equal(model.state_dict()["net.bn1.running_mean"], before["net.bn1.running_mean"])
    model.freeze(False)
    model.train()
    model(torch.rand(4, 3, 32, 32))
    assert not torch.equal(
        model.state_dict()["net.bn1.running_mean"], before["net.bn1.running_mean"]
    )


def test_resnet18_from_pretrained_weights_is_torchvisions_and_takes_the_recipe():
    from tests.helpers import ROOT
    from visionflow.params import ParamsError, parse_params
    from visionflow.train.models import build_model

    def params_with(train: dict) -> dict:
        raw = yaml.safe_load((ROOT / "params.yaml").read_text())
        return {**raw, "train": {**raw["train"], **train}}

    recipe = {"model": "resnet18", "pretrained": "DEFAULT", "freeze_epochs": 2}
    assert parse_params(params_with(recipe)).train.freeze_epochs == 2
    with pytest.raises(ParamsError, match="train.freeze_epochs is for a torchvision classifier"):
        parse_params(params_with({"freeze_epochs": 2}))  # simple_cnn, from scratch
    network = {"input_size": 28, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    model = build_model("resnet18", 1, 3, 32, network=network)
    assert model.head == {"fc.weight", "fc.bias"} and model.net.conv1.in_channels == 3
    assert build_model("resnet18", 1, 3, 32).conv1.in_channels == 1  # the project's own


def test_a_vit_is_built_for_the_size_check_asks_for():
    """vit_h_14's DEFAULT weights are 518 px, the size check asks for: the network takes 518 px
    and a file of those weights fits it (torchvision builds 224 px when given no weights)."""
    from torchvision.models import get_model

    from visionflow.train import zoo

    assert zoo.size_problem("vit_h_14", 518, "") is None
    with torch.device("meta"):  # 632 M parameters: shapes only
        net = zoo.build("vit_h_14", 3, 518)
        head = zoo.head_keys("vit_h_14", 3, net, 518)
        default = get_model("vit_h_14", image_size=518).state_dict()  # DEFAULT's key layout
    assert net.image_size == 518 and head == {"heads.head.weight", "heads.head.bias"}
    zoo.load_into(net, "vit_h_14", default, head, "vit_h_14.pth")  # no key or shape refused


def test_a_network_that_asserts_its_input_size_is_refused_in_one_line(tmp_path, monkeypatch):
    """ViT checks its input size with torch._assert (an AssertionError, not a RuntimeError):
    build_model's dummy forward refuses it as it refuses a shape error, not as a traceback."""
    from visionflow.train.models import build_model

    (tmp_path / "sized.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, in_channels, num_classes, image_size):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(in_channels * 8 * 8, num_classes)\n"
        "    def forward(self, x):\n"
        "        torch._assert(x.shape[-1] == 8, f'Wrong image width! Expected 8 but got {x.shape[-1]}!')\n"
        "        return self.fc(x.flatten(1))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert build_model("sized:Net", 1, 3, 8)(torch.zeros(2, 1, 8, 8)).shape == (2, 3)
    with pytest.raises(ValueError, match=r"sized:Net does not fit input \(2, 1, 16, 16\): Wrong"):
        build_model("sized:Net", 1, 3, 16)
