"""Fine-tuning torchvision's classifiers (zoo.py): by name, from pretrained weights, with the
weights' preprocessing, a frozen backbone first, and networks of your own; through plain DVC."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import copy_project, sh, write_params

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
    write_params(project, {"prepare": prepare, "train": train})
    sh(project, "dvc", "repro", "train")
    saved = torch.load(project / "results/train/model.pt", weights_only=True)
    trained = {k.removeprefix("net."): v for k, v in saved["state_dict"].items()}
    for key, value in weights.items():  # BatchNorm statistics included
        if key not in HEAD:
            assert torch.equal(trained[key], value), key
    assert trained[HEAD[0]].shape == (3, 1024) and not torch.equal(trained[HEAD[1]], torch.zeros(3))
    meta = saved["meta"]
    assert meta["network"]["input_size"] == 56  # ImageNet's 224 of 256, of a 64 px cache
    assert meta["mean"] == [0.485, 0.456, 0.406] and meta["network"]["weights"] == "mnv3.pth"

    write_params(project, {"train": {"epochs": 2}})
    out = sh(project, "dvc", "repro", "train").stdout
    assert "extending the recorded 1-epoch run to 2 epochs" in out
    second = epoch_state(project, 2)
    first_conv = "net.features.0.0.weight"
    assert not torch.equal(second[first_conv], weights[first_conv.removeprefix("net.")])
    curves = project / "results/train/live/metrics.json"
    lrs = json.loads(curves.read_text())
    assert lrs["lr_backbone"] == pytest.approx(lrs["lr"] * 0.1)  # both groups, both logged


def test_unknown_names_and_sizes_are_one_line_from_check(reproduced_base, tmp_path):
    project = copy_project(reproduced_base, tmp_path / "project")
    cases = {
        "resnet5O": "train.model: unknown model 'resnet5O'; did you mean resnet50?",
        "vit_b_16": "train.model: vit_b_16 takes 224 px inputs only; prepare.image_size 8",
        "inception_v3": "train.model: inception_v3 needs inputs of at least 75 px",
    }
    for model, words in cases.items():
        write_params(project, {"train": {"model": model}})
        result = sh(project, "dvc", "repro", "check", check=False)
        assert result.returncode != 0
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert errors and words in errors[0], result.stderr
        assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.slow
def test_a_weights_name_offline_fails_in_one_line_naming_the_file_to_fetch(
    reproduced_base, tmp_path
):
    project = copy_project(reproduced_base, tmp_path / "project")
    write_params(project, {"train": {"model": "squeezenet1_1", "pretrained": "DEFAULT"}})
    write_params(project, {"prepare": {"image_size": 32}})
    env_offline = "https_proxy=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9"
    result = sh(
        project, "sh", "-c", f"TORCH_HOME={tmp_path}/torch {env_offline} dvc repro train",
        check=False,
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors, result.stderr
    assert errors[0].startswith("error: train.pretrained: cannot download SqueezeNet1_1_Weights")
    assert f"put it at {tmp_path}/torch/hub/checkpoints/squeezenet1_1-b8a52dc0.pth" in errors[0]
    assert "Traceback" not in result.stderr


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
def test_a_network_of_your_own_is_a_dep_and_gets_its_gradients_checked(reproduced_base, tmp_path):
    project = copy_project(reproduced_base, tmp_path / "project")
    (project / "mynets.py").write_text(NETS)
    write_params(project, {"train": {"model": "mynets:Tiny", "epochs": 1}})
    result = sh(project, "dvc", "repro", "train", check=False)
    assert "error: train.model: mynets.py is not among the train stage's deps" in result.stderr
    dvc_yaml = (project / "dvc.yaml").read_text()
    anchor = "      - src/visionflow/zoo.py\n"
    (project / "dvc.yaml").write_text(dvc_yaml.replace(anchor, anchor + "      - mynets.py\n", 1))
    sh(project, "dvc", "repro", "train")
    report = json.loads((project / "results/train/health.json").read_text())
    assert report["gradient_check"]["passed"] is True
    assert report["gradient_check"]["max_relative_error"] < 1e-4
    write_params(project, {"train": {"model": "mynets:BadGrad"}})
    result = sh(project, "dvc", "repro", "train", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors[0].startswith("error: train.model: mynets:BadGrad fails the gradient check")


def test_a_vit_is_built_for_the_size_check_asks_for():
    """vit_h_14's DEFAULT weights are 518 px, the size check asks for: the network takes 518 px
    and a file of those weights fits it (torchvision builds 224 px when given no weights)."""
    from torchvision.models import get_model

    from visionflow import zoo

    assert zoo.size_problem("vit_h_14", 518, "") is None
    with torch.device("meta"):  # 632 M parameters: shapes only
        net = zoo.build("vit_h_14", 3)
        head = zoo.head_keys("vit_h_14", 3, net)
        default = get_model("vit_h_14", image_size=518).state_dict()  # DEFAULT's key layout
    assert net.image_size == 518 and head == {"heads.head.weight", "heads.head.bias"}
    zoo.load_into(net, "vit_h_14", default, head, "vit_h_14.pth")  # no key or shape refused


def test_a_network_that_asserts_its_input_size_is_refused_in_one_line(tmp_path, monkeypatch):
    """ViT checks its input size with torch._assert (an AssertionError, not a RuntimeError):
    build_model's dummy forward refuses it as it refuses a shape error, not as a traceback."""
    from visionflow.models import build_model

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
