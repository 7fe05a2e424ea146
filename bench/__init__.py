"""Benchmarks that print figures (docs/architecture.md). Each one is a script: `python bench/NAME.py --help`.

They are not part of `make test`; `tests/integration/test_bench_smoke.py` runs them with tiny
sizes so that they cannot rot.
"""
