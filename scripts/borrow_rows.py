"""Copy into a study's store (docs/results/<dst>/rows.jsonl) the rows of another study whose row key (kind, recipe,
full flags, metrics hook) equals one of this study's (variant, seed) keys: the same computation, already stored; each
copied row keeps its provenance and names its source (``borrowed_from``). Usage, from the repository root:
``PYTHONPATH=$PWD python scripts/borrow_rows.py SRC_STUDY DST_STUDY``."""
import sys

from hfpfl.experiments import load_study
from hfpfl.experiments.runner import RowStore, current_rows

src_name, dst_name = sys.argv[1], sys.argv[2]
src, dst = load_study(src_name), load_study(dst_name)
have = {r["key"]: r for r in current_rows(src, RowStore("docs/results", src_name).load()).values()}
store = RowStore("docs/results", dst_name)
mine = current_rows(dst, store.load())
n = 0
for v in dst.variants:
    for s in dst.seeds:
        k = dst.row_key(v, s)
        if (v.name, s) in mine or k not in have:
            continue
        row = dict(have[k])
        assert row["argv"] == dst.argv(v, s) and row["seed"] == s and row["kind"] == v.kind
        row.update(study=dst_name, variant=v.name, borrowed_from=f"{src_name}/{have[k]['variant']}")
        store.append(row)
        n += 1
        print(f"{dst_name}: {v.name} seed {s} <- {src_name}/{have[k]['variant']}")
print(n, "rows borrowed")
