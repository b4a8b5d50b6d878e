"""Benchmarks (``recover bench ...``): measured numbers for docs/BENCHMARKS.md, not timed tests.

``recover.bench.collectives``: layer 1, failure latency and failure-free overhead of the
fault-tolerant all-reduce. Further benchmarks register under ``recover bench`` in ``bench/cli.py``.
"""
