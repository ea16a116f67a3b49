"""The few-shot draw (``--shots_per_class``) and the fixed split seed (``--data_seed``) of the data options: what
FedBiP's setting needs (16 shots per class in the paper; a split that shares nothing with the LDM's public pool)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hfpfl.data import DataArguments, build_federated_dataset  # noqa: E402

ARGS = dict(dataset="digits-nomnist", num_clients=3, max_per_domain=80, image_size=8, test_fraction=0.3)


def _labels(ds):
    return np.asarray(ds.with_format(None)["labels"])


def _rows(ds):
    return np.asarray(ds.with_format(None)["pixel_values"]).reshape(len(ds), -1)


def test_shots_keep_exactly_k_train_images_per_class_from_the_full_split():
    full = build_federated_dataset(DataArguments(**ARGS), seed=0)
    few = build_federated_dataset(DataArguments(**ARGS, shots_per_class=2), seed=0)
    for a, b in zip(full.clients, few.clients):
        ya, yb = _labels(a.train), _labels(b.train)
        for k in np.unique(ya):   # exactly min(2, what the client has) of every class it has, and nothing else
            assert (yb == k).sum() == min(2, (ya == k).sum())
        assert set(np.unique(yb)) == set(np.unique(ya))
        # every kept image is one of the client's own train images
        kept, own = _rows(b.train), {r.tobytes() for r in _rows(a.train)}
        assert all(r.tobytes() in own for r in kept)
        # the test split is untouched
        assert np.array_equal(_rows(a.test), _rows(b.test)) and np.array_equal(_labels(a.test), _labels(b.test))


def test_data_seed_fixes_the_split_and_the_run_seed_draws_the_shots():
    fixed = [build_federated_dataset(DataArguments(**ARGS, shots_per_class=2, data_seed=0), seed=s) for s in (0, 1)]
    for a, b in zip(fixed[0].clients, fixed[1].clients):
        assert np.array_equal(_rows(a.test), _rows(b.test))             # the same split at every run seed
    assert any(not np.array_equal(_rows(a.train), _rows(b.train))      # another draw of the shots
               for a, b in zip(fixed[0].clients, fixed[1].clients))
    # data_seed 0 at run seed 1 is the split of run seed 0 without a data seed (the default follows the run seed)
    plain = build_federated_dataset(DataArguments(**ARGS), seed=0)
    assert all(np.array_equal(_rows(a.test), _rows(b.test)) for a, b in zip(plain.clients, fixed[1].clients))
    other = build_federated_dataset(DataArguments(**ARGS), seed=1)
    assert any(not np.array_equal(_rows(a.test), _rows(b.test)) for a, b in zip(plain.clients, other.clients))


def test_bad_shots_and_data_seed_name_the_option():
    with pytest.raises(ValueError, match="--shots_per_class must be >= 1"):
        DataArguments(**ARGS, shots_per_class=0)
    with pytest.raises(ValueError, match=r"--data_seed must be in \[0, 2\*\*32\)"):
        DataArguments(**ARGS, data_seed=-1)
