"""Engine-side request state: counters, not phase flags (prefill, prefix hit and recompute
after preemption are all "num_computed_tokens catching up with num_tokens")."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from kvfleet.allocator.hashing import block_hash_chain
from kvfleet.constraint import Constraint
from kvfleet.priority import DEFAULT as DEFAULT_PRIORITY
from kvfleet.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"            # EOS, a stop token or a stop string
    LENGTH = "length"        # max_tokens reached
    CANCELLED = "cancelled"  # client went away or Abort
    DEADLINE = "deadline"    # the propagated deadline passed
    ERROR = "error"          # processing this request failed


@dataclass
class SeqTiming:
    """Monotonic timestamps (seconds) of one sequence's milestones on the worker."""

    arrival: float
    first_scheduled: Optional[float] = None
    # When the scheduler admitted the prefill now in progress (None while waiting; a
    # preempted sequence's recompute starts a new one): the ITL target's floor grows with it.
    prefill_started: Optional[float] = None
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (step start, tokens)


@dataclass
class SequenceState:
    """One sample (``index`` of ``n``) of one request as the scheduler sees it.

    ``all_token_ids = prompt + output``; ``num_computed_tokens`` of them have KV in the cache.
    ``block_hashes`` is the chain over every full block of ``all_token_ids`` (docs/design.md §2),
    extended as output tokens fill blocks.
    """

    seq_id: str
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    root_hash: bytes
    block_size: int
    arrival_seq: int  # FCFS order; also "newest" for preemption
    deadline: Optional[float] = None  # monotonic seconds
    tenant: str = "default"  # whose request (not its cache scope): fair admission among tenants
    priority: int = DEFAULT_PRIORITY  # kvfleet.priority: lower runs first (class, then FCFS)
    adapter_slot: int = 0  # the runner's LoRA slot (0 = base model), set once resident
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: Optional[int] = None  # set once, at first admission
    num_preemptions: int = 0
    class_preemptions: int = 0  # of num_preemptions, those for a higher class or a tenant behind (bounded)
    tier_skip: bool = False  # a host-tier restore for it failed: recompute from now on
    may_speculate: bool = True  # False: never carries drafts (a structured-output row)
    spec_drafted: int = 0  # draft tokens verified for it, and of those accepted
    spec_accepted: int = 0
    replica_s: float = 0.0  # forward seconds of its rows (kvfleet.worker.step_cost.share)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    error: Optional[BaseException] = None
    block_hashes: list[bytes] = field(default_factory=list)
    timing: SeqTiming = field(default_factory=lambda: SeqTiming(time.monotonic()))

    def __post_init__(self) -> None:
        self.update_block_hashes()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """``tuple(all_token_ids[start:end])`` without concatenating prompt and output."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return tuple(self.output_token_ids[start - p:end - p])
        if end <= p:
            return tuple(self.prompt_token_ids[start:end])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[:end - p])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence may reach: prompt + max_tokens."""
        return self.num_prompt_tokens + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def update_block_hashes(self) -> None:
        """Extend the hash chain over any newly full block (cheap: incremental)."""
        if self.num_tokens // self.block_size > len(self.block_hashes):
            self.block_hashes = block_hash_chain(
                self.root_hash, self.all_token_ids, self.block_size, self.block_hashes
            )

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.update_block_hashes()


@dataclass(frozen=True)
class EngineRequest:
    """A validated request as the worker receives it (token ids, never text)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    tenant: str = "default"  # whose request: fair admission counts it
    priority: int = DEFAULT_PRIORITY  # kvfleet.priority: lower runs first
    cache_salt: str = ""
    adapter: str = ""
    deadline: Optional[float] = None  # monotonic seconds
    cache_scope: str = ""  # the block-hash root's scope ("" = the tenant's own)
    # Structured output: the constraint, and its compiled grammar when the caller compiled it
    # off the engine thread (GrammarCache.compile_async); else add_request compiles it.
    constraint: Optional[Constraint] = None
    grammar: Any = None
    # Never restore from the host tier (a peer pull for it was refused: recompute instead).
    tier_skip: bool = False
