#!/usr/bin/env bash
# The peers' environment: .venv-peers with ArcticInference's suffix decoding (`arctic_inference.suffix_decoding`) and
# hybridspec (editable) side by side, so that benchmarks/bench_suffix.py runs every proposer in one process; and
# llama-cpp-python for benchmarks/bench_architectures.py.
# Idempotent: each step is skipped when what it installs already imports.
#
# arctic-inference is on PyPI only as an sdist. Its full build compiles only the suffix-tree extension on a machine
# without CUDA (~1 min); if that build fails, we build just its csrc/suffix_decoding nanobind extension from the
# downloaded sdist in a temporary directory (nothing of its code lands in this repository).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=.venv-peers
PIP="$VENV/bin/pip"
# Pin torch everywhere, isolated builds included: an unpinned torch pulls a multi-GB CUDA build.
export PIP_CONSTRAINT="$ROOT/scripts/constraints.txt"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$PIP" install -q --upgrade pip
fi
"$VENV/bin/python" -c "import numpy, numba, tqdm" 2>/dev/null || "$PIP" install -q numpy numba tqdm

build_suffix_extension_from_sdist() {
  # Fallback: compile arctic_inference's suffix_decoding extension alone and install the Python package files
  # without the rest of its (CUDA) build.
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  "$PIP" install -q "nanobind>=2" cmake ninja
  "$PIP" download -q --no-deps arctic-inference -d "$tmp"
  tar -xzf "$tmp"/arctic_inference-*.tar.gz -C "$tmp"
  local src
  src=$(echo "$tmp"/arctic_inference-*/)
  local site
  site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  PATH="$ROOT/$VENV/bin:$PATH" cmake -S "$src/csrc/suffix_decoding" -B "$tmp/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$ROOT/$VENV/bin/python" >/dev/null
  PATH="$ROOT/$VENV/bin:$PATH" cmake --build "$tmp/build" >/dev/null
  cp -r "$src/arctic_inference" "$site/"
  find "$tmp/build" -name "*.so" -exec cp {} "$site/arctic_inference/suffix_decoding/" \;
}

if ! "$VENV/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
  "$PIP" install -q arctic-inference || build_suffix_extension_from_sdist
fi

# hybridspec itself, editable, with its Cython suffix tree compiled by this install.
# (a fresh venv brings setuptools 65: too old for our package-dir mapping and SPDX licence string)
"$PIP" install -q "Cython>=3.0" "setuptools>=77" wheel
"$VENV/bin/python" -c "import hybridspec.suffix" 2>/dev/null || "$PIP" install -q --no-build-isolation -e "$ROOT"

# llama.cpp, the CPU peer of benchmarks/bench_architectures.py: built from source (~10 min on 2 cores the first time;
# pip keeps the wheel in its cache, so a fresh checkout on the same machine installs it in seconds).
"$VENV/bin/python" -c "import llama_cpp" 2>/dev/null || "$PIP" install -q llama-cpp-python==0.3.36

"$VENV/bin/python" -c "import arctic_inference.suffix_decoding, hybridspec.suffix, llama_cpp; print('peers ready')"
