#!/usr/bin/env bash
# The pool benchmarks on the GPU machine, next to the peers, interleaved and repeated
# (the machine's speed moves by up to 2x between moments). Expects, carried with the
# working tree:
#   .gpu/bench/window             our Rust bench (make gpu-build)
#   .gpu/wheels/*.whl             our wheel (make gpu-build)
#   .peers/bench_rmm.cpp, .peers/bench_py.py   the peers' programs (../shared/peers/)
#   .peers/*.whl                  librmm-cu13 26.10.0, rapids-logger 0.3, rmm-cu13 26.10.0
# (.peers/ is ignored by git; made here with
#   mkdir -p .peers && cp ../shared/peers/bench_rmm.cpp ../shared/peers/bench_py.py .peers/ &&
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_24_x86_64 -d .peers librmm-cu13==26.10.0 "rapids-logger==0.3.*" rmm-cu13==26.10.0
# and carried with .gpu/.)
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
X=/tmp/rmmx
mkdir -p $X && for w in .peers/librmm*.whl .peers/rapids_logger*.whl; do python3 -m zipfile -e "$w" $X; done
(
  cd $X && nvcc -std=c++17 -O2 -I$X/librmm/include/rapids -I$X/librmm/include -I$X/rapids_logger/include \
    "$OLDPWD/.peers/bench_rmm.cpp" -o bench_rmm -L$X/librmm/lib64 -L$X/rapids_logger/lib64 \
    -lrmm -lrapids_logger -Xlinker -rpath -Xlinker "$X/librmm/lib64:$X/rapids_logger/lib64"
) >"$OUT/build.txt" 2>&1 || { echo "bench_rmm build failed"; tail -20 "$OUT/build.txt"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
for round in 1 2; do
  [ -x $X/bench_rmm ] && $X/bench_rmm "$SECS" "$REPS" all fixed,mt >"$OUT/rmm-$round.txt" 2>&1
  .gpu/bench/window --secs "$SECS" --reps "$REPS" --resources sharded,async,control --json "$OUT/ours-rust-$round.json" >"$OUT/ours-rust-$round.txt" 2>&1
done
python3 .peers/bench_py.py --part B --secs "$SECS" --reps "$REPS" >"$OUT/peers-py.txt" 2>&1
python3 .peers/bench_py.py --part A --reps "$REPS" >"$OUT/peers-py-fixed.txt" 2>&1
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
