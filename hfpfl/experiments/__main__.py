"""study: run paper-table studies, verify rows, regenerate docs/results/. ``python -m hfpfl.experiments --help``."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..cli import user_error_line

STORE = os.path.join("docs", "results")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hfpfl.experiments", description=(
        "Every claim of a paper table as a study: seeds x variants (and controls) through the engine, resumable rows, "
        "summary.json with mean and sample std, claims evaluated in code, docs/results/<study>.md generated."))
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp, study=True):
        if study:
            sp.add_argument("study", help="a study name (see `list`) or the path of a .py file defining STUDY")
        sp.add_argument("--store", default=STORE, help="where rows.jsonl / summary.json / figures live "
                                                       "(default: docs/results)")
        return sp

    common(sub.add_parser("list", help="the studies and how many rows each has stored"), study=False)
    r = common(sub.add_parser("run", help="run the missing rows (seeds x variants), then summarize"))
    r.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the study's seeds")
    r.add_argument("--variants", nargs="+", default=None, help="only these rows (default: all, controls included)")
    r.add_argument("--work_dir", default=None, help="the runs' output folders (default: outputs/studies/<study>)")
    common(sub.add_parser("summarize", help="rewrite summary.json and the figure from the stored rows"))
    common(sub.add_parser("claims", help="print each claim's verdict from the stored summary"))
    v = common(sub.add_parser("verify", help="re-run one row at one seed and compare with the stored value"))
    v.add_argument("variant")
    v.add_argument("--seed", type=int, required=True)
    v.add_argument("--tolerance", type=float, default=1e-6,
                   help="absolute tolerance per metric (default 1e-6: one thread on the same machine reproduces a row "
                        "exactly; another CPU may flip a prediction, so loosen it there)")
    b = common(sub.add_parser("borrow", help="copy in another study's stored rows whose row key (kind, recipe, full "
                                             "flags, metrics hook) equals one of this study's: the same computation; "
                                             "each keeps its provenance and names its source"))
    b.add_argument("--from", dest="source", required=True, help="the study whose stored rows are read")
    d = common(sub.add_parser("docs", help="regenerate <out>/<study>.md from the stored summaries"), study=False)
    d.add_argument("studies", nargs="*", help="default: every study with a stored summary")
    d.add_argument("--out", default=None, help="default: the store (docs/results)")
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    a = _parser().parse_args(argv)
    from . import load_study, study_names
    from . import runner
    try:
        if a.cmd == "list":
            for name in study_names():
                st = load_study(name)
                have = runner.current_rows(st, runner.RowStore(a.store, name).load())
                print(f"{name:<24} {len(have):>3}/{len(st.variants) * len(st.seeds)} rows  {st.title}")
            return 0
        if a.cmd == "docs":
            from .docs import write_docs
            # the README's short table follows the default store only (a scratch store must not rewrite it)
            readme = "README.md" if a.store == STORE and a.out is None and os.path.exists("README.md") else None
            for path in write_docs(a.store, a.out, a.studies or None, readme=readme):
                print(f"wrote {path}")
            return 0
        study = load_study(a.study)
        if a.cmd == "run":
            if a.variants:
                for n in a.variants:
                    study.variant(n)
            summary = runner.run_study(study, a.store, seeds=a.seeds, variants=a.variants, work_dir=a.work_dir)
        elif a.cmd == "borrow":
            for line in runner.borrow_rows(load_study(a.source), study, a.store):
                print(line)
            summary = runner.write_summary(study, a.store)
        elif a.cmd == "summarize":
            summary = runner.write_summary(study, a.store)
        elif a.cmd == "claims":
            path = os.path.join(a.store, study.name, "summary.json")
            if not os.path.exists(path):
                raise FileNotFoundError(f"no stored summary {path!r}; run `python -m hfpfl.experiments run "
                                        f"{study.name}` first")
            with open(path) as f:
                summary = json.load(f)
        elif a.cmd == "verify":
            ok, checks = runner.verify(study, a.variant, a.seed, a.store, tolerance=a.tolerance)
            for c in checks:
                diff = abs(c["stored"] - c["now"]) if c["stored"] is not None and c["now"] is not None else None
                print(f"{a.variant} seed {a.seed} {c['metric']}: stored {c['stored']}, now {c['now']}, "
                      f"|diff| {diff} {'<=' if c['ok'] else '>'} {a.tolerance}: {'ok' if c['ok'] else 'DIFFERS'}")
            print("verified" if ok else "NOT verified")
            return 0 if ok else 1
        print_claims(summary)
        return 0
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(user_error_line(e), file=sys.stderr)
        return 2


def print_claims(summary: dict) -> None:
    for c in summary.get("claims", []):
        print(f"{c['verdict']:<13} {c['claim']:<40} {c['detail']}"
              + (f"  [budgets {c['budgets']}]" if c.get("budgets") else ""))


if __name__ == "__main__":
    raise SystemExit(main())
