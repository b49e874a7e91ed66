#!/usr/bin/env bash
# Scrape latency of two daemon builds, same run: each round starts an OLD and
# a NEW `kachedb` daemon side by side, fills each with 100 000 blocks over 64
# tenants and scrapes them in turns, SCRAPES scrapes each (default 1001): one
# line per build with p50, p99, min, max and the scrapes over 1 ms. BUSY=1:
# every tenant puts and reads a block before each scrape (untimed), so the
# per-tenant figures change between scrapes.
# usage: [SCRAPES=N] [BUSY=1] benchmarks/scrape_old_vs_new.sh OLD_KACHEDB NEW_KACHEDB [ROUNDS]
# OLD is typically the commit before a change, built apart:
#   git worktree add --detach ../old COMMIT && (cd ../old && cargo build --release -p kachedb-cli --bin kachedb)
# (build the tool first: cargo build --release -p kachedb-bench --example scrape_latency)
set -euo pipefail
old=$1 new=$2 rounds=${3:-5}
tool=${SCRAPE_TOOL:-target/release/examples/scrape_latency}
scrapes=${SCRAPES:-1001}
busy=(); [ "${BUSY:-0}" = 1 ] && busy=(--busy)
# Starts build $1 as instance $2 in directory $3; prints "PID PORT".
start() {
  local port=$((20000 + RANDOM % 20000))
  "$1" serve --instance "$2" --socket "$3/s.sock" --size 640MiB --metrics-addr "127.0.0.1:$port" >"$3/log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do grep -q "metrics at" "$3/log" 2>/dev/null && [ -S "$3/s.sock" ] && break; sleep 0.1; done
  echo "$pid $port"
}
for r in $(seq 1 "$rounds"); do
  dold=$(mktemp -d /tmp/kdb-scrape.XXXX) dnew=$(mktemp -d /tmp/kdb-scrape.XXXX)
  read -r pold port_old < <(start "$old" 37 "$dold")
  read -r pnew port_new < <(start "$new" 38 "$dnew")
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  out=$("$tool" "${busy[@]}" 100000 64 "$scrapes" "$dold/s.sock" "127.0.0.1:$port_old" "$dnew/s.sock" "127.0.0.1:$port_new" 2>&1 | tail -2)
  echo "old round $r load $load: $(echo "$out" | sed -n 1p)"
  echo "new round $r load $load: $(echo "$out" | sed -n 2p)"
  kill "$pold" "$pnew"; wait "$pold" "$pnew" 2>/dev/null || true; rm -rf "$dold" "$dnew"
done
