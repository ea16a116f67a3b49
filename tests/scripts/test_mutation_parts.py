"""The fedpop mutation target's narrow parts (``fedpop_<part>`` in scripts/mutation.py) together mutate every function
mutmut mutates in its core, each in exactly one part: a function added to hfpfl/tuning/ must be given to a part."""
import fnmatch

import pytest

from conftest import load_script

pytest.importorskip("mutmut")   # the dev extra: the check asks mutmut itself what it mutates


@pytest.fixture(scope="module")
def mod():
    return load_script("scripts/mutation.py", "mutation_script")


@pytest.fixture(scope="module")
def fns(mod):
    """What mutmut mutates in the fedpop target's core (computed once: about 2 s)."""
    return mod.mutated_functions(mod.expand(mod.TARGETS["fedpop"].core))


def test_fedpop_parts_cover_every_mutated_function_exactly_once(mod, fns):
    assert mod.check_parts("fedpop", fns) == []
    # the parts' mutants add up to the whole target's
    total = sum(sum(c.values()) for c in fns.values())
    per_part = 0
    for t in mod.parts_of("fedpop").values():
        per_part += sum(c for f in mod.expand(t.core) for fn, c in fns[f].items()
                        if any(fnmatch.fnmatchcase(fn, g) for g in (t.functions or ["*"])))
    assert per_part == total > 0


def test_check_parts_names_a_function_left_out_and_one_in_two_parts(mod, fns, monkeypatch):
    """Moving ``cos_anneal`` out of fedpop_evo leaves it in no part; adding ``fedex_update`` to fedpop_evo puts it in
    two parts: the check names each."""
    evo = mod.TARGETS["fedpop_evo"]
    left = [g for g in evo.functions if g != "x_cos_anneal"]
    monkeypatch.setitem(mod.TARGETS, "fedpop_evo", mod.Target(evo.core, evo.tests, left + ["xǁTunerǁfedex_update"], evo.k))
    problems = mod.check_parts("fedpop", fns)
    assert any("x_cos_anneal" in p and "no part" in p for p in problems), problems
    assert any("fedex_update" in p and "fedpop_evo" in p and "fedpop_fedex" in p for p in problems), problems
    assert len(problems) == 2
