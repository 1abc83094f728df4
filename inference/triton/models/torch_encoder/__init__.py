"""Triton Python-backend encoder on PyTorch (GPU or CPU), pooling in its stub."""
