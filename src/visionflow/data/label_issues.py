"""The images whose label is most likely wrong: confident learning (cleanlab's
`find_label_issues`, Northcutt et al.) on out-of-sample predicted probabilities from a
cross-validated probe. Torch-free: the features come in as an array, the normalised pixels from
scratch or a pretrained backbone's (`visionflow.train.features`).

The probes, as measured with 1-10% of labels flipped (bench/label_issues_bench.py,
docs/benchmarks.md): on the pixels, PCA to 30 components then 10 nearest neighbours (digits:
precision 0.93, recall 0.86 over four draws; a logistic regression on the pixels found as many at
0.85 precision, an RBF SVM cost 20x the time for no more; but on photo-like images, whose classes
differ in texture, not in where the ink is, it flagged a third of the folder at 0.1 precision);
on features, a logistic regression (a linear probe): a pretrained backbone's, or from scratch the
train network's last convolution at random weights, its mean and maximum per channel (photo-like
images at 1-10%: precision 1.0, recall 0.7-0.96; digits weaker than the pixels, 0.29-0.75
precision). `find` runs every probe it is given and ranks by the one
whose probabilities agree with the given labels most often out of sample (digits: the pixels,
photos: the random features). Probabilities are out of sample: each image's come from the probe
fitted on the other folds (scikit-learn's `cross_val_predict`), so an image cannot vouch for its
own label.
"""

from typing import NamedTuple

import numpy as np

FOLDS = 5  # cross-validation folds: fewer when the smallest class has fewer images (2 at least)
COMPONENTS = 30  # PCA components of the pixels before the neighbours
NEIGHBOURS = 10  # nearest neighbours that vote an image's class
SMALLEST = 2  # images a class needs in the pool for a fold to hold it out
DOUBTFUL = 0.8  # a probe agreeing with fewer of the labels than this is said to be weak


class Suspects(NamedTuple):
    index: np.ndarray  # positions in the pool, the likeliest mislabelled first
    suggested: np.ndarray  # the probe's class for each
    score: np.ndarray  # the probe's probability of the given label (low: likely wrong)
    folds: int = FOLDS  # the cross-validation folds the probes ran with
    probe: str = ""  # the probe whose probabilities ranked them
    accuracy: dict = {}  # each probe's out-of-sample agreement with the given labels


def folds_for(labels: np.ndarray, classes: list[str]) -> int:
    """Folds for a pool of `labels`: FOLDS, fewer when the smallest class has fewer images. A
    ValueError naming the classes too small to cross-validate (fewer than SMALLEST images)."""
    counts = np.bincount(labels, minlength=len(classes))
    if len(classes) < 2:
        raise ValueError(f"one class ({classes[0]!r}): no other label to suspect")
    small = {c: int(n) for c, n in zip(classes, counts, strict=True) if n < SMALLEST}
    if small:
        raise ValueError(
            f"classes {small} have fewer than {SMALLEST} images: cross-validation needs "
            f"{SMALLEST} per class"
        )
    return int(min(FOLDS, counts.min()))


def probe(linear: bool, n_train: int, dims: int, seed: int):
    """A probe for a fold of `n_train` images of `dims` features: a linear one (scaled features,
    logistic regression) for a backbone's features, else PCA then nearest neighbours."""
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if linear:  # C 0.01: precision 0.94-0.98 where 0.1 gave 0.84-0.95 (random features, 5-10%)
        return make_pipeline(StandardScaler(), LogisticRegression(C=0.01, max_iter=200))
    components = min(COMPONENTS, dims, n_train)
    return make_pipeline(
        PCA(components, random_state=seed),
        KNeighborsClassifier(min(NEIGHBOURS, n_train)),
    )


def out_of_sample(
    features: np.ndarray, labels: np.ndarray, folds: int, linear: bool, seed: int
) -> np.ndarray:
    """(n, classes) probabilities, each image's from a probe that did not see it."""
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    split = StratifiedKFold(folds, shuffle=True, random_state=seed)
    n_train = len(labels) - -(-len(labels) // folds)  # the smallest training fold
    model = probe(linear, n_train, features.shape[1], seed)
    return cross_val_predict(model, features, labels, cv=split, method="predict_proba")


def rank(labels: np.ndarray, probabilities: np.ndarray) -> Suspects:
    """The label issues confident learning finds in `probabilities` (cleanlab's default filter,
    prune_by_noise_rate), ranked by self-confidence (the probability of the given label), the
    least confident first."""
    from cleanlab.filter import find_label_issues

    index = find_label_issues(
        labels, probabilities, return_indices_ranked_by="self_confidence", n_jobs=1
    )
    index = np.asarray(index, dtype=np.int64)
    score = probabilities[index, labels[index]]
    # ties (a neighbours' vote gives many a 0) go to the surest suggestion first
    index = index[np.lexsort((-probabilities[index].max(axis=1), score))]
    score = probabilities[index, labels[index]]
    return Suspects(index, probabilities[index].argmax(axis=1), score)


def find(
    probes: dict[str, tuple[np.ndarray, bool]], labels: np.ndarray, classes: list[str], seed: int
) -> Suspects:
    """The likely mislabelled images of a pool. `probes`: name -> (features, one row per image;
    linear or not); each is cross-validated, and the one whose probabilities agree with the
    given labels most often (the better model of them: its disagreements are likelier the
    labels' fault) ranks. A ValueError (one line) when the pool cannot be cross-validated: one
    class, a class of one image."""
    folds = folds_for(labels, classes)
    accuracy, best = {}, None
    for name, (features, linear) in probes.items():
        probabilities = out_of_sample(features.astype(np.float32), labels, folds, linear, seed)
        accuracy[name] = round(float(np.mean(probabilities.argmax(axis=1) == labels)), 4)
        if best is None or accuracy[name] > accuracy[best[0]]:
            best = name, probabilities
    return rank(labels, best[1])._replace(folds=folds, probe=best[0], accuracy=accuracy)


def class_shares(labels: np.ndarray, suspects: Suspects, classes: list[str]) -> dict:
    """Per class (given label): its suspects, its images and their share."""
    given = np.bincount(labels[suspects.index], minlength=len(classes))
    total = np.bincount(labels, minlength=len(classes))
    return {
        c: {"suspects": int(s), "images": int(n), "share": round(s / n, 4) if n else 0.0}
        for c, s, n in zip(classes, given, total, strict=True)
    }


def summary(report: dict, shown: int) -> str:
    """The log line of a label-issue report: how many suspects, the share of each class that has
    any (the highest first), the classes of which half or more are suspects (their folder may
    hold another class's images), and the picture's cap of `shown`."""
    issues, n, shares = report["suspects"], report["images"], report["per_class"]
    agree = report["probe_accuracy"][report["probe"]]
    probe = f"probe: {report['probe']}, agreeing with {agree:.1%} of the labels"
    if agree < DOUBTFUL:
        probe += (
            " only: many suspects may be its own mistakes (a pretrained backbone's features, "
            "train.pretrained, make a better probe)"
        )
    if not issues:
        return f"sanity: no suspected label issues among {n} images (label_issues.json; {probe})"
    ranked = sorted(shares.items(), key=lambda item: -item[1]["share"])
    line = (
        f"sanity: {issues} suspected label issues of {n} images ({issues / n:.1%}; "
        "label_issues.png, label_issues.json); per class: "
        + ", ".join(f"{c} {v['suspects']} ({v['share']:.1%})" for c, v in ranked if v["suspects"])
    )
    most = [f"{c!r} ({v['suspects']} of {v['images']})" for c, v in ranked if v["share"] >= 0.5]
    if most:
        line += (
            f"; half or more of a class are suspects: {', '.join(most)}: its folder may hold "
            "another class's images, or the probe cannot tell it from the others"
        )
    if issues > shown:
        line += f"; the picture shows the {shown} likeliest"
    return f"{line}; {probe}"


def probe_macs(images: int, dims: int, classes: int, linear: bool) -> int:
    """An estimate of the probe's multiply-adds over FOLDS folds: PCA's fit and transform and
    each fold's distances to the others (neighbours), or the logistic regression's passes (50
    of a gradient, two products each: it took 35-38 iterations on digits and photos)."""
    folds = FOLDS
    if linear:
        return 2 * 50 * folds * images * dims * classes
    components = min(COMPONENTS, dims)
    return 3 * folds * images * dims * components + images * images * components
