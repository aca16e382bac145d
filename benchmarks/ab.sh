#!/usr/bin/env bash
# A/B of two builds of the Rust window bench on one machine, interleaved, so that both see
# the same moments (the H200 host's speed for the pool moves by up to 2x between moments).
#   bash benchmarks/ab.sh A_BINARY B_BINARY [ROUNDS] [extra window arguments...]
# Prints each round's lines, tagged A or B. See benchmarks/RESULTS.md for how it was used.
set -uo pipefail
A=$1 B=$2 ROUNDS=${3:-4}
shift $(( $# < 3 ? $# : 3 ))
for round in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    bin=$A; [ $side = B ] && bin=$B
    "$bin" --secs 0.3 --reps 3 --threads 1,16 --resources control,sharded "$@" 2>&1 \
      | grep -E "^(fixed|window)" | sed "s/^/$side r$round /"
  done
done
