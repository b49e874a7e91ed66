#!/bin/bash
# `kachedb-bench ops` against a daemon with the KV event publisher on (and a subscriber) and off,
# alternating rounds (R, default 3); prints the JSON lines of each, prefixed "on R" / "off R"
#   benchmarks/events_on_off.sh [R]   (after `cargo build --release -p kachedb-cli -p kachedb-bench`)
ROOT=$(cd "$(dirname "$0")/.." && pwd); BIN=${BIN:-$ROOT/target/release/kachedb}; BENCH=${BENCH:-$ROOT/target/release/kachedb-bench}
R=${1:-3}; D=$(mktemp -d /tmp/kdb-ev-XXXX); cd $D
for r in $(seq 1 $R); do
  for mode in on off; do
    extra=(); [ $mode = on ] && extra=(--events-endpoint tcp://127.0.0.1:5597)
    $BIN serve --socket $D/$mode.sock --size 2GiB "${extra[@]}" > $D/$mode.log 2>&1 & dpid=$!
    for i in $(seq 50); do [ -S $D/$mode.sock ] && break; sleep 0.1; done
    spid=; if [ $mode = on ]; then $BIN events --endpoint tcp://127.0.0.1:5597 > $D/sub.log 2>&1 & spid=$!; sleep 0.3; fi
    $BENCH ops --socket $D/$mode.sock --json --scrape-hz 0 --stats-hz 0 --tenants false 2>/dev/null | sed "s/^/$mode $r /"
    [ -n "$spid" ] && kill $spid; kill $dpid; wait $dpid 2>/dev/null
    [ $mode = on ] && echo "on $r subscriber batches: $(grep -c . $D/sub.log)"
  done
done
rm -rf $D
