"""The narrow parts of the slow mutation targets (``fedpop_<part>``, ``fedbip_<part>`` in scripts/mutation.py)
together mutate every function mutmut mutates in the target's core, each in exactly one part: a function added to
hfpfl/tuning/ or to FedBiP's core files must be given to a part."""
import fnmatch

import pytest

from conftest import load_script

pytest.importorskip("mutmut")   # the dev extra: the check asks mutmut itself what it mutates


@pytest.fixture(scope="module")
def mod():
    return load_script("scripts/mutation.py", "mutation_script")


@pytest.fixture(scope="module")
def mutated(mod):
    """What mutmut mutates in each split target's core (computed once per target: about 2 s)."""
    cache = {}

    def of(target):
        if target not in cache:
            cache[target] = mod.mutated_functions(mod.expand(mod.TARGETS[target].core))
        return cache[target]
    return of


@pytest.mark.parametrize("target", ["fedpop", "fedbip"])
def test_parts_cover_every_mutated_function_exactly_once(mod, mutated, target):
    fns = mutated(target)
    assert mod.check_parts(target, fns) == []
    # the parts' mutants add up to the whole target's
    total = sum(sum(c.values()) for c in fns.values())
    per_part = 0
    for t in mod.parts_of(target).values():
        per_part += sum(c for f in mod.expand(t.core) for fn, c in fns[f].items()
                        if any(fnmatch.fnmatchcase(fn, g) for g in (t.functions or ["*"])))
    assert per_part == total > 0


def test_fedbip_parts_and_what_mutmut_leaves_out(mod, mutated):
    fns = mutated("fedbip")
    assert set(mod.parts_of("fedbip")) == {"fedbip_server", "fedbip_protocol", "fedbip_client", "fedbip_pipeline",
                                           "fedbip_concepts", "fedbip_rest"}
    # FedBiPPipeline.__call__ carries a decorator: mutmut skips it (its changes are applied by hand: fedbip.md)
    assert "xǁFedBiPPipelineǁ__call__" not in fns["pipelines/pipeline_fedbip.py"]
    assert {"xǁFedBiPǁtrain_concepts", "xǁFedBiPǁsave_grid"} <= set(fns["hfpfl/fedbip/method.py"])
    assert {"x__template_ok", "x__sampler_ok"} <= set(fns["hfpfl/fedbip/config.py"])


@pytest.mark.parametrize("target, part, drop, add, other", [
    ("fedpop", "fedpop_evo", "x_cos_anneal", "xǁFedPopǁslot_vectors", "fedpop_fedex"),
    ("fedbip", "fedbip_rest", "xǁFedBiPǁsave_grid", "xǁFedBiPǁreal_images", "fedbip_concepts")])
def test_check_parts_names_a_function_left_out_and_one_in_two_parts(mod, mutated, monkeypatch, target, part, drop,
                                                                    add, other):
    """A function dropped from its part is in no part; a function added to a second part is in two: the check names
    each, and nothing else."""
    t = mod.TARGETS[part]
    monkeypatch.setitem(mod.TARGETS, part, mod.Target(t.core, t.tests, [g for g in t.functions if g != drop] + [add],
                                                      t.k))
    problems = mod.check_parts(target, mutated(target))
    assert any(drop in p and "no part" in p for p in problems), problems
    assert any(add.split("ǁ")[-1] in p and part in p and other in p for p in problems), problems
    assert len(problems) == 2
