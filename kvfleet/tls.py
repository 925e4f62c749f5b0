"""TLS for the router's client port and mutual TLS between router and workers.

Client port: a certificate and key (PEM files) the operator provides (``--tls-cert`` /
``--tls-key``); clients verify it with their CA (``kvfleet generate --tls-ca``).

Inside the cluster, an *internal TLS directory* holds one cluster CA and three leaf
certificates signed by it (file names defined once here)::

    ca.pem                    the cluster CA certificate(s) (trusted by every side)
    worker.pem, worker.key    served by every worker (DNS name ``kvfleet-worker``)
    router.pem, router.key    presented by every router to the workers (client auth)
    replica.pem, replica.key  presented by a replica to a peer's worker port for a peer
                              pull (client auth; the peer lets it call ``ExportBlocks`` only)
    ca.key                    the CA's key, only where :func:`~kvfleet.tls_ca.generate_internal_tls` made it
                              (it lets ``renew_internal_tls`` re-issue under the same CA)

Each role reads only its own files: a router :data:`ROUTER_FILES` (:class:`RouterTLS`), a
worker :data:`WORKER_FILES` and, when present, :data:`REPLICA_FILES` (:class:`WorkerTLS`).
So a worker's host (a Kubernetes worker pod mounts only those items) never holds the router's
key, and a compromised worker cannot call the others as the router (any tenant, Drain,
LoadAdapter). Workers require a client certificate signed by the cluster CA: a process that
reaches a worker's port without one cannot generate on it. Routers reach workers by IP
address, so they verify the worker certificate against the fixed name ``kvfleet-worker``
(``grpc.ssl_target_name_override``), not the address.

Mutual TLS is on whenever replicas serve beyond loopback (:func:`needs_internal_tls`): a worker
refuses to bind a non-loopback address in plaintext. Files are written atomically, keys created
mode 0600 in a 0700 directory (never readable by others, not even for an instant). Rotation:
:func:`kvfleet.tls_ca.renew_internal_tls` replaces the files in place; workers pick the new ones up at their
next TLS handshake (:func:`reloading_worker_credentials`), routers on SIGHUP.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import grpc

log = logging.getLogger(__name__)

WORKER_NAME = "kvfleet-worker"  # the DNS name in every worker certificate
ROUTER_NAME = "kvfleet-router"
REPLICA_NAME = "kvfleet-replica"  # a replica calling a peer's ExportBlocks (a peer pull)
ROUTER_FILES = ("ca.pem", "router.pem", "router.key")
WORKER_FILES = ("ca.pem", "worker.pem", "worker.key")
REPLICA_FILES = ("replica.pem", "replica.key")  # beside WORKER_FILES: peer pulls under TLS
FILES = ("ca.pem", "worker.pem", "worker.key", "router.pem", "router.key", "replica.pem",
         "replica.key")  # a whole directory, as generated (the operator's copy)
CA_KEY = "ca.key"
CERT_DAYS = 365
CA_RENEW_DAYS = 30  # renew_internal_tls makes a new CA when the old one has fewer days left


def _read(directory: str | Path, names: tuple[str, ...]) -> list[bytes]:
    """The files ``names`` of ``directory``. Raises FileNotFoundError naming the first
    missing one."""
    d = Path(directory)
    for name in names:
        if not (d / name).is_file():
            raise FileNotFoundError(f"internal TLS directory {d}: {name} is missing")
    return [(d / name).read_bytes() for name in names]


@dataclass(frozen=True)
class RouterTLS:
    """A router's side of internal TLS: the cluster CA and the router's client certificate."""

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: str | Path) -> "RouterTLS":
        """:data:`ROUTER_FILES` of ``directory``. Raises FileNotFoundError naming the first
        missing file."""
        return cls(*_read(directory, ROUTER_FILES))

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel to a worker: trusts the cluster CA, presents the router certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


@dataclass(frozen=True)
class WorkerTLS:
    """A worker's side of internal TLS: the cluster CA, the worker's server certificate and,
    where the directory has one, the replica client certificate of peer pulls."""

    ca: bytes
    cert: bytes
    key: bytes
    replica: Optional[tuple[bytes, bytes]] = None  # (certificate, key)

    @classmethod
    def load(cls, directory: str | Path) -> "WorkerTLS":
        """:data:`WORKER_FILES` of ``directory``, and :data:`REPLICA_FILES` when both are
        there (a directory issued before them has none: no peer pulls under TLS).

        Raises FileNotFoundError naming the first missing file (one replica file without
        the other included)."""
        ca, cert, key = _read(directory, WORKER_FILES)
        present = [(Path(directory) / name).is_file() for name in REPLICA_FILES]
        replica = tuple(_read(directory, REPLICA_FILES)) if any(present) else None
        return cls(ca, cert, key, replica)  # type: ignore[arg-type]

    def server_credentials(self) -> grpc.ServerCredentials:
        """The worker port: its certificate, and a client certificate required."""
        return grpc.ssl_server_credentials([(self.key, self.cert)],
                                           root_certificates=self.ca, require_client_auth=True)



@dataclass(frozen=True)
class InternalTLS:
    """The PEM bytes of a whole internal TLS directory, as generated (see the module
    docstring); each process reads only its role's part (:meth:`router`, :meth:`worker`)."""

    ca: bytes
    worker_cert: bytes
    worker_key: bytes
    router_cert: bytes
    router_key: bytes
    replica_cert: bytes
    replica_key: bytes

    @classmethod
    def load(cls, directory: str | Path) -> "InternalTLS":
        """Raises FileNotFoundError naming the first missing file."""
        return cls(*_read(directory, FILES))

    def router(self) -> RouterTLS:
        return RouterTLS(self.ca, self.router_cert, self.router_key)

    def worker(self) -> WorkerTLS:
        return WorkerTLS(self.ca, self.worker_cert, self.worker_key,
                         (self.replica_cert, self.replica_key))

    def worker_credentials(self) -> grpc.ServerCredentials:
        return self.worker().server_credentials()

    def router_credentials(self) -> grpc.ChannelCredentials:
        return self.router().credentials()


# Channels to workers verify the certificate name, not the (IP) address.
WORKER_CHANNEL_OPTIONS = [("grpc.ssl_target_name_override", WORKER_NAME)]


def is_loopback(host: str) -> bool:
    """True for an address only this host can reach (127.0.0.0/8, ::1, ``localhost``);
    False for a wildcard (``0.0.0.0``, ``::``, ``""``), any other address or host name."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def needs_internal_tls(replica_host: str) -> bool:
    """Whether replicas bound to ``replica_host`` must serve mutual TLS (anything beyond
    loopback: another host could reach their port)."""
    return not is_loopback(replica_host)


def default_internal_tls_dir() -> Path:
    """Where ``kvfleet up`` keeps the cluster CA when replicas serve beyond loopback and no
    ``--internal-tls-dir`` was given: ``~/.kvfleet/internal-tls`` (on a multi-host cluster every
    host must see it, e.g. a shared home; a host that cannot refuses to start its replicas)."""
    return Path.home() / ".kvfleet" / "internal-tls"


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """Credentials for a TLS listener from PEM files. Raises FileNotFoundError."""
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(),
                                         Path(cert_file).read_bytes())])


def client_credentials(ca_file: Optional[str] = None) -> grpc.ChannelCredentials:
    """Credentials for a TLS client: trust ``ca_file`` (PEM), else the system's roots."""
    return grpc.ssl_channel_credentials(Path(ca_file).read_bytes() if ca_file else None)


def _signature(directory: Path) -> tuple:
    """What changes when any worker file of the directory is replaced (inode, size, mtime)."""
    out: list[Optional[tuple[int, int, int]]] = []
    for name in WORKER_FILES:
        try:
            st = (directory / name).stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def reloading_worker_credentials(directory: str | Path) -> grpc.ServerCredentials:
    """A worker's server credentials that follow ``directory``: each new TLS handshake
    checks whether its files were replaced (a stat per file) and, if the new set loads and
    its key matches its certificate, serves it from then on (a broken set is logged and the
    previous one kept). Open connections keep their session.

    Raises FileNotFoundError naming a missing file (at start only)."""
    d = Path(directory)
    tls = WorkerTLS.load(d)
    state = {"sig": _signature(d)}

    def config(t: WorkerTLS):
        return grpc.ssl_server_certificate_configuration([(t.key, t.cert)],
                                                         root_certificates=t.ca)

    def fetch():
        sig = _signature(d)
        if sig == state["sig"]:
            return None
        state["sig"] = sig
        try:
            new = WorkerTLS.load(d)
            check_key_matches(new.cert, new.key, "worker")
        except (OSError, ValueError) as exc:
            log.error("internal TLS in %s not reloaded, keeping the previous files: %s", d, exc)
            return None
        log.info("internal TLS reloaded from %s (worker certificate expires %s)", d,
                 not_valid_after(new.cert).isoformat())
        return config(new)

    return grpc.dynamic_ssl_server_credentials(config(tls), fetch,
                                               require_client_authentication=True)


def check_key_matches(cert_pem: bytes, key_pem: bytes, what: str) -> None:
    """Raises ValueError naming ``what`` when the key is not the certificate's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if cert.public_key().public_bytes(*raw) != key.public_key().public_bytes(*raw):
        raise ValueError(f"{what}.key is not the key of {what}.pem")


def not_valid_after(cert_pem: bytes) -> datetime.datetime:
    """Expiry (UTC) of the first certificate in ``cert_pem``. Raises ValueError if none."""
    from cryptography import x509

    return x509.load_pem_x509_certificates(cert_pem)[0].not_valid_after_utc


def expiry_report(directory: str | Path, now: Optional[datetime.datetime] = None) -> dict:
    """Per certificate file of ``directory``: ``{"expires": ISO 8601 UTC, "days_left": float}``
    (days, may be negative), or ``{"error": why}`` when it cannot be read here."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    out: dict[str, dict] = {}
    for name in ("ca.pem", "worker.pem", "router.pem", "replica.pem"):
        try:
            expires = not_valid_after((Path(directory) / name).read_bytes())
        except (OSError, ValueError) as exc:
            out[name] = {"error": str(exc)}
            continue
        out[name] = {"expires": expires.isoformat(),
                     "days_left": round((expires - now).total_seconds() / 86400, 1)}
    return out


def credentials_loader(directory: str | Path) -> Callable[[], grpc.ChannelCredentials]:
    """A function returning the router's channel credentials from ``directory`` as it is now
    (for a reload on SIGHUP). Raises FileNotFoundError / ValueError when the files are
    missing or the router key does not match its certificate."""
    def load() -> grpc.ChannelCredentials:
        tls = RouterTLS.load(directory)
        check_key_matches(tls.cert, tls.key, "router")
        return tls.credentials()
    return load


def peer_credentials_loader(directory: str | Path
                            ) -> Optional[Callable[[], grpc.ChannelCredentials]]:
    """A function returning a replica's peer-pull channel credentials from ``directory`` as
    it is now (each new channel reads them: a renewal applies without a restart), or None
    when the directory has no replica certificate. Raises FileNotFoundError / ValueError
    (a missing worker file, a replica key that is not its certificate's) at the call."""
    if WorkerTLS.load(directory).replica is None:
        return None

    def load() -> grpc.ChannelCredentials:
        tls = WorkerTLS.load(directory)
        if tls.replica is None:  # removed since the start
            raise FileNotFoundError(f"internal TLS directory {directory}: replica.pem is missing")
        check_key_matches(*tls.replica, "replica")
        return grpc.ssl_channel_credentials(root_certificates=tls.ca,
                                            private_key=tls.replica[1],
                                            certificate_chain=tls.replica[0])
    return load
