"""The embedding sidecar: localhost gRPC (and an HTTP facade) in front of an embedding backend."""
