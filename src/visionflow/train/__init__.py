"""The model side: networks (models, zoo), augmentation and batches (augment, loading), the
step and the epoch (engine, training), checkpoints, the health report, scores. Takes values,
never the params models or the stages."""

OWN_MODELS = (
    "simple_cnn",
    "small_resnet",
    "resnet18",
)  # the project's own; the rest: torchvision's


def from_torchvision(model: str, pretrained: str) -> bool:
    """Whether train.model is built from torchvision's registry and fine-tuned (zoo.FineTune):
    any classifier of it, resnet18 included when it starts from pretrained weights (the
    project's own resnet18, with a one-channel stem, is for training from scratch)."""
    if ":" in model:
        return False
    return model not in OWN_MODELS or (model == "resnet18" and bool(pretrained))
