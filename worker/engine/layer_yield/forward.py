"""Layer-level yield, the engine's side: run a step's forward so that it pauses between
decoder layers for a nested step (:mod:`.nested` plans it; docs/slo.md §2).

The step's ``should_yield`` (called by the runner after each layer) is one cheap check of
:meth:`Arrivals.pending` while nothing new arrived. When something did, it takes the new
requests into the engine (new requests only: aborts and other controls wait for the step's
end) and pauses when the step yields to the head of the waiting queue
(:func:`~.nested.may_yield`); otherwise the forward goes on, and the same arrival is not
looked at again. Paused, the engine plans the nested step, runs its forward on its own
(disjoint, free) slots, samples and emits its outputs at once through
:meth:`Arrivals.emit`, then resumes the paused forward, which may pause again for a later
arrival. Only a :class:`~kvfleet.worker.executor.base.PausableExecutor` (tp = 1) can do this.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import torch

from kvfleet.worker.engine.layer_yield.nested import may_yield
from kvfleet.worker.engine.output.outputs import SeqOutput
from kvfleet.worker.engine.scheduling.output import SchedulerOutput

if TYPE_CHECKING:  # annotations only: the engine imports this module
    from kvfleet.worker.engine.engine import Engine


class Arrivals(Protocol):
    """Where new requests reach the engine thread while a step runs (the engine loop's inbox)."""

    def pending(self) -> bool:
        """True when a request may have arrived since the last :meth:`take` (called after
        every layer: an attribute or ``threading.Event`` read, never a lock or a queue scan)."""
        ...

    def take(self) -> None:
        """Add the requests that arrived to the engine (``Engine.add_request``, on the engine
        thread); leave every other control (aborts, ...) for after the step. Clears
        :meth:`pending`."""
        ...

    def emit(self, outputs: list[SeqOutput]) -> None:
        """Deliver outputs to their streams now (a nested step's, before its paused step ends)."""
        ...


def execute_yielding(engine: Engine, out: SchedulerOutput, arrivals: Arrivals
                     ) -> tuple[torch.Tensor, float]:
    """Run ``out``'s forward on ``engine.executor`` (a PausableExecutor), pausing for nested
    steps of new arrivals it yields to.

    Returns:
        ``(logits, nested_s)``: ``out``'s float32 ``(len(out.plan.chunks), vocab)`` logits,
        as :meth:`Executor.execute` returns them, and the seconds spent in nested steps
        (not part of ``out``'s own forward time).

    Raises:
        Whatever ``out``'s forward raises (a nested forward's failure ends only its requests).
    """
    executor = engine.executor

    def should_yield() -> bool:
        if not arrivals.pending():
            return False
        arrivals.take()
        return may_yield(engine.scheduler, out)

    result = executor.execute_pausable(out.plan, should_yield)  # type: ignore[attr-defined]
    nested_s = 0.0
    while not isinstance(result, torch.Tensor):
        start = time.perf_counter()
        arrivals.emit(engine.run_nested(out))
        nested_s += time.perf_counter() - start
        result = executor.resume(result, should_yield)  # type: ignore[attr-defined]
    return result, nested_s
