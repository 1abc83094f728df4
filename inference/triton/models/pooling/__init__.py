"""Triton Python-backend pooling: the shared inference.pooling code."""
