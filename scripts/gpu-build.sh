#!/usr/bin/env bash
# Builds, on the development machine, everything the GPU machine runs (it has no Rust
# toolchain and no network): the abi3 wheel, the core crate's test binaries (.gpu/bin,
# every one of them: scripts/gpu-suite.sh runs them all), its benches (.gpu/bench: window,
# pipeline, replay; see benchmarks/README.md for their options) and Dask's wheels (.gpu/dask).
# Fails when a test file or bench of the crate has no binary.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/bin .gpu/bench
maturin build --release -q -o .gpu/wheels

# collect DEST KIND: copies the executables named in cargo's JSON messages (stdin) into
# DEST, KIND "test" (the library's unit tests and every tests/*.rs) or "bench" (every
# benches/*.rs), and checks that none is missing.
collect() {
  python3 -c '
import json, pathlib, shutil, sys
dest, kind = sys.argv[1], sys.argv[2]
got = set()
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    target = m["target"]
    if kind == "test" and not m["profile"]["test"]:
        continue
    if kind == "bench" and target["kind"] != ["bench"]:
        continue
    name = target["name"]
    shutil.copy(m["executable"], f"{dest}/{name}")
    got.add(name)
    print(f"{kind} binary: {name}")
crate = pathlib.Path("rust/streampool")
expected = {p.stem for p in (crate / ("tests" if kind == "test" else "benches")).glob("*.rs")}
if kind == "test":
    expected.add("streampool")  # the library unit tests (the driver tests of device::cuda)
missing = sorted(expected - got)
if missing:
    sys.exit(f"gpu-build: no {kind} binary for {missing}")
' "$@"
}
cargo test -p streampool --release --no-run --message-format=json 2>/dev/null | collect .gpu/bin test
cargo bench -p streampool --no-run --message-format=json 2>/dev/null | collect .gpu/bench bench
strip .gpu/bin/* .gpu/bench/*
# Dask's wheels for the GPU machine's Python (GPU_PYTHON, default 3.12; it has no network),
# which scripts/gpu-suite.sh installs there: streampool.dask's GPU tests and the Dask part of
# scripts/gpu_multi.py need them. Without them (no network here) those parts skip.
python3 -m pip download -q "dask[distributed]" --python-version "${GPU_PYTHON:-3.12}" --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .gpu/dask \
  || echo "gpu-build: could not download dask[distributed]; the GPU machine's Dask tests will skip" >&2
du -sh .gpu
