# One target per habit; CI (.ci/run) and people call these.
PYTHON ?= python3
CARGO ?= cargo
export PYTHONUNBUFFERED := 1
export PIP_ROOT_USER_ACTION := ignore
# Pinned: ruff's format and rules change between releases.
RUFF_VERSION ?= 0.17.6
NUMBA_CUDA_VERSION ?= 0.30.4

.PHONY: help install install-lint test test-rust test-python test-loom test-torch-errors test-numba lint fmt bench profile-build gpu-build test-gpu gpu-bench peers clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

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

test-loom: ## every loom model of the library: the pool, the adaptors (the fixed-size resource's too), the sync layer (a separate build; Rust 1.95+)
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom $(CARGO) test -p streampool --release --lib loom

bench: ## the window and fixed workloads here (on the simulated device without a GPU: numbers of the simulator)
	$(CARGO) bench -p streampool --bench window -- --secs 0.3 --reps 1
	$(PYTHON) benchmarks/bench_pool.py --secs 0.3 --reps 1

test-torch-errors: ## PyTorch's out-of-memory error made from three PyTorch releases' own libraries (fetches their headers and libc10 into .torch-c10/, about 2 GB of downloads)
	STREAMPOOL_TEST_TORCH_DIRS="$$(PYTHON=$(PYTHON) bash scripts/fetch-torch-c10.sh .torch-c10)" \
	  $(PYTHON) -m pytest -q -p no:cacheprovider tests/test_torch_errors.py

# .numba/ is installed anew when it lacks NUMBA_CUDA_VERSION's dist-info (after a bump:
# pip --target would keep the version already there).
test-numba: ## the Numba plugin's tests against Numba's own CUDA target (numba-cuda, installed into .numba/; no GPU needed)
	[ -d .numba/numba_cuda-$(NUMBA_CUDA_VERSION).dist-info ] || { rm -rf .numba && \
	  $(PYTHON) -m pip install -q --target .numba "numba-cuda==$(NUMBA_CUDA_VERSION)"; }
	PYTHONPATH=.numba STREAMPOOL_TEST_NUMBA=1 $(PYTHON) -m pytest -q -p no:cacheprovider -rs tests/test_allocators.py tests/test_allocators_numba.py -k numba

install-lint: ## install what lint uses: ruff, mypy, rustfmt and clippy; the package too when it is missing
	$(PYTHON) -m pip install -q "ruff==$(RUFF_VERSION)" mypy
	if command -v rustup >/dev/null; then rustup component add rustfmt clippy >/dev/null; fi
	$(PYTHON) -c "import streampool._native" 2>/dev/null || $(MAKE) install

lint: install-lint ## rustfmt, clippy, ruff (check and format), stubtest, mypy, and a typed program under mypy --strict (run `make install` first to check a changed binding)
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --quiet -- -D warnings
	$(PYTHON) -m ruff check python tests benchmarks scripts
	$(PYTHON) -m ruff format --check python tests benchmarks scripts
	$(PYTHON) -m mypy.stubtest streampool._native --allowlist python/stubtest-allowlist.txt
	$(PYTHON) -m mypy
	$(PYTHON) -m mypy --strict tests/typed_usage.py

fmt: install-lint ## format Rust and Python
	$(CARGO) fmt --all
	$(PYTHON) -m ruff format python tests benchmarks scripts

profile-build: ## the window bench and a wheel with line tables (the `profiling` profile), for perf and callgrind
	$(CARGO) bench -p streampool --bench window --profile profiling --no-run
	$(PYTHON) -m maturin build --profile profiling -q -o dist/profiling

gpu-build: ## build what the GPU machine runs into .gpu/ (the wheel, the Rust test binaries and benches, Dask's wheels)
	bash scripts/gpu-build.sh

test-gpu: ## on a GPU machine, the wheel installed first: every Rust test binary, gpu_multi.py, the hang probe and pytest tests/ (PYTEST_ARGS="-m gpu": GPU-marked only; see DEVELOPERS.md)
	bash scripts/gpu-suite.sh

gpu-bench: ## on a GPU machine: the pool benchmarks next to RMM's, CuPy's and PyTorch's (benchmarks/README.md)
	bash benchmarks/gpu-bench.sh

peers: ## download the RMM wheels gpu-bench uses into .peers/ (for the GPU machine's Python 3.12)
	mkdir -p .peers
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_24_x86_64 -d .peers librmm-cu13==26.10.0 "rapids-logger==0.3.*" rmm-cu13==26.10.0

clean: ## remove build outputs
	$(CARGO) clean
	rm -rf .gpu dist
