"""The sweep claim ``rises`` (hfpfl.experiments.claims): "the metric rises with x" as one verdict per step of the sweep,
on hand-made summaries."""
import pytest

from hfpfl.experiments import claims as claims_mod
from hfpfl.experiments.claims import rises


def _entry(mean, seeds=(0, 1, 2), steps=500):
    return {"kind": "run", "seeds": list(seeds), "budget": {"optimizer_steps_per_model": steps},
            "metrics": {"personal_accuracy": {"mean": mean, "std": 0.01, "n": len(seeds), "seeds": list(seeds)},
                        "global_accuracy": {"mean": 1 - mean, "std": 0.01, "n": len(seeds), "seeds": list(seeds)}}}


def _verdicts(claims, variants):
    return [claims_mod.evaluate(c, {"variants": variants}, primary="personal_accuracy", seeds=(0, 1, 2),
                                matched_by="steps") for c in claims]


def test_rises_gives_one_step_per_consecutive_pair_and_shows_where_it_stops():
    """Sweep 1x 0.40, 5x 0.55, 20x 0.53: step 1x -> 5x held (0.55 > 0.40, detail +0.1500), step 5x -> 20x not held
    (0.53 vs 0.55, -0.0200): the rise stops (saturates) at 5x. Claims in sweep order, the larger x on the left, so
    a reversed pair (1x > 5x) or a skipped pair (20x > 1x, which holds here) cannot pass."""
    cs = rises(["x1", "x5", "x20"], paper="Fig. 5")
    assert [(c.kind, c.a, c.b) for c in cs] == [("greater", "x5", "x1"), ("greater", "x20", "x5")]
    assert [c.paper for c in cs] == ["Fig. 5 (step x1 -> x5)", "Fig. 5 (step x5 -> x20)"]
    v = _verdicts(cs, {"x1": _entry(0.40), "x5": _entry(0.55), "x20": _entry(0.53)})
    assert [x["verdict"] for x in v] == ["held", "not held"]
    assert v[0]["detail"] == "0.5500 vs 0.4000 (+0.1500)"
    assert v[1]["detail"] == "0.5300 vs 0.5500 (-0.0200)"


def test_rises_passes_metric_and_budget_reason_to_every_step():
    """metric="global_accuracy" (1 - personal here: 0.60, 0.45, 0.47): 1x -> 5x falls (not held), 5x -> 20x rises
    (held), the opposite of the personal-accuracy verdicts; with 100 vs 500 steps a step is refused unless the reason
    is given, and then it is evaluated and the reason shown."""
    variants = {"x1": _entry(0.40), "x5": _entry(0.55), "x20": _entry(0.53)}
    v = _verdicts(rises(["x1", "x5", "x20"], metric="global_accuracy"), variants)
    assert [x["verdict"] for x in v] == ["not held", "held"] and v[1]["metric"] == "global_accuracy"
    unequal = {"x1": _entry(0.40, steps=100), "x5": _entry(0.55, steps=500)}
    assert _verdicts(rises(["x1", "x5"]), unequal)[0]["verdict"] == "refused"
    (v,) = _verdicts(rises(["x1", "x5"], budgets_differ_because="the paper's epochs"), unequal)
    assert v["verdict"] == "held" and "the paper's epochs" in v["budgets"]


def test_rises_without_a_paper_text_names_the_step_and_refuses_a_single_row():
    """No paper text: each step still says which step it is; fewer than two rows is no sweep (ValueError)."""
    assert [c.paper for c in rises(["a", "b"])] == ["step a -> b"]
    with pytest.raises(ValueError, match="at least two"):
        rises(["a"])
