"""pytest fixtures for the catalog tests (loaded by tests/conftest.py)."""
