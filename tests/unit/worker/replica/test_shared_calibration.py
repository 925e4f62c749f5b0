"""The start-up calibration keyed by what the process may use and shared through Redis: a
fresh replica (a new pod, an empty disk cache) of a key another replica calibrated times no
step; a cgroup CPU quota, not the host's core count, names the device."""

from __future__ import annotations

from types import SimpleNamespace

from kvfleet.worker.step_cost.calibration import device_name
from kvfleet.worker.replica.replica import ReplicaConfig, _step_cost
from tests.unit.worker.step_cost.test_step_cost import FakeExecutor

IDENTITY = SimpleNamespace(digest=lambda: bytes.fromhex("ab" * 16))


def _cfg(redis_url: str, namespace: str) -> ReplicaConfig:
    # step_cost_dir "": no disk cache (a fresh pod has none either).
    return ReplicaConfig("r", "m", "/models/m", redis_url=redis_url, namespace=namespace,
                         step_cost_dir="", calibration_budget_s=0.5)


def test_a_second_replica_of_a_key_takes_the_first_ones_calibration(redis_server,
                                                                   redis_namespace):
    first, second = FakeExecutor(), FakeExecutor()
    a = _step_cost(_cfg(redis_server.url, redis_namespace), first, IDENTITY)
    b = _step_cost(_cfg(redis_server.url, redis_namespace), second, IDENTITY)
    assert first.plans and not second.plans  # the second timed no step
    assert b.prior.to_json() | {"source": ""} == a.prior.to_json() | {"source": ""}
    other = FakeExecutor()  # another namespace (cluster) calibrates its own
    _step_cost(_cfg(redis_server.url, redis_namespace + "x:"), other, IDENTITY)
    assert other.plans


def test_an_unreachable_redis_only_costs_a_calibration():
    ex = FakeExecutor()
    cost = _step_cost(_cfg("redis://127.0.0.1:1", "ns:"), ex, IDENTITY)
    assert ex.plans and cost.prior.step_base_s >= 0


def _cgroup_v2(tmp_path, quota: str):
    (tmp_path / "proc").write_text("0::/kubepods/pod1/ctr\n")
    leaf = tmp_path / "cg" / "kubepods" / "pod1" / "ctr"
    leaf.mkdir(parents=True)
    (leaf / "cpu.max").write_text("max 100000\n")
    (leaf.parent / "cpu.max").write_text(f"{quota} 100000\n")  # the pod's limit
    return tmp_path / "cg", tmp_path / "proc"


def test_the_device_names_the_cgroup_quota_not_the_hosts_cores(tmp_path, monkeypatch):
    import kvfleet.cpus as cpus

    root, proc = _cgroup_v2(tmp_path, "150000")
    monkeypatch.setattr(cpus, "CGROUP_ROOT", root)
    monkeypatch.setattr(cpus, "PROC_CGROUP", proc)
    monkeypatch.setattr(cpus, "_affinity", lambda: 64)  # a big node
    assert cpus.available_cpus() == 1.5 and cpus.whole_cpus() == 2
    assert device_name("cpu").endswith(":1.5")


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    from kvfleet.cpus import available_cpus, cgroup_quota

    (tmp_path / "proc").write_text("4:memory:/x\n2:cpu,cpuacct:/kubepods/pod2\n")
    d = tmp_path / "cg" / "cpu,cpuacct" / "kubepods" / "pod2"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("400000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(tmp_path / "cg", tmp_path / "proc") == 4.0
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota(tmp_path / "cg", tmp_path / "proc") is None
    assert available_cpus(tmp_path / "cg", tmp_path / "missing") >= 1  # unreadable: no quota
