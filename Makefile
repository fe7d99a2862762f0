# One place for the commands that the README, pre-commit habits and CI all use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
WHEEL_DIR := dist

.PHONY: venv test-venv build install run test test-rust test-python test-vllm lint fmt bench bench-smoke valgrind clean

# What building and running need.
$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "maturin>=1.7,<2" "numpy>=1.24"
	touch $@

# What the tests and linters need on top; torch is the large one (a CUDA build from PyPI).
$(VENV)/.test-deps: $(VENV)/.deps pyproject.toml
	$(PIP) install -q "pytest>=8" "hypothesis>=6.100" "ruff>=0.6" "mypy>=1.10" \
		"prometheus_client>=0.17" "typing_extensions>=4.15" "matplotlib>=3.7" "torch>=2.1"
	$(PIP) install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" || \
		echo "Mooncake not installed: tests marked mooncake will skip"
	touch $@

venv: $(VENV)/.deps

test-venv: $(VENV)/.test-deps

# The product: one cp311-abi3 wheel.
build: venv
	rm -rf $(WHEEL_DIR)
	$(VENV)/bin/maturin build --release --out $(WHEEL_DIR)

# Installs the wheel (not the source tree) into the virtual environment.
install: build
	$(PIP) install -q --force-reinstall --no-deps $(WHEEL_DIR)/aostore-*-cp311-abi3-*.whl

# The main job: build, install, run the workload with its defaults.
run: install
	$(PY) -m aostore

test-rust:
	cargo test

# Runs from tests/ so `import aostore` finds the installed wheel, never python/.
test-python: install test-venv
	cd tests && ../$(PY) -m pytest -q -p no:cacheprovider .

test: test-rust test-python

# vLLM 0.33.0's own store tests, from its sdist, against the wheel through the plugin, then
# with the plugin off as the control (tests/vllm_compat/run.py; its own .venv-vllm).
test-vllm: build
	$(PYTHON) tests/vllm_compat/run.py

lint: install test-venv
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(VENV)/bin/mypy
	cd tests && ../$(PY) -m mypy.stubtest aostore --ignore-missing-stub

fmt: test-venv
	cargo fmt
	$(VENV)/bin/ruff format python tests benches
	$(VENV)/bin/ruff check --fix python tests benches

# The Rust test binaries under memcheck: any invalid access or definite leak fails.
valgrind:
	PROPTEST_CASES=200 cargo test --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))/\1/p' > target/test-binaries
	for bin in $$(cat target/test-binaries); do \
		PROPTEST_CASES=200 valgrind -q --error-exitcode=3 --leak-check=full \
			--errors-for-leak-kinds=definite --show-possibly-lost=no $$bin --test-threads=1 || exit 1; \
	done

# The SPEC section 10 table (bench-out/: results.json, w1_scaling.png, w3_latency.png; T9 in
# variable.json), the core alone, and the criterion benches.
bench: install test-venv
	$(PY) benches/bench.py --out bench-out
	$(PY) benches/variable_bench.py --out bench-out
	cargo bench --bench w2_core
	cargo bench --bench store

# Tiny sizes, so the benchmarks cannot rot (CI).
bench-smoke: install test-venv
	$(PY) benches/bench.py --quick --out target/bench-smoke
	$(PY) benches/variable_bench.py --quick --out target/bench-smoke
	$(PY) -m aostore churn --slots 4096 --batches 50 >/dev/null

clean:
	rm -rf target $(WHEEL_DIR) $(VENV) .venv-vllm
