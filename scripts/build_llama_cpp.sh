#!/usr/bin/env bash
# Builds llama.cpp (the copy vendored in the llama-cpp-python source package) as a CPU benchmark
# peer: llama-bench, llama-batched-bench, llama-perplexity, llama-quantize, llama-tokenize.
#   scripts/build_llama_cpp.sh [DEST]      (default DEST: .cache/llama.cpp under the repo root)
# Layout: DEST/sdist (the .tar.gz), DEST/llama_cpp_python-$VERSION (unpacked; the source is its
# vendor/llama.cpp, with convert_hf_to_gguf.py and gguf-py), DEST/build/bin (the binaries).
# Idempotent: does nothing when DEST/build/.built names this version. The sdist comes from the
# package index pip is configured with (the repo venv's pip). Build: 4.5 min with 2 jobs on a
# 2-core EPYC.
# JOBS (default 2) sets the parallel jobs; run it under `nice -n 19` on a shared box.
set -euo pipefail
VERSION=0.3.36
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEST=$(mkdir -p "${1:-$ROOT/.cache/llama.cpp}" && cd "${1:-$ROOT/.cache/llama.cpp}" && pwd)
PIP=${PIP:-$ROOT/.venv/bin/pip}
JOBS=${JOBS:-2}
TOOLS=(llama-bench llama-batched-bench llama-perplexity llama-quantize llama-tokenize)
SRC=$DEST/llama_cpp_python-$VERSION/vendor/llama.cpp
BUILD=$DEST/build

if [ "$(cat "$BUILD/.built" 2>/dev/null)" = "$VERSION" ]; then
  echo "llama.cpp $VERSION already built: $BUILD/bin"
  exit 0
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  sdist=$DEST/sdist/llama_cpp_python-$VERSION.tar.gz
  [ -f "$sdist" ] || "$PIP" download -q --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$DEST/sdist"
  tar -xzf "$sdist" -C "$DEST"
fi

start=$(date +%s)
# CPU only, static binaries (no rpath to the build tree), none of tests / examples / server / app;
# no HTTPS (models are local files). LLAMA_CURL is a deprecated no-op here, kept for older trees.
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF >"$DEST/configure.log" 2>&1 \
  || { tail -30 "$DEST/configure.log" >&2; exit 1; }
cmake --build "$BUILD" -j "$JOBS" --target "${TOOLS[@]}"
echo "$VERSION" >"$BUILD/.built"
echo "llama.cpp $VERSION built in $(( $(date +%s) - start )) s"
echo "binaries:  $BUILD/bin (${TOOLS[*]})"
echo "converter: PYTHONPATH=$SRC/gguf-py $ROOT/.venv/bin/python $SRC/convert_hf_to_gguf.py"
