#!/usr/bin/env bash
# One thread of the Rust window bench pinned to each CPU in turn (taskset), the control
# beside the pool: shows whether the host's moments of slowness belong to some CPUs.
#   bash benchmarks/cpu-scan.sh BINARY [extra window arguments...]
# Prints each CPU's fixed-pair and window lines, tagged with the CPU. See benchmarks/RESULTS.md.
set -uo pipefail
BIN=$1
shift
for cpu in $(seq 0 $(($(nproc) - 1))); do
  taskset -c "$cpu" "$BIN" --secs 0.2 --reps 3 --threads 1 --resources control,sharded "$@" 2>&1 \
    | grep -E "^(fixed  [a-z]+ +65536|window)" | sed "s/^/cpu$cpu /"
done
