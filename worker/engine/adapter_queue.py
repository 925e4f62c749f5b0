"""The engine's side of adapters: a request's chain root under its adapter's revision, and
requests held back until their adapter is resident (then queued in the scheduler holding one
reference to its slot, released when the request ends)."""

from __future__ import annotations

from typing import Callable

from kvfleet.allocator.hashing import CacheIdentity
from kvfleet.errors import KvfleetError, NotFound
from kvfleet.worker.engine.adapter_residency import AdapterResidency
from kvfleet.worker.engine.request import SequenceState


class AdapterQueue:
    """Requests for adapters of ``residency`` in front of ``scheduler``; ``identity`` is the
    served model's (its digest keys base-model requests). ``residency`` None: no adapter is
    served (a request naming one is NOT_FOUND)."""

    def __init__(self, residency: AdapterResidency | None, identity: CacheIdentity | None,
                 base_digest: bytes, scheduler) -> None:
        if residency is not None and identity is None:
            raise ValueError("an engine serving adapters needs the model's CacheIdentity")
        self.residency, self.identity, self.base_digest = residency, identity, base_digest
        self.scheduler = scheduler
        self._digests: dict[tuple[str, str], bytes] = {}
        self._waiting: list[tuple[str, list[SequenceState]]] = []  # arrival order
        self._slot_of: dict[str, int] = {}  # request_id -> adapter slot it holds

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def digest_for(self, adapter: str) -> bytes:
        """The identity digest of a chain root: the model's, or the model's with the adapter's
        name and content revision (a reloaded adapter gets new block hashes).

        Raises:
            NotFound: the adapter is not served here (the message names it).
        """
        if not adapter:
            return self.base_digest
        if self.residency is None:
            raise NotFound(f"adapter {adapter!r} is not served by this replica", field="adapter")
        key = (adapter, self.residency.spec(adapter).revision)
        if key not in self._digests:
            self._digests[key] = self.identity.with_adapter(*key).digest()
        return self._digests[key]

    def add(self, adapter: str, seqs: list[SequenceState]) -> None:
        """Queue a request's ``seqs`` now if ``adapter`` is resident, else hold them until it
        is. Raises what :meth:`Scheduler.add` raises when queued at once."""
        first = seqs[0]
        self.scheduler.check_can_ever_fit(first.num_prompt_tokens, first.params.max_tokens, len(seqs))
        if not self._start(adapter, seqs):
            self._waiting.append((adapter, seqs))

    def _start(self, adapter: str, seqs: list[SequenceState]) -> bool:
        slot = self.residency.acquire(adapter)
        if slot is None:
            return False
        for s in seqs:
            s.adapter_slot = slot
        try:
            self.scheduler.add(seqs)
        except BaseException:
            self.residency.release(slot)
            raise
        self._slot_of[seqs[0].request_id] = slot
        return True

    def admit(self, fail: Callable[[SequenceState, BaseException], object]) -> list:
        """Queue the held requests whose adapter is now resident, in arrival order; ``fail``
        ends a sample whose adapter failed to load or that the scheduler refused, and returns
        its output. Returns those outputs."""
        outputs, still = [], []
        for adapter, seqs in self._waiting:
            try:
                if not self._start(adapter, seqs):
                    still.append((adapter, seqs))
            except (KvfleetError, RuntimeError) as exc:
                outputs += [fail(s, exc) for s in seqs]
        self._waiting = still
        return outputs

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for a load or a release (nothing else to run)."""
        if self.residency is not None:
            self.residency.wait(timeout_s)

    def request_done(self, request_id: str) -> None:
        """Every sample of ``request_id`` ended: drop it and release its slot reference."""
        self._waiting = [(a, g) for a, g in self._waiting if g[0].request_id != request_id]
        if request_id in self._slot_of:
            self.residency.release(self._slot_of.pop(request_id))
