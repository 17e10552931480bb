import pytest
import torch

from visionflow.errors import Unavailable
from visionflow.train import CHECKPOINTING, OWN_MODELS, TORCHVISION_HAS_TOO
from visionflow.train.models import MODELS, Checkpointed, build_model, load_pretrained


def test_the_own_models_list_is_what_the_builders_build():
    """OWN_MODELS (torch-free: params.py and zoo.py check train.model against it) names exactly
    the networks MODELS builds; those it says take train.checkpointing take it."""
    assert list(MODELS) == list(OWN_MODELS)
    assert set(CHECKPOINTING) | set(TORCHVISION_HAS_TOO) <= set(OWN_MODELS)
    for name in OWN_MODELS:
        model = build_model(name, 1, 3, 8, checkpointing=name in CHECKPOINTING)
        wrapped = any(isinstance(m, Checkpointed) for m in model.modules())
        checkpointed = wrapped or getattr(model, "checkpointing", False)
        assert checkpointed == (name in CHECKPOINTING), name


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("channels,size", [(1, 8), (3, 32)])
def test_each_model_fits_its_input_and_gives_logits(name, channels, size):
    model = build_model(name, channels, 5, size, dropout=0.1)
    assert model(torch.zeros(3, channels, size, size)).shape == (3, 5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_parameter_learns_from_every_input(name):
    """No layer left out of the graph (a head built but not used, a frozen block) and no input
    image ignored: each parameter gets a gradient, and each image of the batch one of its own."""
    torch.manual_seed(0)
    model = build_model(name, 1, 3, 8).train()
    x = torch.randn(4, 1, 8, 8, requires_grad=True)
    model(x).logsumexp(dim=1).sum().backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert not dead
    assert all(x.grad[i].abs().sum() > 0 for i in range(4))


@pytest.mark.parametrize("name", ["small_resnet", "resnet18"])
def test_activation_checkpointing_gives_the_same_gradients(name):
    torch.manual_seed(0)
    plain = build_model(name, 3, 4, 32)
    saved = build_model(name, 3, 4, 32, checkpointing=True)
    saved.load_state_dict(
        {k: v for k, v in zip(saved.state_dict(), plain.state_dict().values(), strict=True)}
    )
    x = torch.randn(4, 3, 32, 32)
    for model in (plain, saved):
        model.train()(x).square().mean().backward()
    for a, b in zip(plain.parameters(), saved.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_pretrained_resnet18_loads_from_a_local_file(tmp_path):
    import torchvision

    reference = torchvision.models.resnet18(weights=None)
    torch.save(reference.state_dict(), tmp_path / "r18.pt")
    model = build_model("resnet18", 3, 7, 32)
    load_pretrained(model, str(tmp_path / "r18.pt"))
    assert torch.equal(model.layer3[0].conv1.weight, reference.layer3[0].conv1.weight)
    assert model.fc[-1].out_features == 7  # the head keeps this task's classes
    gray = build_model("resnet18", 1, 7, 32, checkpointing=True)
    load_pretrained(gray, str(tmp_path / "r18.pt"))
    assert torch.allclose(gray.conv1.weight, reference.conv1.weight.mean(dim=1, keepdim=True))
    with pytest.raises(Unavailable, match="does not fit resnet18"):
        torch.save({"bogus.weight": torch.zeros(1)}, tmp_path / "bad.pt")
        load_pretrained(model, str(tmp_path / "bad.pt"))
