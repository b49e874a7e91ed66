"""Fixtures of the vLLM integration tests: they run only where vLLM is installed
(``make test-vllm`` runs them in .venv-vllm); elsewhere this folder is skipped."""

import importlib.util
import sys
from pathlib import Path

import pytest



def _have_vllm() -> bool:
    # (this folder is itself named "vllm": a namespace package of that name is not vLLM)
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    here = str(Path(__file__).resolve().parent)
    return bool(spec and spec.origin and spec.origin.endswith("__init__.py") and not spec.origin.startswith(here))


if not _have_vllm():  # e.g. the project's main environment
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("kachedb-vllm")


@pytest.fixture(scope="session")
def model_dir(workdir):
    from models import make_model

    return make_model(str(workdir / "llama-tiny"))
