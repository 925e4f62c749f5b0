"""``kvfleet up`` runs its cluster in a session of its own under a supervisor: a signal sent to
the caller's whole process group reaches only the supervisor, which forwards it, so the cluster
stops what it started in order (the Ray head and the private redis-server are not hit by the
group's signal). If the supervisor is SIGKILLed, the cluster process gets SIGTERM.

Real processes, no cluster: the supervisor runs ``run_in_own_session`` on a tiny child that
reports its session and the signals it receives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfleet.deploy import cli, own_session

pytestmark = pytest.mark.skipif(not own_session.supported(), reason="Linux only (PR_SET_PDEATHSIG)")

# The child: write its session id, then a line per SIGTERM / SIGINT / SIGHUP, and exit 0 on the
# first one (or after a long wait, which the test never reaches).
CHILD = r"""
import os, signal, sys, time
out = sys.argv[1]
def note(text):
    with open(out, "a") as f:
        f.write(text + "\n")
def on_signal(signum, _):
    note(f"signal {signum} supervised={os.environ.get('KVFLEET_UP_SUPERVISED')}")
    sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, on_signal)
note(f"sid {os.getsid(0)}")
time.sleep(600)
"""

SUPERVISOR = r"""
import sys
from kvfleet.deploy.own_session import run_in_own_session
sys.exit(run_in_own_session([sys.executable, "-c", sys.argv[1], sys.argv[2]]))
"""


def _lines(path: Path, n: int, deadline_s: float = 60.0) -> list[str]:
    """The first ``n`` lines the child wrote (waits for them; fails past a generous deadline)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if path.exists() and len(lines := path.read_text().splitlines()) >= n:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"the child wrote {path.read_text() if path.exists() else 'nothing'}")


def _supervisor(out: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != own_session.SUPERVISED_ENV}
    # In a session of its own, standing for the caller's process group.
    return subprocess.Popen([sys.executable, "-c", SUPERVISOR, CHILD, str(out)], env=env,
                            start_new_session=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_group_signal_reaches_the_child_once_through_the_supervisor(tmp_path, sig) -> None:
    out = tmp_path / "child.txt"
    sup = _supervisor(out)
    try:
        sid = int(_lines(out, 1)[0].split()[1])
        assert sid != sup.pid  # the child leads a session of its own, outside the group
        os.killpg(sup.pid, sig)  # what `timeout`, systemd or `kill -- -PGID` do
        assert sup.wait(60) == 0
        assert _lines(out, 2)[1:] == [f"signal {int(sig)} supervised=1"]
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()


def test_a_killed_supervisor_leaves_the_child_a_sigterm(tmp_path) -> None:
    out = tmp_path / "child.txt"
    sup = _supervisor(out)
    _lines(out, 1)
    sup.kill()
    sup.wait()
    assert _lines(out, 2)[1] == f"signal {int(signal.SIGTERM)} supervised=1"


def test_exit_status_of_a_signalled_child_reads_as_a_shell_reports_it() -> None:
    code = own_session.run_in_own_session(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert code == 128 + signal.SIGKILL


def test_only_the_command_line_up_and_demo_are_supervised(monkeypatch) -> None:
    monkeypatch.delenv(own_session.SUPERVISED_ENV, raising=False)
    assert cli._supervise_cluster(["up", "--replicas", "1"])
    assert cli._supervise_cluster(["-v", "up"])
    assert cli._supervise_cluster(["demo"])
    assert not cli._supervise_cluster(["up", "--help"])
    assert not cli._supervise_cluster(["demo", "-h"])
    assert not cli._supervise_cluster(["status"])
    monkeypatch.setenv(own_session.SUPERVISED_ENV, "1")
    assert not cli._supervise_cluster(["up"])
    assert not cli._supervise_cluster(["demo"])



# The cluster process stand-in: start a grandchild in its own process group (as the launcher
# starts the router and redis-server), write into the Ray session directory the supervisor made,
# write the grandchild's pid and that directory, then die by SIGKILL.
KILLED_LAUNCHER = r"""
import os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[2]])
ray_dir = os.environ["KVFLEET_RAY_TEMP_DIR"]
os.makedirs(os.path.join(ray_dir, "session_latest", "logs"))
with open(sys.argv[1], "w") as f:
    f.write(f"{child.pid} {ray_dir}")
os.kill(os.getpid(), signal.SIGKILL)
"""
SLEEPER = "import time; time.sleep(600)"
DEAF_SLEEPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def _gone(pid: int, deadline_s: float = 30.0) -> bool:
    """Whether ``pid`` has exited (reaped by whoever adopted it) within the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("grandchild", [SLEEPER, DEAF_SLEEPER], ids=["terminates", "ignores-term"])
def test_a_sigkilled_cluster_process_leaves_nothing_it_started(tmp_path, grandchild) -> None:
    pid_file = tmp_path / "grandchild.pid"
    code = own_session.run_in_own_session(
        [sys.executable, "-c", KILLED_LAUNCHER, str(pid_file), grandchild])
    assert code == 128 + signal.SIGKILL
    pid_text, ray_dir = pid_file.read_text().split()
    pid = int(pid_text)
    try:
        assert _gone(pid), "the router / redis-server stand-in outlived the killed launcher"
        assert not Path(ray_dir).exists(), "the Ray session directory was left behind"
    finally:
        try:  # never leave the sleeper behind, whatever the assertion said
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_stopping_an_empty_group_is_a_no_op() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    assert own_session.stop_orphaned_group(proc.pid, grace_s=0.1)
