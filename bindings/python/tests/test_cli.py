"""`python -m kachedb` / the `kachedb` console script."""

import subprocess
import sys

import pytest

import kachedb.__main__ as cli
from kachedb import _kachedb_rust as rust


def test_forwards_argv_to_the_native_cli(monkeypatch):
    seen = []

    def fake_cli_main(argv):
        seen.append(list(argv))
        return 3

    monkeypatch.setattr(rust, "cli_main", fake_cli_main, raising=False)
    assert cli.main(["stats", "--json"]) == 3
    monkeypatch.setattr(sys, "argv", ["kachedb", "bench", "ring"])
    assert cli.main() == 3
    assert seen == [["kachedb", "stats", "--json"], ["kachedb", "bench", "ring"]]


def test_without_native_cli_says_so(monkeypatch, capsys):
    monkeypatch.delattr(rust, "cli_main", raising=False)
    assert cli.main(["stats"]) == 2
    assert "cli_main" in capsys.readouterr().err


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "kachedb", "--help"], capture_output=True, text=True, timeout=120)
    if hasattr(rust, "cli_main"):
        assert out.returncode == 0, out.stderr
        assert "serve" in out.stdout
    else:
        assert out.returncode == 2
        assert "no command-line interface yet" in out.stderr
