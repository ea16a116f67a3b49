"""The fedbip mutation target's narrow parts (``fedbip_<part>`` in scripts/mutation.py) together mutate every function
mutmut mutates in its core, each in exactly one part: a function added to FedBiP's core files must be given to a
part."""

import pytest

from conftest import load_script

pytest.importorskip("mutmut")   # the dev extra: the check asks mutmut itself what it mutates

@pytest.fixture(scope="module")
def mod():
    return load_script("scripts/mutation.py", "mutation_script")


@pytest.fixture(scope="module")
def fns(mod):
    return mod.mutated_functions(mod.expand(mod.TARGETS["fedbip"].core))


def test_fedbip_parts_cover_every_mutated_function_exactly_once(mod, fns):
    assert set(mod.parts_of("fedbip")) == {"fedbip_server", "fedbip_protocol", "fedbip_client", "fedbip_pipeline",
                                           "fedbip_concepts", "fedbip_rest"}
    assert mod.check_parts("fedbip", fns) == []
    # every function of the four files is in a part (FedBiPPipeline.__call__ carries a decorator: mutmut skips it)
    assert "xǁFedBiPPipelineǁ__call__" not in fns["pipelines/pipeline_fedbip.py"]
    assert {"xǁFedBiPǁtrain_concepts", "xǁFedBiPǁsave_grid"} <= set(fns["hfpfl/algorithms/fedbip.py"])


def test_check_parts_names_a_fedbip_function_left_out_and_one_in_two_parts(mod, fns, monkeypatch):
    rest = mod.TARGETS["fedbip_rest"]
    left = [g for g in rest.functions if g != "xǁFedBiPǁsave_grid"]
    monkeypatch.setitem(mod.TARGETS, "fedbip_rest", mod.Target(rest.core, rest.tests, left + ["xǁFedBiPǁreal_images"]))
    problems = mod.check_parts("fedbip", fns)
    assert any("save_grid" in p and "no part" in p for p in problems), problems
    assert any("real_images" in p and "fedbip_concepts" in p and "fedbip_rest" in p for p in problems), problems
    assert len(problems) == 2
