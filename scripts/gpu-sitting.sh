#!/usr/bin/env bash
# One GPU sitting's runs, for a GPU machine without Rust or network: install the wheel
# that scripts/gpu-build.sh put in .gpu/, then run one part, logs under $OUT (OUT=DIR;
# default /tmp/streampool-sitting). Each part fits in a run of at most 10 minutes; the
# guide's window part needs a run of its own (guide-part window):
#   bash scripts/gpu-sitting.sh suite   the GPU suite (HANG_PROBE=0, -m gpu; the framework
#                                       tests and the README's examples are the part below), a program that
#                                       forks before its first use profiled on the driver, and
#                                       the window bench at 1 and 16 threads, alternated with
#                                       .gpu/bench/window-old where there is one (a binary of
#                                       an earlier commit, copied there by hand: record that
#                                       commit with the sitting's files, or the comparison
#                                       names no baseline)
#   bash scripts/gpu-sitting.sh framework-tests   the PyTorch/CuPy/Numba tests (CUDA graphs and
#                                       torch.compile among them: PyTorch's and Triton's first
#                                       compilations take a minute on a fresh machine) and the
#                                       README's GPU examples
#   bash scripts/gpu-sitting.sh guide   tests/test_torch_errors.py (against
#                                       the installed PyTorch), then the guide's recommend (handoff),
#                                       latency and random parts (REPEATS=2); not the window
#                                       part: `guide-part window`
#   bash scripts/gpu-sitting.sh frameworks   benchmarks/bench_frameworks.py: PyTorch, CuPy
#                                       and the C entry points beside their own allocators
#   bash scripts/gpu-sitting.sh short-log   tests/test_harness_gpu.py, the full-device
#                                       out-of-memory test with its messages printed, then
#                                       `recommend` on benchmarks/guide/short-log/short.log,
#                                       4 times with --quick and 4 without, alternated
#   bash scripts/gpu-sitting.sh guide-part NAME   one part of benchmarks/guide.sh alone
#                                       (REPEATS=2), in a run of its own: the window part
#                                       with every peer takes most of one. Stopped at 540 s,
#                                       its JSON keeps the runs that had finished
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?usage: gpu-sitting.sh suite|framework-tests|guide|frameworks|short-log|guide-part NAME}
OUT=${OUT:-/tmp/streampool-sitting}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 STREAMPOOL_GPU_TESTS=1
# RMM too where `make peers` put its wheels in .peers/ (carried beside .gpu/): the guide's
# tables keep their RMM columns only when RMM is measured in the same run.
python3 -m pip install -q --no-index --no-deps --target /tmp/sp .gpu/wheels/*.whl $(ls .peers/*.whl 2>/dev/null) 2>&1 | tail -n 2
export PYTHONPATH=/tmp/sp
case $PART in
suite)
  PYTEST_ADDOPTS="--ignore=tests/test_gpu_frameworks.py --ignore=tests/test_readme.py --ignore=tests/test_allocators.py" \
    HANG_PROBE=0 PYTEST_ARGS="-m gpu" RUST_TIMEOUT=120 SUITE_LOGS="$OUT/suite" timeout -k 10 400 \
    bash scripts/gpu-suite.sh >"$OUT/suite-summary.txt" 2>&1
  echo "suite rc=$?" >>"$OUT/suite-summary.txt"
  tail -n 30 "$OUT/suite-summary.txt"
  echo "===== a program that forks before its first use, profiled on the driver"
  mkdir -p /tmp/sitting-fork
  cat >/tmp/sitting-fork/prog.py <<'PY'
import multiprocessing, os, streampool
def work(size):
    r, s = streampool.get_current_device_resource(), streampool.Stream()
    r.deallocate(r.allocate(size, s), size, s)
    return size
if __name__ == '__main__':
    pid = os.fork()
    if pid == 0:
        work(111)
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    with multiprocessing.get_context('fork').Pool(2) as pool:
        assert pool.map(work, [222, 222]) == [222, 222]
    work(333)
    print('done')
PY
  (cd /tmp/sitting-fork && timeout -k 5 60 python3 -m streampool profile -o fork.log -- python3 prog.py
   echo "rc=$?"; cat fork.log) 2>&1 | tee "$OUT/fork-profile.txt" | tail -n 12
  echo "===== the window bench"
  binaries=window
  [ -x .gpu/bench/window-old ] && binaries="window-old window"
  for round in 1 2; do for b in $binaries; do
    echo "===== $b, round $round"
    timeout -k 5 60 .gpu/bench/$b --secs 0.4 --reps 3 --threads 1,16 --no-fixed --resources sharded
  done; done 2>&1 | tee "$OUT/window-ab.txt" | grep -E "=====|T="
  ;;
framework-tests)
  timeout -k 5 540 python3 -m pytest -v -p no:cacheprovider -m gpu -rs tests/test_gpu_frameworks.py \
    tests/test_readme.py tests/test_allocators.py >"$OUT/frameworks.txt" 2>&1
  echo "frameworks rc=$?"; grep -E "FAILED|ERROR" "$OUT/frameworks.txt" | head -n 20; tail -n 8 "$OUT/frameworks.txt"
  ;;
guide)
  # PyTorch's out-of-memory error against the installed PyTorch's own headers and libraries.
  timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider -rs tests/test_torch_errors.py >"$OUT/torch-errors.txt" 2>&1
  echo "torch errors rc=$?"; tail -n 3 "$OUT/torch-errors.txt"
  mkdir -p "$OUT/guide"
  GUIDE_OUT="$OUT/guide" PARTS=recommend PROGRAMS=handoff REPEATS=2 timeout -k 10 90 \
    bash benchmarks/guide.sh >"$OUT/guide-recommend-log.txt" 2>&1
  echo "recommend rc=$?"; tail -n 12 "$OUT/guide-recommend-log.txt"
  for part in latency random; do
    GUIDE_OUT="$OUT/guide" PARTS=$part REPEATS=2 timeout -k 10 300 bash benchmarks/guide.sh \
      >"$OUT/guide-$part-log.txt" 2>&1
    echo "guide $part rc=$? at ${SECONDS}s"
  done
  tail -n 25 "$OUT/guide-random-log.txt"
  ;;
frameworks)
  # PyTorch, CuPy and the C entry points beside their own allocators (the counted C++ pair
  # beside the plain one), memory beside speed.
  timeout -k 10 500 python3 benchmarks/bench_frameworks.py --parts torch,cupy,capi --reps 3 \
    --json "$OUT/frameworks-bench.json" >"$OUT/frameworks-bench.txt" 2>&1
  echo "frameworks bench rc=$?"; grep -v '^{' "$OUT/frameworks-bench.txt" | tail -n 45
  ;;
short-log)
  timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_harness_gpu.py \
    >"$OUT/harness-gpu.txt" 2>&1
  echo "harness gpu rc=$?"; tail -n 5 "$OUT/harness-gpu.txt"
  timeout -k 5 60 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
    "tests/test_gpu.py::test_a_full_device_says_what_limited_the_request" >"$OUT/full-device.txt" 2>&1
  echo "full device rc=$?"; grep -E "Error|passed|failed" "$OUT/full-device.txt" | tail -n 6
  for round in 1 2 3 4; do for quick in --quick ""; do
    echo "===== round $round: streampool recommend short.log $quick"
    timeout -k 5 60 python3 -m streampool recommend benchmarks/guide/short-log/short.log $quick
    echo "rc=$?"
  done; done >"$OUT/short-log-runs.txt" 2>&1
  grep -E "^=====|^Recommended|^recommend:|^streampool recommend:|^rc=" "$OUT/short-log-runs.txt"
  ;;
guide-part)
  name=${2:?usage: gpu-sitting.sh guide-part NAME (a part of benchmarks/guide.sh)}
  mkdir -p "$OUT/guide"
  GUIDE_OUT="$OUT/guide" PARTS=$name REPEATS=2 timeout -k 20 540 bash benchmarks/guide.sh \
    >"$OUT/guide-$name-log.txt" 2>&1
  echo "guide $name rc=$? at ${SECONDS}s"; tail -n 25 "$OUT/guide-$name-log.txt"
  ;;
*) echo "gpu-sitting: unknown part '$PART' (suite, framework-tests, guide, frameworks, short-log or guide-part NAME)" >&2; exit 2 ;;
esac
