#!/usr/bin/env python3
"""Side-by-side handoff benchmark: KacheDB vs TCP loopback, Unix socket,
multiprocessing.shared_memory, torch.multiprocessing, Redis and Ray's object store.

A thin wrapper: the implementation ships with the package as ``kachedb._compare``
(also ``python -m kachedb bench compare``). See docs/benchmarks.md.

    python benchmarks/compare.py                      # full run, table on stdout
    python benchmarks/compare.py --quick --json       # CI: small sizes, JSON lines
    python benchmarks/compare.py --out docs --doc docs/benchmarks.md   # regenerate the docs
"""
import sys

from kachedb._compare import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="benchmarks/compare.py"))
