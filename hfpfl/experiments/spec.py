"""What a study is: variants (method + options + data), seeds, metrics, controls and claims, as plain data.

A study is one paper table. Each variant is the command line of one run (the flags of ``hfpfl run`` / a recipe), so a
row of a study is exactly what ``hfpfl run <flags> --seed S`` computes. Controls are variants too (built by
:mod:`hfpfl.experiments.controls`). Claims compare two rows' means of one metric and are evaluated in code
(:mod:`hfpfl.experiments.claims`)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

#: how a study matches its variants' training budgets
MATCHED_BY = ("steps", "epochs", "rounds")


@dataclass(frozen=True)
class Variant:
    """One row of the table. ``argv``: the run's flags on top of the study's ``common`` flags (later flags win, as on
    a command line). ``kind``: ``"run"`` (trained through the engine), a control kind (``"chance"``,
    ``"majority"``, ``"untrained"``, or a task-specific one registered with :func:`controls.register`), or a
    registered driver (a method that is not one ``Simulation.run``, e.g. a tuner; ``register(..., control=False)``).
    ``paper``: the paper's number for this row, as the paper prints it (shown beside ours, never computed on).
    ``recipe``: a recipe file (``recipes/<name>.py``, from the repository root) whose ``main(argv)`` runs the row, for
    methods with their own benchmark data; default: ``hfpfl run``. ``metrics_hook``: ``"module:function"``, called as
    ``function(sim, results)`` on the trained simulation (run_recipe's ``after``) to add task-specific metrics to
    ``results["final"]`` (e.g. label-re-weighted or new-client accuracy) before the row is stored."""
    name: str
    argv: tuple[str, ...] = ()
    label: str | None = None
    kind: str = "run"
    paper: str | None = None
    note: str | None = None
    recipe: str | None = None
    metrics_hook: str | None = None

    def title(self) -> str:
        return self.label or self.name


@dataclass(frozen=True)
class Claim:
    """One claim of the paper about two rows of the table, on ``metric`` (default: the study's primary metric).

    ``kind``: ``"greater"`` (a > b), ``"margin"`` (a >= b + value), ``"within"`` (|a - b| <= value, two-sided).
    ``paper``: what the paper says, with where (table / section). ``budgets_differ_because``: the reason a claim
    between rows trained with different budgets is still meaningful (without it such a claim is refused).
    ``metric_b``: ``b``'s metric when it is not ``a``'s, for a claim between two metrics (e.g. two inference paths of
    one trained row: ``margin("feddat", "feddat", 0, metric="inference_shared", metric_b="inference_dat")``)."""
    kind: str
    a: str
    b: str
    value: float = 0.0
    metric: str | None = None
    paper: str = ""
    budgets_differ_because: str | None = None
    metric_b: str | None = None

    def text(self) -> str:
        a, b = self.a, self.b
        if self.metric_b is not None:
            a, b = f"{a}.{self.metric}", f"{b}.{self.metric_b}"
        if self.kind == "greater":
            return f"{a} > {b}"
        if self.kind == "margin":
            return f"{a} >= {b} + {self.value:g}"
        return f"|{a} - {b}| <= {self.value:g}"


def greater(a: str, b: str, **kw) -> Claim:
    """The paper says row ``a`` beats row ``b``."""
    return Claim("greater", a, b, **kw)


def margin(a: str, b: str, value: float, **kw) -> Claim:
    """The paper says row ``a`` beats row ``b`` by at least ``value`` (in the metric's units)."""
    return Claim("margin", a, b, value, **kw)


def within(a: str, b: str, value: float, **kw) -> Claim:
    """The paper says rows ``a`` and ``b`` are within ``value`` of each other, either way."""
    return Claim("within", a, b, value, **kw)


@dataclass(frozen=True)
class Study:
    """One paper table. ``common``: flags every run gets (the data and the shared settings); ``metrics``: result
    keys (of ``results.json``'s ``final``) shown as columns, the first being the primary metric claims default to;
    ``matched_by``: how the variants' budgets are matched (``"steps"``: the same optimizer steps per trained model,
    ``"epochs"``: the same passes over each model's data; ``"rounds"``: the same communication rounds spent in all,
    for drivers such as tuners whose candidates train with different local steps); ``paper_ordering``: the paper's rows best first on the
    primary metric, shown beside ours; ``per_domain``: report per-domain means (the paper reports them)."""
    name: str
    title: str
    paper: str
    variants: tuple[Variant, ...]
    seeds: tuple[int, ...] = (0, 1, 2)
    common: tuple[str, ...] = ()
    metrics: dict = field(default_factory=lambda: {"personal_accuracy": "mean per-client accuracy"})
    matched_by: str = "steps"
    claims: tuple[Claim, ...] = ()
    paper_ordering: tuple[str, ...] = ()
    per_domain: bool = True
    description: str = ""
    command: str | None = None

    def __post_init__(self):
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"study {self.name!r}: variant names repeat: {names}")
        if self.matched_by not in MATCHED_BY:
            raise ValueError(f"study {self.name!r}: matched_by must be one of {MATCHED_BY}, got {self.matched_by!r}")
        for c in self.claims:
            if c.kind not in ("greater", "margin", "within"):
                raise ValueError(f"study {self.name!r}: unknown claim kind {c.kind!r}")
            if c.metric_b is not None and c.metric is None:
                raise ValueError(f"study {self.name!r}: claim {c.a!r} vs {c.b!r} names metric_b, so it must name "
                                 "metric (a's) too")
            for side in (c.a, c.b):
                if side not in names:
                    raise ValueError(f"study {self.name!r}: claim {c.text()!r} names {side!r}, not a variant "
                                     f"(variants: {', '.join(names)})")
        for n in self.paper_ordering:
            if n not in names:
                raise ValueError(f"study {self.name!r}: paper_ordering names {n!r}, not a variant")
        for v in self.variants:
            if v.recipe and v.metrics_hook:
                raise ValueError(f"study {self.name!r}: variant {v.name!r}: a metrics_hook runs on hfpfl run's path; "
                                 "a recipe adds its metrics in its own `after`")
            if v.kind == "untrained" and v.recipe:
                raise ValueError(f"study {self.name!r}: control {v.name!r}: the untrained control runs through "
                                 "hfpfl run, not a recipe; register a task-specific control for recipe data")

    @property
    def primary(self) -> str:
        return next(iter(self.metrics))

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(f"study {self.name!r} has no variant {name!r}; variants: "
                       + ", ".join(v.name for v in self.variants))

    def argv(self, variant: Variant, seed: int) -> list[str]:
        """The full command line of one row: common flags, the variant's, then the seed."""
        return [*self.common, *variant.argv, "--seed", str(seed)]

    def row_key(self, variant: Variant, seed: int) -> str:
        """What identifies a row's computation: the variant's kind and full flags at this seed. A stored row whose key
        differs (the spec changed) is stale and runs again."""
        parts = [variant.kind, variant.recipe, self.argv(variant, seed)]
        if variant.metrics_hook:   # optional fields join only when set: rows stored without them stay current
            parts.append({"metrics_hook": variant.metrics_hook})
        blob = json.dumps(parts)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def default_command(self) -> str:
        return self.command or f"python -m hfpfl.experiments run {self.name}"
