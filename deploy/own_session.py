"""Run ``kvfleet up``'s cluster in a session of its own, under a thin supervisor.

A signal sent to a whole process group (``timeout``, systemd's ``KillMode=control-group``,
``kill -TERM -- -PGID``) would otherwise reach the Ray head processes and the private
redis-server as well as the launcher: they die at once and the launcher's orderly stop (drain the
replicas, stop the router, then Ray, then Redis) waits on a dead head. Ray gives no option to start
a local head's processes outside the caller's group, so the launcher itself moves out: the
supervisor stays in the caller's group, receives the group's signals and forwards each one to the
cluster process, which stops everything it started in order. If the supervisor is killed
(SIGKILL), the kernel sends the cluster process SIGTERM (``PR_SET_PDEATHSIG``), so it still stops
cleanly instead of running on unowned. If the cluster process itself dies by a signal it could
not handle (SIGKILL from the OOM killer, a crash), whatever it started in its process group (the
router, the private redis-server, Ray's head processes) would run on unowned: the supervisor then
stops that group (:func:`stop_orphaned_group`) and removes the local Ray's session directory,
which it made for the cluster process (:data:`RAY_TEMP_DIR_ENV`).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from kvfleet.deploy.ray_local import RAY_TEMP_DIR_ENV

SUPERVISED_ENV = "KVFLEET_UP_SUPERVISED"  # set in the cluster process: do not supervise again
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
ORPHAN_GRACE_S = 5.0  # SIGTERM first (the router drains, redis-server exits), then SIGKILL


def supported() -> bool:
    """True where the parent-death signal exists (Linux): elsewhere ``kvfleet up`` runs as before,
    in the caller's process group."""
    return sys.platform.startswith("linux")


def _term_on_parent_death(parent_pid: int, mask) -> Callable[[], None]:
    """A ``preexec_fn`` that restores the signal mask ``mask`` (the parent blocks the forwarded
    signals while it starts the child, and exec keeps a mask) and asks the kernel for SIGTERM
    when the parent dies. Runs in the child between fork and exec."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not between fork and exec

    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


def run_in_own_session(cmd: Sequence[str], env: Optional[dict] = None) -> int:
    """Start ``cmd`` in a new session (its own process group), forward SIGINT / SIGTERM / SIGHUP
    to it until it exits, and return its exit status (128 + N when signal N ended it, as a shell
    reports it). ``env``: its environment (default: this one), with :data:`SUPERVISED_ENV` set
    and :data:`RAY_TEMP_DIR_ENV` naming a fresh directory, removed when the child has exited.

    The child inherits stdin, stdout and stderr; it gets SIGTERM if this process dies first. If
    the child dies by a signal, what is left in its process group is stopped.
    Must be called from the main thread (signal handlers; the parent-death signal is tied to the
    thread that starts the child).

    Raises:
        OSError: ``cmd`` could not be started.
    """
    child_env = dict(os.environ if env is None else env)
    child_env[SUPERVISED_ENV] = "1"
    ray_dir = child_env[RAY_TEMP_DIR_ENV] = tempfile.mkdtemp(prefix="kvf-ray-")
    try:
        code = _run_forwarding_signals(cmd, child_env)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)  # the child's own stop removed it, or not
    return 128 - code if code < 0 else code


def _run_forwarding_signals(cmd: Sequence[str], env: dict) -> int:
    """Start ``cmd`` in a new session, forward the signals until it exits and return its
    ``Popen.returncode``; if a signal ended it, stop what is left in its process group."""
    # Block the forwarded signals until the handlers are in place, so that none arriving while
    # the child starts is lost (or kills this process and leaves the child to PDEATHSIG).
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    previous = {}
    try:
        proc = subprocess.Popen(list(cmd), env=env, start_new_session=True,
                                preexec_fn=_term_on_parent_death(os.getpid(), previous_mask))

        def forward(signum, _frame) -> None:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:  # it exited already; wait() reports how
                pass

        for sig in FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, forward)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
    try:
        code = proc.wait()  # retried after each forwarded signal (the handler returns)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code < 0:  # it could not stop what it started: its group is left to this process
        stop_orphaned_group(proc.pid)
    return code


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member runs as another user: still there, not ours to stop
        return True
    return True


def stop_orphaned_group(pgid: int, grace_s: float = ORPHAN_GRACE_S) -> bool:
    """Stop every process left in process group ``pgid`` (the dead cluster process's group):
    SIGTERM, then SIGKILL to what is still there after ``grace_s`` seconds. A group id is not
    given to a new process while any member lives, so this reaches only what the cluster process
    started. Returns True when the group is empty at the end."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        end = time.monotonic() + wait_s
        while time.monotonic() < end:
            if not _group_alive(pgid):
                return True
            time.sleep(0.05)
    return not _group_alive(pgid)
