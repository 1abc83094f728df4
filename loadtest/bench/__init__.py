"""`embedcar bench <area>`: the benchmarks behind docs/performance.md, apart from the runtime packages.

One module per area: model (raw ONNX Runtime), triton (the Triton hop), sidecar (Embed latency,
with floor: the do-nothing gRPC server), catalog (batch job and index), demo (the scripted typist);
cli registers the commands. Each figure's command and report field: docs/bench/<area>.md.
"""
