"""FedPCE's Class imbalance group and the new clients' larger test sets (FedPCE paper section 4.2) in
hfpfl.data.benchmarks.degradation_benchmark / hfpfl.data.class_imbalance, against hand values."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hfpfl.data.benchmarks import class_counts, degradation_benchmark, degradation_settings  # noqa: E402
from hfpfl.data.class_imbalance import class_imbalance_split, cut_by_proportions, imbalance_alphas  # noqa: E402


def test_alphas_are_log_spaced_from_0_1_to_10_one_per_client_pair():
    """2M clients, M alphas logspace(0.1, 10): M = 5 -> 0.1, 10^-0.5 = 0.316228, 1, 10^0.5 = 3.162278, 10, each for
    two clients in a row; M = 2 -> 0.1, 10; an odd count is refused (the paper pairs the clients)."""
    assert imbalance_alphas(10) == pytest.approx([0.1, 0.1, 0.316228, 0.316228, 1.0, 1.0, 3.162278, 3.162278,
                                                  10.0, 10.0], rel=1e-5)
    assert imbalance_alphas(4) == pytest.approx([0.1, 0.1, 10.0, 10.0])
    assert degradation_settings("imbalance", 4) == [{"alpha": a} for a in imbalance_alphas(4)]
    with pytest.raises(ValueError, match="even number of clients, got 5"):
        imbalance_alphas(5)


def test_cut_by_proportions_by_hand():
    """Cuts at floor(cumsum(p) * n): 10 at (0.25, 0.75) -> 2, 8; 7 at (0.5, 0.5) -> floor(3.5) = 3, 4;
    5 at (0.2, 0.3, 0.5) -> bounds 0, 1, floor(2.5) = 2, 5 -> 1, 1, 3."""
    assert cut_by_proportions(10, [0.25, 0.75]) == [2, 8]
    assert cut_by_proportions(7, [0.5, 0.5]) == [3, 4]
    assert cut_by_proportions(5, [0.2, 0.3, 0.5]) == [1, 1, 3]


def test_class_counts_largest_remainders_by_hand():
    """6:3:1 of 10 -> 6, 3, 1; thirds of 100 -> 33.33 each, the one left goes to the lowest class: 34, 33, 33;
    5:0:3 of 4 -> 2.5, 0, 1.5 -> 2, 0, 1 and the tie of remainders 0.5 goes to class 0: 3, 0, 1."""
    assert class_counts([6, 3, 1], 10) == [6, 3, 1]
    assert class_counts([1, 1, 1], 100) == [34, 33, 33]
    assert class_counts([5, 0, 3], 4) == [3, 0, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pairs_share_their_subset_and_low_alpha_pairs_are_skewed(seed):
    """10 classes x 40 images over 4 clients: subsets of 200 each go to pairs (0, 1) at alpha 0.1 and (2, 3) at
    alpha 10; every image goes to exactly one client; each pair's class shares are mostly all-or-nothing at alpha 0.1
    (mean |share - 1/2| > 0.25; Beta(0.1, 0.1) gives about 0.42) and near halves at alpha 10 (< 0.2; Beta(10, 10)
    about 0.09)."""
    labels = np.repeat(np.arange(10), 40)
    parts = class_imbalance_split(labels, 4, seed=seed)
    allidx = np.concatenate(parts)
    assert sorted(allidx.tolist()) == list(range(400))
    assert len(parts[0]) + len(parts[1]) == 200 and len(parts[2]) + len(parts[3]) == 200

    def skew(a, b):
        ca, cb = np.bincount(labels[a], minlength=10), np.bincount(labels[b], minlength=10)
        both = ca + cb
        return float(np.mean(np.abs(ca[both > 0] / both[both > 0] - 0.5)))

    assert skew(parts[0], parts[1]) > 0.25 and skew(parts[2], parts[3]) < 0.2


def _pixels(ds):
    return np.asarray(ds.with_format("numpy")[:]["pixel_values"])


def test_benchmark_imbalance_group_and_new_client_test_sets():
    """groups noise + imbalance, 3 + 1 clients each, new_client_test_size 15: every new client tests on 15 images;
    the imbalance group's clients are undegraded ('imbalance-1'..'-4'); its new client's test images are rows of the
    source's test split (the global test set) with class counts class_counts(its train labels, 15), disjoint from
    the other new client's; the noise group's new client's test images are noised (none equals a clean test image).
    Without the option the new clients keep their own 25 % split."""
    kw = dict(clients_per_group=3, new_per_group=1, max_per_domain=1200, image_size=8, num_channels=1, seed=0)
    fed = degradation_benchmark("mnist", ("noise", "imbalance"), new_client_test_size=15, **kw)
    assert [len(c.test) for c in fed.new_clients] == [15, 15]
    doms = sorted(c.domain for c in fed.clients + fed.new_clients if c.domain.startswith("imbalance"))
    assert doms == ["imbalance-1", "imbalance-2", "imbalance-3", "imbalance-4"]
    glob = {p.tobytes() for p in _pixels(fed.global_test)}
    noise_new, imb_new = sorted(fed.new_clients, key=lambda c: not c.domain.startswith("noise"))
    imb_rows = [p.tobytes() for p in _pixels(imb_new.test)]
    assert all(r in glob for r in imb_rows)
    train_labels = np.asarray(imb_new.train.with_format(None)["labels"])
    test_labels = np.asarray(imb_new.test.with_format(None)["labels"])
    expect = class_counts(np.bincount(train_labels, minlength=10), 15)
    assert np.bincount(test_labels, minlength=10).tolist() == expect + [0] * (10 - len(expect))
    assert not any(p.tobytes() in glob for p in _pixels(noise_new.test))
    two = degradation_benchmark("mnist", ("imbalance", "imbalance"), new_client_test_size=15, **kw)
    a, b = ({p.tobytes() for p in _pixels(c.test)} for c in two.new_clients)
    assert len(a) + len(b) >= 29 and not a & b             # disjoint draws (two identical images may exist)
    plain = degradation_benchmark("mnist", ("noise", "imbalance"), **kw)
    assert all(len(c.test) == round(0.25 * (len(c.train) + len(c.test))) for c in plain.new_clients)
    with pytest.raises(ValueError, match="even number of clients"):
        degradation_benchmark("mnist", ("imbalance",), clients_per_group=4, new_per_group=1, max_per_domain=200,
                              image_size=8, num_channels=1)


def test_new_client_test_pool_draws_are_disjoint():
    """NewClientTests: uniform takes of 3 rows from a 7-row pool never repeat a row; asking for more than the pool
    holds (3 clients x 3 > 7) is refused when the pool is made."""
    from datasets import Dataset

    from hfpfl.data.benchmarks import NewClientTests

    ds = Dataset.from_dict({"uid": list(range(7)), "label": [0, 1, 0, 1, 0, 1, 0]})
    pool = NewClientTests(ds, 3, 2, seed=0)
    a, b = (set(pool.take()["uid"]) for _ in range(2))
    assert len(a) == len(b) == 3 and not a & b
    per_class = NewClientTests(ds, 4, 1, seed=0).take(np.array([0, 0, 0, 1]))
    assert sorted(per_class["label"]) == [0, 0, 0, 1]                 # 3 : 1 of 4
    with pytest.raises(ValueError, match="3 new clients x new_client_test_size 3 > the 7 images"):
        NewClientTests(ds, 3, 3, seed=0)


def test_new_client_test_draws_cap_a_class_that_runs_short():
    """A client trained 8 : 2 on classes 0 and 1 asks for 4 + 1 of a 5-image test set; the pool holds 2 images of
    class 0, so it gets both and the 2 missing go to class 1 (its only other class): 2 + 3, never class 2. A client
    trained on class 0 alone cannot be served and is refused with the fix."""
    from datasets import Dataset

    from hfpfl.data.benchmarks import NewClientTests, capped_class_counts

    ds = Dataset.from_dict({"uid": list(range(10)), "label": [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]})
    got = NewClientTests(ds, 5, 1, seed=0).take(np.array([0] * 8 + [1] * 2))
    assert sorted(got["label"]) == [0, 0, 1, 1, 1]
    assert capped_class_counts([8, 2], 5, [9, 9]) == [4, 1]           # none short: the plain proportions
    assert capped_class_counts([6, 3, 1], 10, [3, 9, 9]) == [3, 5, 2]  # 6 -> 3; 7 left at 3 : 1 = 5.25 + 1.75
    with pytest.raises(ValueError, match="too few images of the classes \\[0\\].*raise max_per_domain"):
        NewClientTests(ds, 3, 1, seed=0).take(np.array([0] * 4))
