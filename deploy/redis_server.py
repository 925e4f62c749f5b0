"""A private ``redis-server`` on a free loopback port (for ``kvfleet up`` and tests).

Started with no persistence (``--save "" --appendonly no``); never assumes port 6379.
Optionally with a password (``requirepass``) and/or TLS only (``--tls-port``, no plaintext
port); :attr:`RedisServer.url` then carries them (``redis://:pw@…``, ``rediss://…``).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class RedisTLS:
    """PEM files of a TLS redis-server: its certificate and key, and the CA that signed it
    (clients verify the server with it; the server asks no client certificate)."""

    cert_file: str
    key_file: str
    ca_file: str


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
    password: Optional[str] = None
    tls: Optional[RedisTLS] = None
    _stopped: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        """The URL routers and workers take (redis-py's form: password, ``rediss`` + CA)."""
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}{self.host}:{self.port}/0"
        ca = urllib.parse.quote(self.tls.ca_file)
        return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"

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


def start_redis(port: int | None = None, timeout_s: float = 10.0, *,
                password: Optional[str] = None, tls: Optional[RedisTLS] = None) -> RedisServer:
    """Start ``redis-server`` on 127.0.0.1 and wait until it answers PING (with ``password``:
    ``requirepass``; with ``tls``: TLS only, on ``port``).

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
    args = [exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", workdir, "--protected-mode", "yes"]
    if tls is None:
        args += ["--port", str(port)]
    else:
        args += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", tls.cert_file,
                 "--tls-key-file", tls.key_file, "--tls-ca-cert-file", tls.ca_file,
                 "--tls-auth-clients", "no"]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(port=port, process=proc, workdir=workdir, password=password, tls=tls)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"redis-server exited with code {proc.returncode} on port {port}")
        try:
            if _answers_ping(port, tls):
                return server
        except OSError:
            pass
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s} s")


def _answers_ping(port: int, tls: Optional[RedisTLS]) -> bool:
    """True once the server answers PING (``-NOAUTH`` is an answer: it wants the password).
    Raises OSError while it does not accept connections yet."""
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
        sock = raw
        if tls is not None:
            sock = ssl.create_default_context(cafile=tls.ca_file).wrap_socket(
                raw, server_hostname="127.0.0.1")
        sock.sendall(b"PING\r\n")
        reply = sock.recv(16)
        return reply.startswith((b"+PONG", b"-NOAUTH"))
