"""The model side: networks (models, zoo), augmentation and batches (augment, loading), the
step and the epoch (engine, training), checkpoints, the health report, scores. Takes values,
never the params models or the stages."""

# The project's own networks, the one list of their names (models.MODELS builds them; params.py
# and zoo.py check train.model against it without importing torch); any other name is
# torchvision's, or a network of your own (package.module:Name).
OWN_MODELS = ("simple_cnn", "small_resnet", "resnet18")
TORCHVISION_HAS_TOO = ("resnet18",)  # with train.pretrained, torchvision's is fine-tuned instead
CHECKPOINTING = ("small_resnet", "resnet18")  # those with train.checkpointing (from scratch)


def from_torchvision(model: str, pretrained: str) -> bool:
    """Whether train.model is built from torchvision's registry and fine-tuned (zoo.FineTune):
    any classifier of it, resnet18 included when it starts from pretrained weights (the
    project's own resnet18, with a one-channel stem, is for training from scratch)."""
    if ":" in model:
        return False
    return model not in OWN_MODELS or (model in TORCHVISION_HAS_TOO and bool(pretrained))
