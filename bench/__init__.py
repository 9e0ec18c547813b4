"""Benchmarks (not timed tests): ``python -m bench.verify_throughput``, ``python -m bench.gpu_check``."""
