"""The study runner's `borrow`: rows another study stored under the same row key are copied, not re-run."""
import json
import shutil
from pathlib import Path

from hfpfl.experiments import load_study
from hfpfl.experiments.runner import borrow_rows


def test_borrow_copies_exactly_the_rows_whose_key_another_study_stored(tmp_path):
    """`experiments borrow fedbip_amount --from fedbip_digits` on a store without the borrowed rows gives back the
    stored study's rows: the same (variant, seed, metrics), each with its source named and its provenance kept;
    a second borrow adds nothing."""
    root = Path(__file__).resolve().parents[2] / "docs" / "results"
    shutil.copytree(root / "fedbip_digits", tmp_path / "fedbip_digits")
    stored = [json.loads(line) for line in (root / "fedbip_amount" / "rows.jsonl").read_text().splitlines()]
    (tmp_path / "fedbip_amount").mkdir()
    (tmp_path / "fedbip_amount" / "rows.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in stored if "borrowed_from" not in r))
    src, dst = load_study("fedbip_digits"), load_study("fedbip_amount")
    lines = borrow_rows(src, dst, str(tmp_path))
    assert len(lines) == sum("borrowed_from" in r for r in stored) > 0
    assert borrow_rows(src, dst, str(tmp_path)) == []
    got = [json.loads(line) for line in (tmp_path / "fedbip_amount" / "rows.jsonl").read_text().splitlines()]

    def view(rows):
        return sorted((r["variant"], r["seed"], json.dumps(r["metrics"], sort_keys=True), r.get("borrowed_from"),
                       r["provenance"]["commit"]) for r in rows)
    assert view(got) == view(stored)
