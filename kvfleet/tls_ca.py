"""Issuing an internal TLS directory (see :mod:`kvfleet.tls`): a cluster CA and the worker,
router and replica certificates it signs, written atomically with keys never readable by
others; renewal in place under the same CA while it can sign."""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from pathlib import Path
from typing import Optional

from kvfleet.tls import (
    CA_KEY,
    CA_RENEW_DAYS,
    CERT_DAYS,
    FILES,
    REPLICA_NAME,
    ROUTER_NAME,
    WORKER_NAME,
    InternalTLS,
)


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
    replica = leaf(REPLICA_NAME, ExtendedKeyUsageOID.CLIENT_AUTH)
    tls = InternalTLS(b"".join(c.public_bytes(pem) for c in trusted), *worker, *router,
                      *replica)
    _write_private(d, CA_KEY, key_bytes(issuer_key), 0o600)
    # Keys before certificates: a reader never sees a new certificate with an old key for
    # long (and the worker's reload checks that they match).
    for file, data in zip(FILES, (tls.ca, *worker, *router, *replica), strict=True):
        if file.endswith(".key"):
            _write_private(d, file, data, 0o600)
    for file, data in zip(FILES, (tls.ca, *worker, *router, *replica), strict=True):
        if not file.endswith(".key"):
            _write_private(d, file, data, 0o644)
    return tls
