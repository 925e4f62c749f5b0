"""Adapters loaded and unloaded at run time on one replica (the Worker LoadAdapter /
UnloadAdapter RPCs): the adapter is checked off the engine thread and off the event loop;
its weights reach a slot on first use, as for adapters given at start. With a
:class:`~.adapter_record.AdapterRecord`, each change is also recorded for replicas that start
later (:meth:`AdapterAdmin.apply_record`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from kvfleet.errors import InvalidArgument, KvfleetError, PermissionDenied
from kvfleet.index_keys import REDIS_DOWN_ERRORS
from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.replica.adapter_catalog import adapter_files, check_name, confine
from kvfleet.worker.replica.adapter_record import UNLOADED, AdapterRecord
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.lora.config import AdapterError
from kvfleet.worker.runner.model_config import ModelConfig

log = logging.getLogger(__name__)


class AdapterAdmin:
    """Serve or stop serving adapters on ``residency`` for a model of ``config``; ``roots``:
    the only directories a load may read from (:func:`.adapter_catalog.adapter_roots`)."""

    def __init__(self, residency: AdapterResidency, config: ModelConfig, max_lora_rank: int,
                 roots: tuple[str, ...] = (), record: Optional[AdapterRecord] = None) -> None:
        self.residency, self.config, self.max_lora_rank = residency, config, max_lora_rank
        self.roots = roots
        self.record = record  # None: changes live only as long as this replica

    async def load(self, name: str, path: str) -> str:
        """Check ``path`` and serve it as ``name``; returns its revision.

        Raises:
            InvalidArgument: a bad name, a relative path, a path that is not a directory, or a
                bad adapter (the message names the file and the field).
            PermissionDenied: the path lies outside the replica's adapter directories
                (``..``, a symlink out, an absolute path elsewhere; the message names it).
        """
        try:
            check_name(name)
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="name") from None
        # Resolved once: what is read below (and served) is the directory that was checked,
        # not whatever ``path`` (a symlink) points at by then.
        checked = confine(path, self.roots)
        files = adapter_files(checked)
        if not checked.is_dir():
            raise InvalidArgument(f"path {path!r} is not a directory on this replica", field="path")
        try:
            spec = await asyncio.to_thread(check_adapter, name, checked, self.config,
                                           self.max_lora_rank)
        except AdapterError as exc:
            raise InvalidArgument(str(exc), field="path") from None
        if adapter_files(checked) != files:  # a file's symlink moved while it was read
            raise PermissionDenied(f"path {path!r}: its files changed while they were checked",
                                   field="path")
        self.residency.register(spec)
        await self._record(self.record and self.record.loaded(name, spec.path))
        return spec.revision

    async def unload(self, name: str) -> None:
        """Stop serving ``name``. Raises NotFound when it is not served."""
        self.residency.unregister(name)
        await self._record(self.record and self.record.unloaded(name))

    async def _record(self, write) -> None:
        if write is None:
            return
        try:
            await write
        except REDIS_DOWN_ERRORS as exc:  # served here now; only later replicas miss it
            log.warning("adapter change not recorded (Redis: %s): replicas started later will "
                        "not have it", exc)

    async def apply_record(self) -> None:
        """Apply the recorded runtime changes over the start-time adapters (a replica that
        starts after them serves what its peers serve). A recorded adapter this replica
        refuses (its files, its adapter directories) is logged and skipped."""
        if self.record is None:
            return
        recorded = await self.record.read()
        record, self.record = self.record, None  # applying is no new change: not re-recorded
        try:
            for name, path in sorted(recorded.items()):
                try:
                    if path is UNLOADED:
                        if name in self.residency.catalog:
                            await self.unload(name)
                    else:
                        await self.load(name, path)
                except KvfleetError as exc:
                    log.error("recorded adapter %r (%s) not served by this replica: %s", name,
                              path or "unloaded", exc)
        finally:
            self.record = record
