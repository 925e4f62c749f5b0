"""Ranks 0..T-1 of a real gloo group as threads of the test process (no Ray, no model)."""

from __future__ import annotations

import threading
from typing import Any, Callable

from kvfleet.worker.executor.tp.comm import GroupAddress, RankComm, host_store


def on_ranks(world: int, body: Callable[[RankComm], Any], **addr_options) -> tuple[list, GroupAddress]:
    """``body(comm)`` on every rank of a fresh group (``addr_options``: extra
    :class:`GroupAddress` fields; ``shm_name`` may hold ``{port}``); every rank's result, and
    the group's address. Re-raises the first rank's error."""
    store = host_store("127.0.0.1", world, 30)
    if "shm_name" in addr_options:
        addr_options["shm_name"] = addr_options["shm_name"].format(port=store.port)
    addr = GroupAddress("127.0.0.1", store.port, world, timeout_s=30, **addr_options)
    out: list = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            out[r] = body(RankComm(addr, r, store=store if r == 0 else None))
        except BaseException as exc:  # surfaced in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out, addr
