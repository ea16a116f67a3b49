"""The data flags (:class:`DataArguments`): which source, how it is partitioned among clients and split within
each, each option with its declared check."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from ..options import Check, at_least, in_range, one_of, positive, validate
from .partition import PARTITIONS
from .sources import check_degradations, check_source_name
from .transforms import DEGRADATIONS


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
                          "concept_drift, natural_id, label_quantity (#M).", "check": one_of(*PARTITIONS)},
    )
    num_clients: int = field(default=8, metadata={"help": "Number of training clients.", "check": at_least(1)})
    alpha: float = field(default=0.5, metadata={"help": "Dirichlet concentration (dirichlet; quantity sizes).",
                                                "check": _ALPHA})
    min_partition_size: int = field(default=10, metadata={"help": "Minimum samples per client (dirichlet, quantity).",
                                                          "check": at_least(0)})
    classes_per_client: int = field(default=2, metadata={"help": "Classes per client (pathological, label_quantity).",
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
    noise_skew: float | None = field(
        default=None,
        metadata={"help": "Noise-based feature skew Gau(sigma) (adapters paper section IV, after NIID-Bench): training "
                          "client i of N gets Gaussian noise of variance sigma * i / N (i = 1..N; see "
                          "--noise_skew_rule) on the [0, 1] image scale, on its train/val/test splits; the global "
                          "test set and new clients stay clean. The paper: 0.1 with a homogeneous split "
                          "(--partition iid). None = off.", "check": _says(positive(), "> 0 (or None = off)")},
    )
    noise_skew_rule: str = field(
        default="paper",
        metadata={"help": "--noise_skew per-client spread: paper (variance sigma * i / N, i = 1..N) | niid_bench (the "
                          "NIID-Bench code: standard deviation sigma * i / (N - 1), i = 0..N-1, client 0 clean) | "
                          "uniform (standard deviation sigma on every client: FRAug's privatized clients, section "
                          "4.3.4).",
                  "check": one_of("paper", "niid_bench", "uniform")},
    )
    noise_skew_splits: str = field(
        default="all",
        metadata={"help": "Which splits of each training client --noise_skew noises: all (train, val and test) | "
                          "train (train and val, the data the client trains and validates on; its test split stays "
                          "clean: FRAug's noise-robustness experiment, section 4.3.4).",
                  "check": one_of("all", "train")},
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

