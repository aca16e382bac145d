# One target per habit; CI (.ci/run), hooks and people all call these.
PYTHON ?= python3
CARGO ?= cargo
export PYTHONUNBUFFERED := 1
export PIP_ROOT_USER_ACTION := ignore

.PHONY: help install test test-rust test-python test-loom lint fmt bench gpu-build test-gpu gpu-bench clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

install: ## build the wheel once and install it with the test dependencies
	$(PYTHON) -m pip install -q --upgrade pip maturin
	rm -rf dist && $(PYTHON) -m maturin build --release -q -o dist
	$(PYTHON) -m pip install -q --force-reinstall --no-deps dist/*.whl
	$(PYTHON) -m pip install -q "$$(ls dist/*.whl)[test]"

test: install test-rust test-python ## install, then run the Rust and Python suites (simulated device)

test-rust: ## Rust unit, conformance and doc tests on the simulated device
	$(CARGO) test -p streampool --quiet

test-python: ## pytest on the simulated device (GPU-marked tests skip without a GPU)
	$(PYTHON) -m pytest -q tests

test-loom: ## loom models of the pool's shards and the adaptors' counters (a separate build)
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom $(CARGO) test -p streampool --release --lib loom

bench: ## the window and fixed workloads here (on the simulated device without a GPU: numbers of the simulator)
	$(CARGO) bench -p streampool --bench window -- --secs 0.3 --reps 1
	$(PYTHON) benchmarks/bench_pool.py --secs 0.3 --reps 1

lint: ## rustfmt, clippy, ruff (check and format) and stubtest
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --quiet -- -D warnings
	$(PYTHON) -m ruff check python tests benchmarks scripts
	$(PYTHON) -m ruff format --check python tests benchmarks scripts
	$(PYTHON) -m mypy.stubtest streampool._native --allowlist python/stubtest-allowlist.txt

fmt: ## format Rust and Python
	$(CARGO) fmt --all
	$(PYTHON) -m ruff format python tests benchmarks scripts

gpu-build: ## build what the GPU machine runs into .gpu/ (wheel + Rust test binaries)
	bash scripts/gpu-build.sh

test-gpu: ## on a GPU machine: the GPU-marked pytest tests and the Rust GPU tests (see DEVELOPERS.md)
	bash scripts/gpu-suite.sh

gpu-bench: ## on a GPU machine: the pool benchmarks next to RMM's, CuPy's and PyTorch's (benchmarks/RESULTS.md)
	bash benchmarks/gpu-bench.sh

clean: ## remove build outputs
	$(CARGO) clean
	rm -rf .gpu dist
