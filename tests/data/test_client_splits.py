"""Each client's train/test/val split is drawn on its labels alone and selected once: the same examples, in the
same order, as ``datasets.Dataset.train_test_split`` (stratified by label where possible) gives on the client's
dataset, which the builder called twice per client before."""
import numpy as np
import pytest

from hfpfl.data.build import _split


def _reference_split(ds, fraction, seed):
    """The split as datasets computes it (the builder's earlier code, through the public API)."""
    if fraction <= 0:
        return ds, None
    n_held = max(1, int(round(fraction * len(ds))))
    try:
        dd = ds.train_test_split(test_size=n_held, stratify_by_column="labels", seed=seed)
    except ValueError:
        dd = ds.train_test_split(test_size=n_held, seed=seed)
    return dd["train"], dd["test"]


@pytest.mark.parametrize("labels", [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 3],   # stratifiable
    [0, 0, 0, 0, 1, 2, 2, 2, 5, 5],                 # a class with a single member: the plain permutation
    [4] * 9,                                        # one class
])
@pytest.mark.parametrize("fraction, seed", [(0.25, 7), (0.5, 100003), (0.1, 3)])
def test_split_positions_are_datasets_train_test_split(labels, fraction, seed):
    from datasets import ClassLabel, Dataset, Features, Value

    ds = Dataset.from_dict({"labels": labels, "pos": list(range(len(labels)))},
                           features=Features({"labels": ClassLabel(num_classes=6), "pos": Value("int64")}))
    want_rest, want_held = _reference_split(ds, fraction, seed)
    rest, held = _split(np.asarray(labels), fraction, seed, stratify=True)
    assert list(rest) == want_rest["pos"] and list(held) == want_held["pos"]


def test_no_split_and_too_small_a_client():
    rest, held = _split(np.array([1, 2, 3]), 0.0, 0, stratify=True)
    assert list(rest) == [0, 1, 2] and held is None
    with pytest.raises(ValueError, match="cannot be split"):
        _split(np.array([1]), 0.5, 0, stratify=True)
