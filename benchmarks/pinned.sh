#!/usr/bin/env bash
# One thread of ours and of the peers on the same vCPUs: the host's fastest and its slowest
# (by the control of the window bench, 0.3 s on each), so that one-thread figures are
# compared where both ran, not wherever the scheduler put each (benchmarks/RESULTS.md).
# Expects what gpu-bench.sh expects; builds benchmarks/bench_rmm.cpp as it does when
# gpu-bench.sh has not already (benchmarks/README.md). Prints tagged lines.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
X=${RMM_BENCH_DIR:-/tmp/rmmx}
[ -x "$X/bench_rmm" ] || bash benchmarks/build-rmm.sh
[ -d /tmp/spb ] || python3 -m pip install -q --no-index --no-deps --target /tmp/spb .gpu/wheels/*.whl .peers/*.whl
rates=()
for cpu in $(seq 0 $(($(nproc) - 1))); do
  r=$(taskset -c "$cpu" .gpu/bench/window --secs 0.3 --reps 1 --threads 1 --resources control 2>/dev/null \
    | awk '/^window/ {print $4}')
  rates+=("$r $cpu")
done
sorted=$(printf '%s\n' "${rates[@]}" | sort -n)
echo "control M allocs/s by vCPU: $(echo "$sorted" | awk '{printf "%s:%s ", $2, $1}')"
slow=$(echo "$sorted" | head -n 1 | awk '{print $2}')
fast=$(echo "$sorted" | tail -n 1 | awk '{print $2}')
for cpu in $fast $slow; do
  tag="vcpu$cpu"
  for round in 1 2; do
    taskset -c "$cpu" .gpu/bench/window --secs 0.3 --reps 3 --threads 1 --resources sharded,control 2>&1 \
      | grep -E "^(fixed|window)" | sed "s/^/$tag r$round ours /"
    [ "$round" = 1 ] && [ -x $X/bench_rmm ] && taskset -c "$cpu" $X/bench_rmm 0.3 3 all fixed,mt 2>&1 \
      | grep -E "^(resource|raw_|rmm_)" | awk '$2 == "1" || $2 ~ /^[0-9]+$/ && NF == 5 || $1 == "resource"' \
      | sed "s/^/$tag r$round rmm /"
  done
  PYTHONPATH=/tmp/spb taskset -c "$cpu" python3 benchmarks/bench_pool.py --threads 1 --secs 0.2 --reps 3 2>&1 \
    | grep -E "^fixed  (control|ShardedPool)" | sed "s/^/$tag py ours /"
  PYTHONPATH=/tmp/spb taskset -c "$cpu" python3 benchmarks/bench_py.py --part A --reps 3 2>&1 \
    | grep -E "noop|pool\(async\)|cupy_MemoryPool|torch|canary" | sed "s/^/$tag py peers /"
done
