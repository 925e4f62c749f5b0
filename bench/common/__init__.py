"""What the benchmarks share: the workload, load generators, statistics, plots, where results
go, seeded checkpoints, importing from a bare checkout. Nothing here is a benchmark."""
