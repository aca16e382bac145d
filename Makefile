# One target per habit; CI (.ci/run), hooks and people all call these.
PYTHON ?= python3
CARGO ?= cargo
export PYTHONUNBUFFERED := 1
export PIP_ROOT_USER_ACTION := ignore

.PHONY: help install test test-rust test-python lint fmt gpu-build test-gpu clean

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

lint: ## rustfmt, clippy, ruff and stubtest
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --quiet -- -D warnings
	$(PYTHON) -m ruff check python tests
	$(PYTHON) -m mypy.stubtest streampool._native --allowlist python/stubtest-allowlist.txt

fmt: ## format Rust and Python
	$(CARGO) fmt --all
	$(PYTHON) -m ruff format python tests

gpu-build: ## build what the GPU machine runs into .gpu/ (wheel + Rust test binaries)
	bash scripts/gpu-build.sh

test-gpu: ## on a GPU machine: the GPU-marked pytest tests and the Rust GPU tests (see DEVELOPERS.md)
	bash scripts/gpu-suite.sh

clean: ## remove build outputs
	$(CARGO) clean
	rm -rf .gpu dist
