"""pytest fixtures for the sidecar tests (loaded by tests/conftest.py)."""
