"""Which adapters sit in a replica's ``max_loras`` slots: LRU, loaded on first use, off the
engine thread.

A request for an adapter that is not resident waits (it never fails) while a loader thread
reads the adapter into a free slot, or into the least recently used slot no request holds; an
adapter that a live request holds is never evicted. When every slot is held, the request
waits for one to be released. Each live request holds one reference to its slot.

The engine thread calls :meth:`acquire`, :meth:`release` and :meth:`ready`; only the loader
thread calls the runner's ``load_adapter`` (which every tensor-parallel rank then runs).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvfleet.errors import NotFound
from kvfleet.worker.runner.lora.adapter import AdapterSpec

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    name: str | None = None
    revision: str = ""
    refs: int = 0
    loading: Future | None = None
    error: BaseException | None = field(default=None, repr=False)


class AdapterResidency:
    """LRU adapter slots over ``runner`` (anything with ``load_adapter(slot, spec)`` and
    ``unload_adapter(slot)``).

    Args:
        catalog: the adapters this replica may serve, by name (checked specs).
        max_loras: slots (>= 1 when the catalog is not empty).
    """

    def __init__(self, runner, catalog: dict[str, AdapterSpec], max_loras: int) -> None:
        if catalog and max_loras < 1:
            raise ValueError("max_loras must be at least 1 to serve adapters")
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
        replaces it: requests already holding the old one finish on it)."""
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

    def acquire(self, name: str) -> int | None:
        """Take a reference to ``name``'s slot and return it when the adapter is resident;
        otherwise start loading it (when a slot can be freed) and return None: call again
        once :meth:`ready` fires.

        Raises:
            NotFound: the adapter is not in the catalog.
            RuntimeError: the adapter's last load failed (the message says why).
        """
        spec = self.spec(name)
        with self._lock:
            i = self._slot_of(name, spec.revision)
            if i is not None:
                slot = self._slots[i]
                if slot.error is not None:
                    err, slot.name, slot.error = slot.error, None, None
                    raise RuntimeError(f"adapter {name!r} failed to load: {err}") from err
                if slot.loading is not None:
                    return None
                slot.refs += 1
                self._lru.move_to_end(i)
                return i
            victim = next((j for j in self._lru if self._slots[j].refs == 0
                           and self._slots[j].loading is None), None)
            if victim is None:
                return None  # every slot is held or loading: wait for a release
            slot = self._slots[victim]
            slot.name, slot.revision, slot.error = name, spec.revision, None
            self._lru.move_to_end(victim)
            slot.loading = self._pool.submit(self._load, victim, spec)
            return None

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
