"""Triton Python-backend encoder: ONNX Runtime on CPU."""
