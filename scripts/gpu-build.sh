#!/usr/bin/env bash
# Builds, on the development machine, everything the GPU machine runs (it has no Rust
# toolchain and no network): the abi3 wheel and the core crate's test binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/bin
maturin build --release -q -o .gpu/wheels
cargo test -p streampool --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        shutil.copy(m["executable"], ".gpu/bin/" + m["target"]["name"])
        print("test binary:", m["target"]["name"])
'
mkdir -p .gpu/bench
cargo bench -p streampool --bench window --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bench"]:
        shutil.copy(m["executable"], ".gpu/bench/" + m["target"]["name"])
        print("bench binary:", m["target"]["name"])
'
strip .gpu/bin/* .gpu/bench/*
du -sh .gpu
