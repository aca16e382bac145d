#!/usr/bin/env bash
# The harness's figures for docs/choosing-a-resource.md, on a GPU machine: each command's
# JSON document (schema streampool.harness/2) and plots into $GUIDE_OUT (default
# benchmarks/guide/), to be committed; the guide quotes figures from these files only.
# Expects streampool installed with the harness extra (pip install '.[harness]' or the
# wheel), and the peers to compare with where wanted (rmm-cu13, cupy-cuda13x, torch):
# the peers not installed are left out, and say so.
# Usage: bash benchmarks/guide.sh   (REPEATS=3 by default; NO_PEERS=1 leaves the peers out;
# PARTS=window,random runs only those parts, of: pipeline headroom window random multistream
# larger-than-memory latency recommend stress; the other parts' files are left as they are)
# Takes about 10-20 minutes on an H200 with every peer installed (the peers run behind
# Python callbacks, so the many-thread workloads are slower on them): PARTS splits it.
set -euo pipefail
# Stopped (timeout's SIGTERM, Ctrl-C): wait for the command running, which writes the runs
# it finished into its JSON document, then stop (bash runs a trap once its foreground
# command has exited).
trap 'settle; exit 143' TERM
trap 'settle; exit 130' INT
PENDING=""  # the JSON document being written (run), kept only when it holds one
settle() {
  [ -n "$PENDING" ] || return 0
  if [ -s "$PENDING.tmp" ]; then mv "$PENDING.tmp" "$PENDING"; else rm -f "$PENDING.tmp"; fi
  PENDING=""
}
cd "$(dirname "$0")/.."
PARTS=${PARTS:-pipeline,headroom,window,random,multistream,larger-than-memory,latency,recommend,stress}
for part in ${PARTS//,/ }; do
  case $part in pipeline|headroom|window|random|multistream|larger-than-memory|latency|recommend|stress) ;;
    *) echo "guide: unknown part '$part' in PARTS (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
done
want() { [[ ",$PARTS," == *",$1,"* ]]; }  # want PART: is PART to be run?

OUT=${GUIDE_OUT:-benchmarks/guide}
REPEATS=${REPEATS:-3}
mkdir -p "$OUT/plots"
export PYTHONUNBUFFERED=1
SP="python3 -m streampool"

peers=""
[ -n "${NO_PEERS:-}" ] || {
python3 -c "import rmm" 2>/dev/null && peers="$peers,rmm:async,rmm:pool(cuda),rmm:arena,rmm:binning" || echo "guide: rmm not installed: no RMM columns"
python3 -c "import cupy" 2>/dev/null && peers="$peers,cupy:pool,cupy:async" || echo "guide: cupy not installed: no CuPy columns"
python3 -c "import torch" 2>/dev/null && peers="$peers,torch:native" || echo "guide: torch not installed: no PyTorch column"
}
OURS="async,pool(async),binning(async)"
if python3 -c "import matplotlib" 2>/dev/null; then PLOTS=1; else
  PLOTS=""; echo "guide: matplotlib not installed (pip install 'streampool[harness]'): no plots"; fi
plot_to() {  # the --plot option when plots are on (rename_plots renames the files)
  [ -n "$PLOTS" ] && echo "--plot $OUT/plots" || true
}
rename_plots() {  # rename_plots WORKLOAD NAME
  [ -n "$PLOTS" ] || return 0
  mv "$OUT/plots/$1-throughput.png" "$OUT/plots/$2-throughput.png"
  mv "$OUT/plots/$1-latency.png" "$OUT/plots/$2-latency.png"
}

$SP info | tee "$OUT/info.txt"
if grep -q "simulated device" "$OUT/info.txt" && [ -z "${GUIDE_ALLOW_SIM:-}" ]; then
  echo "guide: no GPU here (or STREAMPOOL_DEVICE=sim): these would be figures of the simulator" >&2; exit 1
fi

run() {  # run NAME ARGS...: one JSON document, the table on stderr's side
  local name=$1 status=0; shift
  echo "== $name: streampool $*" >&2
  # Into a new file, which replaces the old one once it holds a document: one stopped
  # before its first run prints none, and the committed one stays.
  PENDING="$OUT/$name.json"
  $SP "$@" --json >"$PENDING.tmp" || status=$?
  settle
  return "$status"
}

# The pipeline of the context issue, driven from Rust and from Python threads; with the
# stack the guide recommends for it (more headroom, batched events) beside the peers.
PIPELINE="$OURS,pool(async, headroom=2, event_batch=8)"
# Chunks per pair from Python threads: 2000 make a run at one pair last about 0.1 s (500
# made it 25 ms, short enough that one scheduling hiccup moved a run's figures by a third).
PY_CHUNKS=2000
if want pipeline; then
run pipeline-native bench pipeline --resources "$PIPELINE$peers" --threads 1,4,8 --repeats "$REPEATS" \
  --param chunks=3000 --param driver=native $(plot_to)
rename_plots pipeline pipeline-native
run pipeline-python bench pipeline --resources "$PIPELINE$peers" --threads 1,4,8 --repeats "$REPEATS" \
  --param chunks=$PY_CHUNKS --param driver=python $(plot_to)
rename_plots pipeline pipeline-python
fi

# The pipeline again: the sharded pool trading memory for fewer driver calls (headroom,
# event_batch), from Rust and from Python threads.
HEADROOM="pool(async),pool(async, headroom=1),pool(async, headroom=2, event_batch=8),pool(async, headroom=3, event_batch=16)"
if want headroom; then
run pipeline-headroom bench pipeline --resources "$HEADROOM" --threads 1,4,8 --repeats "$REPEATS" \
  --param chunks=3000 --param driver=native
run pipeline-python-headroom bench pipeline --resources "$HEADROOM" --threads 1,4,8 --repeats "$REPEATS" \
  --param chunks=$PY_CHUNKS --param driver=python
fi

# Many threads and streams; RMM's random_allocations; allocations between kernels.
want window && run window bench window --resources "$OURS$peers" --threads 1,4,16 --repeats "$REPEATS" \
  --param allocations=20000 $(plot_to)
want random && run random bench random --resources "$OURS$peers" --threads 1,4,16 --repeats "$REPEATS" \
  --param allocations=5000 $(plot_to)
want multistream && run multistream bench multistream --resources "$OURS$peers" --threads 1,4,16 --streams 16 \
  --repeats "$REPEATS" --param iterations=1000 $(plot_to)

# Managed memory with and without prefetching (8 GiB: far below an H200's free memory).
want larger-than-memory && run larger-than-memory bench larger-than-memory --resources "managed,prefetch(managed)" \
  --repeats "$REPEATS" --param total=8GiB --param chunk_size=256MiB --param passes=3

# Replay overhead: the window trace on an empty-handed baseline is in window.json (cuda);
# the adaptor that records latencies, on and off, for its overhead:
if ! want latency; then :
elif python3 -c "from streampool import mr; mr.LatencyHistogramAdaptor" 2>/dev/null; then
  run latency-overhead bench window --resources "pool(async),latency(pool(async))" --threads 1,16 \
    --repeats "$REPEATS" --param allocations=20000
else
  echo "guide: this build has no LatencyHistogramAdaptor: no latency-overhead.json"
fi

# profile -> recommend on the guide's programs.
# PROGRAMS picks some of them (default: all three).
want recommend && for prog in ${PROGRAMS:-one_stream many_streams handoff}; do
  $SP profile -o "$OUT/$prog.log" -- python3 "benchmarks/guide_programs/$prog.py"
  run "recommend-$prog" recommend "$OUT/$prog.log" --repeats "$REPEATS"
  [ -z "$PLOTS" ] || $SP plot "$OUT/$prog.log" -o "$OUT/plots/$prog-memory.png" --resource "pool(async)"
  gzip -f "$OUT/$prog.log"
done

# Data verification under stress on the GPU (exit status 1 on any corruption or overlap).
want stress && run stress stress --resources "pool(async),async,binning(async)" --seconds 20 --threads 8

echo "guide: wrote $(ls "$OUT"/*.json | wc -l) JSON documents and $(ls "$OUT"/plots/ | wc -l) plots to $OUT"
