#!/usr/bin/env bash
# The sharded pool's speed beside its memory: the window workload at 1, 4 and 16 threads
# and the producer/consumer hand-off (half the blocks freed on another stream after an
# event) at 16 threads, with the default footprint budget (headroom 0.15) and without one
# (--headroom none), beside the driver's pool; every line gives peak reserved against peak
# live bytes. Two rounds, alternated, because the machine's speed moves between moments;
# then the same with the live bytes counted exactly (--exact-live: a shared counter, which
# slows every thread, so its speed is not the pool's), then one long hand-off run (the soak,
# with its peak reserved and live bytes every 5 s: they must level off). Runs the window bench that `make gpu-build` puts in
# .gpu/bench (or BENCH=...); JSON under $OUT (default /tmp/footprint).
#
#   SECS=0.5 REPS=3 SOAK_SECS=20 bash benchmarks/footprint.sh
set -uo pipefail
bench=${BENCH:-.gpu/bench/window}
secs=${SECS:-0.5}
reps=${REPS:-3}
soak=${SOAK_SECS:-20}
out=${OUT:-/tmp/footprint}
mkdir -p "$out"
run() { # NAME ARGS...: one bench run, its lines printed, its JSON kept
  local name=$1
  shift
  "$bench" --secs "$secs" --reps "$reps" --no-fixed --json "$out/$name.json" "$@" 2>&1 | grep -E "^(device|window|handoff| +[0-9.]+ s:)"
}
for round in 1 2; do
  echo "== round $round"
  run "window-$round" --threads 1,4,16 --resources sharded,async
  run "window-nobudget-$round" --threads 1,16 --resources sharded --headroom none
  run "handoff-$round" --threads 16 --resources sharded,async --handoff
  run "handoff-nobudget-$round" --threads 16 --resources sharded --handoff --headroom none
done
echo "== exact live bytes"
run window-exact --threads 1,4,16 --resources sharded,async --exact-live
run handoff-exact --threads 16 --resources sharded,async --handoff --exact-live
echo "== soak: the hand-off for ${soak} s at 16 threads"
secs=$soak reps=1 run soak --threads 16 --resources sharded --handoff --exact-live --every 5
