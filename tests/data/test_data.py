"""hfpfl.data: sources, splits, degradations, model inputs, the federated dataset. Offline, small, 1 thread."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import hashlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import datasets  # noqa: E402
from datasets import ClassLabel, Image, Value  # noqa: E402

from hfpfl.data import (  # noqa: E402
    PARTITIONS,
    SOURCES,
    ClientData,
    DataArguments,
    FederatedData,
    SourceUnavailableError,
    build_federated_dataset,
    degrade,
    load_source,
    to_model_inputs,
)

torch.set_num_threads(1)
datasets.disable_progress_bars()


def _hashes(ds):
    return {hashlib.md5(np.asarray(im).tobytes()).hexdigest() for im in ds["image"]}


def _schema_ok(ds):
    assert set(ds.column_names) == {"image", "label", "domain"}
    assert isinstance(ds.features["image"], Image)
    assert isinstance(ds.features["label"], ClassLabel)
    assert ds.features["domain"] == Value("string")


# ------------------------------------------------------------------------------------------------ built-in sources
def test_mnist_is_real_and_split_70_15_15():
    sizes = {s: len(load_source("mnist", s, seed=0)) for s in ("train", "test", "public")}
    assert sizes == {"train": 3500, "test": 750, "public": 750}
    ds = load_source("mnist", "test", seed=0)
    _schema_ok(ds)
    assert ds.features["label"].names == [str(i) for i in range(10)]
    assert set(ds["domain"]) == {"mnist"}
    x = np.stack([np.asarray(im) for im in ds[:200]["image"]])
    assert x.shape == (200, 28, 28) and x.dtype == np.uint8
    assert 20 < x.mean() < 50  # real MNIST: mostly black with white strokes (mean ~33)
    assert x.max() == 255
    assert np.bincount(ds["label"], minlength=10).tolist() == [75] * 10  # stratified


def test_usps_has_1797_rows_before_split_and_splits_are_disjoint():
    parts = {s: load_source("usps", s, seed=3) for s in ("train", "test", "public")}
    assert sum(len(p) for p in parts.values()) == 1797
    h = {s: _hashes(p) for s, p in parts.items()}
    assert not (h["train"] & h["test"]) and not (h["train"] & h["public"]) and not (h["test"] & h["public"])
    assert np.asarray(parts["train"][0]["image"]).shape == (28, 28)


def test_mnistm_and_syn_are_rgb_and_distinct_domains():
    mm = load_source("mnistm", "test", seed=0, max_per_domain=100)
    sy = load_source("syn", "test", seed=0, max_per_domain=100)
    for ds, dom in ((mm, "mnistm"), (sy, "syn")):
        _schema_ok(ds)
        assert set(ds["domain"]) == {dom} and len(ds) == 15
        a = np.stack([np.asarray(im) for im in ds["image"]])
        assert a.shape == (15, 28, 28, 3)
        assert a.std(axis=(1, 2)).mean() > 10  # textured, not blank
        assert np.abs(a[..., 0].astype(int) - a[..., 1]).mean() > 3  # colour, not grey in RGB
    # mnistm is made from the same base digits as mnist: the digit is visible (correlates with the MNIST digit)
    mn = load_source("mnist", "test", seed=0, max_per_domain=100)
    assert mn["label"] == mm["label"]


def test_digits_concatenates_domains_with_cap_and_is_deterministic():
    ds = load_source("digits", "train", seed=0, max_per_domain=100)
    _schema_ok(ds)
    counts = {d: ds["domain"].count(d) for d in set(ds["domain"])}
    assert counts == {"mnist": 70, "usps": 70, "mnistm": 70, "syn": 70}
    again = load_source("digits", "train", seed=0, max_per_domain=100)
    assert _hashes(again) == _hashes(ds)
    other = load_source("digits", "train", seed=1, max_per_domain=100)
    assert _hashes(other) != _hashes(ds)
    # splits stay disjoint for any cap, and the public pool is held by nobody
    pub = load_source("digits", "public", seed=0, max_per_domain=100)
    assert not (_hashes(pub) & _hashes(load_source("digits", "train", seed=0, max_per_domain=300)))


def test_degraded_domains():
    ds = load_source("usps+noise+rotation:5", "test", seed=0, max_per_domain=60)
    assert sorted(set(ds["domain"])) == ["usps", "usps-noise", "usps-rotation"]
    base = load_source("usps", "test", seed=0, max_per_domain=60)
    noisy = degrade(base, "noise", 3, seed=0)
    assert len(noisy) == len(base) and noisy["label"] == base["label"]
    a = np.stack([np.asarray(i) for i in base["image"]]).astype(float)
    b = np.stack([np.asarray(i) for i in noisy["image"]]).astype(float)
    assert 10 < np.abs(a - b).mean() < 60
    assert _hashes(degrade(base, "noise", 3, seed=0)) == _hashes(noisy)  # deterministic
    assert _hashes(degrade(base, "noise", 3, seed=1)) != _hashes(noisy)
    col = degrade(base, "color", 3, seed=0, domain_suffix=True)
    assert set(col["domain"]) == {"usps-color"} and col[0]["image"].mode == "RGB"
    with pytest.raises(ValueError, match="unknown degradation"):
        degrade(base, "blur", 3)


def test_bad_names_raise_clearly():
    with pytest.raises(ValueError) as e:
        load_source("nope")
    for name in SOURCES:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="split"):
        load_source("mnist", split="validation")


# ------------------------------------------------------------------------------------------------ local / hub
def _png(color, size=10):
    from PIL import Image as PILImage

    return PILImage.new("RGB", (size, size), color)


def test_imagefolder_fixture_loads_through_same_path(tmp_path):
    for cls, color in (("cat", (200, 10, 10)), ("dog", (10, 10, 200))):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(10):
            _png(tuple(min(255, c + 3 * i) for c in color)).save(tmp_path / "imgs" / cls / f"{i}.png")
    name = f"imagefolder:{tmp_path / 'imgs'}"
    parts = {s: load_source(name, s, seed=0) for s in ("train", "test", "public")}
    for p in parts.values():
        _schema_ok(p)
    assert {s: len(p) for s, p in parts.items()} == {"train": 14, "test": 4, "public": 2}
    assert parts["train"].features["label"].names == ["cat", "dog"]
    assert set(parts["train"]["domain"]) == {"imgs"}
    assert not (_hashes(parts["train"]) & _hashes(parts["test"]))
    mi = to_model_inputs(parts["train"], image_size=12)
    assert mi[0]["pixel_values"].shape == (3, 12, 12)


def test_parquet_fixture_normalizes_columns(tmp_path):
    n = 40
    raw = datasets.Dataset.from_dict(
        {
            "img": [_png((i * 5, 0, 0), 8) for i in range(n)],
            "fine_label": [i % 4 for i in range(n)],
            "style": ["photo" if i % 2 else "sketch" for i in range(n)],
            "extra": list(range(n)),
        },
        features=datasets.Features(
            {"img": Image(), "fine_label": Value("int64"), "style": Value("string"), "extra": Value("int64")}
        ),
    )
    path = tmp_path / "data.parquet"
    raw.to_parquet(str(path))
    ds = load_source(f"parquet:{path}", "train", seed=0)
    _schema_ok(ds)
    assert sorted(set(ds["domain"])) == ["photo", "sketch"]
    assert ds.features["label"].num_classes == 4
    total = sum(len(load_source(f"parquet:{path}", s, seed=0)) for s in ("train", "test", "public"))
    assert total == n
    capped = load_source(f"parquet:{path}", "train", seed=0, max_per_domain=20)
    assert {d: capped["domain"].count(d) for d in ("photo", "sketch")} == {"photo": 14, "sketch": 14}


def test_uncached_hub_id_fails_fast_offline(monkeypatch, network_calls):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceUnavailableError) as e:
        load_source("hfpfl-no-such-user/no-such-dataset-xyz", "train")
    assert network_calls == []
    msg = str(e.value)
    assert "hfpfl-no-such-user/no-such-dataset-xyz" in msg
    assert "hf download" in msg and "huggingface-cli" not in msg and "offline" in msg and "mnist" in msg


# ------------------------------------------------------------------------------------------------ model inputs
def test_to_model_inputs_dtype_shape_range():
    ds = load_source("digits", "test", seed=0, max_per_domain=40)
    mi = to_model_inputs(ds)
    b = mi[:8]
    assert b["pixel_values"].dtype == torch.float32 and b["pixel_values"].shape == (8, 3, 28, 28)
    assert b["labels"].dtype == torch.int64
    assert set(mi.column_names) == {"pixel_values", "labels", "domain"}
    allx = mi[:]["pixel_values"]
    assert allx.min() >= -1.0 and allx.max() <= 1.0 and allx.min() < -0.9 and allx.max() > 0.9
    # grey -> RGB repeats the channel exactly
    mn = mi.filter(lambda d: d == "mnist", input_columns="domain")[0]["pixel_values"]
    assert torch.equal(mn[0], mn[1]) and torch.equal(mn[1], mn[2])
    g = to_model_inputs(ds, image_size=16, num_channels=1)[:2]["pixel_values"]
    assert g.shape == (2, 1, 16, 16) and g.dtype == torch.float32
    expected = (np.asarray(ds[0]["image"].convert("RGB"), dtype=np.float32) / 255 - 0.5) / 0.5
    assert np.allclose(mi[0]["pixel_values"].numpy(), expected.transpose(2, 0, 1), atol=1e-6)


# ------------------------------------------------------------------------------------------------ federated dataset
@pytest.fixture(scope="module")
def fed_default():
    return build_federated_dataset(DataArguments(num_new_clients=2, val_fraction=0.1), seed=0)


def test_default_federated_dataset(fed_default):
    fed = fed_default
    assert isinstance(fed, FederatedData) and len(fed.clients) == 8 and len(fed.new_clients) == 2
    assert all(isinstance(c, ClientData) for c in fed.clients)
    assert [c.domain for c in fed.clients] == ["mnist", "usps", "mnistm", "syn"] * 2
    assert fed.num_labels == 10 and fed.label_names == [str(i) for i in range(10)]
    assert len(fed.global_test) == 360 and len(fed.public) == 360
    c = fed.clients[0]
    assert len(c) == len(c.train) > 0 and len(c.test) > 0 and c.val is not None and len(c.val) > 0
    b = c.train[:4]
    assert b["pixel_values"].dtype == torch.float32 and b["pixel_values"].shape == (4, 3, 28, 28)
    assert b["labels"].dtype == torch.int64 and set(c.train["domain"]) == {"mnist"}
    # train/test/val disjoint within a client, clients disjoint from each other and from the global test pool
    def h(d):
        return {hashlib.md5(x.numpy().tobytes()).hexdigest() for x in d["pixel_values"]}

    ht, hs, hv = h(c.train), h(c.test), h(c.val)
    assert not (ht & hs) and not (ht & hv) and not (hs & hv)
    assert not (ht & h(fed.clients[4].train))
    assert not (ht & h(fed.global_test)) and not (ht & h(fed.public))
    assert fed.new_clients[0].client_id == 8 and not (h(fed.new_clients[0].train) & ht)
    s = fed.summary()
    assert "mnistm" in s and "8*" in s and s.count("\n") >= 12


def test_federated_deterministic_per_seed(fed_default):
    fed = fed_default
    again = build_federated_dataset(DataArguments(num_new_clients=2, val_fraction=0.1), seed=0)
    assert torch.equal(again.clients[3].train[:]["pixel_values"], fed.clients[3].train[:]["pixel_values"])
    other = build_federated_dataset(DataArguments(num_new_clients=2, val_fraction=0.1), seed=1)
    assert not torch.equal(other.clients[3].train[:5]["pixel_values"], fed.clients[3].train[:5]["pixel_values"])


def test_federated_schemes_and_caps():
    args = DataArguments(dataset="mnist", partition="pathological", num_clients=5, classes_per_client=2,
                         max_per_domain=500, samples_per_client=40, test_fraction=0.25)
    fed = build_federated_dataset(args, seed=0)
    for c in fed.clients:
        assert len(c.train) + len(c.test) <= 40
        assert len(set(c.train[:]["labels"].tolist()) | set(c.test[:]["labels"].tolist())) <= 2
    cd = build_federated_dataset(DataArguments(dataset="usps", partition="concept_drift", num_clients=4,
                                               max_per_domain=200), seed=0)
    assert len(cd.clients) == 4
    with pytest.raises(ValueError, match="unknown degradation"):
        build_federated_dataset(DataArguments(degradations="blur"), seed=0)


def test_save_and_reload(fed_default, tmp_path):
    fed = fed_default
    fed.save_to_disk(str(tmp_path / "fd"))
    back = FederatedData.load_from_disk(str(tmp_path / "fd"))
    assert [len(c) for c in back.clients] == [len(c) for c in fed.clients]
    assert [c.client_id for c in back.new_clients] == [8, 9]
    assert torch.equal(back.clients[2].test[:]["pixel_values"], fed.clients[2].test[:]["pixel_values"])
    assert back.clients[2].domain == "mnistm" and back.label_names == fed.label_names


def test_partitions_registry_names():
    assert {"iid", "dirichlet", "pathological", "shards", "quantity", "feature_shift", "concept_drift",
            "natural_id"} <= set(PARTITIONS)
