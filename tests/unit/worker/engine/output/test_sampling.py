"""Sampler against reference computations: argmax, penalties, masks, distributions, logprobs."""

from __future__ import annotations

import hashlib
import math
import random

import pytest
import torch

from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.output.sampling import (
    Sampler,
    SampleResult,
    SampleState,
    apply_penalties,
    make_generator,
)


def state(params: SamplingParams | None = None, index: int = 0, prompt=(), output=(),
          **kw) -> SampleState:
    params = params or SamplingParams(**kw).validate()
    return SampleState(params, index, list(prompt), list(output),
                       make_generator(params.seed, index))


def logits_for(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


# --- generators -------------------------------------------------------------------------------


def test_make_generator_follows_documented_derivation() -> None:
    seed, index = 1234567, 3
    digest = hashlib.sha256(b"kvfleet.sample.v1\0" + seed.to_bytes(8, "little")
                            + index.to_bytes(4, "little")).digest()
    expected = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    got = make_generator(seed, index)
    assert torch.equal(torch.rand(16, generator=got), torch.rand(16, generator=expected))


def test_generators_deterministic_and_siblings_differ() -> None:
    a1, a2 = make_generator(2**64 - 1, 0), make_generator(2**64 - 1, 0)
    assert torch.equal(torch.rand(8, generator=a1), torch.rand(8, generator=a2))
    draws = {tuple(torch.rand(4, generator=make_generator(7, i)).tolist()) for i in range(16)}
    assert len(draws) == 16
    other_seed = torch.rand(4, generator=make_generator(8, 0)).tolist()
    assert tuple(other_seed) not in draws


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_is_argmax_and_consumes_no_randomness() -> None:
    logits = logits_for(6, 50, seed=0)
    states = [state(seed=i) for i in range(6)]
    before = [s.generator.get_state() for s in states]
    results = Sampler()(logits, states)
    assert [r.token_id for r in results] == logits.argmax(dim=1).tolist()
    assert all(torch.equal(b, s.generator.get_state()) for b, s in zip(before, states))
    assert all(r == SampleResult(r.token_id, None, ()) for r in results)


def test_greedy_ties_pick_first_index() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0]])
    assert Sampler()(logits, [state()])[0].token_id == 1


# --- penalties --------------------------------------------------------------------------------


def reference_penalties(row: list[float], p: SamplingParams, prompt, output) -> list[float]:
    out = list(row)
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(output):
        c = output.count(t)
        out[t] -= c * p.frequency_penalty + p.presence_penalty
    return out


def test_penalties_match_hand_written_reference() -> None:
    rng = random.Random(0)
    vocab = 40
    logits = logits_for(5, vocab, seed=1)
    configs = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7),
               dict(presence_penalty=-1.1), {},  # a row without penalties stays bit-identical
               dict(repetition_penalty=0.8, frequency_penalty=1.5, presence_penalty=0.5)]
    states = [state(prompt=[rng.randrange(vocab) for _ in range(12)],
                    output=[rng.randrange(vocab) for _ in range(20)], **cfg) for cfg in configs]
    got = apply_penalties(logits, states)
    for i, s in enumerate(states):
        ref = reference_penalties(logits[i].tolist(), s.params, s.prompt_token_ids,
                                  s.output_token_ids)
        torch.testing.assert_close(got[i], torch.tensor(ref), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], logits[3])
    assert not torch.equal(got, logits) and torch.equal(logits, logits_for(5, vocab, seed=1))


def test_greedy_applies_penalties() -> None:
    logits = torch.tensor([[5.0, 4.9, -1.0, 0.0]])
    s = state(repetition_penalty=1.2, prompt=[0], output=[])
    assert Sampler()(logits, [s])[0].token_id == 1  # 5 / 1.2 < 4.9
    s = state(frequency_penalty=2.0, output=[0, 0, 0, 1, 1])
    assert Sampler()(logits, [s])[0].token_id == 1  # 5-6, 4.9-4, -1, 0
    s = state(frequency_penalty=2.0, presence_penalty=1.0, output=[0, 0, 0, 1, 1])
    assert Sampler()(logits, [s])[0].token_id == 3  # 5-7, 4.9-5, -1, 0


# --- temperature, top-k, top-p ----------------------------------------------------------------


def reference_probs(row: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """Straightforward per-row temperature -> top-k -> top-p, float64, vocab order."""
    z = row.double() / t
    if k:
        kth = sorted(z.tolist(), reverse=True)[min(k, len(z)) - 1]
        z = torch.where(z >= kth, z, torch.tensor(float("-inf"), dtype=torch.float64))
    probs = torch.softmax(z, dim=0)
    if p < 1:
        mass = 0.0
        for cut in sorted(probs.tolist(), reverse=True):
            mass += cut
            if mass >= p:
                break
        probs = torch.where(probs >= cut, probs, 0.0)
        probs = probs / probs.sum()
    return probs


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.5, 5, 1.0), (1.3, 0, 0.6), (0.8, 7, 0.5),
                                   (2.0, 1, 1.0), (1.0, 0, 0.01), (1.0, 100, 0.9)])
@pytest.mark.parametrize("vocab,scale", [(60, 3.0), (3000, 3.0), (3000, 0.05)])
def test_processed_distribution_matches_reference(t: float, k: int, p: float, vocab: int,
                                                  scale: float) -> None:
    """vocab 60: fewer tokens than top-p's candidates; 3000 peaked: the cut lies among them;
    3000 flat: the nucleus is wider, so the full-sort fallback runs."""
    logits = logits_for(4, vocab, seed=int(t * 10) + k, scale=scale)
    states = [state(temperature=t, top_k=k, top_p=p) for _ in range(4)]
    got = Sampler().probs(logits, states)
    for i in range(4):
        ref = reference_probs(logits[i], t, k, p)
        assert torch.equal(got[i] > 0, ref > 0), "kept set differs from the reference mask"
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("p,lo,hi", [(0.3, 1, 256), (0.6, 257, 4096), (0.98, 4097, 6000)])
def test_top_p_each_candidate_path(p: float, lo: int, hi: int) -> None:
    """Nucleus within the top 256, within the top 4096, and wider (full sort)."""
    logits = logits_for(2, 6000, seed=5, scale=1.5)
    got = Sampler().probs(logits, [state(temperature=1.0, top_p=p) for _ in range(2)])
    for i in range(2):
        ref = reference_probs(logits[i], 1.0, 0, p)
        assert lo <= int((ref > 0).sum()) <= hi
        assert torch.equal(got[i] > 0, ref > 0)
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-4, atol=1e-7)


def test_top_p_keeps_ties_with_the_cut() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]]).log()  # probs 2/5, 1/5 x3, 0
    got = Sampler().probs(logits, [state(temperature=1.0, top_p=0.5)])[0]
    assert got.tolist() == pytest.approx([0.4, 0.2, 0.2, 0.2, 0.0])
    got = Sampler().probs(logits, [state(temperature=1.0, top_p=0.3)])[0]
    assert got.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0, 0.0])


def test_top_k_keeps_ties_with_kth() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    got = Sampler().probs(logits, [state(temperature=1.0, top_k=2)])[0]
    assert (got > 0).tolist() == [True, False, True, True, False]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    support = expected > 0
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


@pytest.mark.parametrize("t,k,p,critical", [
    (0.7, 0, 1.0, 24.32),   # 7 degrees of freedom, p = 0.001
    (1.5, 6, 0.9, 20.52),   # <= 5 degrees of freedom
])
def test_empirical_distribution_matches_softmax(t: float, k: int, p: float,
                                                critical: float) -> None:
    vocab, rows, steps = 8, 2000, 10
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]]).expand(rows, vocab)
    states = [state(temperature=t, top_k=k, top_p=p, seed=99, index=i) for i in range(rows)]
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(steps):
        for r in Sampler()(logits, states):
            counts[r.token_id] += 1
    ref = reference_probs(logits[0], t, k, p)
    assert counts[ref == 0].sum() == 0, "drew a token outside the top-k/top-p set"
    assert chi_square(counts, ref) < critical


def run(states: list[SampleState], logits_seq: list[torch.Tensor]) -> list[list[int]]:
    """Feed a fixed logits sequence; append each chosen token like the engine does."""
    out: list[list[int]] = [[] for _ in states]
    for logits in logits_seq:
        for i, r in enumerate(Sampler()(logits, states)):
            states[i].output_token_ids.append(r.token_id)
            out[i].append(r.token_id)
    return out


def test_same_seed_same_sequence_and_siblings_differ() -> None:
    steps = [logits_for(1, 100, seed=s, scale=1.0) for s in range(30)]
    kw = dict(temperature=1.0, top_p=0.95, seed=5, frequency_penalty=0.3)
    a = run([state(**kw)], steps)[0]
    b = run([state(**kw)], steps)[0]
    c = run([state(index=1, **kw)], steps)[0]
    assert a == b
    assert a != c


def test_batch_invariance() -> None:
    vocab, n_steps = 257, 12
    target_kw = dict(temperature=0.9, top_k=40, top_p=0.9, seed=11, repetition_penalty=1.1)
    target_logits = [logits_for(1, vocab, seed=100 + s) for s in range(n_steps)]
    alone = run([state(index=2, prompt=[1, 2, 3], **target_kw)], target_logits)[0]

    rng = random.Random(3)
    others = [dict(), dict(temperature=0.3), dict(temperature=1.0, top_p=0.5, seed=11),
              dict(temperature=2.0, top_k=3, presence_penalty=1.0), dict(repetition_penalty=1.5)]
    for trial in range(3):
        mates = [state(prompt=[rng.randrange(vocab)], **rng.choice(others)) for _ in range(5)]
        pos = rng.randrange(len(mates) + 1)
        target = state(index=2, prompt=[1, 2, 3], **target_kw)
        batch = mates[:pos] + [target] + mates[pos:]
        seq = [torch.cat([logits_for(pos, vocab, seed=1000 * trial + s), target_logits[s],
                          logits_for(len(mates) - pos, vocab, seed=2000 * trial + s)])
               for s in range(n_steps)]
        assert run(batch, seq)[pos] == alone


def test_tiny_temperature_is_finite_and_picks_argmax() -> None:
    logits = torch.tensor([[100.0, 99.0, -50.0, 98.5]])
    for t in (1e-6, 1e-50):
        assert Sampler()(logits, [state(temperature=t)])[0].token_id == 0


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_top_n() -> None:
    logits = logits_for(4, 64, seed=7)
    states = [state(logprobs=5, temperature=0.8, repetition_penalty=1.4, output=[3, 4]),
              state(logprobs=None, temperature=0.8),
              state(logprobs=0),
              state(logprobs=20, frequency_penalty=2.0, output=[int(logits[3].argmax())])]
    results = Sampler()(logits, states)
    ref = torch.log_softmax(logits.double(), dim=1)
    for i, (s, r) in enumerate(zip(states, results)):
        if s.params.logprobs is None:
            assert r.logprob is None and r.top_logprobs == ()
            continue
        assert r.logprob == pytest.approx(ref[i, r.token_id].item(), abs=1e-5)
        n = s.params.logprobs
        ref_lp, ref_ids = ref[i].topk(n) if n else (ref[i, :0], ref[i, :0].long())
        assert [t for t, _ in r.top_logprobs] == ref_ids.tolist()
        assert [lp for _, lp in r.top_logprobs] == pytest.approx(ref_lp.tolist(), abs=1e-5)
        assert all(isinstance(t, int) and isinstance(lp, float) for t, lp in r.top_logprobs)
    # Row 3: the penalty moved the choice off the raw argmax; its logprob is still the raw one.
    assert results[3].token_id != int(logits[3].argmax())
    assert results[3].logprob < results[3].top_logprobs[0][1]
    assert math.isfinite(results[0].logprob)
