"""The baselines of the engine benchmark: transformers ``generate`` as users run it.

* A: one request at a time (what users reach for first);
* B: left-padded static batches of ``batch`` requests in list order, each batch generating
  its longest requested output, every row then cut to its own length (the best a careful
  user gets).

Greedy, EOS disabled, fp32. A logits processor (called once per generated token, after the
forward) timestamps tokens for TTFT/ITL; for A it also keeps each step's top-2 logit gap, to
tell near-ties from real disagreements.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class RunResult:
    """One system's run over a request list; times in seconds from the run's start."""

    system: str
    wall_s: float
    tokens: list[list[int]]
    ttft_s: list[float]
    itl_s: list[float]
    gaps: list[list[float]] = field(default_factory=list)  # A only: top-2 logit gap per step
    extra: dict = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


class _Clock:
    """A logits processor that records when each step's logits exist (and top-2 gaps)."""

    def __init__(self, gaps: bool) -> None:
        self.times: list[float] = []
        self.gaps: list[torch.Tensor] = []
        self._want_gaps = gaps

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        if self._want_gaps:
            top2 = scores.float().topk(2, dim=-1).values
            self.gaps.append(top2[:, 0] - top2[:, 1])
        return scores


def load_hf(model_dir):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS disabled: every request runs to its length
    return model


def _generate(model, input_ids, attention_mask, max_new: int, clock: _Clock) -> torch.Tensor:
    import transformers

    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new,
                             do_sample=False, pad_token_id=0,
                             logits_processor=transformers.LogitsProcessorList([clock]))
    return out[:, input_ids.shape[1]:]


def run_single(model, requests: list[tuple[list[int], int]]) -> RunResult:
    """Baseline A."""
    t0 = time.perf_counter()
    tokens, ttft, itl, gaps = [], [], [], []
    for prompt, out_len in requests:
        clock = _Clock(gaps=True)
        ids = torch.tensor([prompt])
        new = _generate(model, ids, torch.ones_like(ids), out_len, clock)
        tokens.append(new[0, :out_len].tolist())
        assert len(tokens[-1]) == out_len, "EOS must be disabled"
        ttft.append(clock.times[0] - t0)
        itl += [b - a for a, b in zip(clock.times, clock.times[1:])]
        gaps.append([g[0].item() for g in clock.gaps])
    return RunResult("A: HF generate, one at a time", time.perf_counter() - t0, tokens, ttft, itl, gaps)


def run_static_batches(model, requests: list[tuple[list[int], int]], batch: int) -> RunResult:
    """Baseline B."""
    t0 = time.perf_counter()
    tokens, ttft, itl = [], [], []
    for start in range(0, len(requests), batch):
        group = requests[start:start + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(group):  # left padding
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        clock = _Clock(gaps=False)
        new = _generate(model, ids, mask, max(n for _, n in group), clock)
        for row, (_, out_len) in enumerate(group):
            tokens.append(new[row, :out_len].tolist())
            ttft.append(clock.times[0] - t0)
            itl += [b - a for a, b in zip(clock.times[:out_len], clock.times[1:out_len])]
    return RunResult(f"B: HF generate, static batches of {batch}", time.perf_counter() - t0,
                     tokens, ttft, itl)
