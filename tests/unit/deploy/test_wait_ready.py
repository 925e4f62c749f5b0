"""The launcher's ready-line wait keeps draining the child's stdout afterwards."""

from __future__ import annotations

import io
import subprocess
import sys
import threading

import pytest

from kvfleet.deploy.process_relay import wait_ready


class Sink(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, s: str) -> int:
        with self.lock:
            return super().write(s)


@pytest.fixture
def child():
    """Start ``python -c CODE`` with its stdout on a pipe; every child is killed afterwards."""
    procs: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                      text=True))
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_lines_after_ready_are_relayed_and_never_block_the_child(child):
    # 2 MiB after the ready line: far more than a pipe holds (64 KiB). Were the pipe left
    # unread, the child would block in print() and never exit (what a console span exporter
    # did to the router).
    proc = child("import sys\n"
                 "print('starting up', flush=True)\n"
                 "print('router ready 127.0.0.1:5555', flush=True)\n"
                 "for i in range(20000): print(f'span {i:05d} ' + 'x' * 100)\n")
    sink = Sink()
    assert wait_ready(proc, "router ready ", 30.0, sink) == "127.0.0.1:5555"
    assert proc.wait(30) == 0
    for _ in range(100):  # the relay thread finishes copying after the child exits
        if sink.getvalue().count("\n") == 20001:
            break
        threading.Event().wait(0.05)
    lines = sink.getvalue().splitlines()
    assert lines[0] == "starting up" and lines[1].startswith("span 00000 ")
    assert len(lines) == 20001 and lines[-1].startswith("span 19999 ")
    assert not any("ready" in line for line in lines)


def test_a_child_that_exits_before_ready_is_an_error_with_its_code(child):
    proc = child("print('no marker here'); raise SystemExit(3)")
    with pytest.raises(RuntimeError, match="code 3"):
        wait_ready(proc, "router ready ", 30.0, Sink())


def test_a_child_that_closes_its_stdout_without_ready_is_an_error(child):
    proc = child("import os, time; os.close(1); time.sleep(30)")
    with pytest.raises(RuntimeError, match="closed its stdout and still runs"):
        wait_ready(proc, "router ready ", 30.0, Sink())


def test_a_child_that_never_gets_ready_times_out(child):
    proc = child("import time; time.sleep(30)")
    with pytest.raises(TimeoutError, match="router ready"):
        wait_ready(proc, "router ready ", 0.5, Sink())
