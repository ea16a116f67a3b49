"""The "Writing a method" page shows the code as it is: every line of its worked examples (FedProx, SCAFFOLD) is a line
of the method's file, and every declaration its table names is an attribute of the protocol."""
import re
from pathlib import Path

from hfpfl.federated.protocol import Algorithm

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "how-to" / "writing-a-method.md"


def _code(line: str) -> str:
    return line.split("  #")[0].split(" # ")[0].rstrip() if not line.lstrip().startswith("#") else ""


def _examples() -> list[tuple[str, str]]:
    text = PAGE.read_text()
    out = []
    for m in re.finditer(r"\(`(hfpfl/algorithms/\w+\.py)`[^\n]*\n(?:[^\n]*\n)*?```python\n(.*?)```", text, re.S):
        out.append((m.group(1), m.group(2)))
    return out


def test_worked_examples_are_the_methods_code():
    examples = _examples()
    assert [f for f, _ in examples] == ["hfpfl/algorithms/fedprox.py", "hfpfl/algorithms/scaffold.py"]
    for file, code in examples:
        source = {_code(line) for line in (ROOT / file).read_text().splitlines()}
        missing = [line for line in map(_code, code.splitlines()) if line and line not in source]
        assert not missing, (file, missing)


def test_declarations_in_the_table_are_the_protocols():
    text = PAGE.read_text()
    table = text[text.index("**Declarations**"):text.index("**Hooks**")]
    names = re.findall(r"^\| `(\w+)`", table, re.M)
    assert names[:3] == ["aggregation", "local_update", "personal_model"]
    for name in names:
        assert hasattr(Algorithm, name), name
    assert (Algorithm.aggregation, Algorithm.local_update, Algorithm.personal_model) == ("mean", "engine", "loaded")


def test_the_context_paragraph_names_every_member_of_the_context_and_no_other():
    from hfpfl.federated.context import MethodContext

    text = PAGE.read_text()
    para = text[text.index("**The context.**"):]
    para = para[:para.index("checks this list against")]
    named = {m.split("(")[0] for m in re.findall(r"`(\w+)(?:\([^`]*\))?`", para)}
    members = {n for n in vars(MethodContext) if not n.startswith("_")}
    assert members <= named, sorted(members - named)
    assert {"train", "evaluate"} <= named
    assert not {n for n in named if n not in members and n in {"args", "accelerator", "public_data",
                                                                  "global_test_data", "make_optimizer"}}


def test_the_callback_example_is_the_tested_one():
    text = PAGE.read_text()
    block = text[text.index("**Callbacks.**"):]
    block = block[block.index("```python\n") + len("```python\n"):]
    block = block[:block.index("```")]
    source = {_code(line) for line in (ROOT / "tests" / "federated" / "test_callbacks.py").read_text().splitlines()}
    missing = [line for line in map(_code, block.splitlines()) if line and line not in source]
    assert "class ValidationScorer(Callback):" in block and not missing, missing
