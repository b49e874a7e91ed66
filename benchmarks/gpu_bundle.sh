#!/bin/bash
# Packs what benchmarks/gpu_check.py needs on a GPU machine that has torch but no registry
# and no vLLM: the kachedb wheel built here (abi3, manylinux_2_28, the daemon inside),
# msgspec and dill for the target's Python, and vLLM's .py files (for its kv_offload types).
#   benchmarks/gpu_bundle.sh [DIR=.gpu] [PYVER=3.12]   (needs `make wheel vllm-env` first)
# then, on the GPU machine, from the repository root: benchmarks/gpu_run.sh [DIR]
set -euo pipefail
DIR=${1:-.gpu}; PYVER=${2:-3.12}
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"; mkdir -p "$DIR"; DIR=$(cd "$DIR" && pwd)
WHEEL=$(ls -t target/wheel/kachedb_shm-*.whl 2>/dev/null | head -1) || true
[ -n "$WHEEL" ] || { echo "gpu_bundle: no wheel in target/wheel: run 'make wheel' first" >&2; exit 2; }
SITE=$(ls -d .venv-vllm/lib/python3*/site-packages 2>/dev/null | head -1) || true
[ -d "$SITE/vllm" ] || { echo "gpu_bundle: no vLLM in .venv-vllm: run 'make vllm-env' first" >&2; exit 2; }
ver() { "$SITE/../../../bin/python" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf "$DIR/whl"; mkdir -p "$DIR/whl"
cp "$WHEEL" "$DIR/whl/"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR/whl" "msgspec==$(ver msgspec)" "dill==$(ver dill)"
(cd "$SITE" && find vllm -name '*.py' -print0 | tar --null -T - -czf "$DIR/vllm_py.tgz")
du -sh "$DIR"; echo "gpu_bundle: $DIR ready; on the GPU machine: benchmarks/gpu_run.sh $DIR"
