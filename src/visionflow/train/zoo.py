"""Every classifier in torchvision's registry, fine-tuned as the field does it: built by name with
a new head for the project's classes, pretrained weights from a file in torchvision's key layout
(`.pth`, `.pt`, `.safetensors`) or by weights name (`DEFAULT`, `IMAGENET1K_V2`: downloaded once
into torch's cache, checked by its hash), and the weights' own preprocessing.

The network is wrapped in `FineTune`, which takes what the rest of the project feeds every model
(uint8 images of the cache's size, scaled to 0..1 and normalised with the mean/std that model.pt
records) and centre-crops them to the network's input size, as the weights' transforms do; the
training loop hands it random resized crops of that size already (augment.py), for which the crop
does nothing. So predict, serve, the exports and the ONNX client feed it as they feed any model.

A network of your own is `package.module:Name`, built as `Name(in_channels=, num_classes=,
image_size=)`; `check_network` gives it the checks a new model needs (output shape, gradients).
"""

import argparse
import difflib
import importlib
import pathlib
import pickle
import re
import sys
from pathlib import Path

import torch
from torch import nn

from visionflow.errors import Unavailable
from visionflow.train import OWN_MODELS, from_torchvision

WEIGHTS_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")  # DEFAULT, IMAGENET1K_V2, ...
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:Name
# builders whose training forward also returns auxiliary logits: built without them (their
# weights in a pretrained file are left out)
NO_AUX = {"inception_v3": {"aux_logits": False}, "googlenet": {"aux_logits": False}}
AUX_KEYS = ("AuxLogits.", "aux1.", "aux2.")
# builders with a fixed input size (position embeddings, partitions): it must be the weights'
FIXED_SIZE = ("vit_", "maxvit_")
WRAPPERS = ("module.", "_orig_mod.", "net.")  # DDP, torch.compile, FineTune: before every key
# the class weights_only refused, in torch's message
# what torchvision's reference scripts save beside the model as `args`: an argparse Namespace,
# its paths among its values; rebuilt from plain values that weights_only checks in turn
ARGS_CLASSES = [argparse.Namespace, pathlib.PosixPath, pathlib.PurePosixPath]
UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL (\S+) ")


def registry() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def is_weights_name(pretrained: str) -> bool:
    """A torchvision weights name (`imagenet`: resnet18's old name for its DEFAULT), not a file."""
    return pretrained == "imagenet" or bool(WEIGHTS_NAME.match(pretrained))


def is_import_path(name: str) -> bool:
    return bool(IMPORT_PATH.match(name))


def unknown_model(name: str) -> str | None:
    """The line refusing `train.model: name` (None: it names a network)."""
    if name in OWN_MODELS or is_import_path(name):
        return None
    names = registry()
    if name in names:
        return None
    close = difflib.get_close_matches(name, [*OWN_MODELS, *names], n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else ""
    return (
        f"train.model: unknown model {name!r}{hint} (the project's {', '.join(OWN_MODELS)}, any of "
        "torchvision's classifiers: torchvision.models.list_models(), or package.module:Name)"
    )


def weights_enum(arch: str, name: str):
    """torchvision's weights `name` of `arch` (DEFAULT when `name` is a file or empty: its
    preprocessing is what a file in torchvision's layout was trained with, ImageNet's)."""
    from torchvision.models import get_model_weights

    family = get_model_weights(arch)
    if not WEIGHTS_NAME.match(name or ""):
        return family.DEFAULT
    try:
        return family[name]
    except KeyError:
        known = ", ".join(["DEFAULT", *(m for m in family.__members__ if m != "DEFAULT")])
        raise Unavailable(f"{arch} has no weights {name!r}; it has {known}") from None


def preprocessing(arch: str, pretrained: str) -> dict:
    """What the weights expect: ImageNet's mean/std (3 channels), the crop's share of the resize
    side (224 of 256: 0.875), the interpolation, and their name."""
    weights = weights_enum(arch, pretrained)
    transforms = weights.transforms()
    return {
        "weights": str(weights) if is_weights_name(pretrained) else Path(pretrained).name,
        "mean": list(transforms.mean),
        "std": list(transforms.std),
        "crop_ratio": transforms.crop_size[0] / transforms.resize_size[0],
        "interpolation": transforms.interpolation.value,
        "min_size": list(weights.meta.get("min_size", (1, 1))),
        "crop_size": transforms.crop_size[0],
        "resize_size": transforms.resize_size[0],
    }


def input_size(arch: str, image_size: int, pretrained: str) -> int:
    """The side of the network's input: the cache's side, or with pretrained weights the share
    of it their centre crop keeps (a 256 px cache feeds a 224 px crop to ImageNet weights)."""
    if not pretrained or not from_torchvision(arch, pretrained):
        return image_size
    return round(image_size * preprocessing(arch, pretrained)["crop_ratio"])


def size_problem(arch: str, image_size: int, pretrained: str) -> str | None:
    """The line refusing a cache size the architecture cannot take, naming the size it needs."""
    if not from_torchvision(arch, pretrained):
        return None
    pre = preprocessing(arch, pretrained)
    size = input_size(arch, image_size, pretrained)
    crop, resize = pre["crop_size"], pre["resize_size"]
    via = f"prepare.image_size {image_size} gives it {size} px"
    wanted = resize if pretrained else crop
    if arch.startswith(FIXED_SIZE) and size != crop:
        return f"train.model: {arch} takes {crop} px inputs only; {via}: set prepare.image_size to {wanted}"
    low = max(pre["min_size"])
    if size < low:
        need = round(low / pre["crop_ratio"]) if pretrained else low
        return f"train.model: {arch} needs inputs of at least {low} px; {via}: set prepare.image_size to {need} or more"
    return None


def build(arch: str, num_classes: int, size: int | None = None) -> nn.Module:
    """torchvision's `arch`, randomly initialised, with a head for `num_classes`. A ViT gets
    position embeddings for its input `size`, the size `size_problem` asks for (its weights'),
    as torchvision builds it when it loads them (without, it builds 224: vit_h_14's DEFAULT is
    518)."""
    from torchvision.models import get_model

    extra = dict(NO_AUX.get(arch, {}))
    if arch.startswith("vit_") and size:
        extra["image_size"] = size
    return get_model(arch, weights=None, num_classes=num_classes, **extra)


def head_keys(arch: str, num_classes: int, built: nn.Module, size: int | None = None) -> set[str]:
    """The state_dict keys of the head: those whose shape follows the class count (the same
    network built for one class more differs there only; built on the meta device: no memory)."""
    try:
        with torch.device("meta"):
            other = build(arch, num_classes + 1, size).state_dict()
    except (NotImplementedError, RuntimeError):  # a builder that computes with tensors
        other = build(arch, num_classes + 1, size).state_dict()
    return {k for k, v in built.state_dict().items() if other[k].shape != v.shape}


def read_weights(source: str) -> dict:
    """A state_dict from a file: `.safetensors`, or torch's format read with weights_only (and
    `argparse.Namespace` allowed: torchvision's reference scripts save their `args` beside the
    model; it holds only plain values, which weights_only checks in turn)."""
    path = Path(source)
    if not path.is_file():
        raise Unavailable(f"{source} is not a file (a state_dict in torchvision's layout)")
    if path.stat().st_size == 0:
        raise Unavailable(f"{source} is empty (0 bytes): not a state_dict")
    try:
        if path.suffix == ".safetensors" or is_safetensors(path):  # named .pth, say
            from safetensors.torch import load_file

            weights = load_file(path)
        else:
            with torch.serialization.safe_globals(ARGS_CLASSES):
                weights = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:  # Python objects: loading them could run code
        if "Weights only load failed" not in str(error):
            raise Unavailable(
                f"{source} is not a loadable state_dict (UnpicklingError: {error})"
            ) from None
        found = UNSUPPORTED.search(str(error))
        what = f" ({found.group(1)})" if found else ""
        raise Unavailable(
            f"{source} holds pickled Python objects{what}, which are not loaded (they can run "
            "code): save model.state_dict() instead"
        ) from None
    except Exception as error:  # truncated, not torch's format
        raise Unavailable(
            f"{source} is not a loadable state_dict ({type(error).__name__}: {error})"
        ) from None
    return unwrapped(weights, source)


def is_safetensors(path: Path) -> bool:
    """A safetensors file, whatever its name: an 8-byte little-endian header length, then the
    header's JSON (torch's format is a zip or a pickle: neither starts so)."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 2**27


def unwrapped(weights, source: str) -> dict:
    """The state_dict inside the usual checkpoint layouts: `{"state_dict": ...}` (this
    project's model.pt, Lightning), `{"model": ...}` (torchvision's reference scripts),
    `{"model_state_dict": ...}`; keys with `module.` (DDP), `_orig_mod.` (torch.compile) or
    `net.` (this project's fine-tuned model.pt) before every name lose it, as often as they
    are nested (`_orig_mod.module.`: torch.compile of a DDP model)."""
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(weights, dict) and isinstance(weights.get(key), dict):
            weights = weights[key]
            break
    if not isinstance(weights, dict):
        raise Unavailable(f"{source} holds a {type(weights).__name__}, not a state_dict")
    while weights:
        prefix = next((p for p in WRAPPERS if all(str(k).startswith(p) for k in weights)), None)
        if prefix is None:
            return weights
        weights = {k.removeprefix(prefix): v for k, v in weights.items()}
    return weights


def fit_problem(arch: str, source: str, size: int) -> str | None:
    """The line refusing a weights file that cannot be loaded into `arch` (the head aside: its
    class count is the data's), before any stage has run; None when it fits."""
    net = build(arch, 2, size)
    try:
        load_into(net, arch, read_weights(source), head_keys(arch, 2, net, size), source)
    except Unavailable as error:
        return f"train.pretrained: {error}"
    return None


def download(arch: str, name: str) -> dict:
    """torchvision's weights `name`, from torch's cache or downloaded into it (hash checked)."""
    weights = weights_enum(arch, "DEFAULT" if name == "imagenet" else name)
    fetch(arch, name)
    return weights.get_state_dict(progress=True, check_hash=True)


def fetch(arch: str, name: str) -> Path:
    """The file of torchvision's weights `name` in torch's cache, downloaded there first if need
    be (hash checked), without loading it: `check` does this, so that an offline machine is
    told before DVC removes the train stage's results."""
    weights = weights_enum(arch, "DEFAULT" if name == "imagenet" else name)
    target = Path(torch.hub.get_dir()) / "checkpoints" / weights.url.rsplit("/", 1)[-1]
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        prefix = torch.hub.HASH_REGEX.search(target.name)
        print(f"downloading {weights} to {target}", file=sys.stderr)
        torch.hub.download_url_to_file(weights.url, str(target), prefix and prefix.group(1))
    except OSError as error:  # offline (URLError), or the cache unwritable
        raise Unavailable(
            f"cannot download {weights} ({type(error).__name__}): offline, fetch {weights.url} "
            f"elsewhere and put it at {target}, or name a state_dict file in data/pretrained/"
        ) from None
    return target


def load_into(net: nn.Module, arch: str, weights: dict, head: set[str], source: str) -> None:
    """Every weight of the file but the head's (the class count differs); a file for another
    architecture is refused with the keys that do not fit."""
    mine = net.state_dict()
    weights = {k: v for k, v in weights.items() if not k.startswith(AUX_KEYS) or k in mine}
    missing = sorted(k for k in mine if k not in weights and k not in head)
    unexpected = sorted(k for k in weights if k not in mine)
    shapes = sorted(
        k for k in weights if k in mine and k not in head and weights[k].shape != mine[k].shape
    )
    if missing or unexpected or shapes:
        found = [
            f"{what} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} ({len(keys)})"
            for what, keys in (
                ("missing", missing),
                ("unexpected", unexpected),
                ("other shapes", shapes),
            )
            if keys
        ]
        raise Unavailable(f"{source} does not fit {arch}: {'; '.join(found)}")
    net.load_state_dict({k: v for k, v in weights.items() if k not in head}, strict=False)


LR_GROUPS = 3  # the backbone's layer groups for rates per group (train.group_lr_factor)


class FineTune(nn.Module):
    """A torchvision network as the project feeds it (see the module's docstring): centre-crop
    to `size`, one channel to the three the network takes (each with the weights' own
    normalisation, from the project's one-channel mean/std), then the network.

    `freeze(True)` keeps the backbone (everything but the `head` keys) as it is, no gradients,
    but for its BatchNorm layers while `train_bn` (fastai's default): they keep training, their
    scale and shift and their statistics, so that they follow the new data's statistics (photos
    darker or smaller than ImageNet's). Without `train_bn` they are kept too (eval mode while the
    rest trains): the frozen epochs then leave every backbone weight as the file has it."""

    def __init__(self, net: nn.Module, size: int, head: set[str], gray: tuple | None = None):
        super().__init__()
        self.net, self.size, self.head, self.frozen = net, size, head, False
        self.train_bn = True  # train.train_bn
        self.gray = gray is not None
        if gray is not None:  # the network's 3-channel (mean, std); the project normalised
            mean3, std3 = torch.tensor(gray[0]), torch.tensor(gray[1])  # with their averages
            scale, shift = std3.mean() / std3, (mean3.mean() - mean3) / std3
            self.register_buffer("scale", scale.view(1, 3, 1, 1), persistent=False)
            self.register_buffer("shift", shift.view(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, left = (x.shape[-2] - self.size) // 2, (x.shape[-1] - self.size) // 2
        x = x[..., top : top + self.size, left : left + self.size]
        if self.gray:
            x = x.expand(-1, 3, -1, -1) * self.scale + self.shift
        return self.net(x)

    def backbone(self) -> list[nn.Parameter]:
        return [p for name, p in self.net.named_parameters() if name not in self.head]

    def head_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.net.named_parameters() if name in self.head]

    def layer_groups(self, n: int = LR_GROUPS) -> list[list[nn.Parameter]]:
        """The backbone's parameters in `n` groups of consecutive layers, the earliest first: as
        many parameter tensors in each (depth, whatever the family), for rates per group."""
        params = self.backbone()
        bounds = [round(i * len(params) / n) for i in range(n + 1)]
        groups = [params[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        return [group for group in groups if group]

    def backbone_norms(self) -> list[tuple[str, nn.Module]]:
        heads = {name.rpartition(".")[0] for name in self.head}
        return [
            (name, module)
            for name, module in self.net.named_modules()
            if isinstance(module, nn.modules.batchnorm._NormBase) and name not in heads
        ]

    def freeze(self, frozen: bool) -> None:
        self.frozen = frozen
        trained = {id(p) for _, m in self.backbone_norms() for p in m.parameters()}
        for p in self.backbone():
            p.requires_grad_(not frozen or (self.train_bn and id(p) in trained))
        self.train(self.training)

    def train(self, mode: bool = True) -> "FineTune":
        super().train(mode)
        if self.frozen and not self.train_bn:
            for _, module in self.backbone_norms():
                module.eval()
        return self


def finetune(
    arch: str, in_channels: int, num_classes: int, size: int, norm: tuple, pretrained: str = ""
) -> FineTune:
    """torchvision's `arch` with a new head, the pretrained weights if any (a file, or a weights
    name), wrapped to take the project's inputs. `norm` is the network's 3-channel (mean, std)
    (a 1-channel project normalises with their averages)."""
    net = build(arch, num_classes, size)
    head = head_keys(arch, num_classes, net, size)
    if pretrained:
        weights = (
            download(arch, pretrained) if is_weights_name(pretrained) else read_weights(pretrained)
        )
        load_into(net, arch, weights, head, pretrained)
        if arch in NO_AUX and hasattr(net, "transform_input"):
            net.transform_input = True  # as torchvision does for these weights
    gray = norm if in_channels == 1 else None
    return FineTune(net, size, head, gray)


def builder_of(path: str):
    """`Name` of `package.module:Name`, imported from the project; a module that fails to import
    (whatever it raises) or lacks `Name` is one line."""
    module_name, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except Exception as error:  # the module's own code runs here: any error
        raise ValueError(
            f"train.model: cannot import {path} ({type(error).__name__}: {error})"
        ) from None


def import_network(path: str, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """`package.module:Name(in_channels=, num_classes=, image_size=)`, imported from the project."""
    builder = builder_of(path)
    try:
        return builder(in_channels=in_channels, num_classes=num_classes, image_size=image_size)
    except Exception as error:
        raise ValueError(
            f"train.model: {path}(in_channels={in_channels}, num_classes={num_classes}, "
            f"image_size={image_size}) failed: {type(error).__name__}: {error}"
        ) from None


def gradient_check(model: nn.Module, in_channels: int, size: int, num_classes: int) -> dict:
    """Autograd against central finite differences, in float64, on a few entries of the first,
    middle and last parameter tensors (eval mode: dropout draws nothing); the worst relative
    error, and whether it is within 1e-4."""
    model = model.double().eval()
    x = torch.rand(
        2, in_channels, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    y = torch.arange(2) % num_classes
    loss = lambda: nn.functional.cross_entropy(model(x), y)  # noqa: E731
    params = [p for p in model.parameters() if p.requires_grad]
    picked = {id(p): p for p in (params[0], params[len(params) // 2], params[-1])}.values()
    model.zero_grad()
    loss().backward()
    worst, eps = 0.0, 1e-6
    with torch.no_grad():
        for p in picked:
            flat, grad = p.view(-1), p.grad.view(-1)
            for i in torch.linspace(0, flat.numel() - 1, min(3, flat.numel())).long().tolist():
                saved = flat[i].item()
                flat[i] = saved + eps
                up = loss().item()
                flat[i] = saved - eps
                down = loss().item()
                flat[i] = saved
                numeric = (up - down) / (2 * eps)
                error = abs(numeric - grad[i].item()) / max(1e-6, abs(numeric), abs(grad[i].item()))
                worst = max(worst, error)
    model.zero_grad()
    model.float()
    return {"max_relative_error": worst, "passed": worst <= 1e-4}
