"""An exclusive lock across the processes of one host, on a lock file, with a bounded wait:
replicas starting together use it so that one of them does a shared piece of work (the
step-cost calibration) while the others wait for its result."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Iterator, Optional

log = logging.getLogger(__name__)


@contextlib.contextmanager
def host_lock(path: Optional[Path], wait_s: float, poll_s: float = 0.1) -> Iterator[bool]:
    """Hold ``flock(LOCK_EX)`` on ``path`` (created, with its folder, when missing) for the
    ``with`` block; yields True when held. Waits at most ``wait_s`` seconds for another holder,
    then yields False and the block runs unlocked (logged): a stuck holder delays, never
    blocks. ``path`` None, or a lock file that cannot be opened, yields False at once. The lock
    dies with its holder (the kernel drops it when the process exits), so a crashed holder
    never leaves it stuck. The file itself is left in place (removing it would race a waiter).

    Raises:
        ValueError: ``wait_s`` negative or not finite.
    """
    if not (wait_s >= 0 and wait_s != float("inf")):
        raise ValueError(f"wait_s must be finite and >= 0, got {wait_s}")
    if path is None:
        yield False
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        log.warning("lock %s not opened (%s): going on unlocked", path, exc)
        yield False
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("lock %s still held after %.0f s: going on unlocked", path, wait_s)
                    held = False
                    break
                time.sleep(poll_s)
        yield held
    finally:
        os.close(fd)  # closing the descriptor releases the lock
