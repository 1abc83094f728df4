"""Inference backends behind one interface: embedded ONNX Runtime, or Triton over gRPC."""
