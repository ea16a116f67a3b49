"""The federated dataset: each client's train/test(/val) splits in model-input format, the global test pool, the
public pool and held-out new clients (:class:`FederatedData`), saved to and reloaded from disk with a checked
``federated.json``; plus the few-shot view of one. Built by :func:`hfpfl.data.build.build_federated_dataset`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

import datasets
from datasets import Dataset


@dataclass
class ClientData:
    client_id: int
    train: Dataset  # pixel_values, labels, domain; torch format
    test: Dataset
    val: Dataset | None = None
    domain: str | None = None  # the client's single domain, None if it holds several

    def __len__(self) -> int:
        return len(self.train)


@dataclass
class FederatedData:
    clients: list[ClientData]
    new_clients: list[ClientData]
    global_test: Dataset
    public: Dataset | None
    num_labels: int
    label_names: list[str]
    image_size: int
    num_channels: int

    def label_histograms(self, which: str = "train", include_new: bool = True) -> np.ndarray:
        """[num_clients (+ new), num_labels] label counts of each client's ``which`` split."""
        rows = []
        for c in self.clients + (self.new_clients if include_new else []):
            d = getattr(c, which)
            y = np.asarray(d.with_format(None)["labels"]) if d is not None and len(d) else np.zeros(0, np.int64)
            rows.append(np.bincount(y, minlength=self.num_labels))
        return np.stack(rows) if rows else np.zeros((0, self.num_labels), np.int64)

    def save_to_disk(self, path: str, metadata: dict | None = None) -> None:
        """One ``datasets.DatasetDict`` at ``path`` with splits ``client_{i}_train`` / ``client_{i}_test`` /
        ``client_{i}_val`` (held-out new clients continue the ids), ``global_test`` and ``public``, plus
        ``federated.json`` (client ids, new-client ids, domains, label names, image shape, ``metadata``).
        Reload with :meth:`FederatedData.load_from_disk`."""
        splits = {}
        for c in self.clients + self.new_clients:
            splits[f"client_{c.client_id}_train"] = c.train
            splits[f"client_{c.client_id}_test"] = c.test
            if c.val is not None:
                splits[f"client_{c.client_id}_val"] = c.val
        splits["global_test"] = self.global_test
        if self.public is not None:
            splits["public"] = self.public
        dd = datasets.DatasetDict({k: v.with_format(None) for k, v in splits.items()})
        dd.save_to_disk(path)
        meta = {
            "clients": [c.client_id for c in self.clients],
            "new_clients": [c.client_id for c in self.new_clients],
            "domains": {str(c.client_id): c.domain for c in self.clients + self.new_clients},
            "num_labels": self.num_labels,
            "label_names": self.label_names,
            "image_size": self.image_size,
            "num_channels": self.num_channels,
            "splits": {k: _split_fingerprint(v) for k, v in dd.items()},
            **({"metadata": metadata} if metadata else {}),
        }
        tmp = os.path.join(path, "federated.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=2)
        os.replace(tmp, os.path.join(path, "federated.json"))  # written last: its presence marks a complete save

    @classmethod
    def load_from_disk(cls, path: str) -> "FederatedData":
        """Reload a :meth:`save_to_disk` folder. ``federated.json`` is checked against the stored splits (client ids,
        label feature, image shape, domains, split fingerprints): what disagrees is a one-line ValueError."""
        meta_path = os.path.join(path, "federated.json")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"federated dataset folder {path!r} does not exist; create one with "
                                    f"scripts/partition.py --output_dir <dir> (it is <dir>/dataset)")
        if not os.path.isfile(meta_path):
            raise ValueError(f"{path!r} is not a complete hfpfl federated dataset (no federated.json; an interrupted "
                             f"save?); re-create it with scripts/partition.py")
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{meta_path!r} is not valid JSON ({e}); re-create it with scripts/partition.py") from None
        dd = datasets.load_from_disk(path)
        check_federated_metadata(meta, dd, path)

        def client(i):
            val = dd.get(f"client_{i}_val")
            return ClientData(
                client_id=i,
                train=dd[f"client_{i}_train"].with_format("torch"),
                test=dd[f"client_{i}_test"].with_format("torch"),
                val=val.with_format("torch") if val is not None else None,
                domain=meta["domains"].get(str(i)),
            )

        return cls(
            clients=[client(i) for i in meta["clients"]],
            new_clients=[client(i) for i in meta["new_clients"]],
            global_test=dd["global_test"].with_format("torch"),
            public=dd["public"].with_format("torch") if "public" in dd else None,
            num_labels=meta["num_labels"],
            label_names=meta["label_names"],
            image_size=meta["image_size"],
            num_channels=meta["num_channels"],
        )

    def summary(self) -> str:
        """Per-client sizes and train label histograms as a text table."""
        hist = self.label_histograms("train")
        names = [n[:4] for n in self.label_names]
        w = max(4, max((len(n) for n in names), default=4), len(str(hist.max() if hist.size else 0)))
        dom_w = max([6] + [len(str(c.domain)) for c in self.clients + self.new_clients])
        head = f"{'client':>8} {'domain':<{dom_w}} {'train':>6} {'test':>5} {'val':>4} | " + " ".join(
            f"{n:>{w}}" for n in names)
        lines = [head, "-" * len(head)]
        for c, h in zip(self.clients + self.new_clients, hist):
            cid = f"{c.client_id}{'*' if c in self.new_clients else ''}"
            val = len(c.val) if c.val is not None else 0
            lines.append(f"{cid:>8} {str(c.domain or 'mixed'):<{dom_w}} {len(c.train):>6} {len(c.test):>5} {val:>4} | "
                         + " ".join(f"{v:>{w}}" for v in h))
        lines.append(f"global_test={len(self.global_test)} public={len(self.public) if self.public is not None else 0} "
                     f"labels={self.num_labels} image={self.num_channels}x{self.image_size}x{self.image_size}"
                     + (" (* = held-out new client)" if self.new_clients else ""))
        return "\n".join(lines)


def _split_fingerprint(ds: Dataset) -> dict:
    """Rows, datasets' own fingerprint and a hash of the labels: enough to notice a replaced or edited split."""
    labels = np.asarray(ds.with_format(None)["labels"], dtype=np.int64) if "labels" in ds.column_names else np.zeros(0)
    return {"num_rows": len(ds), "fingerprint": ds._fingerprint,
            "labels_sha1": hashlib.sha1(labels.tobytes()).hexdigest()}


def check_federated_metadata(meta: dict, dd, path: str) -> None:
    """``federated.json`` must agree with the splits stored beside it; the first disagreement is a ValueError that
    says what differs (a hand-edited num_labels, image_size, domain name or client list is caught here)."""
    fix = "; re-create the folder with scripts/partition.py instead of editing federated.json"

    def bad(msg):
        raise ValueError(f"federated dataset {path!r}: {msg}{fix}")

    required = ("clients", "new_clients", "domains", "num_labels", "label_names", "image_size", "num_channels")
    missing = [k for k in required if k not in meta]
    if missing:
        bad(f"federated.json lacks {', '.join(missing)}")
    ids = list(meta["clients"]) + list(meta["new_clients"])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        bad(f"client ids must be integers, got {ids}")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        bad(f"client ids listed more than once: {dup}")
    stored = sorted(int(k.split("_")[1]) for k in dd if k.startswith("client_") and k.endswith("_train"))
    if sorted(ids) != stored:
        bad(f"federated.json lists clients {sorted(ids)} but the stored splits hold clients {stored}")
    for i in ids:
        if f"client_{i}_test" not in dd:
            bad(f"client {i} has no stored test split")
    if "global_test" not in dd:
        bad("no stored global_test split")
    first = dd[f"client_{ids[0]}_train"] if ids else dd["global_test"]
    feat = first.features.get("labels")
    names = list(getattr(feat, "names", []) or [])
    if names and meta["num_labels"] != len(names):
        bad(f"num_labels is {meta['num_labels']} but the stored label feature has {len(names)} classes")
    if names and list(meta["label_names"]) != names:
        bad(f"label_names {meta['label_names']} differ from the stored label names {names}")
    if len(meta["label_names"]) != meta["num_labels"]:
        bad(f"num_labels is {meta['num_labels']} but label_names has {len(meta['label_names'])} entries")
    shape = getattr(first.features.get("pixel_values"), "shape", None)
    want = (meta["num_channels"], meta["image_size"], meta["image_size"])
    if shape is not None and tuple(shape) != want:
        bad(f"image_size/num_channels say {want[0]}x{want[1]}x{want[2]} but stored images are "
            f"{'x'.join(map(str, shape))}")
    for i in ids:
        dom = meta["domains"].get(str(i))
        if dom is None:
            continue
        seen = set(dd[f"client_{i}_train"].unique("domain")) if "domain" in dd[f"client_{i}_train"].column_names \
            else set()
        if seen and seen != {dom}:
            bad(f"client {i}'s domain is {dom!r} in federated.json but its stored samples are from {sorted(seen)}")
    for name, fp in (meta.get("splits") or {}).items():
        if name not in dd:
            bad(f"split {name!r} recorded in federated.json is missing")
        now = _split_fingerprint(dd[name])
        if now["num_rows"] != fp.get("num_rows") or now["labels_sha1"] != fp.get("labels_sha1"):
            bad(f"split {name!r} differs from the one saved ({now['num_rows']} rows now, {fp.get('num_rows')} saved; "
                f"labels {'same' if now['labels_sha1'] == fp.get('labels_sha1') else 'changed'})")


def few_shot(fed: FederatedData, shots: int | None, seed: int) -> FederatedData:
    """Keep ``shots`` train images per class on every client, new clients included (a few-shot setting such as
    FedBiP's, dissertation §5.1: 16 shots per class); classes with fewer keep all. Deterministic per (seed, client);
    the test, validation, global-test and public splits are untouched."""
    if shots is None:
        return fed
    if shots < 1:
        raise ValueError(f"shots_per_class must be >= 1, got {shots}")
    out = []
    for c in fed.clients + fed.new_clients:
        y = np.asarray(c.train.with_format(None)["labels"])
        rng = np.random.default_rng([seed, 17, c.client_id])
        keep = np.sort(np.concatenate([rng.permutation(np.flatnonzero(y == k))[:shots] for k in np.unique(y)]))
        out.append(dataclasses.replace(c, train=c.train.select(keep)))
    n = len(fed.clients)
    return dataclasses.replace(fed, clients=out[:n], new_clients=out[n:])
