#!/usr/bin/env bash
# Builds, on the development machine, everything the GPU machine runs (it has no Rust
# toolchain and no network): the abi3 wheel, the core crate's test binaries (.gpu/bin,
# every one of them: scripts/gpu-suite.sh runs them all) and its benches (.gpu/bench).
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
du -sh .gpu
