"""Triton integration: model repository, launcher, TensorRT engine build, CLI."""
