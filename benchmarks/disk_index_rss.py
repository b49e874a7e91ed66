#!/usr/bin/env python3
"""The disk tier's index: resident memory per block on disk after a restart.

Writes N blocks of 1 KiB through a daemon with a 64 MiB megaslab and the disk
tier (write-behind, paced so none is dropped), kills it with SIGKILL, starts a
daemon on the same DIR, waits for its index, and reads its RssAnon against a
daemon on an empty DIR (docs/deploy.md, "Memory beside the region")::

    python3 benchmarks/disk_index_rss.py [N=100000] [--bin target/release/kachedb]

Run it in a scratch directory on a real file system (it makes DIRs there).
"""
import argparse, os, signal, subprocess, sys, time
from pathlib import Path

import numpy as np

import kachedb

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("n", nargs="?", type=int, default=100000)
ap.add_argument("--bin", default=str(Path(__file__).resolve().parents[1] / "target" / "release" / "kachedb"))
a = ap.parse_args()
BIN, N, here = a.bin, a.n, os.getcwd()
def start(tag, d):
    sock=f'{here}/{tag}.sock'
    p=subprocess.Popen([BIN,'serve','--socket',sock,'--size','64MiB','--disk',d,'--disk-size','8GiB','--disk-worker-class','normal'],stdout=open(f'{tag}.log','w'),stderr=subprocess.STDOUT)
    for _ in range(200):
        try: return p, kachedb.connect(sock)
        except Exception: time.sleep(0.05)
    raise SystemExit('no daemon')
def rss(pid):
    for l in open(f'/proc/{pid}/status'):
        if l.startswith('RssAnon'): return int(l.split()[1])*1024
def wait(kc, cond):
    while True:
        s=kc.stats()
        if cond(s): return s
        time.sleep(0.1)
p,kc=start('a', f'{here}/d')
v=np.zeros(1024, dtype=np.uint8)
t=time.time()
for b in range(0, N, 1000):
    keys=[(b+i).to_bytes(16,'big') for i in range(1000)]
    kc.put_many(keys, [v]*1000)
    wait(kc, lambda s: s['disk_queue_blocks']==0)
s=wait(kc, lambda s: s['disk_blocks']+s['disk_dropped_writes']>=N)
print('written', s['disk_blocks'], 'dropped', s['disk_dropped_writes'], f'{time.time()-t:.0f}s', flush=True)
kc.close(); p.send_signal(signal.SIGKILL); p.wait()
p,kc=start('b', f'{here}/d'); s=wait(kc, lambda s: s['disk_indexed']); time.sleep(1); full=rss(p.pid); nb=s['disk_blocks']
kc.close(); p.terminate(); p.wait()
os.makedirs('e', exist_ok=True)
p,kc=start('c', f'{here}/e'); s=wait(kc, lambda s: s['disk_indexed']); time.sleep(1); empty=rss(p.pid)
kc.close(); p.terminate(); p.wait()
print(f'blocks {nb}: RssAnon rebuilt {full/2**20:.1f} MiB, empty {empty/2**20:.1f} MiB, {(full-empty)/nb:.0f} bytes per block')
