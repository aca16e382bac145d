#!/usr/bin/env bash
# The GPU suite, run on the GPU machine over the working tree and the .gpu/ that
# scripts/gpu-build.sh made (see DEVELOPERS.md):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/sp .gpu/wheels/*.whl \
#     && export PYTHONPATH=/tmp/sp && bash scripts/gpu-suite.sh
# Full logs go to $SUITE_LOGS (default /tmp/streampool-gpu); a short summary is printed last,
# then the table of the per-thread default stream hang probe (scripts/gpu_hang_probe.py
# --quick: each case in its own process, killed after 20 s, so a hang cannot stop the suite).
# PYTEST_ARGS adds pytest options (e.g. "-m gpu": the GPU-marked tests alone).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${SUITE_LOGS:-/tmp/streampool-gpu}
mkdir -p "$OUT"
export STREAMPOOL_GPU_TESTS=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Dask from the wheels scripts/gpu-build.sh downloaded, where the machine lacks it.
if ls .gpu/dask/*.whl >/dev/null 2>&1 && ! python3 -c "import distributed" 2>/dev/null; then
  python3 -m pip install -q --no-index --find-links .gpu/dask --target /tmp/sp-dask "dask[distributed]" \
    && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/sp-dask"
fi
summary=()
step() {  # step NAME LOG COMMAND...
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  "$@" >"$OUT/$log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$log")")")
}

nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$OUT/nvidia-smi.txt"
step "environment report" report.txt python3 -m streampool
cat "$OUT/report.txt"
# Each test binary is killed after RUST_TIMEOUT seconds (default 300), so that a hang in one
# does not stop the rest (its log ends where it hung; rc 124).
for bin in .gpu/bin/*; do
  step "rust $(basename "$bin")" "rust-$(basename "$bin").txt" \
    timeout -k 10 "${RUST_TIMEOUT:-300}" "$bin" --include-ignored --test-threads=4
done
if [ "${HANG_PROBE:-1}" = 1 ]; then  # HANG_PROBE=0 leaves the probe out (a few minutes)
  step "hang probe (--quick)" hang-probe.txt timeout -k 10 480 \
    python3 scripts/gpu_hang_probe.py --quick --no-native-stacks --logs "$OUT/hang-probe"
fi
step "multi-GPU (gpu_multi.py)" gpu-multi.txt timeout -k 10 300 python3 scripts/gpu_multi.py
step "pytest (gpu + simulated)" pytest.txt python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_ARGS:-} tests
grep -E "passed|failed|error" "$OUT/pytest.txt" | tail -n 3
for bin in .gpu/bin/*; do grep -E "^test result|FAILED|panicked" "$OUT/rust-$(basename "$bin").txt" | tail -n 5; done
echo "== multi-GPU: scripts/gpu_multi.py =="
grep -E "^(PASS|FAIL|SKIP) |^all parts|^FAILED" "$OUT/gpu-multi.txt"
echo "== summary =="
printf '%s\n' "${summary[@]}"
if [ "${HANG_PROBE:-1}" = 1 ]; then
  echo "== hang probe: per-thread default stream, threads exit, then the device is synchronised =="
  tail -n +2 "$OUT/hang-probe.txt"
fi
