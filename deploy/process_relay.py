"""Waiting for a child process's ready line while its stdout keeps flowing somewhere."""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
import time
from typing import Optional, TextIO


def wait_ready(proc: subprocess.Popen, marker: str, timeout_s: float,
               sink: Optional[TextIO] = None) -> str:
    """Wait for the line starting with ``marker`` on ``proc``'s stdout (a text pipe) and return
    its last word; every other line, before and after, is copied to ``sink`` (default: this
    process's stdout) by a daemon thread. The pipe must be drained for the process's whole
    life: a child that prints to it (e.g. ``OTEL_TRACES_EXPORTER=console``) would otherwise
    block once the pipe's buffer (64 KiB) is full.

    Raises RuntimeError if the process exits first, TimeoutError after ``timeout_s`` seconds.
    """
    stdout = proc.stdout
    if stdout is None:
        raise ValueError("wait_ready needs a process started with stdout=subprocess.PIPE")
    found: queue.Queue[str] = queue.Queue()

    def relay() -> None:
        out = sink or sys.stdout
        with contextlib.suppress(ValueError, OSError):  # pipe or sink closed at shutdown
            for line in stdout:
                if found.empty() and line.startswith(marker):
                    found.put(line.split()[-1])
                    continue
                out.write(line)
                out.flush()
        found.put("")  # EOF: the process closed its stdout

    threading.Thread(target=relay, name=f"relay-{proc.pid}", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            address = found.get(timeout=0.2)
            if address:
                return address
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            how = ("still runs" if proc.returncode is None
                   else f"exited with code {proc.returncode}")
            raise RuntimeError(f"{marker.strip()!r} never came: the process closed its stdout "
                               f"and {how} (see its error above)")
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before "
                               f"{marker.strip()!r} (see its error above)")
    raise TimeoutError(f"no {marker.strip()!r} within {timeout_s} s")
