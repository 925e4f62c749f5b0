"""The CLI as a user runs it: `kvfleet up` on the real SmolLM2, `kvfleet generate`, Ctrl-C."""

from __future__ import annotations

import os
import select
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

KVFLEET = [sys.executable, "-m", "kvfleet.deploy.cli"]


def _wait_ready(proc: subprocess.Popen, timeout_s: float) -> str:
    """The router's gRPC address from the ready line (the line itself: ``proc.ready_line``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvfleet up exited early with {proc.returncode}")
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if "ready" in line:
                proc.ready_line = line
                return line.split("router at ")[1].split()[0]
    raise AssertionError("kvfleet up never printed ready")


@pytest.fixture(scope="module")
def cli_cluster(smollm2_dir, redis_server):
    # Its own TMPDIR (short: Ray's socket paths live under it) shows what the run leaves behind.
    tmp = tempfile.mkdtemp(prefix="kvfup", dir="/tmp")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": tmp}
    proc = subprocess.Popen(
        [*KVFLEET, "up", "--model", str(smollm2_dir), "--port", "0", "--replicas", "2",
         "--redis-url", redis_server.url, "--kv-memory", "64MiB", "--http-port", "0"],
        stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        yield proc, _wait_ready(proc, 240), Path(tmp)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_readme_openai_snippet_works_against_kvfleet_up(cli_cluster):
    """README's snippet: the openai client on the printed URL, greedy (OpenAI's default is
    temperature 1); chat without max_tokens is bounded by the context and the replica's KV
    capacity (64 MiB here: ~1,400 tokens)."""
    from openai import OpenAI

    proc, _, _ = cli_cluster
    base_url = proc.ready_line.split("OpenAI-compatible HTTP at ")[1].split(";")[0]
    client = OpenAI(base_url=base_url, api_key="unused")
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, stream=True, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert "Paris" in text


def test_generate_streams_a_coherent_answer(cli_cluster):
    _, address, _ = cli_cluster
    out = subprocess.run([*KVFLEET, "generate", "--prompt", "What is the capital of France?",
                          "--router", address, "--max-tokens", "24"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "stop" in out.stderr or "length" in out.stderr


def test_generate_reports_bad_input_with_its_status(cli_cluster):
    _, address, _ = cli_cluster
    out = subprocess.run([*KVFLEET, "generate", "--prompt", "hi", "--router", address,
                          "--temperature", "-1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr and "temperature" in out.stderr


def test_ctrl_c_during_generate_exits_130_and_frees_the_request(cli_cluster):
    from kvfleet.client import Client

    _, address, _ = cli_cluster
    # A raw-text story continuation (seeded) runs to max_tokens: ~15 s, no early EOS. CI may
    # start the suite with SIGINT ignored (a background job), which Python children inherit:
    # give the CLI the handler a terminal user's process has.
    args = ["generate", "--raw", "--prompt", "Once upon a time", "--router", address,
            "--max-tokens", "400", "--temperature", "0.8", "--seed", "1"]
    as_in_a_terminal = ("import runpy, signal, sys; "
                        "signal.signal(signal.SIGINT, signal.default_int_handler); "
                        f"sys.argv = ['kvfleet', *{args!r}]; "
                        "runpy.run_module('kvfleet.deploy.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", as_in_a_terminal],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.read(8)  # tokens are streaming
    assert first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    with Client(address) as client:  # the router aborted the call on its replica
        deadline = time.monotonic() + 20
        while any(r.running or r.waiting for r in client.cluster_status().replicas):
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_taken_port_is_a_clear_error(cli_cluster, smollm2_dir):
    _, address, _ = cli_cluster
    port = address.rsplit(":", 1)[1]
    out = subprocess.run([*KVFLEET, "up", "--model", str(smollm2_dir), "--port", port],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"{port} is already in use" in out.stderr


def test_unprepared_model_says_how_to_prepare(tmp_path):
    env = {**os.environ, "KVFLEET_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([*KVFLEET, "up", "--port", "0"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 2
    assert "kvfleet model prepare" in out.stderr


def _operate(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """``kvfleet ARGS`` as a second terminal of the same user runs it (same TMPDIR: it finds
    the cluster file ``kvfleet up`` wrote)."""
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.run([*KVFLEET, *args], capture_output=True, text=True, timeout=300, env=env)


def _status(tmp: Path) -> dict:
    import json

    out = _operate(tmp, "status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_status_and_scale_from_another_terminal(cli_cluster):
    proc, address, tmp = cli_cluster
    status = _status(tmp)
    (app,) = status["applications"]
    assert [r["state"] for r in app["replicas"]] == ["serving", "serving"]
    assert all(r["kv_blocks_total"] > 0 and r["epoch"] >= 1 and r["ranks"] for r in app["replicas"])
    # Per rank the KV and weight bytes (64 MiB of KV asked for), and no adapters served here.
    for r in app["replicas"]:
        (rank,) = r["ranks"]
        assert rank["num_blocks"] == r["kv_blocks_total"]
        assert 0 < rank["kv_bytes"] <= 64 << 20 and rank["weight_bytes"] > 100 << 20
        assert r["adapters"] == []
    assert app["internal_tls"] is None  # loopback replicas: plaintext on this host only
    assert [r["address"] for r in status["routers"]] == [address] and status["redis"]["up"]
    table = _operate(tmp, "status")
    assert table.returncode == 0 and "serving" in table.stdout and address in table.stdout
    assert "rank 0: KV " in table.stdout and "weights " in table.stdout

    # Down, not up: the same command either way, and a scale-up would cost a replica start
    # (tests/integration/test_lifecycle.py scales up and down under traffic).
    out = _operate(tmp, "scale", "--replicas", "1", "--timeout", "240")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 1
    from kvfleet.client import Client

    with Client(address) as client:
        deadline = time.monotonic() + 15  # the drained replica leaves the registry as it stops
        while len(client.cluster_status().replicas) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(client.cluster_status().replicas) == 1
        assert client.generate("Hi", max_tokens=2)
    assert [r["state"] for r in _status(tmp)["applications"][0]["replicas"]] == ["serving"]
    bad = _operate(tmp, "scale", "--replicas", "2", "--model", "no-such-model")
    assert bad.returncode == 2 and "no kvfleet application matches" in bad.stderr


def test_sigterm_during_streams_drains_them_and_stops_everything(cli_cluster):
    import threading

    import grpc

    from kvfleet.client import Client

    proc, address, tmp = cli_cluster
    assert list(tmp.glob("kvf-ray-*")), "the local Ray should keep its session under TMPDIR"
    children = _descendants(proc.pid)
    ends: list = []
    started = threading.Barrier(3)

    def stream(i: int) -> None:
        with Client(address) as client:
            it = client.stream(f"Story {i}: once upon a time", max_tokens=40, ignore_eos=True,
                               timeout=120)
            try:
                next(it)
                started.wait(60)
                for _ in it:
                    pass
                ends.append(("OK", ""))
            except grpc.RpcError as exc:
                ends.append((exc.code().name, exc.details()))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(120)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    # Each stream finished (the drain waits up to 30 s) or ended UNAVAILABLE naming the drain.
    assert len(ends) == 2
    assert all(e[0] == "OK" or (e[0] == "UNAVAILABLE" and "drain" in e[1]) for e in ends), ends
    assert proc.wait(timeout=90) == 0
    time.sleep(1.0)
    alive = [pid for pid in children if _alive(pid)]
    assert not alive, f"orphan processes left: {alive}"
    assert not list(tmp.glob("kvf-ray-*")), "Ray's session directory was left behind"


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    pairs = [tuple(map(int, l.split())) for l in out.strip().splitlines()]
    kids, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in pairs:
            if pp == p:
                kids.append(c)
                frontier.append(c)
    return kids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(") ")[1][0] != "Z"
