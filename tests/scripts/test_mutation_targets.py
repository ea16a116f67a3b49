"""The narrow mutation targets a method's core is split into cover it: every function mutmut mutates in the core's
files is in exactly one part (a function in none would never be mutation-tested, one in two would be run twice)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "scripts" / "mutation.py")
mutation = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mutation  # its dataclasses look their module up
spec.loader.exec_module(mutation)

FEDBIP_PARTS = ["fedbip_server", "fedbip_protocol", "fedbip_client", "fedbip_pipeline", "fedbip_concepts",
                "fedbip_rest"]


def test_mutated_functions_are_mutmuts_keys(tmp_path, monkeypatch):
    """Module functions x_f, methods xǁCǁm (of a decorated class too); a function under another decorator, and a
    nested function, are no keys of their own."""
    (tmp_path / "m.py").write_text(
        "import functools\n\ndef f():\n    def inner():\n        return 1\n    return inner\n\n"
        "@functools.lru_cache\ndef cached():\n    return 2\n\n"
        "@dataclass\nclass C:\n    def m(self):\n        return 3\n\n"
        "    @staticmethod\n    def s():\n        return 4\n\n"
        "    @property\n    def p(self):\n        return 5\n\n"
        "    def __new__(cls):\n        return 6\n")
    monkeypatch.setattr(mutation, "ROOT", tmp_path)
    assert mutation.mutated_functions("m.py") == ["x_f", "xǁCǁm", "xǁCǁs"]


def test_fedbips_parts_cover_its_core_once():
    """fedbip_server + the fedbip_<part> targets select each mutated function of FedBiP's four core files once."""
    core = mutation.expand(mutation.TARGETS["fedbip"].core)
    assert mutation.parts_cover(core, FEDBIP_PARTS) == {}
    # and the check would see a function left out, or one selected twice
    assert mutation.parts_cover(core, FEDBIP_PARTS[1:])["hfpfl/algorithms/fedbip.py"]["missing"] == [
        "xǁFedBiPǁwords", "xǁFedBiPǁaggregate"]
    mutation.TARGETS["_twice"] = mutation.Target(["hfpfl/fedbip/protocol.py"], [], functions=["x_mixed_init"])
    try:
        assert mutation.parts_cover(core, FEDBIP_PARTS + ["_twice"]) == {
            "hfpfl/fedbip/protocol.py": {"missing": [], "twice": ["x_mixed_init (fedbip_protocol, _twice)"]}}
    finally:
        del mutation.TARGETS["_twice"]
