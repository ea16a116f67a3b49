"""Every command in the README (and in the user documentation under docs/) runs as written
from the repository root after `bash scripts/setup.sh`: each one's --help runs and lists every option the command
uses, and the cheap ones run for real (in a temporary folder).
`.venv/bin/python` is this interpreter (the test may run from a worktree whose venv lives elsewhere)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the README and the user documentation it sends readers to (CHANGELOG.md is a record of earlier recipes, whose
# commands are not expected to run today)
DOCUMENTS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
README = "\n".join((ROOT / name).read_text() for name in DOCUMENTS)
# pages written by people (the generated results pages name the study runner's own command line, as it ran)
WRITTEN = "\n".join((ROOT / name).read_text() for name in DOCUMENTS if not name.startswith("docs/results/"))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
# accelerate launch options that take a value (everything else before the script is a flag)
LAUNCH_VALUED = {"--num_processes", "--config_file", "--num_machines", "--mixed_precision", "--dynamo_backend",
                 "--main_process_port", "--machine_rank", "--main_process_ip"}
CHEAP = ("scripts/partition.py", "hfpfl methods", "recipes/run.py --method fedavg --num_rounds 2")


def readme_commands() -> list[str]:
    """Shell lines of the README's ```bash blocks and inline `...` spans that are commands (.venv/bin/..., bash)."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                cmds += [c.strip() for c in line.split("&&")]
    for span in re.findall(r"`([^`\n]+)`", README):
        try:   # a code span is not always shell: an apostrophe or a quoted message cut short
            words = shlex.split(span)
        except ValueError:
            words = span.split()
        first = next((w for w in words if "=" not in w), "")
        if first.startswith(".venv/bin/") and len(words) > 1:
            cmds.append(span)
    return list(dict.fromkeys(cmds))


COMMANDS = readme_commands()


def test_readme_has_commands_and_no_bare_python():
    assert len(COMMANDS) >= 10
    lines = [ln for b in re.findall(r"```bash\n(.*?)```", WRITTEN, flags=re.S) for ln in b.splitlines()]
    for span in re.findall(r"`([^`\n]+)`", WRITTEN) + lines:
        _, words = _split_env(span.split())
        if words and words[0] in ("python", "accelerate", "hfpfl", "pytest") and (len(words) > 2 or any(
                w.endswith(".py") for w in words)):
            pytest.fail(f"README command needs the venv (.venv/bin/...): {span!r}")


def _split_env(words):
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def _check_help(argv, used_flags, env_extra=None):
    out = subprocess.run(argv, cwd=ROOT, env={**ENV, **(env_extra or {})}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (argv, out.stderr[-2000:])
    text = out.stdout + out.stderr
    for flag in used_flags:
        assert flag.split("=")[0] in text, (argv, flag)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs_as_written(command, tmp_path):
    env_extra, words = _split_env(shlex.split(command))
    head = words[0]
    if head == "bash":
        assert (ROOT / words[1]).is_file()
        assert subprocess.run(["bash", "-n", str(ROOT / words[1])]).returncode == 0
        return
    assert head.startswith(".venv/bin/"), command
    tool = head.split("/")[-1]
    if tool == "python" and words[1:3] == ["-m", "pytest"]:  # its options (paths and -m expressions are values)
        _check_help([sys.executable, "-m", "pytest", "--help"], [w for w in words[3:] if w.startswith("-")])
        return
    if tool in ("ruff", "lint-imports"):  # the dev extra's tools, next to this interpreter
        exe = str(Path(sys.executable).parent / tool)
        _check_help([exe, *words[1:2], "--help"] if tool == "ruff" else [exe, "--help"],
                    [w for w in words[2:] if w.startswith("-")])
        return
    if tool == "pip":  # installing an extra: pip's options, and the extra declared in pyproject.toml
        import tomllib
        _check_help([sys.executable, "-m", "pip", "install", "--help"], [w for w in words[2:] if w.startswith("-")])
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        named = [m.group(1) for w in words[2:] if (m := re.fullmatch(r"\.\[(.+)\]", w))]
        assert named and all(set(n.split(",")) <= set(extras) for n in named), command
        return
    if tool == "hfpfl":
        out = subprocess.run([sys.executable, "-m", "hfpfl.cli", *words[1:]], cwd=ROOT, env=ENV, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0 and "fedavg" in out.stdout, out.stderr[-2000:]
        return
    if tool == "accelerate" and words[1] != "launch":
        _check_help([sys.executable, "-m", "accelerate.commands.accelerate_cli", words[1], "--help"], words[2:])
        return
    if tool == "accelerate":
        rest, launch_flags = words[2:], []
        while rest and rest[0].startswith("--"):
            flag = rest.pop(0)
            launch_flags.append(flag)
            if flag in LAUNCH_VALUED:
                rest.pop(0)
        _check_help([*LAUNCH, "--help"], launch_flags)
        script, args = rest[0], rest[1:]
    else:
        assert tool == "python", command
        script, args = words[1], words[2:]
    if script == "-m":  # a module of the package: `python -m hfpfl.experiments ... --help` lists what it uses
        module, args = args[0], args[1:]
        flags = [a for a in args if a.startswith("--") and a != "--help"]
        _check_help([sys.executable, "-m", module, *[a for a in args if a != "--help"], "--help"], flags, env_extra)
        return
    assert (ROOT / script).is_file(), command
    flags = [a for a in args if a.startswith("--") and a != "--help"]
    _check_help([sys.executable, script, *[a for a in args if a != "--help"], "--help"], flags, env_extra)
    if any(c in command for c in CHEAP):  # cheap: run it for real, in a temporary folder
        real = [sys.executable, str(ROOT / script), *args]
        out = subprocess.run(real, cwd=tmp_path, env={**ENV, **env_extra}, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, (command, out.stderr[-3000:])
