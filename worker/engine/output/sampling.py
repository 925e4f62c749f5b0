"""Turn one engine step's logits into one token per sample (docs/design.md §5, sampling).

Order of processing, per row (one row = one :class:`SampleState`, i.e. one of a request's ``n``):

1. repetition penalty (HF/CTRL rule) over every token seen in prompt + output;
2. frequency and presence penalties (OpenAI rule) over output tokens;
3. ``temperature == 0``: greedy argmax (first index on ties), no randomness consumed;
   otherwise temperature, top-k, top-p, then one inverse-CDF draw with the state's generator.

Every operation is row-wise with per-row parameters gathered into tensors, so a batch runs
vectorised whatever its mix of parameters, and a row's result depends only on its own logits,
parameters and generator: the same ``(seed, index, logits)`` gives the same token in any batch.
Which path a row takes (top-k, top-p, full sort) depends on that row alone.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from kvfleet.sampling_params import SamplingParams

_SEED_TAG = b"kvfleet.sample.v1\0"


def make_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for sample ``index`` of a request seeded with ``seed``.

    Derivation (stable across versions; change the tag if it ever changes)::

        digest = sha256(b"kvfleet.sample.v1\\0"
                        + (seed mod 2**64).to_bytes(8, "little")
                        + index.to_bytes(4, "little")).digest()
        generator.manual_seed(int.from_bytes(digest[:8], "little"))

    Siblings (same seed, different index) get unrelated streams; a request's sample ``i`` is
    reproducible from its seed alone.
    """
    if not 0 <= index < 2**32:
        raise ValueError(f"sample index must be in [0, 2**32), got {index}")
    data = _SEED_TAG + (seed % 2**64).to_bytes(8, "little") + index.to_bytes(4, "little")
    digest = hashlib.sha256(data).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little"))
    return generator


@dataclass
class SampleState:
    """One sample (one of ``n``) of one request; the engine appends to ``output_token_ids``."""

    params: SamplingParams
    index: int
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    generator: torch.Generator


@dataclass(frozen=True)
class SampleResult:
    """The chosen token of one row.

    ``logprob`` and ``top_logprobs`` are *raw* model log-probabilities: ``log_softmax`` of the
    logits as given to the sampler, before penalties, temperature, top-k and top-p (vLLM's
    default). Both are set only when ``params.logprobs is not None``: ``logprob`` is the chosen
    token's, ``top_logprobs`` the ``params.logprobs`` most likely ``(token_id, logprob)`` pairs,
    most likely first (``()`` when ``logprobs == 0``). Otherwise ``None`` and ``()``.
    """

    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]


def _needs_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def apply_penalties(logits: torch.Tensor, states: Sequence[SampleState]) -> torch.Tensor:
    """Penalised copy of ``logits`` (B, V) float32; rows without penalties are left untouched.

    Repetition (``r``): for each token in prompt + output, ``l / r`` if ``l > 0`` else ``l * r``.
    Then ``l -= frequency * count + presence``, for each token with ``count`` > 0 occurrences
    in the output. Sparse: the cost is in the number of distinct tokens, not in B x V.
    """
    rows = [i for i, s in enumerate(states) if _needs_penalties(s.params)]
    if not rows:
        return logits
    vocab = logits.shape[1]
    rep_idx: list[int] = []  # flat (row * V + token) indices, each distinct
    rep_val: list[float] = []
    sub_idx: list[int] = []
    sub_val: list[float] = []
    for i in rows:
        s, p = states[i], states[i].params
        if p.repetition_penalty != 1.0:
            seen = set(s.prompt_token_ids).union(s.output_token_ids)
            assert max(seen, default=0) < vocab, "token id beyond the logits' vocab"
            rep_idx.extend(i * vocab + t for t in seen)
            rep_val.extend([p.repetition_penalty] * len(seen))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            counts = Counter(s.output_token_ids)
            assert max(counts, default=0) < vocab, "token id beyond the logits' vocab"
            sub_idx.extend(i * vocab + t for t in counts)
            sub_val.extend(c * p.frequency_penalty + p.presence_penalty for c in counts.values())
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)

    def tensor(vals: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(vals, dtype=dtype, device=logits.device)

    if rep_idx:
        idx, r = tensor(rep_idx, torch.long), tensor(rep_val, out.dtype)
        vals = flat[idx]
        flat[idx] = torch.where(vals > 0, vals / r, vals * r)
    if sub_idx:
        idx = tensor(sub_idx, torch.long)
        flat[idx] = flat[idx] - tensor(sub_val, out.dtype)
    return out


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p for random rows (every ``temperature > 0``).

    Args:
        logits: (R, V) float32, already penalised.
    Returns:
        (R, V) float32 in vocab order: zero outside the kept set, each row summing to 1.

    top-k keeps every token whose logit is >= the k-th largest (ties with it kept, as in HF's
    ``TopKLogitsWarper``); 0 = off. top-p then works on the top-k-renormalised distribution:
    walking tokens from most to least likely, it stops at the first whose cumulative mass
    reaches ``top_p`` and keeps every token at least that likely (so always >= 1 token, and
    ties are kept or dropped together); ``top_p == 1`` keeps everything. Nothing here depends
    on the order of tied tokens, so no (stable) full sort is needed.
    """
    device, vocab = logits.device, logits.shape[1]
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    temp = temp.clamp(min=torch.finfo(torch.float32).tiny)  # 1e-50 would round to 0 in float32
    # Shift by the row max first: dividing by a tiny temperature then cannot overflow.
    x = (logits - logits.max(dim=1, keepdim=True).values) / temp.unsqueeze(1)
    ks = [p.top_k if p.top_k < vocab else 0 for p in params]
    if any(ks):
        k = torch.tensor(ks, dtype=torch.long, device=device).unsqueeze(1)  # (R, 1)
        kth = x.topk(max(ks), dim=1).values.gather(1, (k - 1).clamp(min=0))  # (R, 1)
        x = x.masked_fill((x < kth) & (k > 0), float("-inf"))
    probs = torch.softmax(x, dim=1)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        top_p = torch.tensor([params[i].top_p for i in nucleus], dtype=torch.float64,
                             device=device)  # compared with float64 cumulative sums
        probs[nucleus] = _top_p(probs[nucleus], top_p)
    return probs


# top-p looks for its cut among the 256 most likely tokens, then 4096, then all (full sort).
# Constants, so the path a row takes depends on that row alone.
_TOP_P_CANDIDATES = (256, 4096)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: (P, V) float32 probs, (P,) float64 top_p -> (P, V) renormalised."""
    vocab = probs.shape[1]

    def cut(rows: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(probability at the cut, whether the cut lies in the top ``n``) per row."""
        sub = probs[rows]
        desc = sub.topk(n, dim=1).values if n < vocab else sub.sort(dim=1, descending=True)[0]
        mass = desc.double().cumsum(dim=1)
        before = (mass < top_p[rows].unsqueeze(1)).sum(dim=1)  # tokens before the cut
        found = before < n if n < vocab else torch.ones_like(before, dtype=torch.bool)
        return desc.gather(1, before.clamp(max=n - 1).unsqueeze(1)), found

    rows = torch.arange(len(probs), device=probs.device)
    threshold = probs.new_zeros((len(probs), 1))
    for n in (*(c for c in _TOP_P_CANDIDATES if c < vocab), vocab):
        cut_at, found = cut(rows, n)
        threshold[rows] = cut_at
        rows = rows[~found]
        if len(rows) == 0:
            break
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=1, keepdim=True)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One inverse-CDF draw per row, in vocab order: (R, V) float32 probs -> (R,) token ids.

    Exactly one uniform per row from that row's generator, so a sample's stream advances
    once per step whatever else is in the batch.
    """
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    cdf = probs.double().cumsum(dim=1)  # (R, V), flat over zero-probability tokens
    total = cdf[:, -1]
    # Strictly below the total even after rounding, so the first cdf entry above the target is
    # always a token with mass (zero-probability tokens never raise the cdf).
    target = torch.minimum(u.to(probs.device) * total, torch.nextafter(total, total.new_zeros(())))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


class Sampler:
    """Picks the next token of every row of a batch; stateless (all state is in the states)."""

    def __call__(self, logits: torch.Tensor, states: Sequence[SampleState]) -> list[SampleResult]:
        """Sample one token per row.

        Args:
            logits: (len(states), V), one row per state, raw model output (cast to float32; not
                modified in place).
            states: one per row; each random row's generator advances by one draw.
        Returns:
            one :class:`SampleResult` per row, in order.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
        raw = logits.float()
        x = apply_penalties(raw, states)
        token_ids = torch.empty(len(states), dtype=torch.long, device=raw.device)
        greedy = [i for i, s in enumerate(states) if s.params.temperature == 0.0]
        drawn = [i for i, s in enumerate(states) if s.params.temperature != 0.0]
        if len(greedy) == len(states):
            token_ids = torch.argmax(x, dim=1)
        elif greedy:
            token_ids[greedy] = torch.argmax(x[greedy], dim=1)
        if drawn:
            probs = sampling_probs(x[drawn], [states[i].params for i in drawn])
            token_ids[drawn] = _draw(probs, [states[i].generator for i in drawn])
        return self._results(raw, token_ids, states)

    def probs(self, logits: torch.Tensor, states: Sequence[SampleState]) -> torch.Tensor:
        """The distribution each row is drawn from, (B, V) float32 in vocab order.

        Greedy rows are one-hot on their argmax. Consumes no randomness.
        """
        raw = logits.float()
        x = apply_penalties(raw, states)
        out = torch.zeros_like(x)
        for i, s in enumerate(states):
            if s.params.temperature == 0.0:
                out[i, int(torch.argmax(x[i]))] = 1.0
            else:
                out[i] = sampling_probs(x[i:i + 1], [s.params])[0]
        return out

    @staticmethod
    def _results(raw: torch.Tensor, token_ids: torch.Tensor, states: Sequence[SampleState]
                 ) -> list[SampleResult]:
        """Attach raw logprobs (see :class:`SampleResult`) to the chosen tokens."""
        chosen = token_ids.tolist()
        wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not wanted:
            return [SampleResult(t, None, ()) for t in chosen]
        logp = torch.log_softmax(raw[wanted], dim=1)  # (W, V)
        chosen_lp = logp.gather(1, token_ids[wanted].unsqueeze(1)).squeeze(1).tolist()
        max_n = min(max(states[i].params.logprobs or 0 for i in wanted), raw.shape[1])
        top = logp.topk(max_n, dim=1)  # most likely first
        top_lp, top_ids = top.values.tolist(), top.indices.tolist()
        results = [SampleResult(t, None, ()) for t in chosen]
        for w, i in enumerate(wanted):
            n = states[i].params.logprobs
            # A masked row (structured output) may have fewer than n possible tokens.
            pairs = tuple((t, v) for t, v in zip(top_ids[w][:n], top_lp[w][:n], strict=True)
                          if v != -math.inf)
            results[i] = SampleResult(chosen[i], chosen_lp[w], pairs)
        return results
