"""A minimal stand-in for the scheduler, for exactness tests of the model runner.

``Seq`` keeps a request's tokens and ``num_computed_tokens``; ``step`` runs one plan over
several sequences (any mix of prefill chunk widths and decodes) and records each chunk's
last-token logits by absolute position; a sequence whose known tokens are all computed
appends its greedy token, so the next 1-wide chunk is a decode. ``reference_error`` compares
the recorded logits against transformers' full-prefix forward.

Tolerance: ``max |ours - ref| <= 1e-4 * max(1, max |ref|)`` over every recorded position
(fp32; relative to the logit scale). ``scaled_error`` returns that max diff divided by the
allowed bound: <= 1 passes.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.runner.model_runner import ModelRunner

RTOL = 1e-4


class BlockPool:
    """Hands out block ids in a seeded shuffled order, so block tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        assert len(self.free) >= n, "test pool exhausted"
        out, self.free = self.free[:n], self.free[n:]
        return out


@dataclass
class Seq:
    request_id: str
    tokens: list[int]
    block_table: list[int]
    num_computed: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position → (vocab,) fp32
    greedy: bool = True
    widths: list[int] = field(default_factory=list)  # chunk widths run so far, in order

    def __post_init__(self) -> None:
        self.tokens = list(self.tokens)  # greedy decoding appends: never alias the caller's list

    def chunk(self, width: int) -> SeqChunk:
        todo = self.tokens[self.num_computed : self.num_computed + width]
        assert len(todo) == width, f"{self.request_id}: only {len(todo)} tokens left"
        return SeqChunk(self.request_id, tuple(todo), self.num_computed, tuple(self.block_table))

    def record(self, width: int, logits: torch.Tensor) -> None:
        self.widths.append(width)
        self.num_computed += width
        self.logits[self.num_computed - 1] = logits
        if self.greedy and self.num_computed == len(self.tokens):
            self.tokens.append(int(logits.argmax()))

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.num_computed


def step(runner: ModelRunner, work: list[tuple[Seq, int]], copies: tuple[tuple[int, int], ...] = ()) -> None:
    """One engine step: each ``(seq, width)`` contributes its next ``width`` tokens."""
    plan = StepPlan(tuple(seq.chunk(width) for seq, width in work), copies)
    logits = runner.execute(plan)
    assert logits.shape == (len(work), runner.config.vocab_size) and logits.dtype == torch.float32
    for (seq, width), row in zip(work, logits, strict=True):
        seq.record(width, row)


def replay(runner: ModelRunner, seq: Seq, block_table: list[int]) -> Seq:
    """Run ``seq``'s tokens again, alone and with the same chunk widths, into other blocks."""
    alone = replace(seq, tokens=list(seq.tokens), block_table=block_table, num_computed=0,
                    logits={}, greedy=False, widths=[])
    for w in seq.widths:
        step(runner, [(alone, w)])
    return alone


def prefill(runner: ModelRunner, seq: Seq, widths: list[int]) -> None:
    for w in widths:
        step(runner, [(seq, w)])


def decode(runner: ModelRunner, seq: Seq, steps: int) -> None:
    for _ in range(steps):
        step(runner, [(seq, 1)])


def fork_siblings(runner: ModelRunner, pool: BlockPool, share_partial: bool) -> tuple[Seq, Seq]:
    """``a`` prefilled with 10 tokens (blocks 0-1 full, block 2 half); ``b`` forks from it with
    the second-best next token, sharing a's full blocks (and block 2 when ``share_partial``)."""
    assert runner.block_size == 4
    a = Seq("a", random_prompt(10, seed=5), pool.take(5))
    prefill(runner, a, [10])
    runner_up = int(a.logits[9].topk(2).indices[1])
    shared = 3 if share_partial else 2
    b = Seq("b", a.tokens[:10] + [runner_up], a.block_table[:shared] + pool.take(5 - shared),
            num_computed=10, logits={9: a.logits[9]})
    return a, b


@functools.cache
def hf_model(model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """transformers' logits ``(len(tokens), vocab)``: row ``p`` is the full-prefix forward of 0..p."""
    with torch.no_grad():
        return hf_model(Path(model_dir))(torch.tensor([tokens])).logits[0].float()


def scaled_error(ours: dict[int, torch.Tensor], ref: torch.Tensor | dict[int, torch.Tensor]) -> float:
    """Max abs diff over ``ours``' positions ÷ ``RTOL * max(1, max |ref|)``; ``ref[p]`` is position p."""
    assert ours, "no logits recorded"
    diff = max((ref[p] - row).abs().max().item() for p, row in ours.items())
    scale = max(1.0, max(ref[p].abs().max().item() for p in ours))
    return diff / (RTOL * scale)


def reference_error(model_dir: Path, seq: Seq) -> float:
    """:func:`scaled_error` of ``seq``'s logits against transformers on its own tokens."""
    last = max(seq.logits)
    return scaled_error(seq.logits, reference_logits(model_dir, seq.tokens[: last + 1]))


@functools.cache
def runner_for(model_dir: Path, block_size: int = 4, num_blocks: int = 160) -> ModelRunner:
    """One runner per model per test session. Tests share its cache: every position a test
    reads was written by that same test, so what other tests left in other slots is irrelevant."""
    return ModelRunner(model_dir, num_blocks=num_blocks, block_size=block_size)


def random_prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
