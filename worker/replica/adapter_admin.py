"""Adapters loaded and unloaded at run time on one replica (the Worker LoadAdapter /
UnloadAdapter RPCs): the adapter is checked off the engine thread and off the event loop;
its weights reach a slot on first use, as for adapters given at start."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvfleet.worker.engine.adapter_residency import AdapterResidency
from kvfleet.worker.replica.adapter_catalog import check_name, confine
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.lora.config import AdapterError
from kvfleet.worker.runner.model_config import ModelConfig

from kvfleet.errors import InvalidArgument


class AdapterAdmin:
    """Serve or stop serving adapters on ``residency`` for a model of ``config``; ``roots``:
    the only directories a load may read from (:func:`.adapter_catalog.adapter_roots`)."""

    def __init__(self, residency: AdapterResidency, config: ModelConfig, max_lora_rank: int,
                 roots: tuple[str, ...] = ()) -> None:
        self.residency, self.config, self.max_lora_rank = residency, config, max_lora_rank
        self.roots = roots

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
        confine(path, self.roots)
        if not Path(path).is_dir():
            raise InvalidArgument(f"path {path!r} is not a directory on this replica", field="path")
        try:
            spec = await asyncio.to_thread(check_adapter, name, path, self.config,
                                           self.max_lora_rank)
        except AdapterError as exc:
            raise InvalidArgument(str(exc), field="path") from None
        self.residency.register(spec)
        return spec.revision

    def unload(self, name: str) -> None:
        """Stop serving ``name``. Raises NotFound when it is not served."""
        self.residency.unregister(name)
