"""Models, and saving/loading them as plain dicts that `torch.load(weights_only=True)` accepts."""

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from visionflow import faults
from visionflow.errors import DiskFull, Unavailable
from visionflow.train import CHECKPOINTING, zoo


class SimpleCNN(nn.Module):
    """The classic small CNN: conv 16 -> conv 32 -> fc 128 -> classes (logits).

    Each convolution is max-pooled before its ReLU: the same function (max and ReLU commute) and the
    same state_dict as the usual conv -> ReLU -> pool, but ReLU and its backward touch a quarter of
    the values, so a training step runs faster (bench/relu_order_bench.py; docs/benchmarks.md).
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int, dropout: float = 0.25):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.MaxPool2d(2),
            nn.ReLU(),
        )
        side = image_size // 4  # two 2x2 poolings
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * side * side, 128),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (1x1 when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet for small images (e.g. 32x32): a 3x3 stem and three stages of 32, 64, 128 channels.

    With `checkpointing`, each block's activations are recomputed in the backward pass instead of
    stored (torch.utils.checkpoint): less memory, about a third more compute.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: int,
        dropout: float = 0.0,
        checkpointing: bool = False,
    ):
        super().__init__()
        self.checkpointing = checkpointing
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU()
        )
        self.blocks = nn.Sequential(
            BasicBlock(32, 32, 1),
            BasicBlock(32, 64, 2),
            BasicBlock(64, 128, 2),
            BasicBlock(128, 128, 1),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = recompute(block, x)
            else:
                x = block(x)
        return self.head(x)


def resnet18(
    in_channels: int,
    num_classes: int,
    image_size: int,
    dropout: float = 0.0,
    checkpointing: bool = False,
) -> nn.Module:
    """torchvision's ResNet-18 with its input and head resized (weights: `load_pretrained`)."""
    import torchvision  # imported on use: it costs seconds at every stage start

    model = torchvision.models.resnet18(weights=None)
    if in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
    model.fc = nn.Sequential(nn.Dropout(dropout), nn.Linear(512, num_classes))
    if checkpointing:
        for name in ("layer1", "layer2", "layer3", "layer4"):
            setattr(model, name, Checkpointed(getattr(model, name)))
    return model


class Checkpointed(nn.Module):
    """Recompute `inner`'s activations in the backward pass while training."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return recompute(self.inner, x)
        return self.inner(x)


def recompute(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`block(x)` with its activations recomputed in the backward pass (torch.utils.checkpoint).
    The recomputed forward must not update BatchNorm's running statistics a second time
    (pytorch/pytorch#96136): they are put back as the first forward left them."""
    return checkpoint(
        block, x, use_reentrant=False, context_fn=lambda: (nullcontext(), norm_stats_kept(block))
    )


@contextmanager
def norm_stats_kept(module: nn.Module) -> Iterator[None]:
    norms = [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    saved = [
        [b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)] for m in norms
    ]
    try:
        yield
    finally:
        for m, (mean, var, count) in zip(norms, saved, strict=True):
            m.running_mean.copy_(mean)
            m.running_var.copy_(var)
            m.num_batches_tracked.copy_(count)


# ImageNet statistics, which torchvision's pretrained weights expect their inputs normalised with.
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def load_pretrained(model: nn.Module, source: str) -> None:
    """ResNet-18 weights from a local file (a state_dict), or by torchvision's weights name
    (`imagenet` is IMAGENET1K_V1), downloaded once into torch's cache.

    The classifier head is left as built (its class count differs); a 1-channel input gets the
    mean of the pretrained RGB filters.
    """
    if source == "imagenet" or zoo.WEIGHTS_NAME.match(source):
        weights = zoo.download("resnet18", "IMAGENET1K_V1" if source == "imagenet" else source)
    else:
        weights = zoo.read_weights(source)
    weights = {k: v for k, v in weights.items() if not k.startswith("fc.")}
    if model.conv1.in_channels == 1 and "conv1.weight" in weights:
        weights["conv1.weight"] = weights["conv1.weight"].mean(dim=1, keepdim=True)
    missing, unexpected = model.load_state_dict(_into(model, weights), strict=False)
    if unexpected or [k for k in missing if not k.startswith("fc.")]:
        raise Unavailable(
            f"{source} does not fit resnet18: missing {missing}, unexpected {unexpected}"
        )


def _into(model: nn.Module, weights: dict) -> dict:
    """Map plain ResNet keys onto a model whose layers may be wrapped in `Checkpointed`."""
    names = set(model.state_dict())
    return {(k if k in names else k.replace(".", ".inner.", 1)): v for k, v in weights.items()}


# a builder for each of the project's own networks (OWN_MODELS: their names, torch-free)
MODELS = {"simple_cnn": SimpleCNN, "small_resnet": SmallResNet, "resnet18": resnet18}


def build_model(
    name: str,
    in_channels: int,
    num_classes: int,
    image_size: int,
    dropout: float = 0.0,
    checkpointing: bool = False,
    network: dict | None = None,
    pretrained: str = "",
) -> nn.Module:
    """Build a model and prove with one dummy forward that the shapes fit. `name` is one of the
    project's (MODELS), a torchvision classifier (`network` then says its input size and the
    3-channel mean/std its weights want; `pretrained` loads them: zoo.py), or an import path."""
    if name in MODELS and network is None:  # resnet18 from pretrained weights: torchvision's
        extra = {"checkpointing": checkpointing} if name in CHECKPOINTING else {}
        model = MODELS[name](in_channels, num_classes, image_size, dropout, **extra)
    elif zoo.is_import_path(name):
        model = zoo.import_network(name, in_channels, num_classes, image_size)
    else:
        norm = (network["mean"], network["std"])
        model = zoo.finetune(
            name, in_channels, num_classes, network["input_size"], norm, pretrained
        )
    dummy = torch.zeros(2, in_channels, image_size, image_size)
    try:
        with torch.no_grad():
            logits = model.eval()(dummy)
    except (RuntimeError, AssertionError) as error:  # torch._assert (ViT's size check) asserts
        raise ValueError(f"{name} does not fit input {tuple(dummy.shape)}: {error}") from None
    if not torch.is_tensor(logits) or logits.shape != (2, num_classes):
        shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ValueError(
            f"{name} gives {shape} for input {tuple(dummy.shape)}, expected (2, {num_classes})"
        )
    return model.train()


def save_atomic(obj: dict, path: Path, **where) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename: never a half file.

    The file's mode follows the umask (0644 under 022) like every other output: not mkstemp's
    0600, which no other user or serving container could read.
    `where` names the write for fault injection (`checkpoint.write@epoch=N`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # less the umask
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            if faults.ACTIVE and where:  # a kill here leaves a half-written temp file
                faults.fault("checkpoint.write", **where)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except RuntimeError as error:  # torch's zip writer on a full disk: "unexpected pos 576 vs 534"
        Path(tmp).unlink(missing_ok=True)
        if "unexpected pos" in str(error) or "write failed" in str(error):
            raise DiskFull.at(path.parent) from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_model(model: nn.Module, meta: dict, path: Path) -> None:
    """`meta` holds plain Python values only: what is needed to rebuild and feed the model."""
    save_atomic({"state_dict": model.state_dict(), "meta": meta}, path)


def load_model(path: Path, map_location: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """Rebuild the model saved by `save_model`, in eval mode, with its meta."""
    return model_from(torch.load(path, map_location=map_location, weights_only=True))


def model_from(saved: dict) -> tuple[nn.Module, dict]:
    """The model a loaded `save_model` dict describes, in eval mode, with its meta."""
    meta = saved["meta"]
    model = build_model(
        meta["model"],
        meta["in_channels"],
        len(meta["classes"]),
        meta["image_size"],
        meta["dropout"],
        meta.get("checkpointing", False),  # wrappers change the state_dict's key names
        meta.get("network"),  # a torchvision classifier's input size and normalisation
    )
    model.load_state_dict(saved["state_dict"])
    return model.eval(), meta


def input_words(meta: dict) -> str:
    """What the network sees, from a model's meta: its input (the cache's side, or the centre
    crop of it that pretrained weights take) and the normalisation. The train log, the model card
    and docs/fine-tuning.md say it in these words."""
    side, size = meta["image_size"], meta.get("network", {}).get("input_size", meta["image_size"])
    if size < side:
        seen = (
            f"a {size} px centre crop of the {side} px cache ({size * size / side**2:.0%} of its "
            f"area; random resized crops of {size} px while training)"
        )
    else:
        seen = f"the whole {side} px cached image"
    mean, std = ([round(v, 4) for v in meta[k]] for k in ("mean", "std"))
    norm = meta.get("norm", "unknown")
    return f"{seen}, normalised as (pixel / 255 - mean) / std with mean {mean}, std {std} ({norm})"
