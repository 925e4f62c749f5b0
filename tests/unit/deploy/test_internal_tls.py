"""The cluster CA's files (kvfleet.tls): keys never readable by others, renewal in place, expiry
figures; mutual TLS on by default whenever replicas serve beyond loopback (items 12 and 15)."""

from __future__ import annotations

import datetime
import os
import stat

import pytest
from cryptography import x509

from kvfleet.deploy.cli import build_parser
from kvfleet.deploy.cluster_config import ClusterConfig, router_args, serve_application
from kvfleet.deploy.cluster_flags import cluster_config
from kvfleet.errors import PermissionDenied
from kvfleet.grpc_auth import internal_authorizer
from kvfleet.tls import (
    CA_KEY,
    FILES,
    REPLICA_NAME,
    ROUTER_FILES,
    ROUTER_NAME,
    WORKER_FILES,
    RouterTLS,
    WorkerTLS,
    expiry_report,
    is_loopback,
    needs_internal_tls,
    peer_credentials_loader,
)
from kvfleet.tls_ca import generate_internal_tls, renew_internal_tls
from kvfleet.worker.replica.replica import ReplicaConfig


def _spy_on_key_modes(monkeypatch, directory):
    """Record the mode of every key file in ``directory`` each time the writer chmods or
    renames something: a key readable by group or others at any of those instants is a
    window an attacker could read it in."""
    seen: list[tuple[str, int]] = []

    def snapshot() -> None:
        for p in directory.glob("*.key*"):
            seen.append((p.name, stat.S_IMODE(p.stat().st_mode)))
        for p in directory.glob(".*.key.*"):
            seen.append((p.name, stat.S_IMODE(p.stat().st_mode)))

    real_chmod, real_replace = os.chmod, os.replace

    def chmod(path, mode, *a, **kw):
        if os.path.exists(path):
            snapshot()
        return real_chmod(path, mode, *a, **kw)

    def replace(src, dst, *a, **kw):
        snapshot()
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "chmod", chmod)
    monkeypatch.setattr(os, "replace", replace)
    return seen


@pytest.mark.parametrize("renew", [False, True], ids=["generate", "renew"])
def test_keys_are_never_readable_by_others_not_even_while_written(tmp_path, monkeypatch, renew):
    d = tmp_path / "internal"
    if renew:
        generate_internal_tls(d)
    old = os.umask(0)  # the worst case: files would be created 0666
    try:
        seen = _spy_on_key_modes(monkeypatch, d)
        (renew_internal_tls if renew else generate_internal_tls)(d)
    finally:
        os.umask(old)
    assert seen, "the writer was observed"
    assert [(n, oct(m)) for n, m in seen if m & 0o077] == []
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("worker.key", "router.key", "replica.key", CA_KEY):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600
    assert sorted(p.name for p in d.iterdir()) == sorted([*FILES, CA_KEY])  # no temp files left


def test_renewal_keeps_a_ca_that_can_still_sign_and_reports_days_left(tmp_path):
    d = tmp_path / "internal"
    first = generate_internal_tls(d, days=10)
    report = expiry_report(d)
    assert 9.9 <= report["worker.pem"]["days_left"] <= 10.0
    assert report["router.pem"]["days_left"] <= 10.0 < report["ca.pem"]["days_left"]
    second = renew_internal_tls(d)  # the CA (31+ days) still signs: trust does not change
    assert second.ca == first.ca and second.worker_cert != first.worker_cert
    assert 364.9 <= expiry_report(d)["worker.pem"]["days_left"] <= 365
    issued = x509.load_pem_x509_certificate(second.worker_cert)
    assert issued.issuer == x509.load_pem_x509_certificate(first.ca).subject
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=400)
    assert expiry_report(d, now=later)["worker.pem"]["days_left"] < 0
    assert "error" in expiry_report(tmp_path / "none")["ca.pem"]


def test_what_counts_as_beyond_loopback():
    assert [is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "localhost")] == [True] * 4
    assert [needs_internal_tls(h) for h in ("0.0.0.0", "::", "", "10.1.2.3", "node-7")] == [True] * 5


def test_a_replica_beyond_loopback_without_internal_tls_is_refused():
    with pytest.raises(ValueError, match="host '0.0.0.0'.*internal_tls_dir"):
        ReplicaConfig("r", "m", "/m", host="0.0.0.0")
    assert ReplicaConfig("r", "m", "/m", host="0.0.0.0", internal_tls_dir="/tls").host == "0.0.0.0"
    assert ReplicaConfig("r", "m", "/m").internal_tls_dir is None  # loopback: plaintext is fine


def test_kvfleet_up_beyond_loopback_turns_mutual_tls_on_by_default(tmp_path, monkeypatch,
                                                                    tiny_llama_dir):
    monkeypatch.setenv("HOME", str(tmp_path))

    def up(*flags: str) -> ClusterConfig:
        return cluster_config(build_parser().parse_args(["up", "--model", str(tiny_llama_dir),
                                                         *flags]))

    cfg = up("--replica-host", "0.0.0.0")
    tls_dir = cfg.replica.internal_tls_dir
    assert tls_dir == str(tmp_path / ".kvfleet" / "internal-tls")
    app = serve_application(cfg, "redis://127.0.0.1:1/0", num_cpus=0.5, threads=1)
    assert app["args"]["replica"]["internal_tls_dir"] == tls_dir
    args = router_args(cfg.router_config("redis://127.0.0.1:1/0"))
    assert args[args.index("--internal-tls-dir") + 1] == tls_dir
    assert up().replica.internal_tls_dir is None
    assert up("--replica-host", "0.0.0.0",
              "--internal-tls-dir", "/mine").replica.internal_tls_dir == "/mine"


def test_kvfleet_tls_renews_in_place_and_shows_days_left(tmp_path, capsys):
    from kvfleet.deploy.cli import main

    d = tmp_path / "internal"
    assert main(["tls", "renew", "--dir", str(d), "--days", "20"]) == 0  # empty: a new CA
    ca = (d / "ca.pem").read_bytes()
    worker = (d / "worker.pem").read_bytes()
    assert main(["tls", "renew", "--dir", str(d)]) == 0
    assert (d / "ca.pem").read_bytes() == ca and (d / "worker.pem").read_bytes() != worker
    capsys.readouterr()
    assert main(["tls", "show", "--dir", str(d), "--json"]) == 0
    import json

    assert 364.9 <= json.loads(capsys.readouterr().out)["router.pem"]["days_left"] <= 365
    assert main(["tls", "show", "--dir", str(tmp_path / "none")]) == 2
    assert main(["tls", "renew", "--dir", str(d), "--days", "0"]) == 2


def _only(tmp_path, full, names, to: str):
    d = tmp_path / to
    d.mkdir(mode=0o700)
    for name in names:
        (d / name).write_bytes((full / name).read_bytes())
    return d


def test_each_role_reads_only_its_own_files(tmp_path):
    full = tmp_path / "internal"
    tls = generate_internal_tls(full)
    router = _only(tmp_path, full, ROUTER_FILES, "router")
    workers = _only(tmp_path, full, WORKER_FILES + ("replica.pem", "replica.key"), "workers")
    assert RouterTLS.load(router) == tls.router()  # no worker file needed
    assert WorkerTLS.load(workers) == tls.worker()  # no router file needed
    assert peer_credentials_loader(workers) is not None
    names = {name: x509.load_pem_x509_certificate(cert).subject.rfc4514_string()
             for name, cert in (("worker", tls.worker_cert), ("router", tls.router_cert),
                                ("replica", tls.replica_cert))}
    assert names == {"worker": "CN=kvfleet-worker", "router": "CN=kvfleet-router",
                     "replica": "CN=kvfleet-replica"}
    with pytest.raises(FileNotFoundError, match="router.pem"):
        RouterTLS.load(workers)
    (workers / "replica.key").unlink()
    with pytest.raises(FileNotFoundError, match="replica.key"):  # one without the other
        WorkerTLS.load(workers)
    (workers / "replica.pem").unlink()  # issued before replica certificates: no peer pulls
    assert WorkerTLS.load(workers).replica is None and peer_credentials_loader(workers) is None


def test_a_directory_issued_before_replica_certificates_gains_them_under_its_ca(tmp_path):
    d = tmp_path / "internal"
    first = generate_internal_tls(d)
    for name in ("replica.pem", "replica.key"):
        (d / name).unlink()
    assert "error" in expiry_report(d)["replica.pem"]
    second = renew_internal_tls(d)  # what kvfleet up does with a directory missing a file
    assert second.ca == first.ca and WorkerTLS.load(d).replica is not None


class _Peer:
    def __init__(self, *names: bytes) -> None:
        self.names = names

    def auth_context(self):
        return {"x509_common_name": list(self.names)} if self.names else {}


def test_a_worker_lets_the_replica_certificate_call_export_blocks_only():
    export = "/kvfleet.v1.Worker/ExportBlocks"
    authorize = internal_authorizer(True, ROUTER_NAME, {REPLICA_NAME: frozenset({export})})
    for method in ("/kvfleet.v1.Worker/Generate", "/kvfleet.v1.Worker/Drain", export):
        assert authorize(method, _Peer(ROUTER_NAME.encode())) == ROUTER_NAME
    assert authorize(export, _Peer(REPLICA_NAME.encode())) == REPLICA_NAME
    for method, peer in (("/kvfleet.v1.Worker/Generate", _Peer(REPLICA_NAME.encode())),
                         ("/kvfleet.v1.Worker/LoadAdapter", _Peer(REPLICA_NAME.encode())),
                         (export, _Peer(b"kvfleet-worker")), (export, _Peer())):
        with pytest.raises(PermissionDenied, match=method):
            authorize(method, peer)
    assert internal_authorizer(False, ROUTER_NAME)(export, _Peer()) == ""  # no TLS: no identity
