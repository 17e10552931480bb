import numpy as np
import pytest
import torch

from visionflow.train.engine import Split, Step, evaluate, pick_device, train_one_epoch
from visionflow.train.models import build_model, load_model, save_model


def toy_data(n=64, seed=0):
    """Two classes told apart by brightness: a model that learns anything gets them right."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = (torch.rand(n, 8, 8, 1, generator=g) * 100 + y.view(-1, 1, 1, 1) * 150).to(torch.uint8)
    return x, y


def test_model_gives_logits_per_class():
    model = build_model("simple_cnn", 3, 7, 32)
    assert model(torch.zeros(5, 3, 32, 32)).shape == (5, 7)
    assert model.training  # build_model hands back a model ready to train


def test_training_drives_loss_down_and_evaluate_scores_it():
    torch.manual_seed(0)
    x, y = toy_data()
    mean, std = torch.tensor([0.4]), torch.tensor([0.3])
    model = build_model("simple_cnn", 1, 2, 8)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    first = train_one_epoch(model, optimizer, Split(x, y, mean, std, g), Step(16))
    for _ in range(15):
        last = train_one_epoch(model, optimizer, Split(x, y, mean, std, g), Step(16))
    assert last["loss"] < first["loss"] / 5
    metrics, logits = evaluate(model, x, y, mean, std, 32)
    assert not model.training and metrics["accuracy"] == 1.0
    assert logits.shape == (64, 2) and torch.equal(logits.argmax(1), y)


def test_saved_model_loads_weights_only_and_predicts_the_same(tmp_path):
    model = build_model("simple_cnn", 1, 3, 8, dropout=0.5).eval()
    meta = {
        "model": "simple_cnn",
        "in_channels": 1,
        "image_size": 8,
        "dropout": 0.5,
        "classes": ["a", "b", "c"],
        "mean": [0.5],
        "std": [0.2],
    }
    path = tmp_path / "model.pt"
    save_model(model, meta, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]  # no temp file left behind
    torch.load(path, weights_only=True)  # plain dict of tensors and Python values
    loaded, loaded_meta = load_model(path)
    x = torch.randn(4, 1, 8, 8)
    assert loaded_meta == meta and not loaded.training
    assert torch.equal(loaded(x), model(x))


def test_device_auto_falls_back_to_cpu_and_cuda_without_gpu_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="no usable GPU"):
        pick_device("cuda")


def test_simple_cnn_pooling_before_relu_is_the_usual_conv_relu_pool():
    model = build_model("simple_cnn", 1, 10, 16, dropout=0.0)
    conv1, _, _, conv2, _, _ = model.features
    usual = torch.nn.Sequential(
        conv1,
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        conv2,
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        model.classifier,
    )
    x = torch.randn(8, 1, 16, 16)
    ours = model(x)
    grads = torch.autograd.grad(ours.sum(), list(model.parameters()))
    reference = usual(x)
    assert torch.equal(ours, reference)
    expected = torch.autograd.grad(reference.sum(), list(model.parameters()))
    for a, b in zip(grads, expected, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_scores_are_scikit_learns():
    """The evaluate stage's scores, computed with NumPy, equal scikit-learn's: a class never
    predicted and one never present (zero_division=0) included."""
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    from visionflow.train.scores import classification_scores, confusion

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (200,), generator=g)  # class 4 of 5 never present
    logits = torch.randn(200, 5, generator=g)
    logits[:, 3] -= 10  # class 3 never predicted
    got = classification_scores(y, logits, list("abcde"), k=2)
    p, r, f, support = precision_recall_fscore_support(
        y.numpy(), logits.argmax(1).numpy(), labels=range(5), zero_division=0
    )
    assert got["macro_f1"] == f.mean()  # to the last bit: metrics.json as before
    assert got["weighted_f1"] == np.average(f, weights=support)
    for i, name in enumerate("abcde"):
        wanted = {"precision": p[i], "recall": r[i], "f1": f[i], "support": support[i]}
        assert got["per_class"][name] == wanted
    expected = confusion_matrix(y.numpy(), logits.argmax(1).numpy(), labels=range(5))
    assert (confusion(y, logits, 5) == expected).all()


def test_tta_averages_the_centre_crop_and_the_corners_the_single_pass_is_the_centre():
    from torch import nn

    from visionflow.train import tta
    from visionflow.train.loading import to_model_input
    from visionflow.train.zoo import FineTune

    torch.manual_seed(0)  # a network that sees where each pixel is: every view differs
    model = FineTune(nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, 4)), 6, {"1.weight"})
    x = torch.randint(0, 256, (10, 8, 8, 3), dtype=torch.uint8)
    y = torch.arange(10) % 4
    mean, std = torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.25, 0.3])
    views = tta.views(8, 6, flip=False)
    assert views == [(1, 1, False), (0, 0, False), (0, 2, False), (2, 0, False), (2, 2, False)]
    assert tta.views(8, 8, flip=True) == [(0, 0, False), (0, 0, True)]  # the whole image: flips
    _, logits = evaluate(model, x, y, mean, std, 4)
    single = tta.tta_log_probs(model, x, mean, std, 4, views[:1], 6)
    assert torch.allclose(single, logits.log_softmax(1), atol=1e-6)  # exported: this view alone
    inputs = to_model_input(x, mean, std)
    by_hand = (
        sum(model.net(inputs[..., t : t + 6, left : left + 6]).softmax(1) for t, left, _ in views)
        / 5
    )
    averaged = tta.tta_log_probs(model, x, mean, std, 3, views, 6)
    assert torch.allclose(averaged.exp(), by_hand, atol=1e-6)  # evaluate's: the views equally
    assert not torch.allclose(averaged, single, atol=1e-3)
    # fastai's tta(beta=0.25): the views' mean moved a quarter of the way to the centre's
    fastai = tta.tta_log_probs(model, x, mean, std, 3, views, 6, beta=0.25)
    assert torch.allclose(fastai.exp(), 0.75 * by_hand + 0.25 * single.exp(), atol=1e-6)


def test_top_losses_and_most_confused_are_sorted_as_fastai_shows_them():
    from visionflow.train.scores import confusion, most_confused, top_losses

    y = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    logits = torch.tensor(
        [[5.0, 0, 0], [0, 1, 0], [0, 5, 0], [3, 0, 0], [0, 2, 0], [0, 4, 0], [0, 0, 9]]
    )
    worst, losses = top_losses(y, logits, 3)
    assert worst.tolist() == [5, 3, 4]  # the highest loss first, right or wrong
    assert losses[5] > losses[3] > losses[4] > losses[1]
    pairs = most_confused(confusion(y, logits, 3), ["cat", "dog", "fox"])
    assert pairs == [
        {"pair": "fox -> dog", "actual": "fox", "predicted": "dog", "count": 2},
        {"pair": "cat -> dog", "actual": "cat", "predicted": "dog", "count": 1},
        {"pair": "dog -> cat", "actual": "dog", "predicted": "cat", "count": 1},
    ]
