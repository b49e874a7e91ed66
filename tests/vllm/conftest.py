"""Fixtures of the vLLM integration tests: they run only where vLLM is installed
(``make test-vllm`` runs them in .venv-vllm); elsewhere this folder is skipped."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # tests/: engine_support

from engine_support import engine_installed  # noqa: E402

if not engine_installed("vllm"):  # e.g. the project's main environment
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("kachedb-vllm")


@pytest.fixture(scope="session")
def model_dir(workdir):
    from models import make_model

    return make_model(str(workdir / "llama-tiny"))
