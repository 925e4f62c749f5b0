"""Measurements behind ``bench/engine/tp_bench.py``: one runner (tp=1, or rank 0 of a Ray rank group
driven by a :class:`~kvfleet.worker.executor.tp_executor.TPExecutor`) timed on fixed step plans.

Every time is wall-clock seconds on rank 0 (the driver process). Collective time is what rank
0 spent inside ``RankComm.all_reduce`` (the forward's row-parallel sums, waiting for the slowest
rank included) and ``RankComm.send`` (the one step-plan broadcast), read from the always-on
:class:`~kvfleet.worker.executor.tp.comm.CommTimes`; the LM head's time is rank 0's
``compute_logits`` (final norm + head matmul), wrapped here.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from bench.common.seeded import seeded_llama_dir as seeded_llama_dir_for
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.executor.tp.comm import CommTimes
from kvfleet.worker.runner.model_runner import ModelRunner

BLOCK_SIZE = 16
# hidden 1024, 8 layers, 16 query / 8 KV heads (head_dim 64), FFN 2816, vocab 32000: 162 M
# parameters, 0.65 GB fp32 (twice that with the one-row copies).
SEEDED = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
              initializer_range=0.02, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def seeded_llama_dir() -> Path:
    """The seeded Llama above, built once into the kvfleet cache (SmolLM2's tokenizer)."""
    return seeded_llama_dir_for("llama-h1024-l8-q16-kv8-v32000", SEEDED)


@dataclass
class Setup:
    """One configuration under test: ``runner`` executes plans; ``local`` is rank 0's
    :class:`ModelRunner`; ``threads``: torch threads in this process while it runs."""

    name: str
    tp: int
    threads: int
    runner: Any
    local: ModelRunner
    group: Any = None
    head_s: float = 0.0
    prefilled: bool = False

    @property
    def comm(self):
        return self.group.comm if self.group is not None else None

    def comm_times(self) -> CommTimes:
        return self.comm.times.snapshot() if self.comm is not None else CommTimes()

    def peer_times(self) -> list[CommTimes]:
        """Ranks 1..T-1's counters (an actor call each; not on a timed path)."""
        if self.group is None:
            return []
        import ray

        return ray.get([a.comm_times.remote() for a in self.group.actors])

    def close(self) -> None:
        if self.group is not None:
            self.runner.close()


def _time_head(setup: Setup) -> None:
    """Wrap rank 0's ``compute_logits`` so that ``setup.head_s`` accumulates its seconds."""
    model = setup.local.model
    inner = model.compute_logits

    def timed(hidden: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = inner(hidden)
        setup.head_s += time.perf_counter() - start
        return out

    model.compute_logits = timed


def make_setup(model_dir: Path, tp: int, num_blocks: int, shm: bool = False,
               collective_timeout_s: float = 60.0) -> Setup:
    """tp=1: a plain runner with 2 torch threads; tp>1: a rank group (one thread per rank),
    its forward's all-reduces on gloo, or through shared memory with ``shm``."""
    if tp == 1:
        torch.set_num_threads(2)
        runner = ModelRunner(model_dir, num_blocks, BLOCK_SIZE)
        setup = Setup(f"tp=1 ({torch.get_num_threads()} threads)", 1, 2, runner, runner)
    else:
        from kvfleet.worker.executor.tp.group import RankGroup, TPSettings
        from kvfleet.worker.executor.tp.rank_worker import RankSpec
        from kvfleet.worker.executor.tp_executor import TPExecutor

        settings = TPSettings(collective_timeout_s=collective_timeout_s,
                              step_timeout_s=collective_timeout_s, shm_all_reduce=shm)
        group = RankGroup(RankSpec(str(model_dir), tp, num_blocks, BLOCK_SIZE), settings,
                          f"bench-tp{tp}")
        local = group.start()
        name = f"tp={tp} {'shm' if shm else 'gloo'} (1 thread/rank)"
        setup = Setup(name, tp, 1, TPExecutor(local, group), local, group)
    _time_head(setup)
    return setup


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 10_000, (n,), generator=gen).tolist()


def _table(seq: int, tokens: int) -> tuple[int, ...]:
    per = -(-tokens // BLOCK_SIZE)
    return tuple(range(seq * per, (seq + 1) * per))


def blocks_needed(max_batch: int, context: int, prefill_len: int) -> int:
    """KV blocks for ``max_batch`` decode sequences at ``context`` plus one prefill sequence."""
    return max_batch * -(-(context + 1) // BLOCK_SIZE) + -(-prefill_len // BLOCK_SIZE) + 1


@dataclass(frozen=True)
class StepSample:
    """One timed step on rank 0 (seconds)."""

    step_s: float
    reduce_s: float
    send_s: float
    head_s: float
    reduces: int

    @property
    def collective_s(self) -> float:
        return self.reduce_s + self.send_s


def timed_step(setup: Setup, plan: StepPlan) -> StepSample:
    before, head0 = setup.comm_times(), setup.head_s
    start = time.perf_counter()
    setup.runner.execute(plan)
    step = time.perf_counter() - start
    spent = setup.comm_times().minus(before)
    return StepSample(step, spent.all_reduce_s, spent.send_s, setup.head_s - head0,
                      spent.all_reduce_calls)


def summarize(samples: list[StepSample]) -> dict:
    """Medians over the samples (seconds), and shares of the summed step time."""
    total = sum(s.step_s for s in samples)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    return {
        "step_s": med([s.step_s for s in samples]), "min_step_s": min(s.step_s for s in samples),
        "reduce_s": med([s.reduce_s for s in samples]), "send_s": med([s.send_s for s in samples]),
        "head_s": med([s.head_s for s in samples]), "reduces_per_step": samples[0].reduces,
        "collective_share": sum(s.collective_s for s in samples) / total,
        "head_share": sum(s.head_s for s in samples) / total,
        "steps": len(samples),
    }


def prefill_contexts(setup: Setup, max_batch: int, context: int) -> None:
    """Write ``context`` tokens of KV for sequences 0..max_batch-1 (once per setup)."""
    if setup.prefilled:
        return
    torch.set_num_threads(setup.threads)
    for seq in range(max_batch):
        table = _table(seq, context + 1)
        setup.runner.execute(StepPlan((SeqChunk(f"s{seq}", tuple(_tokens(context, seq)), 0, table),)))
    setup.prefilled = True


def decode_round(setup: Setup, batch: int, context: int, repeats: int) -> tuple[dict, Optional[list]]:
    """``repeats`` timed decode steps of sequences 0..batch-1 at position ``context`` (after
    2 untimed); returns the summary and each peer rank's all-reduce seconds per step."""
    torch.set_num_threads(setup.threads)
    plan = StepPlan(tuple(SeqChunk(f"s{seq}", (7 + seq,), context, _table(seq, context + 1))
                          for seq in range(batch)))
    for _ in range(2):
        setup.runner.execute(plan)
    peers0 = setup.peer_times()
    samples = [timed_step(setup, plan) for _ in range(repeats)]
    peers = [(b.minus(a).all_reduce_s / repeats) for a, b in zip(peers0, setup.peer_times())]
    return summarize(samples), peers or None


def prefill_round(setup: Setup, length: int, max_batch: int, context: int, repeats: int) -> dict:
    """``repeats`` timed fresh prefills of one ``length``-token chunk (after 1 untimed);
    adds ``tokens_per_s`` (from the median step)."""
    torch.set_num_threads(setup.threads)
    first = max_batch * -(-(context + 1) // BLOCK_SIZE)
    table = tuple(range(first, first + -(-length // BLOCK_SIZE)))
    plan = StepPlan((SeqChunk("p", tuple(_tokens(length, 99)), 0, table),))
    setup.runner.execute(plan)
    out = summarize([timed_step(setup, plan) for _ in range(repeats)])
    out["tokens_per_s"] = length / out["step_s"]
    return out
