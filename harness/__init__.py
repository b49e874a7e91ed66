"""What the tests and the benchmarks share to drive a real daemon (not product
code: nothing here ships in the wheel). Put the repository root on ``sys.path``
and ``from harness.daemon import Daemon``."""
