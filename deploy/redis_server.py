"""A private ``redis-server`` on a free loopback port (for ``kvfleet up`` and tests).

Started with no persistence (``--save "" --appendonly no``); never assumes port 6379.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A running private redis-server process; ``stop()`` ends it and removes its dir."""

    port: int
    process: subprocess.Popen
    workdir: str
    host: str = "127.0.0.1"
    _stopped: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_redis(port: int | None = None, timeout_s: float = 10.0) -> RedisServer:
    """Start ``redis-server`` on 127.0.0.1 and wait until it answers PING.

    Raises:
        FileNotFoundError: ``redis-server`` is not installed (the message says how to get it).
        RuntimeError: it did not come up within ``timeout_s`` seconds.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError(
            "redis-server not found: install it (Debian: apt-get install -y redis-server) "
            "or pass --redis-url to use an existing Redis"
        )
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="kvfleet-redis-")
    proc = subprocess.Popen(
        [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", workdir, "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    server = RedisServer(port=port, process=proc, workdir=workdir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"redis-server exited with code {proc.returncode} on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s} s")
