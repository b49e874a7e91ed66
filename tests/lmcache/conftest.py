"""The LMCache integration tests run only where LMCache is installed (``make
test-lmcache`` runs them in .venv-lmcache); elsewhere this folder is skipped
(tests/conftest.py). Their fixtures are tests/conftest.py's."""
