"""The adapters paper's #M and Gau(sigma) settings (Elvebakken et al. section IV, after NIID-Bench): hfpfl.data.niid_bench,
``--partition label_quantity`` and ``--noise_skew``. Expected class sets, per-class counts and noise levels are written
out by hand."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import dataclasses  # noqa: E402
import math  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from datasets import ClassLabel, Dataset, Features, Value  # noqa: E402

from hfpfl.data import DataArguments, build_federated_dataset, partition_dataset  # noqa: E402
from hfpfl.data.federated import ClientData, FederatedData  # noqa: E402
from hfpfl.data.niid_bench import noise_skew, noise_skew_stds  # noqa: E402

warnings.filterwarnings("ignore", message="Classes: .* will NOT be used")


def _toy(n_per_class=6, num_classes=10):
    n = n_per_class * num_classes
    return Dataset.from_dict({"uid": list(range(n)), "label": [i % num_classes for i in range(n)]},
                             features=Features({"uid": Value("int64"), "label": ClassLabel(num_classes=num_classes)}))


def _classes(p):
    return sorted(set(p["label"][:]))


def test_label_quantity_m1_gives_client_i_exactly_class_i():
    """#M = 1 over 10 clients and 10 classes: "each class is only found on one client" -- client i holds class i
    and all 6 of its samples (NIID-Bench: client i's first label is i mod 10). The random-mode ``pathological``
    scheme does not guarantee this."""
    parts = partition_dataset(_toy(), "label_quantity", 10, seed=3, classes_per_client=1)
    assert [_classes(p) for p in parts] == [[i] for i in range(10)]
    assert [len(p) for p in parts] == [6] * 10


def test_label_quantity_m1_twenty_clients_split_each_class_in_halves():
    """#M = 1 over 20 clients: clients i and i + 10 both hold class i mod 10 and each gets 3 of its 6 samples,
    disjoint."""
    parts = partition_dataset(_toy(), "label_quantity", 20, seed=0, classes_per_client=1)
    assert [_classes(p) for p in parts] == [[i % 10] for i in range(20)]
    assert [len(p) for p in parts] == [3] * 20
    for i in range(10):
        assert not set(parts[i]["uid"][:]) & set(parts[i + 10]["uid"][:])


@pytest.mark.parametrize("m", [2, 3])
def test_label_quantity_m_labels_first_is_i_mod_k_and_equal_shares(m):
    """#M = m over 10 clients: exactly m labels each, client i's include i; every class is split among the clients
    that hold it in shares that differ by at most one and add up to its 6 samples; no sample goes to two clients."""
    parts = partition_dataset(_toy(), "label_quantity", 10, seed=1, classes_per_client=m)
    sets = [_classes(p) for p in parts]
    assert all(len(s) == m and i in s for i, s in enumerate(sets))
    for k in range(10):
        shares = [int(np.sum(np.asarray(p["label"][:]) == k)) for p, s in zip(parts, sets) if k in s]
        assert sum(shares) == 6 and max(shares) - min(shares) <= 1, (k, shares)
    uids = np.concatenate([np.asarray(p["uid"][:]) for p in parts])
    assert len(uids) == len(set(uids.tolist()))


def test_label_quantity_refuses_more_labels_than_classes():
    with pytest.raises(ValueError, match="classes_per_client must be in 1..10"):
        partition_dataset(_toy(), "label_quantity", 10, classes_per_client=11)


def test_noise_stds_by_hand():
    """sigma = 0.1, N = 4. paper: variance 0.1 * i / 4 for i = 1..4 -> std sqrt(0.025), sqrt(0.05), sqrt(0.075),
    sqrt(0.1); niid_bench: std 0.1 * i / 3 for i = 0..3 -> 0, 1/30, 2/30, 0.1; one client: sqrt(0.1) / 0."""
    assert noise_skew_stds(4, 0.1) == pytest.approx([0.158113883, 0.223606798, 0.273861279, 0.316227766], abs=1e-9)
    assert noise_skew_stds(4, 0.1, "niid_bench") == pytest.approx([0.0, 0.0333333333, 0.0666666667, 0.1], abs=1e-9)
    assert noise_skew_stds(1, 0.1) == pytest.approx([0.316227766]) and noise_skew_stds(1, 0.1, "niid_bench") == [0.0]
    with pytest.raises(ValueError, match="rule must be one of paper, niid_bench"):
        noise_skew_stds(4, 0.1, "std")


def _zeros(n):
    return Dataset.from_dict({"pixel_values": np.zeros((n, 1, 8, 8), np.float32).tolist(),
                              "labels": [0] * n}).with_format("torch")


def _fed(num_clients=4):
    clients = [ClientData(i, train=_zeros(60), test=_zeros(20)) for i in range(num_clients)]
    return FederatedData(clients=clients, new_clients=[ClientData(num_clients, _zeros(10), _zeros(10))],
                         global_test=_zeros(10), public=None, num_labels=1, label_names=["a"], image_size=8,
                         num_channels=1)


@pytest.mark.parametrize("rule", ["paper", "niid_bench"])
def test_noise_skew_noises_each_client_by_its_std(rule):
    """On all-zero inputs the noised pixel_values are the noise: per training client its sample std is
    2 x the hand std above (model inputs are on [-1, 1], the paper's noise on [0, 1]) within 5 % over 3840 values;
    niid_bench's client 0 is left exactly clean; the test split gets its own draw; new clients and the global test
    set stay zero."""
    out = noise_skew(_fed(), 0.1, rule, seed=0)
    hand = {"paper": [0.158113883, 0.223606798, 0.273861279, 0.316227766],
            "niid_bench": [0.0, 0.0333333333, 0.0666666667, 0.1]}[rule]
    for c, std in zip(out.clients, hand):
        x = c.train[:]["pixel_values"]
        if std == 0:
            assert torch.count_nonzero(x) == 0
            continue
        assert float(x.std()) == pytest.approx(2 * std, rel=0.05), c.client_id
        assert float(c.test[:]["pixel_values"].std()) == pytest.approx(2 * std, rel=0.12)
        assert not torch.equal(c.test[:]["pixel_values"], x[:20])
    assert torch.count_nonzero(out.new_clients[0].train[:]["pixel_values"]) == 0
    assert torch.count_nonzero(out.global_test[:]["pixel_values"]) == 0


def test_noise_skew_option_reaches_the_built_clients():
    """--noise_skew 0.1 (paper rule) on a 2-client iid split: each client's train pixel_values minus the clean
    build's are noise of std 2 x sqrt(0.1 * i / 2), i = 1, 2 (0.447, 0.632) within 10 %; the global test set is the
    clean one; a bad value is one line naming the option."""
    base = DataArguments(dataset="mnist", partition="iid", num_clients=2, max_per_domain=60, image_size=8,
                         num_channels=1)
    clean = build_federated_dataset(base, seed=0)
    noisy = build_federated_dataset(dataclasses.replace(base, noise_skew=0.1), seed=0)
    for i, (a, b) in enumerate(zip(clean.clients, noisy.clients)):
        d = b.train[:]["pixel_values"] - a.train[:]["pixel_values"]
        assert float(d.std()) == pytest.approx(2 * math.sqrt(0.1 * (i + 1) / 2), rel=0.1), i
    assert torch.equal(noisy.global_test[:]["pixel_values"], clean.global_test[:]["pixel_values"])
    with pytest.raises(ValueError, match=r"^--noise_skew must be > 0 \(or None = off\), got -0.1$"):
        DataArguments(noise_skew=-0.1)
    with pytest.raises(ValueError, match=r"^--noise_skew_rule must be one of paper, niid_bench"):
        DataArguments(noise_skew_rule="variance")


def test_uniform_rule_gives_every_client_std_sigma():
    """FRAug's privatized clients (section 4.3.4): rule uniform, sigma 0.1 over 4 clients -> std 0.1 each; sigma 1.0
    over 1 client -> 1.0."""
    assert noise_skew_stds(4, 0.1, "uniform") == [0.1, 0.1, 0.1, 0.1]
    assert noise_skew_stds(1, 1.0, "uniform") == [1.0]


def test_train_only_noise_leaves_test_clean_and_noises_train_and_val_by_sigma():
    """rule uniform, sigma 0.1, splits train, on all-zero inputs: every client's train (60 x 64 values) and val
    (20 x 64) pixel_values are noise of sample std 2 x 0.1 = 0.2 on the [-1, 1] model scale (within 5 % / 12 %) and
    mean 0 (|mean| < 0.02); every test split, the new client and the global test set stay exactly zero. The train
    noise is the same draw as with splits all (the option only decides which splits are noised)."""
    fed = _fed()
    fed = dataclasses.replace(fed, clients=[dataclasses.replace(c, val=_zeros(20)) for c in fed.clients])
    out = noise_skew(fed, 0.1, "uniform", seed=3, splits="train")
    every = noise_skew(fed, 0.1, "uniform", seed=3, splits="all")
    for c, e in zip(out.clients, every.clients):
        x = c.train[:]["pixel_values"]
        assert float(x.std()) == pytest.approx(0.2, rel=0.05) and abs(float(x.mean())) < 0.02, c.client_id
        assert float(c.val[:]["pixel_values"].std()) == pytest.approx(0.2, rel=0.12)
        assert torch.count_nonzero(c.test[:]["pixel_values"]) == 0
        assert torch.equal(x, e.train[:]["pixel_values"])
        assert float(e.test[:]["pixel_values"].std()) == pytest.approx(0.2, rel=0.12)
    assert torch.count_nonzero(out.new_clients[0].train[:]["pixel_values"]) == 0
    assert torch.count_nonzero(out.global_test[:]["pixel_values"]) == 0
    with pytest.raises(ValueError, match="splits must be one of all, train"):
        noise_skew(fed, 0.1, "uniform", splits="test")


def test_noise_skew_splits_option_reaches_the_built_clients():
    """--noise_skew 0.1 --noise_skew_rule uniform --noise_skew_splits train on a 2-client iid split: each client's
    train pixel_values minus the clean build's are noise of std 2 x 0.1 = 0.2 (within 10 %); every client's test
    split equals the clean build's; the default (all) still noises the test split; a bad value is one line naming
    the option."""
    base = DataArguments(dataset="mnist", partition="iid", num_clients=2, max_per_domain=60, image_size=8,
                         num_channels=1)
    clean = build_federated_dataset(base, seed=0)
    noisy = build_federated_dataset(dataclasses.replace(base, noise_skew=0.1, noise_skew_rule="uniform",
                                                        noise_skew_splits="train"), seed=0)
    every = build_federated_dataset(dataclasses.replace(base, noise_skew=0.1, noise_skew_rule="uniform"), seed=0)
    for a, b, e in zip(clean.clients, noisy.clients, every.clients):
        d = b.train[:]["pixel_values"] - a.train[:]["pixel_values"]
        assert float(d.std()) == pytest.approx(0.2, rel=0.1)
        assert torch.equal(b.test[:]["pixel_values"], a.test[:]["pixel_values"])
        assert not torch.equal(e.test[:]["pixel_values"], a.test[:]["pixel_values"])
    with pytest.raises(ValueError, match=r"^--noise_skew_splits must be one of all, train"):
        DataArguments(noise_skew_splits="test")
