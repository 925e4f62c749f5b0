"""Benchmarks of the engine and model in one process: throughput against transformers, ITL,
tensor parallelism, LoRA, structured output, the host KV tier, calibration, the GPU check."""
