"""Partitioners (hfpfl.data.partition_dataset) and scripts/partition.py. Offline, small, 1 thread."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import datasets  # noqa: E402
from datasets import ClassLabel, Dataset, Features, Value  # noqa: E402

from hfpfl.data import PARTITIONS, concept_drift_permutations, partition_dataset  # noqa: E402

torch.set_num_threads(1)
datasets.disable_progress_bars()
warnings.filterwarnings("ignore", message="Classes: .* will NOT be used")


def _toy(n_per_class=60, num_classes=10, domains=("a", "b", "c")):
    """Label-only toy data: partitioners never look at images. ``uid`` identifies a row (its 'x')."""
    n = n_per_class * num_classes
    return Dataset.from_dict(
        {"uid": list(range(n)), "label": [i % num_classes for i in range(n)],
         "domain": [domains[(i // num_classes) % len(domains)] for i in range(n)]},
        features=Features({"uid": Value("int64"), "label": ClassLabel(num_classes=num_classes),
                           "domain": Value("string")}),
    )


@pytest.fixture(scope="module")
def toy():
    return _toy()


def _uids(parts):
    return [sorted(p["uid"][:]) for p in parts]


def _covers_disjoint(parts, ds):
    u = np.concatenate([np.asarray(p["uid"][:]) for p in parts])
    assert len(u) == len(set(u.tolist())), "a sample went to two clients"
    return len(u)


def _hist(p, k=10):
    return np.bincount(np.asarray(p["label"][:]), minlength=k)


def test_iid_equal_covering_deterministic(toy):
    parts = partition_dataset(toy, "iid", 6, seed=0)
    assert [len(p) for p in parts] == [100] * 6
    assert _covers_disjoint(parts, toy) == len(toy)
    assert _uids(partition_dataset(toy, "iid", 6, seed=0)) == _uids(parts)
    assert _uids(partition_dataset(toy, "iid", 6, seed=1)) != _uids(parts)
    assert parts[0]["uid"][:10] != list(range(10))  # shuffled, not contiguous slices


def _skew(parts, k=10):
    """Mean total-variation distance between client label distributions and the global one."""
    g = np.full(k, 1 / k)
    return float(np.mean([0.5 * np.abs(_hist(p, k) / len(p) - g).sum() for p in parts]))


def test_dirichlet_small_alpha_more_skew(toy):
    lo = partition_dataset(toy, "dirichlet", 5, seed=0, alpha=0.1, min_partition_size=5)
    hi = partition_dataset(toy, "dirichlet", 5, seed=0, alpha=100.0, min_partition_size=5)
    assert _covers_disjoint(lo, toy) == len(toy) and _covers_disjoint(hi, toy) == len(toy)
    assert _skew(lo) > 0.4 and _skew(hi) < 0.15 and _skew(lo) > 3 * _skew(hi)
    assert _uids(partition_dataset(toy, "dirichlet", 5, seed=0, alpha=0.1, min_partition_size=5)) == _uids(lo)
    assert _uids(partition_dataset(toy, "dirichlet", 5, seed=1, alpha=0.1, min_partition_size=5)) != _uids(lo)


def test_pathological_exactly_k_classes(toy):
    for k in (1, 2, 3):
        parts = partition_dataset(toy, "pathological", 6, seed=0, classes_per_client=k)
        assert [int((_hist(p) > 0).sum()) for p in parts] == [k] * 6
        _covers_disjoint(parts, toy)


def test_shards_few_classes_equal_sizes(toy):
    parts = partition_dataset(toy, "shards", 10, seed=0, num_shards_per_client=2)
    assert [len(p) for p in parts] == [60] * 10
    assert all((_hist(p) > 0).sum() <= 4 for p in parts)  # 2 label-sorted shards span at most 2+2 classes
    assert _skew(parts) > 0.5


def test_quantity_skew_sizes_vary_labels_iid(toy):
    parts = partition_dataset(toy, "quantity", 5, seed=0, alpha=0.5, min_partition_size=20)
    sizes = [len(p) for p in parts]
    assert sum(sizes) == len(toy) and min(sizes) >= 20 and max(sizes) > 2 * min(sizes)
    big = parts[int(np.argmax(sizes))]
    assert _skew([big]) < 0.15  # label distribution stays IID
    lin = partition_dataset(toy, "quantity", 4, seed=0, quantity_mode="linear")
    assert [len(p) for p in lin] == sorted(len(p) for p in lin) and len(lin[3]) > len(lin[0])


def test_feature_shift_one_domain_per_client(toy):
    parts = partition_dataset(toy, "feature_shift", 7, seed=0)
    doms = [set(p["domain"][:]) for p in parts]
    assert all(len(d) == 1 for d in doms)
    assert [d.pop() for d in doms] == ["a", "b", "c", "a", "b", "c", "a"]  # round-robin
    assert _covers_disjoint(parts, toy) == len(toy)
    # domain a (200 samples) split IID over its 3 clients
    assert sorted(len(parts[i]) for i in (0, 3, 6)) == [66, 67, 67]
    assert _uids(partition_dataset(toy, "feature_shift", 7, seed=1)) != _uids(parts)


def test_concept_drift_changes_p_y_given_x(toy):
    parts = partition_dataset(toy, "concept_drift", 4, seed=0, num_concepts=2)
    true = dict(zip(toy["uid"][:], toy["label"][:]))
    perm = concept_drift_permutations(10, 2, seed=0)[1]
    assert not np.any(perm == np.arange(10)) and sorted(perm.tolist()) == list(range(10))
    for i, p in enumerate(parts):
        got = np.asarray(p["label"][:])
        ref = np.asarray([true[u] for u in p["uid"][:]])
        if i % 2 == 0:
            assert np.array_equal(got, ref)  # group 0: true concept
        else:
            assert np.array_equal(got, perm[ref]) and np.all(got != ref)  # group 1: same x, other y
    assert isinstance(parts[1].features["label"], ClassLabel)


def test_natural_id(toy):
    parts = partition_dataset(toy, "natural_id", 3, seed=0, column="domain")
    assert [set(p["domain"][:]) for p in parts] == [{"a"}, {"b"}, {"c"}]
    with pytest.raises(ValueError, match="one per value"):
        partition_dataset(toy, "natural_id", 5, seed=0)


def test_bad_inputs_raise_clearly(toy):
    with pytest.raises(ValueError) as e:
        partition_dataset(toy, "nope", 3)
    assert all(name in str(e.value) for name in PARTITIONS)
    for a in (0, -1.0):
        with pytest.raises(ValueError, match="alpha must be > 0"):
            partition_dataset(toy, "dirichlet", 3, alpha=a)
    with pytest.raises(ValueError, match="fewer clients"):
        partition_dataset(toy, "iid", len(toy) + 1)
    with pytest.raises(ValueError, match="min_partition_size"):
        partition_dataset(toy, "dirichlet", 50, alpha=0.5, min_partition_size=20)
    # a domain with a single sample cannot feed two clients: the empty client is named
    tiny = Dataset.from_dict({"label": [0, 1, 0, 1, 0, 1, 0, 1, 0], "domain": ["a"] * 8 + ["b"]})
    with pytest.raises(ValueError, match=r"client 3 would be empty.*fewer clients"):
        partition_dataset(tiny, "feature_shift", 4)  # clients 1 and 3 share domain b's single sample


# ------------------------------------------------------------------------------------------------ the script
def _script():
    from conftest import load_script

    return load_script("scripts/partition.py", "hfpfl_partition_script")


def test_partition_script_writes_dataset_and_png(tmp_path, capsys):
    out = tmp_path / "run"
    rc = _script().main(["--dataset", "usps", "--partition", "dirichlet", "--alpha", "0.3", "--num_clients", "4",
                         "--max_per_domain", "300", "--min_partition_size", "5", "--num_new_clients", "1",
                         "--output_dir", str(out), "--seed", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "client" in printed and "4*" in printed
    png = out / "label_distribution.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    dd = datasets.load_from_disk(str(out / "dataset"))
    assert {"client_0_train", "client_0_test", "client_4_train", "global_test", "public"} <= set(dd)
    assert dd["client_0_train"].features["pixel_values"].shape == (3, 28, 28)
    meta = json.loads((out / "dataset" / "federated.json").read_text())
    assert meta["clients"] == [0, 1, 2, 3] and meta["new_clients"] == [4]
    assert (out / "summary.txt").read_text().startswith("  client")


def test_partition_script_help(capsys):
    with pytest.raises(SystemExit) as e:
        _script().main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--partition" in out and "--output_dir" in out and "--push_to_hub_cache" in out
