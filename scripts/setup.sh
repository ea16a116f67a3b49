#!/usr/bin/env bash
# Create .venv and install hfpfl with its pinned dependencies (CPU). Safe to run again.
# torch goes FIRST and alone: an unpinned torch pulls several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,tracking,dev]"
echo "hfpfl installed in .venv ($(.venv/bin/python -c 'import torch, transformers, diffusers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "diffusers", diffusers.__version__, "peft", peft.__version__)'))"
