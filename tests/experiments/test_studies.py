"""The study runner (hfpfl.experiments): sample std, claims (held / not held / not measured / two-sided within /
budget refusal), controls, resumable rows, the engine's budget counts, generated docs and verify, end to end on the
committed micro-study (hfpfl/experiments/studies/micro_digits.py)."""
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from hfpfl.experiments import Study, Variant, controls, greater, load_study, margin, within
from hfpfl.experiments import claims as claims_mod
from hfpfl.experiments import runner
from hfpfl.experiments.docs import render, render_index, render_readme_table, replace_readme_table, write_docs

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- summary arithmetic
def test_mean_std_is_the_sample_std_with_n_minus_1():
    """[1, 2, 3, 4]: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, sample variance 5 / 3 (the population
    std, 5 / 4, would give 1.118); one value has no std."""
    got = runner.mean_std([1.0, 2.0, 3.0, 4.0])
    assert got["mean"] == 2.5 and got["n"] == 4
    assert got["std"] == pytest.approx(math.sqrt(5 / 3), abs=1e-12)
    one = runner.mean_std([0.7])
    assert one == {"mean": 0.7, "std": None, "n": 1}
    assert runner.mean_std([]) == {"mean": None, "std": None, "n": 0}


def _study(**kw):
    a, b = Variant("a", ("--method", "fedavg")), Variant("b", ("--method", "fedbn"))
    base = dict(name="t", title="t", paper="p", variants=(a, b, controls.chance()), seeds=(0, 1, 2))
    base.update(kw)
    return Study(**base)


def _row(variant, seed, acc, steps=10, examples=100, domain=None, kind="run"):
    return {"variant": variant, "seed": seed, "kind": kind, "metrics": {"personal_accuracy": acc},
            "per_domain": domain or {}, "per_client": {}, "seconds": 1.0,
            "budget": {"optimizer_steps_per_model": steps, "examples_seen_per_model": examples,
                       "epochs_per_model": 1.0, "trained_models": 4}}


def test_summarize_rows_gives_means_sample_stds_domains_and_budgets():
    """Rows a: 0.5, 0.6, 0.7 at the study's seeds (mean 0.6, sample std 0.1; a row at seed 7 is left out), per-domain mnist 0.4, 0.6 -> 0.5; b: 0.2, 0.4 at steps 10
    and 20 (budget mean 15, marked as varying)."""
    st = _study()
    rows = {("a", 0): _row("a", 0, 0.5, domain={"mnist": 0.4}), ("a", 1): _row("a", 1, 0.6, domain={"mnist": 0.6}),
            ("a", 2): _row("a", 2, 0.7), ("b", 0): _row("b", 0, 0.2, steps=10), ("b", 1): _row("b", 1, 0.4, steps=20),
            ("a", 7): _row("a", 7, 0.0)}   # seed 7 is not one of the study's: outside the table
    s = runner.summarize(st, rows)
    pa = s["variants"]["a"]["metrics"]["personal_accuracy"]
    assert pa["mean"] == pytest.approx(0.6) and pa["std"] == pytest.approx(0.1) and pa["n"] == 3
    assert pa["seeds"] == [0, 1, 2] and pa["values"] == [0.5, 0.6, 0.7]
    assert s["variants"]["a"]["per_domain"]["mnist"]["mean"] == pytest.approx(0.5)
    assert s["variants"]["a"]["per_domain"]["mnist"]["n"] == 2
    bb = s["variants"]["b"]["budget"]
    assert bb["optimizer_steps_per_model"] == 15 and bb["optimizer_steps_per_model_varies"] is True
    assert s["variants"]["a"]["budget"]["optimizer_steps_per_model_varies"] is False
    assert "chance" not in s["variants"]   # no rows: not in the summary (claims on it: not measured)
    assert s["order"] == ["a", "b"]


def test_a_study_without_per_domain_reports_no_domain_columns():
    """per_domain=False: the rows' per-domain accuracies stay in rows.jsonl, the summary has none (so the doc shows no
    domain column); per-client means are still summarized (0.4 and 0.6 -> 0.5)."""
    st = _study(per_domain=False)
    rows = {("a", s): {**_row("a", s, 0.5, domain={"mnist": 1.0}), "per_client": {"0": 0.4 + 0.2 * s}}
            for s in (0, 1)}
    s = runner.summarize(st, rows)
    assert s["variants"]["a"]["per_domain"] == {}
    assert s["variants"]["a"]["per_client"]["0"]["mean"] == pytest.approx(0.5)
    assert "mnist" not in render(s)
    assert runner.summarize(_study(), rows)["variants"]["a"]["per_domain"]["mnist"]["mean"] == 1.0


# ---------------------------------------------------------------------------------------------- claims
def _entry(mean, seeds=(0, 1, 2), steps=10, kind="run"):
    return {"kind": kind, "seeds": list(seeds), "budget": {"optimizer_steps_per_model": steps},
            "metrics": {"personal_accuracy": {"mean": mean, "std": 0.01, "n": len(seeds), "seeds": list(seeds)}}}


def _verdict(claim, variants, matched_by="steps"):
    return claims_mod.evaluate(claim, {"variants": variants}, primary="personal_accuracy", seeds=(0, 1, 2),
                               matched_by=matched_by)


def test_ordering_and_margin_claims_on_hand_made_summaries():
    """a > b: 0.70 vs 0.60 held, 0.60 vs 0.70 not held, a tie is not held (strict); a >= b + 0.015: 0.700 vs 0.685
    held (exactly the margin), 0.700 vs 0.690 not held."""
    assert _verdict(greater("a", "b"), {"a": _entry(0.7), "b": _entry(0.6)})["verdict"] == "held"
    assert _verdict(greater("a", "b"), {"a": _entry(0.6), "b": _entry(0.7)})["verdict"] == "not held"
    assert _verdict(greater("a", "b"), {"a": _entry(0.6), "b": _entry(0.6)})["verdict"] == "not held"
    assert _verdict(margin("a", "b", 0.015), {"a": _entry(0.7), "b": _entry(0.685)})["verdict"] == "held"
    assert _verdict(margin("a", "b", 0.015), {"a": _entry(0.7), "b": _entry(0.69)})["verdict"] == "not held"


def test_within_is_two_sided():
    """|a - b| <= 0.04: a 0.03 below b held, 0.03 above held; a 0.05 ABOVE b not held (a one-sided "a - b <= x" or
    "b - a <= x" test gets one of the last two wrong), 0.05 below not held."""
    w = within("a", "b", 0.04)
    assert _verdict(w, {"a": _entry(0.62), "b": _entry(0.65)})["verdict"] == "held"
    assert _verdict(w, {"a": _entry(0.68), "b": _entry(0.65)})["verdict"] == "held"
    assert _verdict(w, {"a": _entry(0.70), "b": _entry(0.65)})["verdict"] == "not held"
    assert _verdict(w, {"a": _entry(0.60), "b": _entry(0.65)})["verdict"] == "not held"


def test_a_claim_between_two_metrics_compares_a_metric_of_a_with_metric_b_of_b():
    """One row with inference_shared 0.61 and inference_dat 0.58: shared >= dat + 0 held (0.61 vs 0.58), dat >= shared
    + 0 not held; comparing one metric with itself (metric_b ignored) would give 0.61 vs 0.61 and hold both ways.
    A missing metric_b is not measured; metric_b without metric is refused when the study is built."""
    row = {"kind": "run", "seeds": [0, 1, 2], "budget": {"optimizer_steps_per_model": 10},
           "metrics": {"inference_shared": {"mean": 0.61, "seeds": [0, 1, 2]},
                       "inference_dat": {"mean": 0.58, "seeds": [0, 1, 2]}}}
    v = _verdict(margin("f", "f", 0.0, metric="inference_shared", metric_b="inference_dat"), {"f": row})
    assert v["verdict"] == "held" and (v["mean_a"], v["mean_b"]) == (0.61, 0.58)
    assert v["claim"] == "f.inference_shared >= f.inference_dat + 0" and v["metric_b"] == "inference_dat"
    v = _verdict(margin("f", "f", 0.0, metric="inference_dat", metric_b="inference_shared"), {"f": row})
    assert v["verdict"] == "not held" and v["detail"] == "0.5800 vs 0.6100 (-0.0300)"
    v = _verdict(greater("f", "f", metric="inference_dat", metric_b="inference_local"), {"f": row})
    assert v["verdict"] == "not measured" and "no inference_local" in v["detail"]
    with pytest.raises(ValueError, match="must name metric"):
        _study(claims=(greater("a", "b", metric_b="x"),))


def test_missing_rows_are_not_measured_never_not_held():
    """A side with no rows, or without a row for one of the study's seeds, is 'not measured', whatever the means."""
    v = _verdict(greater("a", "b"), {"a": _entry(0.1)})
    assert v["verdict"] == "not measured" and "b: no rows" in v["detail"]
    v = _verdict(greater("a", "b"), {"a": _entry(0.9, seeds=(0, 1)), "b": _entry(0.1)})
    assert v["verdict"] == "not measured" and "seed 2" in v["detail"]


def test_claims_between_different_budgets_are_refused_unless_the_study_says_why():
    """100 vs 940 steps per model: refused; with budgets_differ_because: evaluated (and the reason shown); a budget
    that is not reported is refused too; a control side needs no reason; matched by epochs compares epochs."""
    variants = {"a": _entry(0.5, steps=100), "b": _entry(0.4, steps=940)}
    v = _verdict(greater("a", "b"), variants)
    assert v["verdict"] == "refused" and "100" in v["detail"] and "940" in v["detail"]
    v = _verdict(greater("a", "b", budgets_differ_because="the paper's own budgets"), variants)
    assert v["verdict"] == "held" and "the paper's own budgets" in v["budgets"]
    v = _verdict(greater("a", "b"), {"a": _entry(0.5, steps=None), "b": _entry(0.4)})
    assert v["verdict"] == "refused"
    v = _verdict(greater("a", "b"), {"a": _entry(0.5, steps=100), "b": _entry(0.1, steps=0, kind="chance")})
    assert v["verdict"] == "held" and "control" in v["budgets"]
    driver = {**_entry(0.5, steps=100, kind="tuner"), "control": False}    # a registered driver trains: no pass
    assert _verdict(greater("a", "b"), {"a": driver, "b": _entry(0.4, steps=940)})["verdict"] == "refused"
    ep = {"a": {**_entry(0.5, steps=100), "budget": {"epochs_per_model": 2.0}},
          "b": {**_entry(0.4, steps=900), "budget": {"epochs_per_model": 2.0}}}
    assert _verdict(greater("a", "b"), ep, matched_by="epochs")["verdict"] == "held"
    assert _verdict(greater("a", "b"), ep, matched_by="steps")["verdict"] == "refused"


def test_tuners_are_matched_by_the_rounds_they_spent():
    """matched_by="rounds" compares rounds_used (a tuner's rounds over all its candidates), not steps: 80 vs 80 rounds
    at 400 vs 900 steps is evaluated; 80 vs 60 rounds is refused (a steps match does not rescue it); a study may
    declare it; the summary averages rounds_used over seeds (80, 80, 77 -> 79) and docs show a rounds column."""
    def tuned(mean, rounds, steps):
        return {**_entry(mean, steps=steps, kind="hp_tuner"), "control": False,
                "budget": {"optimizer_steps_per_model": steps, "rounds_used": rounds}}
    v = _verdict(greater("a", "b"), {"a": tuned(0.5, 80, 400), "b": tuned(0.4, 80, 900)}, matched_by="rounds")
    assert v["verdict"] == "held" and "matched (80 rounds used)" in v["budgets"]
    v = _verdict(greater("a", "b"), {"a": tuned(0.5, 80, 400), "b": tuned(0.4, 60, 400)}, matched_by="rounds")
    assert v["verdict"] == "refused" and "80" in v["detail"] and "60" in v["detail"]
    assert _study(matched_by="rounds").matched_by == "rounds"
    st = _study(matched_by="rounds")
    rows = {("a", s): {**_row("a", s, 0.5), "budget": {"rounds_used": r}} for s, r in ((0, 80), (1, 80), (2, 77))}
    summary = runner.summarize(st, rows)
    assert summary["variants"]["a"]["budget"]["rounds_used"] == 79
    assert summary["variants"]["a"]["budget"]["rounds_used_varies"] is True
    doc = render(summary)
    assert "| rounds (all) |" in doc and "| 79 (varies) |" in doc


def test_label_weighted_majority_is_pflbeds_metric_of_the_majority_label():
    """PFLBED weights each test image by the client's training label frequency p. Train counts [6, 3, 1] -> p = [0.6,
    0.3, 0.1], majority label 0; test counts [5, 10, 20]: weights 0.6 * 5 + 0.3 * 10 + 0.1 * 20 = 8, of which label 0
    holds 3: 3 / 8 = 0.375 (the unweighted majority rate would be 5 / 35)."""
    from hfpfl.experiments.studies._recipe_controls import label_weighted_majority
    assert label_weighted_majority([6, 3, 1], [5, 10, 20]) == pytest.approx(0.375, abs=1e-12)
    assert label_weighted_majority([0, 4, 0], [3, 1, 0]) == pytest.approx(1.0)   # only label 1 weighs: 1 / 1


def test_fedpce_embedding_silhouette_by_hand():
    """1-D points 0, 1 (group a) and 10, 11 (group b): each point's own-group distance a = 1; the other group's mean
    distance b is 10.5 for the outer points (0, 11) and 9.5 for the inner ones, so s = 9.5 / 10.5 and 8.5 / 9.5, mean
    (9.5 / 10.5 + 8.5 / 9.5) / 2. Swapping the labels of 1 and 10 makes the groups overlap: s < 0. A third group c at
    100, 101: b is the NEAREST other group's mean distance (for 0: b's 10.5, not c's 100.5; for 100: b's 89.5), so
    the points score 9.5 / 10.5, 8.5 / 9.5, 8.5 / 9.5, 9.5 / 10.5, 88.5 / 89.5, 89.5 / 90.5."""
    sil = runner._load_recipe(str(REPO / "recipes" / "fedpce.py")).silhouette
    X = np.array([[0.0], [1.0], [10.0], [11.0]])
    assert sil(X, ["a", "a", "b", "b"]) == pytest.approx((9.5 / 10.5 + 8.5 / 9.5) / 2, abs=1e-12)
    assert sil(X, ["a", "b", "a", "b"]) < 0
    X3 = np.array([[0.0], [1.0], [10.0], [11.0], [100.0], [101.0]])
    want = (2 * 9.5 / 10.5 + 2 * 8.5 / 9.5 + 88.5 / 89.5 + 89.5 / 90.5) / 6
    assert sil(X3, ["a", "a", "b", "b", "c", "c"]) == pytest.approx(want, abs=1e-12)


def test_registered_kinds_are_controls_unless_they_train():
    controls.register("question_only", lambda *a: {})
    controls.register("tuner", lambda *a: {}, control=False)
    try:
        assert controls.is_control("question_only") and controls.is_control("chance")
        assert not controls.is_control("tuner") and not controls.is_control("run")
    finally:
        for k in ("question_only", "tuner"):
            controls.RUNNERS.pop(k)
            controls.DRIVERS.discard(k)


def test_a_study_refuses_claims_on_rows_it_does_not_have():
    with pytest.raises(ValueError, match="names 'nope'"):
        _study(claims=(greater("a", "nope"),))


# ---------------------------------------------------------------------------------------------- controls
def test_label_majority_predicts_each_clients_train_majority_on_its_test_labels():
    """Client 0 trains on labels [5, 1, 0] (majority 0) and tests on [2, 2, 0]: 2 / 4; client 1 trains on [0, 2, 3]
    (majority 2) and tests on [1, 0, 3]: 3 / 4. Pooled: train [5, 3, 3] -> 0, test [3, 2, 3]: 3 / 8. A tie goes to
    the smaller label ([2, 2, 0] -> 0)."""
    per_client, pooled = controls.majority_scores(np.array([[5, 1, 0], [0, 2, 3]]), np.array([[2, 2, 0], [1, 0, 3]]))
    assert per_client == [0.5, 0.75] and pooled == 3 / 8
    assert controls.majority_scores(np.array([[2, 2, 0]]), np.array([[1, 3, 0]]))[0] == [0.25]


# ---------------------------------------------------------------------------------------------- the engine's budget
@pytest.mark.parametrize("vectorize", ["off", "on"])
def test_engine_counts_steps_and_examples_per_trained_model(run_sim, small_digits, vectorize):
    """The fixture's clients hold 28, 56, 56, 56 training images. 2 rounds of one epoch at batch 12: 28 images are
    batches 12 + 16 (a remainder of 4 < 8 joins the last batch: 2 steps, not 3, and 28 images, not 2 x 12), 56 are
    12 x 4 + 8 (5 steps); every image is seen once per round. With --local_steps 3: the 28-image client takes 12, 16,
    then 12 of its next epoch (40 images), the others 3 x 12 = 36."""
    _, fed = small_digits
    assert [len(c.train) for c in fed.clients] == [28, 56, 56, 56]
    sim, res = run_sim("fedavg", num_rounds=2, batch_size=12, vectorize=vectorize)
    b = res["budget"]
    assert b["trained_models"] == 4
    assert b["optimizer_steps"] == 2 * (2 + 5 + 5 + 5)
    assert b["examples_seen"] == 2 * (28 + 56 + 56 + 56)
    assert b["optimizer_steps_per_model"] == pytest.approx(2 * 17 / 4)
    assert b["examples_seen_per_model"] == pytest.approx(2 * 196 / 4)
    assert [h["optimizer_steps"] for h in sim.history] == [17, 17]       # per round, in metrics.jsonl too
    _, res = run_sim("fedavg", num_rounds=2, batch_size=12, local_steps=3, vectorize=vectorize,
                     output_dir="steps3")
    assert res["budget"]["optimizer_steps"] == 2 * 4 * 3
    assert res["budget"]["examples_seen"] == 2 * (40 + 36 + 36 + 36)


def test_a_resumed_run_counts_the_rounds_before_its_checkpoint(run_sim):
    """Round 1, checkpoint, then resumed to round 2: the same budget as the straight 2-round run (2 x 17 steps at
    batch 12 over the 28/56/56/56-image clients), because the budget is summed from the checkpointed round history."""
    run_sim("fedavg", num_rounds=1, batch_size=12, output_dir="rs", checkpoint_every=1)
    _, res = run_sim("fedavg", num_rounds=2, batch_size=12, output_dir="rs", checkpoint_every=1,
                     resume_from_checkpoint="latest", overwrite_output_dir=False)
    assert res["budget"]["optimizer_steps"] == 2 * 17 and res["budget"]["examples_seen"] == 2 * 196


# ---------------------------------------------------------------------------------------------- rows
def test_rows_resume_and_an_interrupted_line_never_counts(tmp_path):
    """Two complete rows and a line cut mid-write: load gives the two and cuts the partial line off the file, so the
    next append starts on a line of its own; a row whose key no longer matches the spec is stale."""
    st = _study()
    store = runner.RowStore(tmp_path, "t")
    for seed in (0, 1):
        store.append({**_row("a", seed, 0.5), "key": st.row_key(st.variant("a"), seed)})
    with open(store.path, "a") as f:
        f.write('{"variant": "a", "seed": 2, "metrics": {"personal_accu')
    rows = store.load()
    assert [r["seed"] for r in rows] == [0, 1]
    assert store.path.read_text().endswith("\n")
    store.append({**_row("a", 2, 0.5), "key": "changed-spec"})
    assert [r["seed"] for r in store.load()] == [0, 1, 2]
    assert sorted(runner.current_rows(st, store.load())) == [("a", 0), ("a", 1)]


# ---------------------------------------------------------------------------------------------- end to end
MICRO = load_study("micro_digits")


@pytest.fixture(scope="module")
def micro_store(tmp_path_factory):
    """The micro-study run once into a temporary store (2 variants + chance, majority and untrained, 2 seeds)."""
    store = tmp_path_factory.mktemp("store")
    runner.run_study(MICRO, store, work_dir=tmp_path_factory.mktemp("work"), log=lambda *_: None)
    return store


def test_micro_study_runs_every_row_and_summarizes_them(micro_store):
    rows = runner.RowStore(micro_store, "micro_digits").load()
    assert sorted((r["variant"], r["seed"]) for r in rows) == sorted(
        (v.name, s) for v in MICRO.variants for s in MICRO.seeds)
    s = json.loads((micro_store / "micro_digits" / "summary.json").read_text())
    assert (micro_store / "micro_digits" / "micro_digits.png").stat().st_size > 0
    # the summary's std is the sample std of the two stored values, worked out here
    vals = [r["metrics"]["personal_accuracy"] for r in sorted(rows, key=lambda r: r["seed"]) if r["variant"] == "fedbn"]
    m = (vals[0] + vals[1]) / 2
    fb = s["variants"]["fedbn"]["metrics"]["personal_accuracy"]
    assert fb["mean"] == pytest.approx(m) and fb["n"] == 2
    assert fb["std"] == pytest.approx(math.sqrt((vals[0] - m) ** 2 + (vals[1] - m) ** 2))  # / (2 - 1)
    assert s["variants"]["chance"]["metrics"]["personal_accuracy"]["mean"] == pytest.approx(1 / 10)  # 10 digits
    # budgets: trained rows report steps, controls none; the untrained control is the engine at round 0
    for name in ("fedavg", "fedbn"):
        assert s["variants"][name]["budget"]["optimizer_steps_per_model"] > 0
    for name in ("chance", "majority", "untrained"):
        assert s["variants"][name]["budget"]["optimizer_steps_per_model"] == 0
    assert {r["num_rounds"] for r in rows if r["variant"] == "untrained"} == {0}
    assert [c["verdict"] for c in s["claims"]] == [c["verdict"] for c in claims_mod.evaluate_all(MICRO, s)]


def test_micro_study_resume_runs_nothing_new(micro_store, monkeypatch):
    before = (micro_store / "micro_digits" / "rows.jsonl").read_bytes()

    def no_run(*a, **k):
        raise AssertionError("a stored row ran again")
    monkeypatch.setattr(runner, "run_row", no_run)
    runner.run_study(MICRO, micro_store, log=lambda *_: None)
    assert (micro_store / "micro_digits" / "rows.jsonl").read_bytes() == before


def _normalise(md: str) -> str:
    """Commit, date, machine and runtime differ run to run."""
    md = re.sub(r"(?m)^- \*\*(Commit|Date|Machine|Runtime)\*\*: .*$", r"- **\1**: ...", md)
    return md


def test_micro_study_doc_matches_the_committed_expected_output(micro_store, tmp_path):
    """The doc generated from the fresh run equals tests/experiments/data/micro_digits.md but for commit / date / machine /
    runtime: the numbers, steps, controls, ordering and verdicts of the micro-study reproduce."""
    (path,) = write_docs(micro_store, tmp_path, ["micro_digits"])
    assert _normalise(path.read_text()) == _normalise((DATA / "micro_digits.md").read_text())


def test_docs_regenerate_from_stored_summaries_with_no_diff(tmp_path):
    """Every committed docs/results/<study>.md (and index.md) is what the committed summary.json files render to."""
    store = REPO / "docs" / "results"
    summaries = sorted(store.glob("*/summary.json"))
    for s in summaries:
        name = s.parent.name
        assert render(json.loads(s.read_text())) == (store / f"{name}.md").read_text(), name
    if summaries:
        loaded = [json.loads(s.read_text()) for s in summaries]
        assert render_index(loaded) == (store / "index.md").read_text()
        readme = (REPO / "README.md").read_text()   # the README's short table too
        assert replace_readme_table(readme, render_readme_table(loaded)) == readme
    # the committed micro rows are current under today's row keys (a key change would silently re-run every study)
    assert len(runner.current_rows(MICRO, runner.RowStore(DATA, "micro_digits").load())) == 10
    (path,) = write_docs(DATA, tmp_path, ["micro_digits"])    # the committed micro summary too
    assert path.read_text() == (DATA / "micro_digits.md").read_text()


def test_verify_reruns_one_row_and_catches_a_changed_value(micro_store, tmp_path):
    ok, checks = runner.verify(MICRO, "fedbn", 1, micro_store, tolerance=1e-6)
    assert ok and [c["metric"] for c in checks] == ["personal_accuracy"]   # FedBN has no global model
    tampered = tmp_path / "store"
    shutil.copytree(micro_store, tampered)
    path = tampered / "micro_digits" / "rows.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        if (r["variant"], r["seed"]) == ("majority", 0):
            r["metrics"]["personal_accuracy"] += 0.01
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok, checks = runner.verify(MICRO, "majority", 0, tampered, tolerance=1e-6)
    assert not ok and not checks[0]["ok"]


def test_cli_help_and_bad_study_name(capsys):
    from hfpfl.experiments.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "verify" in capsys.readouterr().out
    assert main(["claims", "no_such_study"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown study 'no_such_study'" in err[0] and "baselines_digits" in err[0]


def hook_adds_a_metric(sim, results):
    """A task-specific metric (here: the rounds the simulation ran, and its client count)."""
    results["final"]["rounds_run"] = float(sim.round)
    results["final"]["clients_seen"] = float(sim.num_clients)


def test_metrics_hook_adds_task_specific_metrics_to_the_row(tmp_path):
    """A variant's metrics_hook runs on the trained simulation and its metrics land in the stored row; changing the
    hook changes the row's key (the stored row is then stale)."""
    fedavg = Variant("fedavg", ("--method", "fedavg"), metrics_hook="test_studies:hook_adds_a_metric")
    st = Study(name="hooked", title="t", paper="p", seeds=(0,), common=MICRO.common, variants=(fedavg,),
               metrics={"rounds_run": "rounds", "clients_seen": "clients"})
    s = runner.run_study(st, tmp_path / "store", work_dir=tmp_path / "work", log=lambda *_: None)
    assert s["variants"]["fedavg"]["metrics"]["rounds_run"]["mean"] == 1.0
    assert s["variants"]["fedavg"]["metrics"]["clients_seen"]["mean"] == 4.0
    assert st.row_key(fedavg, 0) != st.row_key(Variant("fedavg", ("--method", "fedavg")), 0)


def test_readme_table_counts_paper_claims_and_control_checks_apart():
    """One line per study: 1 of 2 paper claims held, 1 of 1 control check held (a claim against a control row is
    a control check); the block between the markers is replaced, the text around it kept."""
    summary = {"study": "s", "title": "T", "paper": "P", "claims": [
        {"verdict": "held", "budgets": "matched"}, {"verdict": "not held", "budgets": "matched"},
        {"verdict": "held", "budgets": "chance is a control"}]}
    table = render_readme_table([summary])
    assert "| [s](docs/results/s.md): T | P | 1 of 2 | 1 of 1 |" in table.splitlines()
    text = "before\n<!-- results table: generated by `.venv/bin/python -m hfpfl.experiments docs`; do not edit -->\nold\n" \
           "<!-- end of results table -->\nafter\n"
    out = replace_readme_table(text, table)
    assert out.startswith("before\n") and out.endswith("\nafter\n") and "old" not in out and "1 of 2" in out
    with pytest.raises(ValueError, match="markers"):
        replace_readme_table("no markers", table)
