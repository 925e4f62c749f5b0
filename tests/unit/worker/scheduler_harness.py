"""Scheduler tests without a model: a scheduler on the real KV cache manager, sequences in
arrival order, and one step taken as the engine takes it."""

from __future__ import annotations

import itertools
from typing import Optional

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 4  # tokens per KV block
ARRIVALS = itertools.count()  # arrival order shared by every sequence a test builds


def make_scheduler(n_blocks: int, *, seats_by_service: bool = True, **cfg) -> Scheduler:
    """A scheduler over ``n_blocks`` blocks of ``BS`` tokens; ``cfg``: ``SchedulerConfig`` fields
    (``seats_by_service``: :class:`Scheduler`'s, False for a fixed cap of seats)."""
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(n_blocks, BS),
                     seats_by_service=seats_by_service)


def new_seq(prompt: Optional[list[int]] = None, *, prompt_len: int = 4, max_tokens: int = 8,
            sid: Optional[str] = None, **fields) -> SequenceState:
    """A waiting sequence, the next to arrive. ``prompt`` None: ``prompt_len`` (≤ 100) token ids
    no other sequence shares, so nothing is a prefix hit; ``sid`` names both the sequence and
    its request (default ``s<arrival>``); ``fields``: other ``SequenceState`` fields (``tenant``,
    ``priority``)."""
    a = next(ARRIVALS)
    if prompt is None:
        assert prompt_len <= 100, "unshared prompts are at most 100 tokens"
        prompt = list(range(100 * a + 1, 100 * a + 1 + prompt_len))
    sid = sid or f"s{a}"
    return SequenceState(seq_id=sid, request_id=sid, index=0, prompt_token_ids=prompt,
                         params=SamplingParams(max_tokens=max_tokens), root_hash=b"r" * 16,
                         block_size=BS, arrival_seq=a, **fields)


def run_step(s: Scheduler, token: int = 7, finish: bool = False) -> SchedulerOutput:
    """One step as the engine takes it: schedule, 'compute', append ``token`` to every running
    sequence that samples (``finish``: and finish those at their ``max_tokens``); the KV
    cache's invariants hold after it."""
    out = s.schedule()
    s.on_step_done(out)
    for x in out.scheduled:
        if x.sample and x.seq.status is SeqStatus.RUNNING:
            x.seq.append_token(token)
            if finish and len(x.seq.output_token_ids) >= x.seq.params.max_tokens:
                s.finish(x.seq)
    s.kv.check_invariants()
    return out


def held(s: Scheduler, tenant: str) -> int:
    """Seats ``tenant``'s sequences hold in ``s`` (its running sequences)."""
    return sum(1 for x in s.running if x.tenant == tenant)


def two_tenants_seated(s: Scheduler, a: int, b: int, ahead: str, by: float
                       ) -> tuple[list[SequenceState], list[SequenceState]]:
    """Queue ``a`` and ``b`` long sequences (50 tokens each) of tenants "a" and "b", charge
    ``ahead`` ``by`` prefill tokens of service, and run two steps (admission settles). Returns
    both tenants' sequences."""
    seqs = {t: [new_seq(prompt_len=4, max_tokens=50, tenant=t) for _ in range(n)]
            for t, n in (("a", a), ("b", b))}
    s.add(seqs["a"] + seqs["b"])
    s.service.charge(ahead, prefill_tokens=by)
    for _ in range(2):
        run_step(s)
    return seqs["a"], seqs["b"]
