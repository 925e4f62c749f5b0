"""The engine: one step = schedule → executor forward → sample → detokenize → outputs.

Synchronous and single-threaded by design; :mod:`kvfleet.worker.service.engine_loop` runs it on its
own thread so the gRPC event loop never blocks on a forward.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Optional, Sequence

import tokenizers
import torch

from kvfleet.allocator.hashing import CacheIdentity, root_hash
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.constraint import GrammarConfig
from kvfleet.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from kvfleet.priority import label as priority_label
from kvfleet.sampling_params import check_context_length
from kvfleet.worker.engine.adapters.queue import AdapterQueue
from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.engine.layer_yield.forward import Arrivals, LayerYield
from kvfleet.worker.engine.output.grammar import GrammarCache
from kvfleet.worker.engine.output.masks import mask_logits
from kvfleet.worker.engine.output.outputs import SeqOutput, TokenLogprobs
from kvfleet.worker.engine.output.sample_io import SampleIO, final_output
from kvfleet.worker.engine.output.sampling import Sampler
from kvfleet.worker.engine.request import EngineRequest, FinishReason, SequenceState
from kvfleet.worker.engine.scheduling.preemption import REASONS
from kvfleet.worker.engine.scheduling.scheduler import Fork, Scheduler, SchedulerConfig, SchedulerOutput
from kvfleet.worker.engine.speculative.sizing import query_rows_for
from kvfleet.worker.engine.speculative.verify import Verification
from kvfleet.worker.executor.base import Executor
from kvfleet.worker.kv_tier.export import ExportDone, TierExports
from kvfleet.worker.kv_tier.lookup import TierLookup
from kvfleet.worker.kv_tier.moves import move_blocks
from kvfleet.worker.step_cost.model import MEASURED, StepCost, plan_shape
from kvfleet.worker.step_cost.queue_delay import load_forecast
from kvfleet.worker.step_cost.share import share_step_s

log = logging.getLogger(__name__)
_GRAMMAR_DEFAULTS = GrammarConfig()


class WholeStep:
    """The engine's forward: every step runs whole (no layer-level yield)."""

    nested_steps = 0  # none ever

    def __call__(self, engine: Engine, out: SchedulerOutput, arrivals: Optional[Arrivals]
                 ) -> tuple[torch.Tensor, float]:
        """``out``'s logits (:meth:`Executor.execute`) and 0.0 seconds of nested steps."""
        return engine.executor.execute(out.plan), 0.0



def _rank0_device(executor: Any) -> Optional[str]:
    """Rank 0's torch device string (``"cpu"``, ``"cuda:0"``), from the executor's ranks or,
    for a model runner used as the executor, its ``device``; None when it holds no model
    (a cost-model executor)."""
    ranks = getattr(executor, "ranks", None)
    if callable(ranks):
        infos = ranks()
        return infos[0].device if infos else None
    device = getattr(executor, "device", None)
    return None if device is None else str(device)

class Engine:
    """Continuous-batching engine of one replica (rank 0 of its TP group).

    Args:
        executor: runs each step's :class:`~kvfleet.worker.engine.step_plan.StepPlan`; returns
            last-token logits ``(num_chunks, vocab)`` float32.
        kv: the replica's KV cache manager (block tables, prefix cache).
        identity_digest: :meth:`CacheIdentity.digest` of the served model (docs/design.md §2).
        eos_token_ids: tokens that end a sample unless ``ignore_eos``.
        max_model_len: context length; prompt + max_tokens beyond it is OUT_OF_RANGE.
        adapters: the replica's LoRA slots (None: no adapter is served); ``identity`` (the
            served model's, whose digest is ``identity_digest``) is then required: a request's
            chain root is keyed by its adapter's name and revision.
        grammar: bounds of structured-output compilation (:class:`GrammarConfig`); a
            constrained row's logits are masked to its grammar before sampling.
        step_cost: the replica's step-cost model (``engine.step_cost``), told every
            forward's measured seconds; the scheduler's ITL target budgets with it. Default:
            the constants measured on SmolLM2 (CPU), corrected online from the first step.
        tier: the node's host KV tier as admission looks it up (None: no tier); ``executor``
            then writes evicted blocks back and restores hits (``transfer_blocks``).
    """

    def __init__(self, executor: Executor, kv: KVCacheManager, tokenizer: tokenizers.Tokenizer,
                 identity_digest: bytes, eos_token_ids: Sequence[int], max_model_len: int,
                 vocab_size: int, config: SchedulerConfig = SchedulerConfig(),
                 adapters: AdapterResidency | None = None,
                 identity: CacheIdentity | None = None,
                 grammar: GrammarConfig = _GRAMMAR_DEFAULTS,
                 step_cost: StepCost | None = None,
                 tier: TierLookup | None = None) -> None:
        self.executor = executor
        self.adapters = adapters
        self.kv = kv
        self.tokenizer = tokenizer
        self.identity_digest = identity_digest
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.step_cost = step_cost or StepCost(MEASURED)
        # Whole steps, or layer-level yield's forward (its one seam).
        mode = config.layer_yield
        self.forward: WholeStep | LayerYield = (
            LayerYield(executor, auto=mode == "auto")
            if mode == "on" or (mode == "auto" and executor.pausable) else WholeStep())
        self.scheduler = Scheduler(config, kv, self.step_cost, tier)
        # When the last forward ended, while requests kept running (None: idle since): the
        # gap to the next forward is a step's time outside it (the scheduler plans with it).
        self._busy_since: float | None = None
        self._in_forward = False
        # Forward seconds charged per priority class label, cumulative: what each class took.
        self.replica_s_by_class: dict[str, float] = {}
        # Draft sizing knows the CPU runner's few-row kernel; other devices price drafts
        # by the step-cost model alone (an executor with no device models the CPU's steps).
        device = _rank0_device(executor)
        if device is not None:
            self.scheduler.spec.query_rows = query_rows_for(device)
        # Blocks a peer asks for, snapshotted at once through the engine's executor.
        self.exports = TierExports(kv, lambda: self.executor)
        self.lora = AdapterQueue(adapters, identity, identity_digest, self.scheduler)
        self.sampler = Sampler()
        # Structured output: compiled off this thread by the service, cached by digest.
        self.grammars = GrammarCache(tokenizer, vocab_size, eos_token_ids, grammar)
        self.mask_budget_s = grammar.mask_budget_ms / 1e3  # CPU seconds a row's mask may take
        self._arrivals = itertools.count()
        self._seqs: dict[str, list[SequenceState]] = {}  # request_id -> its n samples
        self._io: dict[str, SampleIO] = {}           # seq_id -> output helpers

    # ---- requests in ---------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> None:
        """Check what the worker alone can check.

        Raises:
            InvalidArgument / OutOfRange: a malformed request.
            AlreadyExists: a request with this id is still live on this replica.
        """
        if not req.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids must not be empty")
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(
                f"prompt_token_ids holds ids outside [0, {self.vocab_size}): e.g. {bad[0]}")
        check_context_length(len(req.prompt_token_ids) + req.params.max_tokens, self.max_model_len,
                             f"prompt ({len(req.prompt_token_ids)} tokens) + sampling.max_tokens "
                             f"({req.params.max_tokens})", field="sampling.max_tokens")
        req.params.check_vocab(self.vocab_size)
        if req.request_id in self._seqs:
            raise AlreadyExists(f"request_id {req.request_id!r} is already running")

    def add_request(self, req: EngineRequest) -> None:
        """Validate and queue all ``n`` samples. Raises a KvfleetError on refusal.

        A constrained request without its compiled ``grammar`` is compiled here, on the
        calling thread (tests, benchmarks); the service compiles before submitting.
        """
        self.validate(req)
        grammar = req.grammar
        if req.constraint is not None and grammar is None:
            grammar = self.grammars.compile(req.constraint)
        pinned = self.lora.pin(req.adapter)  # the revision hashed is the revision run
        root = root_hash(self.lora.digest_for(pinned), req.cache_scope or req.tenant,
                         req.cache_salt)
        arrival = next(self._arrivals)
        seqs = [
            SequenceState(seq_id=f"{req.request_id}#{i}", request_id=req.request_id, index=i,
                     prompt_token_ids=list(req.prompt_token_ids), params=req.params,
                     root_hash=root, block_size=self.kv.block_size, arrival_seq=arrival,
                     deadline=req.deadline, tenant=req.tenant, priority=req.priority,
                     tier_skip=req.tier_skip, may_speculate=req.constraint is None)
            for i in range(req.params.n)
        ]
        if pinned is not None:
            self.lora.add(pinned, seqs)
        else:
            self.scheduler.add(seqs)
        self._seqs[req.request_id] = seqs
        for s in seqs:
            self._io[s.seq_id] = SampleIO(s, self.tokenizer, grammar, req.constraint)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED,
              error: BaseException | None = None) -> list[SeqOutput]:
        """End every unfinished sample of a request now and free its blocks."""
        return [self._finish(s, reason, error)
                for s in list(self._seqs.get(request_id, [])) if not s.is_finished]

    def is_active(self, request_id: str) -> bool:
        """True while any sample of the request is unfinished."""
        return request_id in self._seqs

    @property
    def has_work(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.lora.has_waiting

    # ---- one step ------------------------------------------------------------------------
    def step(self, arrivals: Arrivals | None = None) -> list[SeqOutput]:
        """Run one engine step; returns the outputs it produced (possibly none).

        ``arrivals``: where requests arrive during the step; with ``layer_yield`` on, the
        forward pauses between layers for a nested step of those it yields to, whose outputs
        go out through ``arrivals.emit`` before this step's
        (:mod:`kvfleet.worker.engine.layer_yield.forward`).
        """
        outputs = self._expire_deadlines()
        if self.lora.has_waiting:
            outputs += self.lora.admit(lambda seq, exc: self._finish(seq, FinishReason.ERROR, exc))
        out = self.scheduler.schedule(time.monotonic())
        if out.plan.block_saves or out.plan.block_restores:
            out = move_blocks(self.executor, self.scheduler, out)
        if not out.scheduled:
            self._busy_since = None  # a pause (a load, a lookup), not a step's own time
            if self.lora.has_waiting and not outputs:
                self.lora.wait(0.01)  # nothing to run but a load: do not spin
            elif self.scheduler.tier.lookups_pending and not outputs:
                self.scheduler.tier.wait_lookups(0.01)  # nothing to run but a tier lookup
            return outputs
        return outputs + self.run(out, arrivals)

    def run(self, out: SchedulerOutput, arrivals: Arrivals | None) -> list[SeqOutput]:
        """Forward ``out``, charge its rows their shares of the forward's measured seconds
        (``SequenceState.replica_s``, :mod:`kvfleet.worker.step_cost.share`), then sample and
        emit; a failed forward fails its requests only."""
        if not out.scheduled:
            return []
        now = time.monotonic()
        for s in out.scheduled:
            if s.seq.timing.first_scheduled is None:
                s.seq.timing.first_scheduled = now
            if s.seq.num_computed_tokens < s.seq.num_prompt_tokens:  # a prefill chunk (tracing)
                s.seq.timing.prefill_chunks.append((now, s.num_new_tokens))
        start, nested_s = time.perf_counter(), 0.0
        outer, self._in_forward = not self._in_forward, True  # a nested step runs inside one
        if outer and self._busy_since is not None:
            self.step_cost.observe_outside(start - self._busy_since)
        try:
            logits, nested_s = self.forward(self, out, arrivals)
        except Exception as exc:  # a failed forward fails the requests in it, not the replica
            self._in_forward, self._busy_since = not outer, None
            log.exception("forward failed for %d sequences", len(out.scheduled))
            failed = dict.fromkeys(s.seq.request_id for s in out.scheduled)
            return [o for rid in failed for o in self.abort(rid, FinishReason.ERROR, exc)]
        measured_s = time.perf_counter() - start - nested_s  # nested steps charge their own
        shares = share_step_s(self.step_cost.corrected(), out.plan, measured_s)
        by_class = self.replica_s_by_class
        for s, share in zip(out.scheduled, shares, strict=True):
            s.seq.replica_s += share
            klass = priority_label(s.seq.priority)
            by_class[klass] = by_class.get(klass, 0.0) + share
        self.step_cost.observe(plan_shape(out.plan), measured_s)
        self._in_forward = not outer
        if outer:
            self._busy_since = time.perf_counter() if self.scheduler.running else None
        forks = self.scheduler.on_step_done(out)
        return self._sample_and_emit(out, forks, logits)

    def _sample_and_emit(self, out: SchedulerOutput, forks: list[Fork], logits) -> list[SeqOutput]:
        """Sample every row that reaches its last token; a row with drafts goes on verifying
        them (:class:`~kvfleet.worker.engine.speculative.verify.Verification`): round ``j``
        samples position ``j`` of each row whose drafts so far all matched, so a row emits
        its matching drafts and the first token that differs (or the one after them all)."""
        offsets = out.plan.logit_offsets()
        chunks = [i for i, s in enumerate(out.scheduled) if s.sample]
        # A chunk's sampling row is its last real token's: the first of its 1 + drafts rows.
        rows = [offsets[i] for i in chunks]
        seqs = [out.scheduled[i].seq for i in chunks]
        drafts = [out.scheduled[i].draft_token_ids for i in chunks]
        if forks:  # siblings draw their first token from their leader's logits row
            row_of = {out.scheduled[i].seq.seq_id: offsets[i] for i in chunks}
            for f in forks:
                f.sibling.timing.first_scheduled = f.leader.timing.first_scheduled
                f.sibling.timing.prefill_chunks = list(f.leader.timing.prefill_chunks)
                rows.append(row_of[f.leader.seq_id])
                seqs.append(f.sibling)
                drafts.append(())
        if not rows:
            return []
        v = Verification(seqs, drafts)
        failed: dict[str, BaseException] = {}
        now = time.monotonic()
        while (live := v.live()):
            at = [rows[i] + v.round for i in live]
            picked = logits if at == list(range(len(logits))) else logits[at]
            ios = [self._io[seqs[i].seq_id] for i in live]
            # Constrained rows sample (and report logprobs) from the masked distribution.
            masked = mask_logits(picked, [io.matcher for io in ios], self.mask_budget_s)
            results = self.sampler(masked.logits, [io.state for io in ios])
            # A row whose mask took past the budget ends its request (only it), refused.
            for k, took in masked.over_budget:
                seq = seqs[live[k]]
                failed[seq.request_id] = self.grammars.too_slow_to_mask(ios[k].constraint, took)
            for i, io, res in zip(live, ios, results, strict=True):
                if seqs[i].request_id in failed:
                    continue  # emits nothing more this step
                try:
                    v.add(i, res, io.append(seqs[i], res, now, self.eos_token_ids))
                except Exception as exc:  # one request's failure stays with that request
                    log.exception("post-processing failed for %s", seqs[i].seq_id)
                    v.fail(i, exc)
        outputs = []
        for i, seq in enumerate(seqs):
            if seq.is_finished:
                continue  # a sibling's error ended it already
            if seq.request_id in failed:
                outputs.append(self._finish(seq, FinishReason.ERROR, failed[seq.request_id]))
                continue
            got = v.emitted[i]
            if got.error is not None:
                outputs.append(self._finish(seq, FinishReason.ERROR, got.error))
                continue
            if drafts[i]:
                self.scheduler.spec.verified(seq, len(drafts[i]), got.accepted)
            if got.reason is None:
                if drafts[i]:
                    self.scheduler.accept_drafts(seq, got.accepted)
                outputs.append(SeqOutput(seq.request_id, seq.index, tuple(got.token_ids),
                                         got.text, tuple(got.logprobs)))
            else:
                outputs.append(self._finish(seq, got.reason, token_ids=tuple(got.token_ids),
                                            text=got.text, logprobs=tuple(got.logprobs)))
        for rid, error in failed.items():  # its samples not in this step
            outputs += self.abort(rid, FinishReason.ERROR, error)
        return outputs

    def _expire_deadlines(self) -> list[SeqOutput]:
        now = time.monotonic()
        return [self._finish(s, FinishReason.DEADLINE)
                for seqs in list(self._seqs.values()) for s in seqs
                if s.deadline is not None and now > s.deadline and not s.is_finished]

    def _finish(self, seq: SequenceState, reason: FinishReason, error: BaseException | None = None,
                token_ids: tuple[int, ...] = (), text: str = "",
                logprobs: tuple[TokenLogprobs, ...] = ()) -> SeqOutput:
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        self._io.pop(seq.seq_id, None)
        siblings = self._seqs.get(seq.request_id, [])
        if all(s.is_finished for s in siblings):
            self._seqs.pop(seq.request_id, None)
            self.lora.request_done(seq.request_id)
        return final_output(seq, reason, error, token_ids, text, logprobs)

    def hand_over(self, max_blocks: int, timeout_s: float = 10.0) -> int:
        """Write up to ``max_blocks`` of the hottest cached blocks back to the host tier (a
        drain: the node's other replicas then restore them), within ``timeout_s``: in turns of
        what rank 0's write-back queue holds, each waited for before the next (the other
        ranks: best effort). Engine thread only. Returns the blocks that landed in the tier
        on rank 0 (0 without a tier), never merely the blocks asked.

        Raises:
            Unavailable: the executor can no longer run (a rank died).
        """
        if not self.scheduler.tier.enabled or max_blocks <= 0:
            return 0
        deadline = time.monotonic() + timeout_s
        tier = self.executor.tier  # rank 0's writer
        tier.flush(timeout_s)  # earlier write-backs first: the queue's whole room
        # Coldest first: a run lands in order, so the tier's LRU keeps the hottest longest.
        saves = self.kv.pool.hot_blocks()[:max_blocks][::-1]
        landed = 0
        while saves and time.monotonic() < deadline:
            self.executor.transfer_blocks(saves, ())
            saved = tier.last_saved
            if not saved.blocks:
                break  # no room for one block: the queue is smaller than a block, or stuck
            got = saved.landed(max(0.0, deadline - time.monotonic()))
            landed += got
            if got < saved.blocks:
                break  # a put failed or is late: the tier is not taking more
            saves = saves[saved.blocks:]
        return landed

    def export_blocks(self, hashes: Sequence[bytes], done: ExportDone) -> int:
        """A peer asks for the blocks under ``hashes``: the leading run held in the pool is
        snapshotted for write-back to the host tier now, then ``done(exported hashes)`` is
        called (:class:`~kvfleet.worker.kv_tier.export.TierExports`). Engine thread only,
        between steps. Returns the blocks found.

        Raises:
            FailedPrecondition: this replica has no host tier to export through.
        """
        if not self.scheduler.tier.enabled:
            raise FailedPrecondition("this replica has no host KV tier (kv_host_memory)")
        return self.exports.request(hashes, done)

    # ---- observability --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counts for load reports: sequences running / waiting, free / total KV blocks,
        ``prefill_tokens_queued`` (tokens of waiting and running sequences still to compute
        before their next sample: prompts, recompute after preemption), ``context_tokens``
        (tokens with KV of the running sequences), ``preemptions`` (reason → sequences
        preempted by recompute, cumulative: :data:`~.scheduling.preemption.REASONS`),
        ``nested_steps`` (layer yield's steps run
        inside a paused one, cumulative), ``replica_s_by_class`` (priority class label →
        forward seconds its rows were charged, cumulative: the per-request ``replica_s``
        summed by class, finished or not), speculative decoding's totals
        (``spec_drafted_tokens``, ``spec_accepted_tokens``, ``spec_verify_rows``,
        ``spec_accepted_hist``: verify rows by drafts accepted), per-tenant service, and the
        load forecast
        a router routes on (``queue_delay_s``, ``prefill_token_s``:
        :mod:`kvfleet.worker.step_cost.queue_delay`)."""
        sched = self.scheduler
        running = sched.running
        queued = sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting)
        left = (s.num_tokens - s.num_computed_tokens for s in running)
        queued += sum(n for n in left if n > 1)  # 1 left: a decode row, not prefill
        return {
            "running": len(running),
            "waiting": len(sched.waiting),
            "num_free_blocks": self.kv.num_free_blocks,
            "num_total_blocks": self.kv.num_total_blocks,
            "tenant_service": dict(self.scheduler.service.service),  # a copy: read off-thread
            **load_forecast(self.scheduler, self.step_cost),
            "prefill_tokens_queued": queued,
            "context_tokens": sum(s.num_computed_tokens for s in running),
            "nested_steps": self.forward.nested_steps,
            "preemptions": {r: sched.preemptions[r] for r in REASONS},
            "replica_s_by_class": dict(self.replica_s_by_class),  # a copy: read off-thread
            **self.scheduler.spec.counts.as_dict(),
            **sched.tier.stats(sched.hits, self.executor.tier),
        }
