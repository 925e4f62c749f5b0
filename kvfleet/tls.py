"""TLS for the router's client port and mutual TLS between router and workers.

Client port: a certificate and key (PEM files) the operator provides (``--tls-cert`` /
``--tls-key``); clients verify it with their CA (``kvfleet generate --tls-ca``).

Inside the cluster, an *internal TLS directory* holds one cluster CA and two leaf
certificates signed by it (file names defined once here)::

    ca.pem                  the cluster CA certificate(s) (trusted by both sides)
    worker.pem, worker.key  served by every worker (DNS name ``kvfleet-worker``)
    router.pem, router.key  presented by every router to the workers (client auth)
    ca.key                  the CA's key, only where :func:`generate_internal_tls` made it
                            (it lets :func:`renew_internal_tls` re-issue under the same CA)

Workers then require a client certificate signed by the cluster CA: a process that reaches a
worker's port without one cannot generate on it. Routers reach workers by IP address, so they
verify the worker certificate against the fixed name ``kvfleet-worker``
(``grpc.ssl_target_name_override``), not the address.

Mutual TLS is on whenever replicas serve beyond loopback (:func:`needs_internal_tls`): a worker
refuses to bind a non-loopback address in plaintext. Files are written atomically, keys created
mode 0600 in a 0700 directory (never readable by others, not even for an instant). Rotation:
:func:`renew_internal_tls` replaces the files in place; workers pick the new ones up at their
next TLS handshake (:func:`reloading_worker_credentials`), routers on SIGHUP.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import grpc

log = logging.getLogger(__name__)

WORKER_NAME = "kvfleet-worker"  # the DNS name in every worker certificate
ROUTER_NAME = "kvfleet-router"
FILES = ("ca.pem", "worker.pem", "worker.key", "router.pem", "router.key")
CA_KEY = "ca.key"
CERT_DAYS = 365
CA_RENEW_DAYS = 30  # renew_internal_tls makes a new CA when the old one has fewer days left


@dataclass(frozen=True)
class InternalTLS:
    """The PEM bytes of an internal TLS directory (see the module docstring)."""

    ca: bytes
    worker_cert: bytes
    worker_key: bytes
    router_cert: bytes
    router_key: bytes

    @classmethod
    def load(cls, directory: str | Path) -> "InternalTLS":
        """Raises FileNotFoundError naming the first missing file."""
        d = Path(directory)
        for name in FILES:
            if not (d / name).is_file():
                raise FileNotFoundError(f"internal TLS directory {d}: {name} is missing")
        return cls(*((d / name).read_bytes() for name in FILES))

    def worker_credentials(self) -> grpc.ServerCredentials:
        """A worker's server side: its certificate, and a client certificate required."""
        return grpc.ssl_server_credentials([(self.worker_key, self.worker_cert)],
                                           root_certificates=self.ca, require_client_auth=True)

    def router_credentials(self) -> grpc.ChannelCredentials:
        """A router's channel to a worker: trusts the cluster CA, presents its certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca,
                                            private_key=self.router_key,
                                            certificate_chain=self.router_cert)


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
    """What changes when any file of the directory is replaced (inode, size, mtime)."""
    out: list[Optional[tuple[int, int, int]]] = []
    for name in FILES:
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
    tls = InternalTLS.load(d)
    state = {"sig": _signature(d)}

    def config(t: InternalTLS):
        return grpc.ssl_server_certificate_configuration([(t.worker_key, t.worker_cert)],
                                                         root_certificates=t.ca)

    def fetch():
        sig = _signature(d)
        if sig == state["sig"]:
            return None
        state["sig"] = sig
        try:
            new = InternalTLS.load(d)
            check_key_matches(new.worker_cert, new.worker_key, "worker")
        except (OSError, ValueError) as exc:
            log.error("internal TLS in %s not reloaded, keeping the previous files: %s", d, exc)
            return None
        log.info("internal TLS reloaded from %s (worker certificate expires %s)", d,
                 not_valid_after(new.worker_cert).isoformat())
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
    for name in ("ca.pem", "worker.pem", "router.pem"):
        try:
            expires = not_valid_after((Path(directory) / name).read_bytes())
        except (OSError, ValueError) as exc:
            out[name] = {"error": str(exc)}
            continue
        out[name] = {"expires": expires.isoformat(),
                     "days_left": round((expires - now).total_seconds() / 86400, 1)}
    return out


def _write_private(directory: Path, name: str, data: bytes, mode: int) -> None:
    """Write ``directory/name`` atomically: a temporary file (created 0600 by mkstemp, so a
    key is never readable by others), chmod to ``mode``, then renamed over the old one."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode != 0o600:
            os.chmod(tmp, mode)
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _private_dir(directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # an existing directory too: its listing names the key files
    return d


def generate_internal_tls(directory: str | Path, days: int = CERT_DAYS) -> InternalTLS:
    """Write a new cluster CA (``ca.pem`` + ``ca.key``) and worker/router certificates valid
    for ``days`` into ``directory`` (created mode 0700; keys 0600 from creation) and return
    them. Needs the ``cryptography`` package."""
    return _issue(_private_dir(directory), days, reuse_ca=False)


def renew_internal_tls(directory: str | Path, days: int = CERT_DAYS) -> InternalTLS:
    """Re-issue the worker and router certificates in ``directory`` for ``days`` more days.
    With the CA's key there and the CA valid for more than ``CA_RENEW_DAYS`` days, the same CA
    signs them (nothing a peer trusts changes: no window where old and new disagree); else a
    new CA is made and ``ca.pem`` holds it *and* the old CA while that one is valid, so peers
    that reload at different times still trust each other. Then send SIGHUP to the routers;
    workers reload at their next handshake."""
    return _issue(_private_dir(directory), days, reuse_ca=True)


def _issue(d: Path, days: int, reuse_ca: bool) -> InternalTLS:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    pem = serialization.Encoding.PEM

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key_bytes(key) -> bytes:
        return key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    now = datetime.datetime.now(datetime.timezone.utc)
    old_cas = []
    if (d / "ca.pem").is_file():
        old_cas = [c for c in x509.load_pem_x509_certificates((d / "ca.pem").read_bytes())
                   if c.not_valid_after_utc > now]
    ca_cert: Optional[x509.Certificate] = None
    ca_key: Optional[ec.EllipticCurvePrivateKey] = None
    if reuse_ca and old_cas and (d / CA_KEY).is_file():
        key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{d / CA_KEY}: not an EC private key")
        raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        mine = [c for c in old_cas if c.public_key().public_bytes(*raw)
                == key.public_key().public_bytes(*raw)]
        if mine and mine[0].not_valid_after_utc - now > datetime.timedelta(days=CA_RENEW_DAYS):
            ca_cert, ca_key = mine[0], key
    trusted = old_cas if ca_cert is not None else []
    if ca_cert is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        # A distinct name per CA: during a rotation both sit in one bundle, and a verifier
        # picks the issuer by name.
        ca_name = name(f"kvfleet cluster CA {now:%Y%m%dT%H%M%S.%f}")
        ca_cert = (x509.CertificateBuilder().subject_name(ca_name)
                   .issuer_name(ca_name).public_key(ca_key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now)
                   .not_valid_after(now + datetime.timedelta(days=max(days, CA_RENEW_DAYS + 1)))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                                  critical=False)
                   .sign(ca_key, hashes.SHA256()))
        trusted = [ca_cert] + (old_cas if reuse_ca else [])
    assert ca_cert is not None and ca_key is not None
    issuer_cert, issuer_key = ca_cert, ca_key

    def leaf(cn: str, usage) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                    issuer_key.public_key()), critical=False)
                .sign(issuer_key, hashes.SHA256()))
        return cert.public_bytes(pem), key_bytes(key)

    worker = leaf(WORKER_NAME, ExtendedKeyUsageOID.SERVER_AUTH)
    router = leaf(ROUTER_NAME, ExtendedKeyUsageOID.CLIENT_AUTH)
    tls = InternalTLS(b"".join(c.public_bytes(pem) for c in trusted), *worker, *router)
    _write_private(d, CA_KEY, key_bytes(issuer_key), 0o600)
    # Keys before certificates: a reader never sees a new certificate with an old key for
    # long (and the worker's reload checks that they match).
    for file, data in zip(FILES, (tls.ca, *worker, *router), strict=True):
        if file.endswith(".key"):
            _write_private(d, file, data, 0o600)
    for file, data in zip(FILES, (tls.ca, *worker, *router), strict=True):
        if not file.endswith(".key"):
            _write_private(d, file, data, 0o644)
    return tls


def credentials_loader(directory: str | Path) -> Callable[[], grpc.ChannelCredentials]:
    """A function returning the router's channel credentials from ``directory`` as it is now
    (for a reload on SIGHUP). Raises FileNotFoundError / ValueError when the files are
    missing or the router key does not match its certificate."""
    def load() -> grpc.ChannelCredentials:
        tls = InternalTLS.load(directory)
        check_key_matches(tls.router_cert, tls.router_key, "router")
        return tls.router_credentials()
    return load
