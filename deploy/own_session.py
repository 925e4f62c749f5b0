"""Run ``kvfleet up``'s cluster in a session of its own, under a thin supervisor.

A signal sent to a whole process group (``timeout``, systemd's ``KillMode=control-group``,
``kill -TERM -- -PGID``) would otherwise reach the Ray head processes and the private
redis-server as well as the launcher: they die at once and the launcher's orderly stop (drain the
replicas, stop the router, then Ray, then Redis) waits on a dead head. Ray gives no option to start
a local head's processes outside the caller's group, so the launcher itself moves out: the
supervisor stays in the caller's group, receives the group's signals and forwards each one to the
cluster process, which stops everything it started in order. If the supervisor is killed
(SIGKILL), the kernel sends the cluster process SIGTERM (``PR_SET_PDEATHSIG``), so it still stops
cleanly instead of running on unowned.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Callable, Optional, Sequence

SUPERVISED_ENV = "KVFLEET_UP_SUPERVISED"  # set in the cluster process: do not supervise again
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


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
    reports it). ``env``: its environment (default: this one), with :data:`SUPERVISED_ENV` set.

    The child inherits stdin, stdout and stderr; it gets SIGTERM if this process dies first.
    Must be called from the main thread (signal handlers; the parent-death signal is tied to the
    thread that starts the child).

    Raises:
        OSError: ``cmd`` could not be started.
    """
    child_env = dict(os.environ if env is None else env)
    child_env[SUPERVISED_ENV] = "1"
    # Block the forwarded signals until the handlers are in place, so that none arriving while
    # the child starts is lost (or kills this process and leaves the child to PDEATHSIG).
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    previous = {}
    try:
        proc = subprocess.Popen(list(cmd), env=child_env, start_new_session=True,
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
    return 128 - code if code < 0 else code
