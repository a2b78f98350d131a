"""Benchmarks: workloads, the machine's matmul peak, baselines (static batching) and result reporting."""
