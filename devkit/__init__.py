"""Repo-only scaffolding for the demo, tests and benchmarks (never shipped in the wheel): the tiny
random-weight model builder, real-server launchers (vLLM, Prometheus, the example gateway and app),
an in-process OTLP receiver and the trace-tree printer. Run from the repository root."""
