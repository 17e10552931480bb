"""The stratified train/val/test split (scikit-learn's, step for step, without importing it)
and the duplicates across splits. Torch-free."""

import math

import numpy as np

from visionflow.errors import DataError

SPLITS = ("train", "val", "test")


def approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of `draws` to take from each class: the floor of its share, then one more for the
    largest remainders, ties broken at random (scikit-learn's `_approximate_mode`, step for step)."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    need = int(draws - floored.sum())
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1] if need > 0 else []:
        (tied,) = np.where(remainder == value)
        now = min(len(tied), need)
        floored[rng.choice(tied, size=now, replace=False)] += 1
        need -= now
        if need == 0:
            break
    return floored.astype(int)


class TooFewToSplit(ValueError):
    """Classes with one image where a stratified split needs two: `labels`, the classes'."""

    def __init__(self, labels: list[int]):
        super().__init__(f"classes {labels} have 1 image: 2 at least")
        self.labels = labels


def stratified_split(
    index: np.ndarray, labels: np.ndarray, test_size: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(rest, test) of `index`, each class in proportion: the same indices, in the same order, as
    scikit-learn's `train_test_split(index, test_size=, stratify=labels, random_state=seed)`
    (tests/test_data.py holds them equal). Written out because importing scikit-learn cost a
    large share of the prepare stage's time (docs/benchmarks.md measures it)."""
    n_test = math.ceil(test_size * len(index))
    n_rest = len(index) - n_test
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if counts.min() < 2:
        raise TooFewToSplit(classes[counts < 2].tolist())
    if min(n_rest, n_test) < len(classes):
        raise ValueError(f"{n_rest} and {n_test} images cannot hold {len(classes)} classes each")
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)  # the legacy stream: the same draws in every numpy
    rest_n = approximate_mode(counts, n_rest, rng)
    test_n = approximate_mode(counts - rest_n, n_test, rng)
    rest, test = [], []
    for members, rest_count, test_count in zip(by_class, rest_n, test_n, strict=True):
        shuffled = members.take(rng.permutation(len(members)), mode="clip")
        rest.extend(shuffled[:rest_count])
        test.extend(shuffled[rest_count : rest_count + test_count])
    return index[rng.permutation(rest)], index[rng.permutation(test)]


def split_indices(
    labels: np.ndarray,
    val_fraction: float,
    test_fraction: float,
    seed: int,
    is_test: np.ndarray | None = None,
    classes: list[str] | None = None,
) -> dict[str, np.ndarray]:
    """Stratified train/val/test indices; an official test split is kept as the test split. A
    class too small to split is named (`classes`: the names of the labels)."""
    index = np.arange(len(labels))
    names = classes or [str(c) for c in range(int(labels.max(initial=0)) + 1)]
    counts = np.bincount(labels, minlength=len(names))
    step = "the test split"
    try:
        if is_test is None:
            pool, test = stratified_split(index, labels, test_fraction, seed)
        else:
            pool, test = index[~is_test], index[is_test]
        step = "train and val (what the test split left)"
        train, val = stratified_split(pool, labels[pool], val_fraction, seed)
    except TooFewToSplit as error:  # a class with one image where a split needs two
        few = ", ".join(f"{names[c]!r} ({counts[c]} in all)" for c in error.labels)
        raise DataError(
            f"cannot split {len(labels)} images into {step}: {few} would have 1 image there, "
            "2 at least: give the class more images (3 at least: train, val and test)"
        ) from None
    except ValueError as error:  # more classes than a split has images
        raise DataError(f"cannot split {len(labels)} images into {step}: {error}") from None
    return {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}


def find_duplicates(
    splits: dict[str, np.ndarray], digests, names: list[str], remove: bool
) -> tuple[dict[str, np.ndarray], dict]:
    """Exact duplicates (same cached pixels) across splits; optionally dropped from the later split.

    Train keeps its copy; a val image equal to a train image, or a test image equal to either,
    leaks. Duplicates inside one split are counted, not removed. `digests`: one per image (an
    array, or a list), compared in arrays: no dict of every image (prepare's memory).
    """
    order = np.concatenate([splits[s] for s in SPLITS]).astype(np.int64)  # train, val, test
    placed = np.repeat(np.arange(len(SPLITS)), [len(splits[s]) for s in SPLITS])  # their splits
    _, first_at, same = np.unique(
        np.asarray(digests)[order], return_index=True, return_inverse=True
    )
    first = first_at[same.reshape(-1)]  # where in `order` the first image of the same pixels is
    across = placed[first] != placed  # an earlier split's: train keeps its copy
    within = int(np.count_nonzero(~across & (first != np.arange(len(order)))))
    pairs = [
        {
            "split": SPLITS[placed[p]],
            "image": names[order[p]],
            "same_as": names[order[first[p]]],
            "same_as_split": SPLITS[placed[first[p]]],
        }
        for p in np.flatnonzero(across)
    ]
    drop = across & remove
    kept = {s: order[(placed == k) & ~drop] for k, s in enumerate(SPLITS)}
    report = {
        "across_splits": len(pairs),
        "removed": len(pairs) if remove else 0,
        "within_split": within,
        "pairs": pairs[:1000],
    }
    return kept, report
