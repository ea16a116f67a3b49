"""The PerAda ablation and the parallel-adapter studies: each sweep row differs from its base row by the swept flag
only, and the rows stored before the 5-seed / FedProx / FedNova extension keep their row keys (so they are reused)."""
from pathlib import Path

from hfpfl.experiments import load_study
from hfpfl.experiments.runner import RowStore, current_rows

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _flags(study, name, seed=0):
    return study.argv(study.variant(name), seed)


def test_perada_ablation_is_perada_digits_with_only_the_swept_value_changed():
    """perada_ablation's PerAda, PerAda w/o KD and controls have perada_digits' row keys at seeds 0-2 (the same
    computation, borrowed); each sweep row is perada_digits' PerAda command line plus exactly its lambda, or with
    exactly its --kd_steps value replaced (30 -> 10 / 50)."""
    abl, base = load_study("perada_ablation"), load_study("perada_digits")
    for name in ("perada", "perada_nokd", "chance", "majority", "untrained"):
        for s in (0, 1, 2):
            assert abl.row_key(abl.variant(name), s) == base.row_key(base.variant(name), s), (name, s)
    ref = _flags(base, "perada")
    assert _flags(abl, "lam_0.1") == ref[:-2] + ["--lam", "0.1", "--seed", "0"]
    assert _flags(abl, "lam_10") == ref[:-2] + ["--lam", "10", "--seed", "0"]
    i = ref.index("--kd_steps")
    for name, r in (("kd_10", "10"), ("kd_50", "50")):
        assert ref[i + 1] == "30" and _flags(abl, name) == ref[:i + 1] + [r] + ref[i + 2:], name


def test_fedadapter_studies_keep_the_stored_rows_of_seeds_0_to_2():
    """Every row stored for seeds 0-2 under fedadapter_skews' and fedadapter_silo's original variants still has its
    key (none re-runs), and each FedProx / FedNova skew row is the FedAvg row's command line with the method (and
    FedProx's mu 0.01) added before --adapter."""
    for name in ("fedadapter_skews", "fedadapter_silo"):
        st = load_study(name)
        assert st.seeds == (0, 1, 2, 3, 4)
        have = current_rows(st, RowStore(RESULTS, name).load())
        orig = [v.name for v in st.variants if name == "fedadapter_silo" or not v.name.startswith(("prox_", "nova_"))]
        assert [(v, s) for v in orig for s in (0, 1, 2) if (v, s) not in have] == [], name
    sk = load_study("fedadapter_skews")
    avg = _flags(sk, "parallel_gau")
    j = avg.index("--adapter")
    assert _flags(sk, "prox_parallel_gau") == avg[:j] + ["--method", "fedprox", "--mu", "0.01"] + avg[j:]
    assert _flags(sk, "nova_full_m2") == (lambda f, k: f[:k] + ["--method", "fednova"] + f[k:])(
        _flags(sk, "full_m2"), _flags(sk, "full_m2").index("--adapter"))
