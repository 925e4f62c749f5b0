"""Tensor parallelism: a replica of ``tensor_parallel_size`` ranks, each a Ray actor (rank 0 is
the replica itself) holding its shard of the weights and of the KV heads.

``layout`` says which heads and columns a rank holds, ``shard_weights`` reads exactly those
slices from the checkpoint, ``comm`` is the process group (all-reduce, step-plan broadcast),
``rank_worker`` is ranks 1..T-1, ``group`` starts and watches them from rank 0, and
``tp_runner`` is what rank 0's engine calls instead of a plain model runner.
"""
