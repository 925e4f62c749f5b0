"""Layer-level yield's one seam: a step's forward that pauses between decoder layers for nested
steps of a higher class or a less-served tenant (:class:`LayerYield`).

The engine runs every step's forward through one object: its own whole-step forward, or, with
``SchedulerConfig.layer_yield``, a :class:`LayerYield`; nothing else in the engine or the
scheduler knows whether steps may pause. With layer yield, the
step's ``should_yield`` (called by the runner after each layer) is one cheap check of
:meth:`Arrivals.pending` while nothing new arrived. When something did, it takes the new
requests into the engine (new requests only: aborts and other controls wait for the step's
end) and pauses when the step yields to the head of the waiting queue
(:func:`~.nested.may_yield`); otherwise the forward goes on, and the same arrival is not looked
at again. Paused, it plans the nested step (:func:`~.nested.nested_step`), moves its host-tier
blocks (write-backs of what it evicted, restores of its hits), runs its forward on its own
(disjoint, free) slots, samples and emits its outputs at once through
:meth:`Arrivals.emit`, then resumes the paused forward, which may pause again for a later
arrival. Only a :class:`~kvfleet.worker.executor.base.PausableExecutor` can do this.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional, Protocol

import torch

from kvfleet.worker.engine.layer_yield.nested import may_yield, nested_step
from kvfleet.worker.engine.output.outputs import SeqOutput
from kvfleet.worker.engine.scheduling.output import SchedulerOutput
from kvfleet.worker.executor.base import Executor, PausableExecutor
from kvfleet.worker.kv_tier.moves import move_blocks

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


class LayerYield:
    """Forwards that pause between layers for nested steps of new arrivals they yield to
    (``auto``: only once the scheduler has taken requests that may yield to each other,
    :attr:`~kvfleet.worker.engine.scheduling.scheduler.Scheduler.competing`; before, every
    forward runs whole, as without layer yield).

    Raises:
        ValueError: ``executor`` cannot pause a forward.
    """

    def __init__(self, executor: Executor, auto: bool = False) -> None:
        self.auto = auto  # pause only once the replica's requests compete
        if not executor.pausable:
            raise ValueError("layer_yield (--layer-yield) needs an executor that can pause a "
                             "forward between layers")
        self.nested_steps = 0  # steps run while another step's forward paused (cumulative)

    def __call__(self, engine: Engine, out: SchedulerOutput, arrivals: Optional[Arrivals]
                 ) -> tuple[torch.Tensor, float]:
        """Run ``out``'s forward on ``engine.executor``, pausing for nested steps of new
        arrivals it yields to (whole when ``arrivals`` is None: a nested step itself).

        Returns:
            ``(logits, nested_s)``: ``out``'s float32 ``(out.plan.num_logit_rows, vocab)`` logits,
            as :meth:`Executor.execute` returns them, and the seconds spent in nested steps
            (not part of ``out``'s own forward time).

        Raises:
            Whatever ``out``'s forward raises (a nested forward's failure ends only its
            requests).
        """
        if arrivals is None or (self.auto and not engine.scheduler.competing):
            return engine.executor.execute(out.plan), 0.0
        executor: PausableExecutor = engine.executor  # type: ignore[assignment]  # checked above

        def should_yield() -> bool:
            if not arrivals.pending():
                return False
            arrivals.take()
            return may_yield(engine.scheduler, out)

        result = executor.execute_pausable(out.plan, should_yield)
        nested_s = 0.0
        while not isinstance(result, torch.Tensor):
            start = time.perf_counter()
            nested = nested_step(engine.scheduler, out, time.monotonic())
            # Its write-backs and restores touch no block the paused step holds (nested.py).
            nested = move_blocks(engine.executor, engine.scheduler, nested)
            self.nested_steps += bool(nested.scheduled)
            arrivals.emit(engine.run(nested, None))
            nested_s += time.perf_counter() - start
            result = executor.resume(result, should_yield)
        return result, nested_s
