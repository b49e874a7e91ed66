#!/bin/bash
# Runs benchmarks/gpu_check.py on a GPU machine from a bundle made by benchmarks/gpu_bundle.sh:
#   benchmarks/gpu_run.sh [DIR=.gpu] [OUTDIR=${OUT:-/tmp}]
set -u
DIR=${1:-.gpu}; OUTDIR=${2:-${OUT:-/tmp}}
cd "$(dirname "$0")/.."
nvidia-smi -L; python3 --version; python3 -c "import torch; print('torch', torch.__version__)"
SITE=$(mktemp -d); VT=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$DIR"/whl/*.whl || exit 3
tar -xzf "$DIR/vllm_py.tgz" -C "$VT" || exit 4
export PYTHONPATH=$SITE:$VT PYTHONUNBUFFERED=1
BIN=$SITE/kachedb/bin/kachedb; chmod +x "$BIN"; "$BIN" --version || exit 5
timeout 400 python3 benchmarks/gpu_check.py --json --size 8GiB --bin "$BIN" > "$OUTDIR/gpu_check.json" 2> "$OUTDIR/gpu_check.err"
rc=$?; echo "gpu_check rc=$rc"; cat "$OUTDIR/gpu_check.json"; tail -30 "$OUTDIR/gpu_check.err"; exit $rc
