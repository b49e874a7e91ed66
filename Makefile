# KacheDB developer commands. `make demo` and `make test` are the two that the
# README promises work on a fresh machine (Rust toolchain + CPython 3.9+).
SHELL := /bin/bash
PYTHON ?= python3
CARGO ?= cargo
PIP := $(PYTHON) -m pip
# torch comes from PyPI with its CUDA wheels; it imports and runs on CPU.
PY_DEPS := "maturin>=1.5,<2" "numpy>=1.22" "torch>=2.1" "pytest>=7" "hypothesis>=6" "pytest-timeout>=2" \
	"transformers>=5,<6" "ray>=2.9" "redis>=5" "hiredis" "matplotlib>=3.5"

.PHONY: setup system-deps build python demo test test-rust test-python test-loom test-miri bench lint

## setup: install the Python tools and build everything (idempotent)
setup: build python

## system-deps: redis-server for the side-by-side benchmark (Debian package; needs root)
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then echo "== installing redis-server"; (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null; \
	  else echo "== redis-server missing: sudo apt-get install -y redis-server (needed by the compare benchmark test)"; fi; }

build:
	$(CARGO) build --release --locked -p kachedb-cli

python: system-deps
	@$(PYTHON) -c "import maturin, numpy, torch, pytest, hypothesis, pytest_timeout, transformers, ray, redis, matplotlib" 2>/dev/null \
	  || { echo "== installing Python dependencies (torch is ~5 GB; first time only)"; $(PIP) install -q $(PY_DEPS); }
	$(PIP) install -q --no-build-isolation ./bindings/python

## demo: the daemon plus demo clients — a tensor put by one process, read zero-copy by
## another; then a transformer's prompt KV cache reused across processes (CI size)
demo: setup
	$(PYTHON) examples/quickstart.py
	$(PYTHON) examples/prefill_savings.py --small

## test: the whole suite, as CI runs it
test: setup test-rust test-loom test-python

test-rust:
	$(CARGO) test --release --locked

test-loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom $(CARGO) test --release --locked -p kachedb-shm --test loom_ring

test-python:
	$(PYTHON) -m pytest -q bindings/python/tests tests

## test-miri: the ring under Miri (needs `rustup +nightly component add miri`; not in CI)
test-miri:
	$(CARGO) +nightly miri test -p kachedb-shm --test heap_ring

## bench: every benchmark, printing figures against their same-run baselines
bench: setup
	./target/release/kachedb bench ring
	./target/release/kachedb bench ops
	$(PYTHON) -m kachedb bench
	$(PYTHON) benchmarks/compare.py

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --all-targets --locked -- -D warnings
