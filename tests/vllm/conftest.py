"""Fixtures of the vLLM integration tests: they run only where vLLM is installed
(``make test-vllm`` runs them in .venv-vllm); elsewhere this folder is skipped."""

import pytest


@pytest.fixture(scope="session")
def model_dir(workdir):
    from models import make_model

    return make_model(str(workdir / "llama-tiny"))
