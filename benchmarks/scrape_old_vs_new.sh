#!/usr/bin/env bash
# Scrape latency of two daemon builds, same run: OLD and NEW `kachedb` binaries
# alternate for ROUNDS rounds; each round starts a fresh daemon, fills it with
# 100 000 blocks over 64 tenants and times 21 scrapes (median printed).
# usage: benchmarks/scrape_old_vs_new.sh OLD_KACHEDB NEW_KACHEDB [ROUNDS]
# (build the tool first: cargo build --release -p kachedb-bench --example scrape_latency)
set -euo pipefail
old=$1 new=$2 rounds=${3:-5}
tool=${SCRAPE_TOOL:-target/release/examples/scrape_latency}
for r in $(seq 1 "$rounds"); do
  for which in old new; do
    bin=$old; [ "$which" = new ] && bin=$new
    d=$(mktemp -d /tmp/kdb-scrape.XXXX); port=$((20000 + RANDOM % 20000))
    "$bin" serve --instance 37 --socket "$d/s.sock" --size 640MiB --metrics-addr "127.0.0.1:$port" >"$d/log" 2>&1 &
    pid=$!
    for _ in $(seq 1 300); do grep -q "metrics at" "$d/log" && [ -S "$d/s.sock" ] && break; sleep 0.1; done
    echo "$which round $r load $(cut -d' ' -f1-3 /proc/loadavg): $("$tool" "$d/s.sock" "127.0.0.1:$port" 100000 64 21 2>&1 | tail -1)"
    kill "$pid"; wait "$pid" 2>/dev/null || true; rm -rf "$d"
  done
done
