"""Which adapters sit in a replica's ``max_loras`` slots: LRU, loaded on first use, off the
engine thread.

A request for an adapter that is not resident waits while a loader thread reads the adapter
into a free slot, or into the least recently used slot no request holds; an adapter that a
live request holds is never evicted. Each live request holds one reference to its slot.

**Revisions.** A request acquires exactly the adapter revision it was hashed under (the
:class:`AdapterSpec` pinned at admission), even when a newer revision of the name was
registered while it waited; the loader verifies the files are still that revision
(:func:`~kvfleet.worker.runner.lora.adapter.verified_tensors`), else the request fails
FAILED_PRECONDITION naming the file.

**No starvation** (the S-LoRA / vLLM rule). When every slot is held, a waiting adapter claims
one slot (the least recently used one not loading): from then on no new request of the
adapter in that slot is admitted onto it, so its references drain as its running requests
finish and the waiting adapter loads there (the slot stays claimed for it until one of its
requests takes a reference, so no other load evicts it first). A wait is therefore bounded by the running
requests of one slot; ``max_wait_s`` bounds it in seconds too (the request then ends
RESOURCE_EXHAUSTED naming the adapter). Claims are re-made in arrival order on every pass of
the waiting queue (:meth:`reset_claims`), so a cancelled waiter never keeps one.

The engine thread calls :meth:`acquire`, :meth:`release` and :meth:`ready`; only the loader
thread calls the runner's ``load_adapter`` (which every tensor-parallel rank then runs).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvfleet.errors import FailedPrecondition, KvfleetError, NotFound, StatusError
from kvfleet.worker.runner.lora.adapter import AdapterSpec

log = logging.getLogger(__name__)

DEFAULT_MAX_WAIT_S = 60.0  # a request waits at most this long for its adapter's slot


@dataclass
class _Slot:
    name: str | None = None
    revision: str = ""
    refs: int = 0
    loading: Future | None = None
    error: BaseException | None = field(default=None, repr=False)
    # (name, revision) of a waiting adapter this slot drains for: no new reference is taken.
    claimed_by: tuple[str, str] | None = None


class AdapterResidency:
    """LRU adapter slots over ``runner`` (anything with ``load_adapter(slot, spec)`` and
    ``unload_adapter(slot)``).

    Args:
        catalog: the adapters this replica may serve, by name (checked specs).
        max_loras: slots (>= 1 when the catalog is not empty).
        max_wait_s: seconds a request may wait for its adapter's slot (> 0).
    """

    def __init__(self, runner, catalog: dict[str, AdapterSpec], max_loras: int,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        if catalog and max_loras < 1:
            raise ValueError("max_loras must be at least 1 to serve adapters")
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0 seconds, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        self.runner = runner
        self.catalog = dict(catalog)
        self.max_loras = max_loras
        self._slots = {i: _Slot() for i in range(1, max_loras + 1)}
        self._lru: OrderedDict[int, None] = OrderedDict((i, None) for i in self._slots)
        self._lock = threading.Lock()
        self._loaded = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-loader") if max_loras else None

    def spec(self, name: str) -> AdapterSpec:
        """The servable adapter ``name``. Raises NotFound naming it."""
        spec = self.catalog.get(name)
        if spec is None:
            raise NotFound(f"adapter {name!r} is not served by this replica", field="adapter")
        return spec

    def register(self, spec: AdapterSpec) -> None:
        """Serve ``spec`` under its name from now on (a new revision of a served name
        replaces it for new requests: those hashed under the old one, running or waiting,
        run on the old one)."""
        with self._lock:
            self.catalog[spec.name] = spec

    def unregister(self, name: str) -> None:
        """Stop serving ``name`` (requests holding it finish; its slot is then reused).

        Raises:
            NotFound: it is not served.
        """
        with self._lock:
            if self.catalog.pop(name, None) is None:
                raise NotFound(f"adapter {name!r} is not served by this replica", field="adapter")

    def _slot_of(self, name: str, revision: str) -> int | None:
        for i, s in self._slots.items():
            if s.name == name and s.revision == revision:
                return i
        return None

    def acquire(self, want: AdapterSpec | str) -> int | None:
        """Take a reference to the slot holding ``want`` (the spec pinned at admission, or a
        name: its revision served now) and return it when resident; otherwise start loading
        exactly that revision (when a slot can be freed, else claim one: see the module
        docstring) and return None: call again once :meth:`ready` fires.

        Raises:
            NotFound: the adapter's name is no longer in the catalog.
            FailedPrecondition: its last load failed, e.g. its files changed or are gone
                (the message names the file); a :class:`KvfleetError` of the load keeps its code.
        """
        spec = self.spec(want) if isinstance(want, str) else want
        self.spec(spec.name)  # unloaded since: NotFound
        key = (spec.name, spec.revision)
        with self._lock:
            i = self._slot_of(*key)
            if i is not None:
                slot = self._slots[i]
                if slot.error is not None:
                    err, slot.name, slot.error = slot.error, None, None
                    raise _load_failed(spec, err)
                if slot.loading is not None or slot.claimed_by not in (None, key):
                    return None  # loading, or draining for a waiting adapter
                slot.claimed_by = None  # (a claim of its own: loaded for it, now taken)
                slot.refs += 1
                self._lru.move_to_end(i)
                return i
            victim = next((j for j in self._lru if self._slots[j].refs == 0
                           and self._slots[j].loading is None
                           and self._slots[j].claimed_by in (None, key)), None)
            if victim is None:
                self._claim(key)  # every slot is held or loading: wait, draining one
                return None
            for s in self._slots.values():  # its wait is over: any claim it made goes
                if s.claimed_by == key:
                    s.claimed_by = None
            slot = self._slots[victim]
            # Claimed for itself until a request takes it: no other load evicts it first.
            slot.name, slot.revision, slot.error, slot.claimed_by = spec.name, spec.revision, None, key
            self._lru.move_to_end(victim)
            assert self._pool is not None  # max_loras >= 1 whenever a spec exists
            slot.loading = self._pool.submit(self._load, victim, spec)
            return None

    def _claim(self, key: tuple[str, str]) -> None:
        """Reserve one slot (least recently used, not loading, unclaimed) for ``key``."""
        if any(s.claimed_by == key for s in self._slots.values()):
            return
        j = next((j for j in self._lru if self._slots[j].loading is None
                  and self._slots[j].claimed_by is None), None)
        if j is not None:
            self._slots[j].claimed_by = key

    def reset_claims(self) -> None:
        """Drop every claim (the waiting queue re-makes them, in arrival order)."""
        with self._lock:
            for s in self._slots.values():
                s.claimed_by = None

    def _load(self, i: int, spec: AdapterSpec) -> None:
        try:
            self.runner.load_adapter(i, spec)
            error = None
        except Exception as exc:  # reported to the requests waiting for it
            log.exception("loading adapter %r into slot %d failed", spec.name, i)
            error = exc
        with self._lock:
            self._slots[i].loading, self._slots[i].error = None, error
        self._loaded.set()

    def release(self, slot: int) -> None:
        """Drop one reference to ``slot`` (taken by :meth:`acquire`)."""
        with self._lock:
            s = self._slots[slot]
            assert s.refs > 0, f"adapter slot {slot} released more often than acquired"
            s.refs -= 1
        self._loaded.set()  # a waiting request may now take this slot

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until a load finished or a slot was released."""
        self._loaded.wait(timeout_s)
        self._loaded.clear()

    def resident(self) -> dict[str, str]:
        """Loaded adapters still served at the loaded revision, name → revision (loads in
        flight, and slots left by an unloaded or replaced revision, excluded)."""
        with self._lock:
            return {s.name: s.revision for s in self._slots.values()
                    if s.name and s.loading is None and s.error is None
                    and s.name in self.catalog and self.catalog[s.name].revision == s.revision}

    def servable(self) -> dict[str, str]:
        """Every adapter this replica may serve, name → revision."""
        return {n: s.revision for n, s in self.catalog.items()}

    def close(self) -> None:
        """Stop the loader thread (a load in flight finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _load_failed(spec: AdapterSpec, err: BaseException) -> KvfleetError:
    """The error a request gets when its adapter's load failed: the load's own status when it
    had one (a changed file: FAILED_PRECONDITION; a failed rank: UNAVAILABLE), else
    FAILED_PRECONDITION; the message names the adapter and the cause."""
    message = f"adapter {spec.name!r} (revision {spec.revision}) failed to load: {err}"
    if isinstance(err, KvfleetError):
        return StatusError(err.code, message)
    return FailedPrecondition(message, field="adapter")
