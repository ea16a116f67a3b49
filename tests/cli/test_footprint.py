"""Import footprint: a run with its own model does not pay for transformers' model code (docs/performance.md)."""
import subprocess
import sys

import pytest

HEAVY = ("transformers.modeling_utils", "peft", "diffusers", "hfpfl.models.builders", "hfpfl.algorithms.fedpce")


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1",
                         **{k: v for k, v in __import__("os").environ.items() if k != "PYTHONSTARTUP"}})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_engine_and_light_methods_import_no_model_code_and_lazy_methods_register_on_first_use():
    out = _fresh("import sys, hfpfl.algorithms, hfpfl.federated.engine, hfpfl.data, hfpfl.models, hfpfl.tracking, "
                 "hfpfl.config, hfpfl.arguments\n"
                 "from hfpfl.tracking import describe_model\n"
                 "from hfpfl.arguments import check_model_name\n"
                 "check_model_name('tiny-resnet'); print(describe_model('tiny-resnet'))\n"
                 f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
                 "from hfpfl.algorithms import REGISTRY, LAZY_METHODS, get_algorithm\n"
                 "assert 'pce_fedbn' not in REGISTRY\n"
                 "cls = get_algorithm('pce_fedbn'); print(cls.__module__, 'hfpfl.algorithms.fedpce' in sys.modules)\n"
                 "import hfpfl.algorithms as A\nprint(A.fraug.__name__)\n"
                 "A.load_builtin_methods(); print(sorted(set(LAZY_METHODS) - set(REGISTRY)))\n"
                 "print(sorted(n for n, c in REGISTRY.items() if c.__module__.rsplit('.', 1)[-1] in "
                 "set(LAZY_METHODS.values())) == sorted(LAZY_METHODS))")
    assert out.splitlines()[-6:] == ["tiny-resnet (built-in config, random init)", "[]",
                                     "hfpfl.algorithms.fedpce True", "hfpfl.algorithms.fraug", "[]", "True"]


def test_unknown_method_lists_the_lazy_ones_too():
    import pytest
    from hfpfl.algorithms import get_algorithm
    with pytest.raises(ValueError, match="fedbasis.*feddat.*fedpce.*fraug"):
        get_algorithm("no-such-method")


def test_builtin_model_names_match_the_builders():
    from hfpfl.models.builders import TINY_CLASSIFIERS, TINY_VQA_MODELS
    from hfpfl.models.names import TINY_CLASSIFIER_NAMES, TINY_VQA_MODELS as names_vqa
    assert tuple(TINY_CLASSIFIERS) == TINY_CLASSIFIER_NAMES and TINY_VQA_MODELS == names_vqa


def test_cli_methods_lists_every_method(capsys):
    from hfpfl.cli import main
    main(["methods"])
    names = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert {"fedavg", "fedpce", "pce_fedper", "fraug", "feddat", "vqa_peft", "fedbasis", "perada"} <= names
