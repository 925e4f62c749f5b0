"""Hand freed heap memory back to the operating system.

glibc keeps what a thread frees in that thread's malloc arena; a stopped replica's weights
and KV cache were allocated by several threads, so the process keeps that RSS after the
tensors are gone, and the next replica's threads fill other arenas (a bench that built fleet
after fleet grew by a fleet's memory each time: docs/kv_tier.md). ``malloc_trim(0)``
returns every arena's free pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Optional

log = logging.getLogger(__name__)


@functools.cache
def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def trim_heap() -> bool:
    """Return the process's free heap pages to the OS (glibc's ``malloc_trim``). False where
    there is no glibc (macOS, musl): nothing done. Takes a few ms; call after freeing much."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True
