"""TLS for the router's client port and mutual TLS between router and workers.

Client port: a certificate and key (PEM files) the operator provides (``--tls-cert`` /
``--tls-key``); clients verify it with their CA (``kvfleet generate --tls-ca``).

Inside the cluster, an *internal TLS directory* holds one cluster CA and two leaf
certificates signed by it (file names defined once here)::

    ca.pem                the cluster CA certificate (trusted by both sides)
    worker.pem, worker.key  served by every worker (DNS name ``kvfleet-worker``)
    router.pem, router.key  presented by every router to the workers (client auth)

Workers then require a client certificate signed by the cluster CA: a process that reaches a
worker's port without one cannot generate on it. Routers reach workers by IP address, so they
verify the worker certificate against the fixed name ``kvfleet-worker``
(``grpc.ssl_target_name_override``), not the address. :func:`generate_internal_tls` writes a
fresh directory (``kvfleet up --internal-tls-dir`` does when it is empty); no key material is
ever committed.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import grpc

WORKER_NAME = "kvfleet-worker"  # the DNS name in every worker certificate
ROUTER_NAME = "kvfleet-router"
FILES = ("ca.pem", "worker.pem", "worker.key", "router.pem", "router.key")
CERT_DAYS = 365


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


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """Credentials for a TLS listener from PEM files. Raises FileNotFoundError."""
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(),
                                         Path(cert_file).read_bytes())])


def client_credentials(ca_file: Optional[str] = None) -> grpc.ChannelCredentials:
    """Credentials for a TLS client: trust ``ca_file`` (PEM), else the system's roots."""
    return grpc.ssl_channel_credentials(Path(ca_file).read_bytes() if ca_file else None)


def generate_internal_tls(directory: str | Path) -> InternalTLS:
    """Write a new cluster CA and worker/router certificates into ``directory`` (created,
    keys mode 0600) and return them. Needs the ``cryptography`` package."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(name("kvfleet cluster CA"))
               .issuer_name(name("kvfleet cluster CA")).public_key(ca_key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now)
               .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        return (cert.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))

    worker = leaf(WORKER_NAME, ExtendedKeyUsageOID.SERVER_AUTH)
    router = leaf(ROUTER_NAME, ExtendedKeyUsageOID.CLIENT_AUTH)
    tls = InternalTLS(ca_cert.public_bytes(serialization.Encoding.PEM), *worker, *router)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for file, data in zip(FILES, (tls.ca, *worker, *router), strict=True):
        path = d / file
        path.write_bytes(data)
        if file.endswith(".key"):
            os.chmod(path, 0o600)
    return tls
