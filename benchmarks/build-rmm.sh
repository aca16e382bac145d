#!/usr/bin/env bash
# Builds benchmarks/bench_rmm.cpp on the GPU machine (nvcc 13) against the librmm-cu13 and
# rapids-logger wheels in .peers/, into $RMM_BENCH_DIR (default /tmp/rmmx)/bench_rmm.
# Used by gpu-bench.sh and pinned.sh; see benchmarks/README.md. Prints the build's tail
# and exits non-zero when it fails.
set -uo pipefail
cd "$(dirname "$0")/.."
X=${RMM_BENCH_DIR:-/tmp/rmmx}
SRC=$PWD/benchmarks/bench_rmm.cpp
mkdir -p "$X"
for w in .peers/librmm*.whl .peers/rapids_logger*.whl; do python3 -m zipfile -e "$w" "$X"; done
(
  cd "$X" && nvcc -std=c++17 -O2 -I"$X/librmm/include/rapids" -I"$X/librmm/include" -I"$X/rapids_logger/include" \
    "$SRC" -o bench_rmm -L"$X/librmm/lib64" -L"$X/rapids_logger/lib64" \
    -lrmm -lrapids_logger -Xlinker -rpath -Xlinker "$X/librmm/lib64:$X/rapids_logger/lib64"
) >"$X/build.txt" 2>&1 || { echo "bench_rmm build failed"; tail -20 "$X/build.txt"; exit 1; }
