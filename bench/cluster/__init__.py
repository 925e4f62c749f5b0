"""Benchmarks through real routers and replicas: processes, Ray, Redis, gRPC and HTTP, with
cost-model or real-model replicas."""
