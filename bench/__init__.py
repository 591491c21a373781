"""Benchmark scripts (run as modules, e.g. ``python -m bench.bench_core``)."""
