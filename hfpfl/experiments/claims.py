"""Claims evaluated in code on a study's summary: held / not held / not measured / refused.

* ``not measured``: a side has no row for one of the study's seeds (or lacks the metric) -- never "not held";
* ``refused``: both sides were trained but their budgets (optimizer steps or epochs per trained model, as the study
  matches them) differ or are unknown, and the claim gives no ``budgets_differ_because``;
* otherwise the comparison of the two means over the study's seeds: ``a > b``, ``a >= b + m`` or ``|a - b| <= x``."""
from __future__ import annotations

import math

from .spec import Claim

HELD, NOT_HELD, NOT_MEASURED, REFUSED = "held", "not held", "not measured", "refused"

#: slack on the boundary of a margin / within claim: 0.685 + 0.015 is 0.7000000000000001 in floats
EPS = 1e-12

#: the budget figure compared under each matching rule
BUDGET_KEY = {"steps": "optimizer_steps_per_model", "epochs": "epochs_per_model", "rounds": "rounds_used"}


def _budget(entry: dict, key: str):
    b = (entry.get("budget") or {}).get(key)
    return None if b is None or (isinstance(b, float) and math.isnan(b)) else b


def _measured(entry: dict | None, metric: str, seeds) -> str | None:
    """Why ``entry`` cannot be compared on ``metric`` over ``seeds`` (None: it can)."""
    if entry is None:
        return "no rows"
    m = (entry.get("metrics") or {}).get(metric)
    if m is None or m.get("mean") is None:
        return f"no {metric}"
    missing = sorted(set(seeds) - set(m.get("seeds", entry.get("seeds", []))))
    if missing:
        return f"no row for seed{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
    return None


def evaluate(claim, summary: dict, *, primary: str, seeds, matched_by: str) -> dict:
    """The verdict of ``claim`` on ``summary["variants"]`` (each: kind, metrics{name: {mean, std, n, seeds}},
    budget{...}). Returns the claim's fields plus ``verdict``, ``detail`` and the two means."""
    metric = claim.metric or primary
    metric_b = claim.metric_b or metric
    out = {"claim": claim.text(), "kind": claim.kind, "a": claim.a, "b": claim.b, "value": claim.value,
           "metric": metric, "paper": claim.paper, "mean_a": None, "mean_b": None}
    if claim.metric_b:
        out["metric_b"] = metric_b
    variants = summary.get("variants", {})
    ea, eb = variants.get(claim.a), variants.get(claim.b)
    for side, entry, m in ((claim.a, ea, metric), (claim.b, eb, metric_b)):
        why = _measured(entry, m, seeds)
        if why:
            return {**out, "verdict": NOT_MEASURED, "detail": f"{side}: {why}"}
    ma, mb = ea["metrics"][metric]["mean"], eb["metrics"][metric_b]["mean"]
    out.update(mean_a=ma, mean_b=mb)
    controls = [n for n, e in ((claim.a, ea), (claim.b, eb)) if e.get("control", e.get("kind", "run") != "run")]
    key = BUDGET_KEY[matched_by]
    if controls:
        out["budgets"] = f"{' and '.join(controls)} {'is a control' if len(controls) == 1 else 'are controls'}"
    else:
        ba, bb = _budget(ea, key), _budget(eb, key)
        if ba is None or bb is None or not math.isclose(ba, bb, rel_tol=1e-9, abs_tol=1e-9):
            shown = f"{claim.a} {_fmt_budget(ba)} vs {claim.b} {_fmt_budget(bb)} {key.replace('_', ' ')}"
            if not claim.budgets_differ_because:
                return {**out, "verdict": REFUSED,
                        "detail": f"budgets differ ({shown}); the study matches by {matched_by}: give the claim "
                                  "budgets_differ_because=... or match the budgets"}
            out["budgets"] = f"differ ({shown}): {claim.budgets_differ_because}"
        else:
            out["budgets"] = f"matched ({_fmt_budget(ba)} {key.replace('_', ' ')})"
    diff = ma - mb
    if claim.kind == "greater":
        ok = ma > mb
    elif claim.kind == "margin":
        ok = diff >= claim.value - EPS
    else:
        ok = abs(diff) <= claim.value + EPS
    out["verdict"] = HELD if ok else NOT_HELD
    out["detail"] = f"{ma:.4f} vs {mb:.4f} ({diff:+.4f})"
    return out


def _fmt_budget(b) -> str:
    if b is None:
        return "unknown"
    return f"{b:g}" if isinstance(b, int) or float(b).is_integer() else f"{b:.2f}"


def evaluate_all(study, summary: dict) -> list[dict]:
    return [evaluate(c, summary, primary=study.primary, seeds=study.seeds, matched_by=study.matched_by)
            for c in study.claims]


def rises(names, *, paper: str = "", metric: str | None = None, budgets_differ_because: str | None = None) -> tuple:
    """A sweep's claim "the metric rises with x": ``names`` are the sweep's rows in the order of the swept value
    (smallest first); one ``greater`` claim per consecutive pair (``names[i + 1] > names[i]``), each with its own
    verdict, so where the rise stops (saturates) is the first step that does not hold. ``paper`` is shown on every
    step with the step named."""
    names = list(names)
    if len(names) < 2:
        raise ValueError(f"rises needs at least two rows in sweep order, got {names}")
    return tuple(Claim("greater", hi, lo, metric=metric, budgets_differ_because=budgets_differ_because,
                       paper=f"{paper} (step {lo} -> {hi})" if paper else f"step {lo} -> {hi}")
                 for lo, hi in zip(names, names[1:]))
