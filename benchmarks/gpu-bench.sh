#!/usr/bin/env bash
# The pool benchmarks on the GPU machine, next to the peers, interleaved and repeated
# (the machine's speed moves by up to 2x between moments). See benchmarks/README.md.
# Runs from the repository root, and expects there:
#   .gpu/bench/window             our Rust bench (make gpu-build)
#   .gpu/wheels/*.whl             our wheel (make gpu-build)
#   .peers/*.whl                  librmm-cu13 26.10.0, rapids-logger 0.3, rmm-cu13 26.10.0
#                                 (git-ignored; `make peers` downloads them)
# and on the machine: nvcc 13 (to build benchmarks/bench_rmm.cpp), CuPy, PyTorch and
# cuda-bindings (for benchmarks/bench_py.py).
# Writes logs to $BENCH_LOGS (default /tmp/streampool-bench), prints a summary last. See benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${BENCH_LOGS:-/tmp/streampool-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SECS=${SECS:-0.3}
REPS=${REPS:-3}

python3 -m pip install -q --no-index --no-deps --target /tmp/spb .gpu/wheels/*.whl .peers/*.whl
export PYTHONPATH=/tmp/spb
X=${RMM_BENCH_DIR:-/tmp/rmmx}
bash benchmarks/build-rmm.sh

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
for round in 1 2; do
  [ -x $X/bench_rmm ] && $X/bench_rmm "$SECS" "$REPS" all fixed,mt >"$OUT/rmm-$round.txt" 2>&1
  .gpu/bench/window --secs "$SECS" --reps "$REPS" --resources sharded,async,control --json "$OUT/ours-rust-$round.json" >"$OUT/ours-rust-$round.txt" 2>&1
done
python3 benchmarks/bench_py.py --part B --secs "$SECS" --reps "$REPS" >"$OUT/peers-py.txt" 2>&1
python3 benchmarks/bench_py.py --part A --reps "$REPS" >"$OUT/peers-py-fixed.txt" 2>&1
python3 benchmarks/bench_pool.py --secs "$SECS" --reps "$REPS" --json "$OUT/ours-py.json" >"$OUT/ours-py.txt" 2>&1

echo "== RMM (C++), round 1 and 2 =="
grep -v "^RAW\|^#" "$OUT/rmm-1.txt" | tail -n 40
grep -v "^RAW\|^#" "$OUT/rmm-2.txt" | tail -n 40
echo "== streampool (Rust), round 1 and 2 =="
cat "$OUT/ours-rust-1.txt" "$OUT/ours-rust-2.txt"
echo "== peers (Python) =="
grep -v "^RAW" "$OUT/peers-py.txt" | tail -n 45
grep -v "^RAW" "$OUT/peers-py-fixed.txt" | tail -n 25
echo "== streampool (Python) =="
cat "$OUT/ours-py.txt"
