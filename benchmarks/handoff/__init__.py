"""The pieces of the side-by-side handoff benchmark, ``benchmarks/compare.py``."""
