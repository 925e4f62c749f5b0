"""Property: under any randomised workload of arrivals (n >= 1, shared prefixes), growth,
cancellations and expired deadlines, admission never over-commits the KV pool.

The real Scheduler, KVCacheManager and Engine run over a stub runner that checks every plan
the way the model runner would rely on it — each written slot lies in a block the sequence
alone references (copy-on-write happened), no two chunks write the same slot, every block
table covers its chunk — and returns logits that depend only on the sequence's tokens. After
every call: pool invariants, 0 <= free <= total, blocks held == blocks the live sequences'
tables hold, ``max_num_seqs`` respected, no preemption ever under ``reserve``. At the end,
cancelling everything restores the idle free-block count exactly.
"""

from __future__ import annotations

import itertools
import time

import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.errors import ResourceExhausted
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.request import SeqStatus
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.engine.step_plan import StepPlan

VOCAB = 24
MAX_MODEL_LEN = 512


def _tokenizer() -> Tokenizer:
    return Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))


class CheckingRunner:
    """Validates each plan against the KV cache manager, returns content-derived logits."""

    pausable = False  # whole steps only: no execute_pausable

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.steps = 0
        self.copies = 0

    def execute(self, plan: StepPlan) -> torch.Tensor:
        bs = self.kv.block_size
        for src, dst in plan.block_copies:
            assert self.kv.ref_count(dst) == 1, "copy-on-write target must be private"
            self.copies += 1
        written: set[int] = set()
        rows = []
        for c in plan.chunks:
            end = c.num_computed_tokens + len(c.token_ids)
            assert len(c.token_ids) >= 1 and len(c.block_table) >= -(-end // bs)
            assert list(c.block_table) == self.kv.block_table(c.seq_id)
            for pos in range(c.num_computed_tokens, end):
                block = c.block_table[pos // bs]
                assert self.kv.ref_count(block) == 1, f"{c.seq_id} writes shared block {block}"
                slot = block * bs + pos % bs
                assert slot not in written, "two chunks write one slot"
                written.add(slot)
            for block in c.block_table[: -(-c.num_computed_tokens // bs)]:
                assert self.kv.ref_count(block) >= 1, "reads a block nobody holds"
            gen = torch.Generator().manual_seed(hash((c.token_ids[-1], end)) % 2**31)
            rows.append(torch.randn(VOCAB, generator=gen))
        self.steps += 1
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


def _check(engine: Engine, cfg: SchedulerConfig) -> None:
    kv, sched = engine.kv, engine.scheduler
    kv.check_invariants()
    assert 0 <= kv.num_free_blocks <= kv.num_total_blocks
    held = set(itertools.chain.from_iterable(kv.block_table(s.seq_id) for s in sched.running))
    assert kv.num_total_blocks - kv.num_free_blocks == len(held)
    for s in itertools.chain(sched.waiting, *sched.pending_forks.values()):
        assert s.status is SeqStatus.WAITING and kv.num_blocks(s.seq_id) == 0
    for s in sched.running:
        assert kv.num_blocks(s.seq_id) == -(-s.num_computed_tokens // kv.block_size)
    assert len(sched.running) <= cfg.max_num_seqs
    if cfg.policy == "reserve":
        assert all(s.num_preemptions == 0 for seqs in engine._seqs.values() for s in seqs)


configs = st.builds(
    SchedulerConfig,
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 24),
    max_waiting=st.integers(1, 12),
    policy=st.sampled_from(["watermark", "reserve"]),
    watermark=st.sampled_from([0.0, 0.1]),
)
_add = st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 16), st.integers(1, 3),
                st.integers(0, 2), st.booleans())
_step = st.tuples(st.just("step"), st.integers(1, 8))
ops = st.lists(st.one_of(_add, _add, _add, _step, _step, _step, _step,
                         st.tuples(st.just("cancel"), st.integers(0, 99)),
                         st.tuples(st.just("expire"), st.integers(0, 99))),
               min_size=10, max_size=50)


# A tight pool that always preempts, forks, copies on write and hits the prefix cache.
@example(cfg=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=8, watermark=0.0),
         block_size=2, num_blocks=12, drain=True,
         workload=[("add", 5, 9, 2, 0, True), ("step", 3), ("add", 7, 9, 1, 0, False),
                   ("add", 3, 12, 3, 1, True), ("step", 6), ("add", 9, 5, 1, 0, False),
                   ("cancel", 1), ("step", 4), ("add", 6, 8, 2, 1, True)])
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 32),
       workload=ops, drain=st.booleans())
def test_admission_never_overcommits(cfg, block_size, num_blocks, workload, drain) -> None:
    kv = KVCacheManager(num_blocks, block_size)
    engine = Engine(CheckingRunner(kv), kv, _tokenizer(), b"prop", [], MAX_MODEL_LEN, VOCAB, cfg)
    prefixes = [[(7 * i + j) % VOCAB for j in range(40)] for i in range(3)]
    ids = itertools.count()
    created = []
    for op in workload:
        if op[0] == "add":
            _, plen, max_tokens, n, prefix, sampled = op
            tokens = prefixes[prefix][:plen]
            params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True,
                                    temperature=1.0 if sampled else 0.0, seed=plen)
            rid = f"r{next(ids)}"
            try:
                engine.add_request(EngineRequest(rid, tuple(tokens), params))
            except ResourceExhausted:
                continue
            created += engine._seqs[rid]
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                _check(engine, cfg)
        else:
            active = list(engine._seqs)
            if active:
                rid = active[op[1] % len(active)]
                if op[0] == "cancel":
                    engine.abort(rid)
                else:
                    for s in engine._seqs[rid]:
                        s.deadline = time.monotonic() - 1
        _check(engine, cfg)
    if drain:  # every admitted request finishes: no deadlock, no starvation
        for _ in range(20_000):
            if not engine.has_work:
                break
            engine.step()
            _check(engine, cfg)
        assert not engine.has_work, "the engine stopped making progress"
    event(f"policy={cfg.policy}")
    seqs = created
    if any(s.num_preemptions for s in seqs):
        event("preempted")
    if engine.executor.copies:
        event("copy-on-write")
    if any(s.num_cached_tokens for s in seqs):
        event("prefix hit")
    for rid in list(engine._seqs):  # a storm of cancellations
        engine.abort(rid)
    _check(engine, cfg)
    assert not engine.has_work and not engine._seqs
    assert kv.num_free_blocks == kv.num_total_blocks, "idle free-block count not restored"
