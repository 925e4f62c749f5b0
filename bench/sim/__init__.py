"""Benchmarks on a virtual clock: the real scheduler, block pool and routing policies, with
forward time from the step-cost model (hundreds of replicas in seconds)."""
