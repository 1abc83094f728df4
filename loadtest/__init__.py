"""`embedcar loadtest`: open-loop latency SLA tests of the sidecar, Triton and a naive baseline.

queries (shopper queries from the catalog) -> schedule (arrival times, pacer) -> runner (drives a
target, records every request from its scheduled time) -> report / sweep (numbers, verdict, PNG).
targets, baseline and stack are what gets driven and how it is started locally; faults/ is the
fault suite (`embedcar faults`), bench/ the benchmarks (`embedcar bench <area>`).
"""
