"""A replica's scheduling limits (:class:`SchedulerConfig`), checked once at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvfleet.worker.engine.scheduling.priority_queue import PriorityRules
from kvfleet.worker.engine.speculative.speculator import check_mode

POLICIES = ("watermark", "reserve")
LAYER_YIELD_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling limits of one replica.

    ``watermark`` is the fraction of all blocks kept free when admitting new work under the
    ``watermark`` policy (so running sequences can grow without immediate preemption).
    ``max_waiting``: sequences that may wait beside a full running set; the replica holds at
    most ``max_sequences`` = ``max_num_seqs + max_waiting`` unfinished sequences in all (the
    same bound the worker's arrival count applies, so the engine never refuses one it let in).
    ``itl_target_ms``: a step's predicted forward time (ms) that prefill chunks may fill up to,
    beside the token budget (None: the token budget alone); under it a favoured prefill's step
    leaves out the rows it outranks (:mod:`.class_step`). ``tenant_share`` < 1: one tenant's
    share of the seats, which it may run past while a waiting tenant has been served more than
    it (seats follow service: :mod:`.seats`).

    Raises:
        ValueError: an unknown ``policy``, or a limit or share out of its range.
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_waiting: int = 256
    policy: str = "watermark"
    watermark: float = 0.01
    # Fraction of max_sequences (waiting + running, refused on arrival past it) and of
    # max_num_seqs (running) one tenant may hold on this replica (1.0: no per-tenant cap).
    tenant_share: float = 1.0
    itl_target_ms: Optional[float] = None
    # Priority classes: the fraction of max_num_seqs the batch band may run (1.0: no cap).
    batch_share: float = 1.0
    # Seats a better class may run past max_num_seqs beside a lower one (priority_queue.py,
    # "Headroom"); None: an eighth of max_num_seqs, at least one; 0: none (the seat is taken
    # from the lower class, by preemption if need be).
    class_headroom: Optional[int] = None
    # Layer-level yield (kvfleet.worker.engine.layer_yield): a step in flight pauses between
    # decoder layers for a nested step of newly arrived higher-class prompts. "on"; "auto":
    # once the replica has taken requests of more than one priority, where the executor can
    # pause; "off": whole steps. A bool is read as "on" / "off".
    layer_yield: str = "auto"
    # Speculative decoding (kvfleet.worker.engine.speculative): "off", "ngram" or "suffix";
    # drafts per decode row per step at most (the step-cost model sizes each row's 0..this).
    # Seven: a batch-1 row and its drafts stay one weight pass of the CPU few-row kernel's
    # eight-row tile; the sizing still hands a row fewer (or none) where drafts do not pay.
    speculative: str = "off"
    speculative_tokens: int = 7

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0 or self.max_waiting < 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be > 0, max_waiting >= 0")
        if not 0 <= self.watermark < 1:  # 1 keeps every block free: nothing new would run
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if not 0 < self.tenant_share <= 1:
            raise ValueError(f"tenant_share must be in (0, 1], got {self.tenant_share}")
        if self.itl_target_ms is not None and not 0 < self.itl_target_ms < float("inf"):
            raise ValueError(f"itl_target_ms must be > 0, got {self.itl_target_ms}")
        if isinstance(self.layer_yield, bool):
            object.__setattr__(self, "layer_yield", "on" if self.layer_yield else "off")
        if self.layer_yield not in LAYER_YIELD_MODES:
            raise ValueError(f"layer_yield must be one of {LAYER_YIELD_MODES}, got "
                             f"{self.layer_yield!r}")
        PriorityRules(self.max_num_seqs, self.batch_share, self.class_headroom)  # checks
        check_mode(self.speculative, self.speculative_tokens)

    @property
    def max_sequences(self) -> int:
        """Sequences the replica holds at most (running + waiting): its admission limit."""
        return self.max_num_seqs + self.max_waiting

