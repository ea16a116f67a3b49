"""The FRAug Digits study's spec (hfpfl/experiments/studies/fraug_digits.py): its per-domain metrics hook, that every
per-domain claim names a metric the runs produce, and that each FRAug-vs-FedBN claim compares rows of one
optimizer-state policy. Spec checks only: no run."""
import pytest

from hfpfl.arguments import parse_run_args
from hfpfl.data.builtin_sources import MULTI_DOMAIN
from hfpfl.experiments import load_study
from hfpfl.experiments.studies.fraug_digits import domain_accuracies

STUDY = load_study("fraug_digits")


def test_domain_hook_copies_each_domains_accuracy_into_final_under_its_own_name():
    """Hand-made results: each per-domain accuracy appears as <domain>_accuracy beside the existing final metrics,
    which stay as they were."""
    results = {"final": {"personal_accuracy": 0.5}, "per_domain_accuracy": {"mnist": 0.75, "syn": 0.125}}
    domain_accuracies(None, results)
    assert results["final"] == {"personal_accuracy": 0.5, "mnist_accuracy": 0.75, "syn_accuracy": 0.125}


def test_every_claim_metric_is_the_primary_or_a_digits_domains_accuracy():
    """A per-domain claim on a name the hook never writes (e.g. svhn_accuracy) would stay "not measured" forever;
    the domains are the digits dataset's, as the common flags select it."""
    assert "--dataset" in STUDY.common and STUDY.common[STUDY.common.index("--dataset") + 1] == "digits"
    produced = {f"{d}_accuracy" for d in MULTI_DOMAIN["digits"]}
    per_domain = [c.metric for c in STUDY.claims if c.metric]
    assert set(per_domain) == {"mnistm_accuracy", "syn_accuracy"}   # the paper's hardest domains (section 4.1.4)
    assert set(per_domain) <= produced
    for c in STUDY.claims:
        if c.metric:
            for side in (c.a, c.b):
                assert STUDY.variant(side).metrics_hook, f"{side} has no per-domain metrics for {c.text()}"


def _keeps_optimizer_state(name: str) -> bool:
    _, _, cfg = parse_run_args(STUDY.argv(STUDY.variant(name), 0))
    return cfg.keep_optimizer_state


def test_fraug_vs_fedbn_claims_compare_rows_of_one_optimizer_state_policy():
    """FRAug keeps momentum across rounds by default, FedBN restarts it: a claim across the two policies would
    measure the policy, not the method. The parsed configs (defaults included) decide, not the variant names."""
    pairs = [(c.a, c.b) for c in STUDY.claims if {c.a.split("_")[0], c.b.split("_")[0]} == {"fraug", "fedbn"}]
    assert len(pairs) >= 4
    policies = set()
    for a, b in pairs:
        assert _keeps_optimizer_state(a) == _keeps_optimizer_state(b), (a, b)
        policies.add(_keeps_optimizer_state(a))
    assert policies == {True, False}   # both policies are compared


def test_paper_study_runs_the_schedules_of_a_200_round_run():
    """fraug_digits_paper's FRAug row, as parsed: 100 rounds with R = 200 in the schedules, so (by hand) lambda_syn =
    e^{0.01 (r - 200)} runs from e^{-1.99} = 0.1367 (round 1) to e^{-1} = 0.3679 (round 100); lambda_c ramps from
    0.3 e^{-4.5} = 0.0033 to 0.3 from round r_0 = 0.05 * 200 = 10 on; the weighted loss's rho = min(0.5,
    e^{0.002 (r - 200)}) is 0.5 in every round (e^{0.002 (1 - 200)} = 0.672 > 0.5), so L_real has the weight 0.5."""
    import math
    from types import SimpleNamespace

    from hfpfl.algorithms.fraug import FRAug, cls_ratio, lambda_c, lambda_syn

    paper = load_study("fraug_digits_paper")
    run, _, cfg = parse_run_args(paper.argv(paper.variant("fraug"), 0))
    assert run.num_rounds == 100 and cfg.schedule_rounds == 200 and cfg.cls_loss == "weighted"
    algo = FRAug.__new__(FRAug)
    algo.config, algo.ctx = cfg, SimpleNamespace(run=run)
    R = algo.rounds()
    assert R == 200
    assert lambda_syn(1, R, cfg.syn_gamma) == pytest.approx(0.1367, abs=1e-4)
    assert lambda_syn(100, R, cfg.syn_gamma) == pytest.approx(0.3679, abs=1e-4)
    assert lambda_c(1, R, cfg.lambda_0, cfg.ramp_fraction) == pytest.approx(0.3 * math.exp(-4.5), rel=1e-9)
    assert lambda_c(9, R, cfg.lambda_0, cfg.ramp_fraction) < 0.3 == lambda_c(10, R, cfg.lambda_0, cfg.ramp_fraction)
    assert all(cls_ratio(r, R, cfg.cls_ratio_gamma) == 0.5 for r in range(1, 101))
    _, _, plain = parse_run_args(paper.argv(paper.variant("fraug_sum"), 0))
    assert plain.cls_loss == "sum" and plain.schedule_rounds == 200 and plain.gen_lr == cfg.gen_lr
