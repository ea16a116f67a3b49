"""The federated dataset: a source, partitioned among clients, each client split into train/test(/val), in model-input
format; plus the global test pool, the public pool and held-out new clients."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

import datasets
from datasets import Dataset

from ..options import Check, at_least, in_range, one_of, positive, validate
from .partition import PARTITIONS, partition_dataset
from .sources import check_degradations, check_source_name, load_source
from .transforms import DEGRADATIONS, to_model_inputs


def _degradations_ok(value) -> bool:
    for tok in str(value).split(","):
        kind, colon, sev = tok.strip().partition(":")
        if tok.strip() and (kind not in DEGRADATIONS or (colon and not (sev.isdigit() and 1 <= int(sev) <= 5))):
            return False
    return True


_ALPHA = positive()._replace(
    allowed="a finite number > 0 (small = skewed labels, large = near-IID; for IID clients use --partition iid)")
_DEGRADATIONS = Check(_degradations_ok, f"comma-separated degradations, each one of {', '.join(DEGRADATIONS)} with "
                                        f"an optional ':severity' 1-5 (e.g. 'noise,rotation:5')")


def _says(check: Check, allowed: str) -> Check:
    return check._replace(allowed=allowed)


@dataclass
class DataArguments:
    """Data flags (``transformers.HfArgumentParser``-compatible: every field has help text, every number a declared
    check (:mod:`hfpfl.options`))."""

    dataset: str = field(
        default="digits",
        metadata={"help": "Source: built-in offline (mnist, usps, mnistm, syn, digits), a Hub id (owner/name), "
                          "imagefolder:<dir> or parquet:<path>; '+noise', '+color', '+rotation' (':1-5' severity) "
                          "add degraded copies as extra domains."},
    )
    partition: str = field(
        default="feature_shift",
        metadata={"help": "Partition scheme: iid, dirichlet, pathological, shards, quantity, feature_shift, "
                          "concept_drift, natural_id.", "check": one_of(*PARTITIONS)},
    )
    num_clients: int = field(default=8, metadata={"help": "Number of training clients.", "check": at_least(1)})
    alpha: float = field(default=0.5, metadata={"help": "Dirichlet concentration (dirichlet; quantity sizes).",
                                                "check": _ALPHA})
    min_partition_size: int = field(default=10, metadata={"help": "Minimum samples per client (dirichlet, quantity).",
                                                          "check": at_least(0)})
    classes_per_client: int = field(default=2, metadata={"help": "Classes per client (pathological).",
                                                         "check": at_least(1)})
    num_shards_per_client: int = field(default=2, metadata={"help": "Label-sorted shards per client (shards).",
                                                            "check": at_least(1)})
    quantity_mode: str = field(
        default="dirichlet", metadata={"help": "quantity skew: dirichlet (uses alpha), linear or exponential.",
                                       "check": _says(one_of("dirichlet", "linear", "exponential"),
                                                      "dirichlet, linear or exponential")}
    )
    num_concepts: int = field(
        default=2, metadata={"help": "concept_drift: client groups, each with its own label permutation.",
                             "check": at_least(1)}
    )
    partition_column: str = field(
        default="domain", metadata={"help": "Column for feature_shift / natural_id partitioning."}
    )
    max_per_domain: int | None = field(
        default=600,
        metadata={"help": "Cap on samples per domain over train/test/public (split 70/15/15) for fast CPU runs; "
                          "None = all.", "check": _says(at_least(1), ">= 1 (or None = all)")},
    )
    samples_per_client: int | None = field(
        default=None, metadata={"help": "Optional cap on each client's partition (before its train/test split).",
                                "check": _says(at_least(2), ">= 2 (or None = no cap): each client needs a train "
                                                            "and a test sample")}
    )
    test_fraction: float = field(default=0.2, metadata={
        "help": "Per-client test fraction (stratified if possible).",
        "check": _says(in_range(0, 1, low_open=True, high_open=True),
                       "in (0, 1): every client needs a test split for its personal accuracy")})
    val_fraction: float = field(default=0.0, metadata={"help": "Per-client validation fraction (0 = no val split).",
                                                       "check": in_range(0, 1, high_open=True)})
    num_new_clients: int = field(
        default=0, metadata={"help": "Held-out clients never seen in training (new-client personalization).",
                             "check": at_least(0)}
    )
    image_size: int = field(default=28, metadata={"help": "Model input image size (square).",
                                                  "check": _says(at_least(4), ">= 4 (pixels per side)")})
    num_channels: int = field(default=3, metadata={"help": "Model input channels (1 or 3).",
                                                   "check": _says(one_of(1, 3), "1 (grey) or 3 (RGB)")})
    degradations: str | None = field(
        default=None,
        metadata={"help": "Comma-separated degradations added as extra domains, e.g. 'noise,rotation' or "
                          "'noise:5'; same as appending '+noise+rotation' to --dataset.", "check": _DEGRADATIONS},
    )
    shots_per_class: int | None = field(
        default=None,
        metadata={"help": "Keep this many train images per class on each client (a few-shot draw seeded by the run "
                          "seed; classes with fewer keep all; test splits are untouched); None = all.",
                  "check": _says(at_least(1), ">= 1 (or None = all)")},
    )
    data_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of the split into clients, train/test and public (default: the run's --seed). Fix it "
                          "when a pretrained model's data is one split's public part (FedBiP's tiny LDM: 0), so that "
                          "no seed's clients overlap it.", "check": _says(in_range(0, 2 ** 32, high_open=True),
                                                                          "in [0, 2**32) (or None = the run seed)")},
    )

    def __post_init__(self):
        if self.partition not in PARTITIONS:   # before the declared checks: the same rule with a did-you-mean
            import difflib
            close = difflib.get_close_matches(str(self.partition), PARTITIONS, n=1)
            raise ValueError(f"--partition must be one of {', '.join(PARTITIONS)}, got {self.partition!r}"
                             + (f" (did you mean {close[0]!r}?)" if close else ""))
        check_source_name(self.dataset)   # a misspelt '+degradation' is blamed, not the source
        check_degradations(self.degradations)   # the same rule as the declared check, with a did-you-mean
        validate(self)
        if self.test_fraction + self.val_fraction >= 1:
            raise ValueError(f"--test_fraction + --val_fraction must be < 1 (no training data left), got "
                             f"{self.test_fraction} + {self.val_fraction}; lower one of them")

    def source_name(self) -> str:
        """The effective ``load_source`` name (dataset plus degradations)."""
        name = self.dataset
        if self.degradations:
            for tok in self.degradations.split(","):
                tok = tok.strip()
                if not tok:
                    continue
                if tok.split(":")[0] not in DEGRADATIONS:
                    raise ValueError(f"--degradations: unknown degradation {tok!r}; expected some of {DEGRADATIONS}")
                name += "+" + tok
        return name

    def partition_kwargs(self) -> dict:
        return {
            "alpha": self.alpha,
            "min_partition_size": self.min_partition_size,
            "classes_per_client": self.classes_per_client,
            "num_shards_per_client": self.num_shards_per_client,
            "quantity_mode": self.quantity_mode,
            "num_concepts": self.num_concepts,
            "column": self.partition_column,
        }


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
        import json
        import os

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
        import json
        import os

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
    import hashlib

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


def _split(ds: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset | None]:
    """(rest, held) with round(fraction * n) >= 1 held out, stratified by ``labels`` when possible."""
    if fraction <= 0:
        return ds, None
    n = len(ds)
    n_held = max(1, int(round(fraction * n)))
    if n - n_held < 1:
        raise ValueError(f"client with {n} samples cannot be split with fraction {fraction}: use fewer clients")
    try:
        dd = ds.train_test_split(test_size=n_held, stratify_by_column="labels", seed=seed)
    except ValueError:  # a class with a single member, or fewer held samples than classes
        dd = ds.train_test_split(test_size=n_held, seed=seed)
    return dd["train"], dd["test"]


def _finish(ds: Dataset) -> Dataset:
    return ds.remove_columns([c for c in ds.column_names if c.startswith("_")]).with_format("torch")


def build_federated_dataset(args: DataArguments, seed: int = 0) -> FederatedData:
    """Build the federated dataset described by ``args`` (deterministic per ``seed``).

    The source's ``"train"`` split is partitioned into ``num_clients + num_new_clients`` clients with
    ``args.partition`` (the last ``num_new_clients`` are held out as ``new_clients``); each client's partition is
    capped at ``samples_per_client`` and split into train/test (and val) within itself. ``global_test`` and
    ``public`` are the source's ``"test"`` and ``"public"`` splits. All datasets are in model-input format.
    """
    if args.num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {args.num_clients}")
    if args.num_new_clients < 0:
        raise ValueError(f"num_new_clients must be >= 0, got {args.num_new_clients}")
    if not 0 <= args.test_fraction < 1 or not 0 <= args.val_fraction < 1 or args.test_fraction + args.val_fraction >= 1:
        raise ValueError("test_fraction and val_fraction must be in [0, 1) with a sum < 1")
    draw_seed, seed = seed, (seed if args.data_seed is None else args.data_seed)
    name = args.source_name()
    raw = load_source(name, "train", seed=seed, max_per_domain=args.max_per_domain)
    raw = raw.add_column("_row", np.arange(len(raw)))
    label_feat = raw.features["label"]
    # convert once; clients are index selections of the converted set (no per-client image decoding)
    inputs = to_model_inputs(raw, image_size=args.image_size, num_channels=args.num_channels).with_format(None)
    n_total = args.num_clients + args.num_new_clients
    parts = partition_dataset(raw, args.partition, n_total, seed=seed, **args.partition_kwargs())

    rng = np.random.default_rng([seed, 3])
    clients = []
    for i, p in enumerate(parts):
        cols = p.select_columns(["_row", "label", "domain"]).to_dict()
        rows = np.asarray(cols["_row"])
        labels = np.asarray(cols["label"])
        if args.samples_per_client is not None and len(rows) > args.samples_per_client:
            keep = np.sort(rng.permutation(len(rows))[: args.samples_per_client])
            rows, labels = rows[keep], labels[keep]
        cd = inputs.select(rows)
        if not np.array_equal(np.asarray(cd["labels"]), labels):  # relabelled partition (concept_drift)
            cd = cd.remove_columns("labels").add_column("labels", labels, feature=label_feat)
        client_seed = seed * 100003 + i
        rest, test = _split(cd, args.test_fraction, client_seed)
        if test is None:
            test = cd.select([])
        val_frac = args.val_fraction / (1 - args.test_fraction) if args.val_fraction else 0.0
        train, val = _split(rest, val_frac, client_seed + 1)
        doms = sorted(set(cols["domain"]))
        clients.append(
            ClientData(
                client_id=i,
                train=_finish(train),
                test=_finish(test),
                val=_finish(val) if val is not None else None,
                domain=doms[0] if len(doms) == 1 else None,
            )
        )
    global_test = to_model_inputs(load_source(name, "test", seed, args.max_per_domain), args.image_size,
                                  args.num_channels)
    public = to_model_inputs(load_source(name, "public", seed, args.max_per_domain), args.image_size,
                             args.num_channels)
    fed = FederatedData(
        clients=clients[: args.num_clients],
        new_clients=clients[args.num_clients :],
        global_test=global_test,
        public=public,
        num_labels=label_feat.num_classes,
        label_names=list(label_feat.names),
        image_size=args.image_size,
        num_channels=args.num_channels,
    )
    return few_shot(fed, args.shots_per_class, draw_seed)


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
