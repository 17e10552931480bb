"""Typed, frozen params: `params.yaml` is checked whole before any stage does work.

The file is read as DVC reads it (ruamel.yaml, YAML 1.2: `off`, `on`, `yes`, `no` are strings, `1e-3`
is a float, a duplicate key is an error), so the checker and DVC never disagree on a value.
Unknown keys, wrong types (a boolean is not a number) and out-of-range values are rejected with a
message that names the key (`train.lerning_rate: unknown key; did you mean 'lr'?`). A key is
required exactly when DVC requires it: a key that a stage in dvc.yaml lists one by one, or a
section a stage lists whole (`train`); keys inside a section listed whole may have defaults, as DVC
tracks the section by its value (tests/test_dvc_contract.py holds the two together).

A params.yaml that is a symbolic link is refused (DVC's queued experiments cannot apply their params
through one, and DVC cannot read it at a commit), and so is a `prepare.path` that overlaps an output
of dvc.yaml beside the file (DVC refuses the pipeline then, naming neither).
"""

import difflib
import math
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from visionflow.errors import ParamsError
from visionflow.train import CHECKPOINTING, OWN_MODELS, TORCHVISION_HAS_TOO, from_torchvision


def read_yaml(path: str | Path):
    """A YAML file as DVC reads params.yaml (`dvc.utils.serialize.parse_yaml`: ruamel, safe)."""
    from ruamel.yaml import YAML

    return YAML(typ="safe").load(Path(path).read_text())


def read_file(path: Path):
    """`read_yaml(path)`, or a ParamsError in one line naming the file and the line:
    `cannot read params.yaml: found character '\\t' that cannot start any token (line 31)`. A
    duplicate key, a tab, a `!!python/...` tag are refused as DVC refuses them."""
    from ruamel.yaml import YAMLError

    if path.exists() and not (path.is_file() or path.is_dir()):  # reading a FIFO would block
        raise ParamsError(f"cannot read {path}: not a regular file (a FIFO, socket or device)")
    try:
        return read_yaml(path)
    except OSError as error:
        raise ParamsError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ParamsError(f"cannot read {path}: not UTF-8 text (byte {error.start})") from None
    except YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ParamsError(
            f"cannot read {path}: {getattr(error, 'problem', None) or error}{where}"
        ) from None


def refuse_link(path: Path) -> None:
    """A ParamsError naming `path` when it is a symbolic link, as params.yaml and dvc.yaml must
    not be: DVC's queued experiments cannot apply params through a link ("Could not apply stash
    commit", the edit lost), DVC cannot read it at a commit, and a linked dvc.yaml is read as
    its target, with every path (params.yaml among them) taken beside the target."""
    if path.is_symlink():
        raise ParamsError(
            f"{path} is a symbolic link to {os.readlink(path)}: DVC needs the file itself; "
            f'replace the link with the file: cp --remove-destination "$(readlink -f {path})" '
            f"{path}"
        )


class Section(BaseModel):
    # strict: `epochs: true` is not 1 and `hflip: 1` is not true; a float key takes an int
    # and no inf/nan: `lr: .inf` is not a learning rate
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


ImageFormat = Literal["PNG", "JPEG", "BMP", "GIF", "WEBP", "TIFF"]
Byte = Annotated[int, Field(ge=0, le=255)]


class Prepare(Section):
    source: Literal["digits", "imagefolder", "cifar10", "mnist", "fashion_mnist"]
    path: str
    download: bool
    image_size: int = Field(ge=8, le=1024)
    fit: Literal["crop", "squash"] = "crop"
    interpolation: Literal["nearest", "box", "bilinear", "hamming", "bicubic", "lanczos"] = (
        "bilinear"
    )
    color: Literal["grayscale", "rgb"]
    background: tuple[Byte, Byte, Byte] = Field(strict=False)  # a YAML list
    val_fraction: float = Field(gt=0, le=0.5)
    test_fraction: float = Field(gt=0, le=0.5)
    formats: tuple[ImageFormat, ...] = Field(strict=False)
    max_pixels: int = Field(ge=1)
    max_bad_fraction: float = Field(ge=0, le=1)
    min_per_class: int = Field(ge=1)
    dedupe: bool
    workers: int = Field(0, ge=0)  # 0 = one per core; any count makes the same cache bytes
    max_extract_mb: int = Field(ge=1)
    shard_images: int = Field(0, ge=0)  # 0 = one file per split; N: shards of at most N images
    exclude: tuple[str, ...] = Field((), strict=False)  # files left out (paths under `path`)


class Sanity(Section):
    per_class: int = Field(ge=1, le=32)
    label_issues: bool | Literal["auto"] = "auto"  # rank the likely mislabelled images


class Augment(Section):
    crop_padding: int = Field(2, ge=0)
    hflip: bool = False
    rotation: float = Field(10.0, ge=0, le=180)
    color_jitter: float = Field(0.0, ge=0, lt=1)
    mixup: float = Field(0.0, ge=0)  # Beta(alpha, alpha): torchvision's MixUp of batch pairs
    cutmix: float = Field(0.0, ge=0)  # the same for CutMix; both on: one of them per batch


class Health(Section):
    first_steps: int = Field(50, ge=4)
    min_loss_drop: float = Field(0.05, ge=0, lt=1)
    data_bound: float = Field(0.5, gt=0, le=1)
    max_grad_norm: float = Field(1000.0, gt=0)
    min_grad_norm: float = Field(1e-7, ge=0)
    overfit_epochs: int = Field(3, ge=1)


MODEL_NAME = re.compile(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")  # a name, or package.module:Name

# The fine-tuning recipe (train.recipe; docs/fine-tuning.md, measured by
# bench/fastai_peer_bench.py against fastai's fine_tune, #58): under it, each of these keys still
# at its from-scratch default (params.yaml's) takes the recipe's value; a key the user set to
# anything else keeps the user's. One-cycle's warm-up keeps the new head's first, random gradients
# small while they reach the pretrained backbone; AdamW decays the weights apart from the step;
# label smoothing was measured first (#46). fastai's frozen first epoch and rates spread over the
# groups matched it with resnet18 and lost 9 points with mobilenet_v3_small: they stay opt-in.
FINETUNE = {  # key: (from scratch, fine-tuning)
    "label_smoothing": (0.0, 0.1),
    "scheduler": ("plateau", "onecycle"),
    "optimizer": ("adam", "adamw"),
    "weight_decay": (0.0, 0.01),
}


def with_recipe(train: dict) -> dict:
    """The train section as it runs: train.recipe `finetune` (or `auto` with train.pretrained
    set) puts the fine-tuning values into the keys left at their from-scratch defaults."""
    model, pretrained = train.get("model"), train.get("pretrained")
    fine_tuned = isinstance(model, str) and isinstance(pretrained, str) and pretrained
    if train.get("recipe", "auto") not in ("auto", "finetune") or not fine_tuned:
        return train  # finetune without a network to fine-tune: the model's rule says so
    if not from_torchvision(model, pretrained):
        return train
    unset = {
        k: tuned for k, (scratch, tuned) in FINETUNE.items() if train.get(k, scratch) == scratch
    }
    return {**train, **unset}


def recipe_values(train: dict) -> dict:
    """The recipe's keys that hold the recipe's value in a train section as it runs (`with_recipe`
    applied): what the model card says the recipe set. Empty under `scratch` or without weights."""
    scratch = {key: values[0] for key, values in FINETUNE.items()}
    applied = with_recipe({**train, **scratch})
    return {
        key: train[key]
        for key in FINETUNE
        if applied[key] != scratch[key] and train.get(key) == applied[key]
    }


class Train(Section):
    # the project's own, any torchvision classifier (the check stage asks torchvision), or an
    # import path package.module:Name
    model: str
    pretrained: str
    # auto: finetune when pretrained (a torchvision classifier), else scratch
    recipe: Literal["auto", "finetune", "scratch"] = "auto"
    freeze_epochs: int = Field(0, ge=0)  # pretrained: train only the new head for this many epochs
    backbone_lr_factor: float = Field(1.0, gt=0, le=1)  # pretrained: the backbone's lr is lr x this
    group_lr_factor: float = Field(1.0, gt=0, le=1)  # pretrained: a group's lr is the next's x this
    train_bn: bool = True  # pretrained, frozen epochs: BatchNorm layers keep training
    checkpointing: bool
    device: Literal["auto", "cpu", "cuda", "mps"]
    epochs: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    optimizer: Literal["adam", "adamw", "sgd"]
    lr: float | Literal["auto"]  # auto: a range test's rate (`rate`)
    momentum: float = Field(ge=0, lt=1)
    nesterov: bool
    weight_decay: float = Field(ge=0)
    label_smoothing: float = Field(ge=0, lt=1)
    grad_clip: float = Field(ge=0)
    accumulate: int = Field(ge=1)
    amp: Literal["auto", "bf16", "fp16", "off"]
    scheduler: Literal["plateau", "cosine", "step", "onecycle", "none"]
    lr_patience: int = Field(ge=0)
    lr_factor: float = Field(gt=0, lt=1)
    lr_step: int = Field(ge=1)
    early_stop: int = Field(ge=0)
    max_nonfinite_steps: int = Field(ge=1)
    overfit_batches: int = Field(ge=0)
    deterministic: bool
    channels_last: Literal["auto"] | bool  # auto: per model and device (speed_settings)
    max_memory_gb: float = Field(ge=0)
    compile: bool
    dropout: float = Field(ge=0, lt=1)
    auto_batch: bool
    augment: Augment
    health: Health

    @model_validator(mode="before")
    @classmethod
    def recipe_applied(cls, raw):
        return with_recipe(raw) if isinstance(raw, dict) else raw

    @field_validator("lr", mode="before")
    @classmethod
    def rate(cls, lr):
        number = isinstance(lr, int | float) and not isinstance(lr, bool)
        if number and not math.isfinite(lr):
            raise ValueError(f"Input should be a finite number (got {lr!r})")
        if lr == "auto" or (number and lr > 0):
            return float(lr) if number else lr
        raise ValueError(
            f"a number > 0, or auto (a range test finds one: docs/training.md), not {lr!r}"
        )

    @field_validator("model")
    @classmethod
    def model_name(cls, name: str) -> str:
        if not MODEL_NAME.match(name):
            raise ValueError(
                f"{name!r} is not a model name: {', '.join(OWN_MODELS)}, a torchvision "
                "classifier (resnet50, efficientnet_b0, ...) or package.module:Name"
            )
        return name

    @model_validator(mode="after")
    def fine_tuning_needs_a_pretrained_network(self):
        if self.pretrained and self.model in set(OWN_MODELS) - set(TORCHVISION_HAS_TOO):
            raise ValueError(
                f"train.pretrained is for {', '.join(TORCHVISION_HAS_TOO)} and torchvision's "
                f"classifiers, not {self.model}"
            )
        if self.pretrained and ":" in self.model:
            raise ValueError(
                f"train.pretrained: {self.model} is a network of your own: it loads its own weights"
            )
        fine_tuned = self.pretrained and from_torchvision(self.model, self.pretrained)
        for key, value, off in (
            ("freeze_epochs", self.freeze_epochs, 0),
            ("backbone_lr_factor", self.backbone_lr_factor, 1.0),
            ("group_lr_factor", self.group_lr_factor, 1.0),
            ("train_bn", self.train_bn, True),
        ):
            if value != off and not fine_tuned:
                raise ValueError(
                    f"train.{key} is for a torchvision classifier with train.pretrained "
                    f"(train.model {self.model}, train.pretrained {self.pretrained!r})"
                )
        if self.recipe == "finetune" and not fine_tuned:
            raise ValueError(
                "train.recipe finetune is for a torchvision classifier with train.pretrained "
                f"(train.model {self.model}, train.pretrained {self.pretrained!r})"
            )
        if mixed := [key for key in ("mixup", "cutmix") if getattr(self.augment, key)]:
            if self.batch_size < 2:
                raise ValueError(
                    f"train.augment.{mixed[0]} blends a batch's images in pairs: train.batch_size "
                    "1 pairs each image with itself (set train.batch_size 2 or more)"
                )
        if self.checkpointing and (
            self.model not in CHECKPOINTING or from_torchvision(self.model, self.pretrained)
        ):
            raise ValueError(
                f"train.checkpointing is for {' and '.join(CHECKPOINTING)} from scratch, not "
                f"{self.model}{' with train.pretrained' if self.pretrained else ''}"
            )
        return self


class Evaluate(Section):
    batch_size: int = Field(ge=1)
    top_k: int = Field(ge=1)
    misclassified: int = Field(ge=0, le=100)
    top_losses: int = Field(16, ge=0, le=100)
    tta: bool = False


ONNX_FLOOR_OPSET = 21  # the newest opset of onnx 1.16, the oldest that pyproject.toml allows


class Export(Section):
    batch_size: int = Field(ge=3)
    opset: int = Field(ge=17)  # and at most what the installed onnx defines (below)
    onnx_rtol: float = Field(ge=0)
    onnx_atol: float = Field(ge=0)
    rtol: float = Field(ge=0)
    atol: float = Field(ge=0)
    min_top1_agreement: float = Field(ge=0, le=1)
    latency_repeats: int = Field(ge=1)
    # INT8 ONNX (model.int8.onnx): defaults so that a params.yaml written before it still works
    int8_max_accuracy_drop: float = Field(0.01, ge=0, le=1)  # a fraction of the test images
    int8_calibration_images: int = Field(512, ge=1)  # training images, evenly spaced
    int8_calibration: Literal["minmax", "entropy"] = "minmax"
    int8_min_top1_agreement: float = Field(0.9, ge=0, le=1)  # share of test images

    @field_validator("opset")
    @classmethod
    def writable(cls, opset: int) -> int:
        """The exporter writes 17 up to the newest opset the installed onnx defines; asked for
        more, it would silently write 18."""
        if opset <= ONNX_FLOOR_OPSET:
            return opset  # no import: onnx costs every stage half a second at its start
        import onnx.defs

        newest = onnx.defs.onnx_opset_version()
        if opset > newest:
            raise ValueError(f"the installed onnx writes opsets 17 to {newest}, not {opset}")
        return opset


class Params(Section):
    seed: int = Field(ge=0, lt=2**32)  # what NumPy and scikit-learn accept as a seed
    prepare: Prepare
    sanity: Sanity
    train: Train
    evaluate: Evaluate
    export: Export


def _model_at(loc: tuple) -> type[BaseModel]:
    """The params model that owns the key at `loc` (the section for `train.x`)."""
    model: type[BaseModel] = Params
    for part in loc[:-1]:
        annotation = model.model_fields[part].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            break
        model = annotation
    return model


def _describe(error: dict) -> str:
    loc = tuple(str(p) for p in error["loc"])
    key = ".".join(loc)
    if error["type"] == "value_error":  # a section's rule names its keys; a key's gets its name
        message = str(error["ctx"]["error"])
        return message if isinstance(error["input"], dict) else f"{key}: {message}"
    if error["type"] == "missing":
        return f"{key}: missing (a stage in dvc.yaml reads it)"
    if error["type"] == "bool_type":
        return f"{key}: must be true or false (got {error['input']!r})"
    if error["type"] != "extra_forbidden":
        # YAML reads `- #5` as an empty item: the # starts a comment
        empty = "; empty in YAML, where a # starts a comment: quote '#5'" * (error["input"] is None)
        return f"{key}: {error['msg']} (got {error['input']!r}{empty})"
    valid = sorted(_model_at(loc).model_fields)
    initials = "".join(word[:1] for word in loc[-1].split("_"))  # learning_rate -> lr
    close = [k for k in valid if k == initials] or difflib.get_close_matches(
        loc[-1], valid, n=1, cutoff=0.5
    )
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{key}: unknown key; {hint}valid keys here: {', '.join(valid)}"


# what a union's member (pydantic's last `loc` part, `bool | Literal["auto"]`) accepts, in words
MEMBERS = {"bool": "true or false", "float": "a number", "int": "a whole number", "str": "text"}


def _merge_unions(errors: list[dict]) -> list[str]:
    """One line per key: a value that fits no member of a union (`train.lr: auto | a number`) is
    one line naming every member, not a line per member under the member's type name."""
    lines, unions = [], {}
    for error in errors:
        *where, last = (str(p) for p in error["loc"])
        if where and (last in MEMBERS or last.startswith("literal[")):
            accepted = MEMBERS.get(last) or last.removeprefix("literal[").removesuffix("]")
            unions.setdefault(".".join(where), (error["input"], []))[1].append(accepted)
            if len(unions[".".join(where)][1]) == 1:
                lines.append(".".join(where))  # its place among the lines
        else:
            lines.append(_describe(error))
    return [
        f"{line}: must be {', or '.join(unions[line][1])} (got {unions[line][0]!r})"
        if line in unions
        else line
        for line in lines
    ]


def parse_params(raw: object) -> Params:
    """Validate a mapping (as read from YAML) into `Params`, or raise ParamsError naming the keys."""
    if not isinstance(raw, dict):
        raise ParamsError(f"params must be a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as error:
        lines = _merge_unions(error.errors())
        raise ParamsError("invalid params:\n  " + "\n  ".join(lines)) from None


def stage_outputs(stages: dict) -> list[tuple[str, str]]:
    """(stage, output) for every output dvc.yaml's stages list (a path, or {path: options})."""
    return [
        (name, out if isinstance(out, str) else next(iter(out)))
        for name, spec in stages.items()
        if isinstance(spec, dict)  # DVC names what else is wrong in dvc.yaml
        for out in spec.get("outs", [])
    ]


def overlap(root: Path, data: str, outputs: list[tuple[str, str]]) -> str | None:
    """The line refusing `prepare.path: data` when it is, holds or lies in a pipeline output
    (paths relative to `root`, the project): DVC then refuses the whole pipeline with "Same
    item(s) are defined as both a dependency and an output", naming neither."""

    def where(path: str) -> Path:
        return Path(os.path.normpath(Path(root).absolute() / path))

    if not data.strip():  # "" is the project itself, which holds every output
        return "prepare.path: empty: name the folder of images (data/raw, say)"
    here, found = where(data), []
    for stage, out in outputs:
        there = where(out)
        if here == there or here.is_relative_to(there) or there.is_relative_to(here):
            how = "is" if here == there else "lies in" if here.is_relative_to(there) else "holds"
            found.append(f"{how} {out} (stage {stage}'s output)")
    if not found:
        return None
    return (
        f"prepare.path: {data} {', '.join(found)}: DVC refuses a dep that overlaps an output; "
        "point prepare.path at a folder of its own (data/raw, say)"
    )


def check_paths(path: Path, params: Params) -> None:
    """prepare.path against the outputs of the dvc.yaml beside params.yaml, if there is one."""
    pipeline = path.parent / "dvc.yaml"
    if not pipeline.is_file():
        return
    try:
        spec = read_file(pipeline)
    except ParamsError:  # unreadable: DVC says so itself (and `visionflow repro` before it)
        return
    stages = spec.get("stages") if isinstance(spec, dict) else None
    outputs = stage_outputs(stages) if isinstance(stages, dict) else []
    problem = overlap(path.parent, params.prepare.path, outputs)
    if problem:
        raise ParamsError(f"{path}: invalid params:\n  {problem}")


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate a params file; any problem is a ParamsError that names the file and key."""
    path = Path(path)
    refuse_link(path)
    raw = read_file(path)
    try:
        params = parse_params(raw)
    except ParamsError as error:
        raise ParamsError(f"{path}: {error}") from None
    check_paths(path, params)
    return params


def main(argv: list[str] | None = None) -> int:
    """`python -m visionflow.params [FILE]`: check a params file before any stage runs."""
    import sys

    path = (argv if argv is not None else sys.argv[1:] or ["params.yaml"])[0]
    try:
        load_params(path)
    except ParamsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{path}: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
