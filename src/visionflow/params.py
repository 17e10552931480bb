"""Typed, frozen params: `params.yaml` is checked whole before any stage does work.

Unknown keys, wrong types and out-of-range values are rejected with a message that names the key
(`train.lerning_rate: unknown key; did you mean ...`). PyYAML reads `1e-3` as a string while DVC
reads a float; pydantic's number parsing accepts both, so either spelling works.
"""

import difflib
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


ImageFormat = Literal["PNG", "JPEG", "BMP", "GIF", "WEBP", "TIFF"]
Byte = Annotated[int, Field(ge=0, le=255)]


class Prepare(Section):
    source: Literal["digits", "imagefolder", "cifar10", "mnist", "fashion_mnist"] = "digits"
    path: str = "data/raw"
    download: bool = False
    image_size: int = Field(16, ge=8, le=1024)
    color: Literal["grayscale", "rgb"] = "grayscale"
    background: tuple[Byte, Byte, Byte] = (255, 255, 255)
    val_fraction: float = Field(0.15, gt=0, le=0.5)
    test_fraction: float = Field(0.2, gt=0, le=0.5)
    formats: tuple[ImageFormat, ...] = ("PNG", "JPEG", "BMP", "GIF", "WEBP", "TIFF")
    max_pixels: int = Field(50_000_000, ge=1)
    max_bad_fraction: float = Field(0.05, ge=0, le=1)
    min_per_class: int = Field(5, ge=1)
    dedupe: bool = True
    workers: int = Field(0, ge=0)
    max_extract_mb: int = Field(20_000, ge=1)


class Sanity(Section):
    per_class: int = Field(8, ge=1, le=32)


class Augment(Section):
    crop_padding: int = Field(2, ge=0)
    hflip: bool = False
    rotation: float = Field(10.0, ge=0, le=180)
    color_jitter: float = Field(0.0, ge=0, lt=1)


class Health(Section):
    first_steps: int = Field(50, ge=4)
    min_loss_drop: float = Field(0.05, ge=0, lt=1)
    data_bound: float = Field(0.5, gt=0, le=1)
    max_grad_norm: float = Field(1000.0, gt=0)
    min_grad_norm: float = Field(1e-7, ge=0)
    overfit_epochs: int = Field(3, ge=1)


class Train(Section):
    model: Literal["simple_cnn", "small_resnet", "resnet18"] = "simple_cnn"
    pretrained: str = ""
    checkpointing: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    epochs: int = Field(20, ge=1)
    batch_size: int = Field(64, ge=1)
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    lr: float = Field(1e-3, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = False
    weight_decay: float = Field(0.0, ge=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    grad_clip: float = Field(0.0, ge=0)
    accumulate: int = Field(1, ge=1)
    amp: Literal["auto", "bf16", "fp16", "off"] = "auto"
    scheduler: Literal["plateau", "cosine", "step", "none"] = "plateau"
    lr_patience: int = Field(2, ge=0)
    lr_factor: float = Field(0.5, gt=0, lt=1)
    lr_step: int = Field(10, ge=1)
    early_stop: int = Field(0, ge=0)
    max_nonfinite_steps: int = Field(5, ge=1)
    overfit_batches: int = Field(0, ge=0)
    deterministic: bool = True
    channels_last: bool = True
    max_memory_gb: float = Field(4.0, ge=0)
    compile: bool = False
    dropout: float = Field(0.25, ge=0, lt=1)
    auto_batch: bool = False
    augment: Augment = Augment()
    health: Health = Health()


class Evaluate(Section):
    batch_size: int = Field(256, ge=1)
    top_k: int = Field(3, ge=1)
    misclassified: int = Field(16, ge=0, le=100)


class Export(Section):
    batch_size: int = Field(32, ge=3)
    opset: int = Field(18, ge=17)
    onnx_rtol: float = Field(1e-3, ge=0)
    onnx_atol: float = Field(1e-5, ge=0)
    rtol: float = Field(1e-5, ge=0)
    atol: float = Field(1e-6, ge=0)
    min_top1_agreement: float = Field(1.0, ge=0, le=1)
    latency_repeats: int = Field(20, ge=1)


class Params(Section):
    seed: int = 0
    prepare: Prepare = Prepare()
    sanity: Sanity = Sanity()
    train: Train = Train()
    evaluate: Evaluate = Evaluate()
    export: Export = Export()


class ParamsError(ValueError):
    """params.yaml is malformed; the message names every offending key."""


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
    if error["type"] != "extra_forbidden":
        return f"{key}: {error['msg']} (got {error['input']!r})"
    valid = sorted(_model_at(loc).model_fields)
    initials = "".join(word[:1] for word in loc[-1].split("_"))  # learning_rate -> lr
    close = [k for k in valid if k == initials] or difflib.get_close_matches(
        loc[-1], valid, n=1, cutoff=0.5
    )
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{key}: unknown key; {hint}valid keys here: {', '.join(valid)}"


def parse_params(raw: object) -> Params:
    """Validate a mapping (as read from YAML) into `Params`, or raise ParamsError naming the keys."""
    if not isinstance(raw, dict):
        raise ParamsError(f"params must be a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise ParamsError("invalid params:\n  " + "\n  ".join(lines)) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate a params file; any problem is a ParamsError that names the file and key."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ParamsError(f"cannot read {path}: {e}") from None
    try:
        return parse_params(raw)
    except ParamsError as e:
        raise ParamsError(f"{path}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m visionflow.params [FILE]`: check a params file before any stage runs."""
    import sys

    path = (argv if argv is not None else sys.argv[1:] or ["params.yaml"])[0]
    try:
        load_params(path)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{path}: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
