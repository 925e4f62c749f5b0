"""The engine's side of adapters: a request's chain root under its adapter's revision, and
requests held back until their adapter is resident (then queued in the scheduler holding one
reference to its slot, released when the request ends).

A request's adapter revision is pinned once, at admission (:meth:`AdapterQueue.pin`): the
revision its blocks are hashed under is the one it acquires and runs, whatever is registered
while it waits."""

from __future__ import annotations

import time
from typing import Callable

from kvfleet.allocator.hashing import CacheIdentity
from kvfleet.errors import KvfleetError, NotFound, ResourceExhausted
from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.engine.request import SequenceState
from kvfleet.worker.runner.lora.adapter import AdapterSpec


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
        # (pinned spec, samples, monotonic time it started waiting), in arrival order
        self._waiting: list[tuple[AdapterSpec, list[SequenceState], float]] = []
        self._slot_of: dict[str, int] = {}  # request_id -> adapter slot it holds

    @property
    def _res(self) -> AdapterResidency:
        assert self.residency is not None, "no adapter is served here (pin() refuses first)"
        return self.residency

    @property
    def _identity(self) -> CacheIdentity:
        assert self.identity is not None, "an engine serving adapters has the model's identity"
        return self.identity

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def pin(self, adapter: str) -> AdapterSpec | None:
        """The revision of ``adapter`` a new request hashes with and runs on (None: the base
        model).

        Raises:
            NotFound: the adapter is not served here (the message names it).
        """
        if not adapter:
            return None
        if self.residency is None:
            raise NotFound(f"adapter {adapter!r} is not served by this replica", field="adapter")
        return self.residency.spec(adapter)

    def digest_for(self, spec: AdapterSpec | None) -> bytes:
        """The identity digest of a chain root: the model's (``spec`` None), or the model's
        with the pinned adapter's name and content revision (a new revision gets new block
        hashes)."""
        if spec is None:
            return self.base_digest
        key = (spec.name, spec.revision)
        if key not in self._digests:
            self._digests[key] = self._identity.with_adapter(*key).digest()
        return self._digests[key]

    def add(self, spec: AdapterSpec, seqs: list[SequenceState]) -> None:
        """Queue a request's ``seqs`` now if its pinned adapter revision is resident, else
        hold them until it is. Raises what :meth:`Scheduler.add` raises when queued at once."""
        first = seqs[0]
        self.scheduler.check_can_ever_fit(first.num_prompt_tokens, first.params.max_tokens, len(seqs))
        if not self._start(spec, seqs):
            self._waiting.append((spec, seqs, time.monotonic()))

    def _start(self, spec: AdapterSpec, seqs: list[SequenceState]) -> bool:
        slot = self._res.acquire(spec)
        if slot is None:
            return False
        for s in seqs:
            s.adapter_slot = slot
        try:
            self.scheduler.add(seqs)
        except BaseException:
            self._res.release(slot)
            raise
        self._slot_of[seqs[0].request_id] = slot
        return True

    def admit(self, fail: Callable[[SequenceState, BaseException], object]) -> list:
        """Queue the held requests whose adapter is now resident, in arrival order (each one
        still waiting claims a slot anew: see :mod:`.residency`); ``fail`` ends a
        sample whose adapter failed to load, that waited past the residency's ``max_wait_s``,
        or that the scheduler refused, and returns its output. Returns those outputs."""
        outputs, still = [], []
        self._res.reset_claims()
        now = time.monotonic()
        for spec, seqs, since in self._waiting:
            try:
                if self._start(spec, seqs):
                    continue
                if now - since > self._res.max_wait_s:
                    raise ResourceExhausted(
                        f"adapter {spec.name!r} waited {now - since:.1f} s for one of this "
                        f"replica's {self._res.max_loras} adapter slots (at most "
                        f"{self._res.max_wait_s:g} s); retry", field="adapter")
                still.append((spec, seqs, since))
            except (KvfleetError, RuntimeError) as exc:
                outputs += [fail(s, exc) for s in seqs]
        self._waiting = still
        if not still:
            self._res.reset_claims()  # a claim made by a request that just failed
        return outputs

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for a load or a release (nothing else to run)."""
        if self.residency is not None:
            self._res.wait(timeout_s)

    def request_done(self, request_id: str) -> None:
        """Every sample of ``request_id`` ended: drop it and release its slot reference."""
        self._waiting = [w for w in self._waiting if w[1][0].request_id != request_id]
        if not self._waiting and self.residency is not None:
            self.residency.reset_claims()  # no waiter is left to drain a slot for
        if request_id in self._slot_of:
            self._res.release(self._slot_of.pop(request_id))
