"""pytest fixtures for the triton tests (loaded by tests/conftest.py)."""
