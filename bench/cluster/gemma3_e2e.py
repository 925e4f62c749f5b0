"""Gemma 3 270M end to end: ``kvfleet model prepare gemma3-270m``, ``kvfleet up --model
gemma3-270m`` (a real process), greedy tokens through the router equal to transformers'
``generate`` on the prepared directory, the OpenAI front, ``kvfleet status``.

Checks, each fatal (exit status 1, the failed check named):

- every prompt's token ids through the router (gRPC, text in) equal ``generate``'s
  (``do_sample=False``) on the same directory, and the router tokenized the prompt as
  transformers does; one prompt is longer than the model's 512-token sliding window, so the
  sliding layers' masks are exercised (they keep every block);
- the same prompts again, all at once: batched with each other and hitting the prefix cache,
  the same tokens;
- the long prompt's top-5 log-probabilities at every generated position (gRPC ``logprobs``)
  are within 1e-3 of transformers' full-prefix forward with the windows; the difference to
  the same forward without windows is recorded (it shows the check tells the two apart);
- ``POST /v1/completions`` gives the gRPC text; ``POST /v1/chat/completions`` is refused 400
  ``failed_precondition`` naming the missing chat template (the base model has none);
  ``GET /v1/models`` lists the model;
- ``kvfleet status --json`` shows the application serving ``gemma3-270m`` under the identity
  the router advertises.

Printed and written to ``bench/results/gemma3_e2e.json``: the seconds to prepare (0 when
already prepared), to start the cluster, the router's decode tokens/s (one request) and
transformers' ``generate`` tokens/s (prefill included), both on this machine as loaded.
Takes a few minutes on 2 cores (the first prepare about 1.5 more).

    .venv/bin/python -m bench gemma3_e2e
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = "gemma3-270m"
KVFLEET = [sys.executable, "-m", "kvfleet.deploy.cli"]
SHORT = "The capital of France is"
MEDIUM = "Here is a list of the planets of the solar system, in order from the Sun:"
# Counting past the window: about 700 tokens (Gemma's tokenizer splits digits), > 512.
TOP_LOGPROBS = 5
LOGPROB_TOL = 1e-3  # fp32: a different summation order, not a different computation
LONG = "Counting: " + ", ".join(str(i) for i in range(1, 200)) + ","


class CheckFailed(Exception):
    """One end-to-end check did not hold (the message says which and how)."""


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def reference(model_dir: Path, prompts: list[str], max_tokens: int) -> tuple[list, list, float, tuple]:
    """transformers' prompt ids, greedy ``generate`` ids (new tokens only), the first prompt's
    new tokens per second of ``generate`` (its prefill included; after a warm-up), and the
    last prompt's continuation log-probabilities with and without the sliding windows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids, outs, rate = [], [], 0.0
    with torch.no_grad():
        model.generate(tok(SHORT, return_tensors="pt").input_ids, max_new_tokens=2, do_sample=False)
        for i, p in enumerate(prompts):
            ids = tok(p, return_tensors="pt").input_ids
            start = time.monotonic()
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
            took = time.monotonic() - start
            new = out[0, ids.shape[1]:].tolist()
            prompt_ids.append(ids[0].tolist())
            outs.append(new)
            if i == 0:
                rate = len(new) / took
        # The last (long) prompt: each generated token's log-probability in a full-prefix
        # forward, with the sliding windows and with every layer seeing the whole sequence.
        windowed = _logprobs(model, out, len(outs[-1]))
        model.config.sliding_window = out.shape[1] + 1
        unwindowed = _logprobs(model, out, len(outs[-1]))
    return prompt_ids, outs, rate, (windowed, unwindowed)


def _logprobs(model, ids, num_new: int) -> list[list[float]]:
    """For each of the last ``num_new`` positions of ``ids`` ``[1, n]``, one forward's
    ``TOP_LOGPROBS`` largest log-probabilities, descending (the chosen token's first, under
    greedy decoding; the others are far from 0, so they test the numbers, not the argmax)."""
    import torch

    n = ids.shape[1]
    lp = torch.log_softmax(model(ids).logits[0].float(), -1)  # [n, vocab]
    return lp[n - num_new - 1:n - 1].topk(TOP_LOGPROBS, -1).values.tolist()


class Up:
    """``kvfleet up --model gemma3-270m`` in its own process group, read until ready."""

    def __init__(self, extra: list[str]) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="gemma3-e2e-up.", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [*KVFLEET, "up", "--model", MODEL, "--replicas", "1", "--port", "0", "--http-port", "0",
             "--metrics-port", "0", *extra],
            stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        self.router = self.http = self.ray = ""

    def wait_ready(self, timeout_s: float) -> float:
        start = time.monotonic()
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # blocks until kvfleet prints or exits
            m = re.search(r"kvfleet ready: router at (\S+) .*HTTP at http://([^/]+)/v1", line)
            if m:
                self.router, self.http = m.group(1), m.group(2)
                break
            if time.monotonic() - start > timeout_s:
                break
        if not self.router:
            raise CheckFailed(f"kvfleet up did not become ready; its log: {self.log.name}")
        ray = re.search(r"Ray at (\S+) \(recorded", Path(self.log.name).read_text())
        self.ray = ray.group(1) if ray else ""
        return time.monotonic() - start

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _http(address: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{address}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def run_checks(up: Up, prompts: list[str], ref_prompt: list, ref: list, ref_logprobs: tuple,
               max_tokens: int) -> dict:
    from kvfleet.client import Client, build_request
    from kvfleet.v1 import router_pb2

    out: dict = {}
    with Client(up.router) as client:
        (listed,) = [m for m in client.list_models().models if m.name == MODEL]
        for i, p in enumerate(prompts):
            ids = list(client._stub.Tokenize(router_pb2.TokenizeRequest(model=MODEL, text=p)).token_ids)
            check(ids == ref_prompt[i], f"prompt {i}: the router tokenized it unlike transformers")

        def one(p: str) -> tuple[list[int], str, dict]:
            chunks = list(client.stream(prompt=p, model=MODEL, max_tokens=max_tokens, temperature=0.0))
            return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                    chunks[-1].timing | {"cached": chunks[-1].cached_prompt_tokens})

        serial = [one(p) for p in prompts]
        for i, (ids, _, _) in enumerate(serial):
            check(ids == ref[i], f"prompt {i} ({len(ref_prompt[i])} tokens): router {ids} != "
                                 f"transformers {ref[i]}")
        timing = serial[0][2]
        out["router_decode_tok_s"] = (len(serial[0][0]) - 1) / timing["decode_s"] \
            if timing.get("decode_s") else None
        with ThreadPoolExecutor(len(prompts)) as pool:
            again = list(pool.map(one, prompts))
        for i, (ids, _, _) in enumerate(again):
            check(ids == ref[i], f"prompt {i}, batched + prefix hit: router {ids} != transformers {ref[i]}")
        out["cached_prompt_tokens_second_round"] = [t["cached"] for _, _, t in again]
        out["long_prompt_tokens"] = len(ref_prompt[-1])

    status, body = _http(up.http, "/v1/completions", {"model": MODEL, "prompt": prompts[0],
                                                      "max_tokens": max_tokens, "temperature": 0})
    check(status == 200, f"/v1/completions: HTTP {status} {body}")
    check(body["choices"][0]["text"] == serial[0][1], "/v1/completions text != the gRPC text")
    check(body["usage"]["completion_tokens"] == len(ref[0]), "/v1/completions usage")
    # The sliding windows, seen in the numbers: the long prompt's top log-probabilities match
    # the windowed forward, and the window-less one differs by more than that tolerance.
    windowed, unwindowed = ref_logprobs
    with Client(up.router) as client:
        req = build_request(prompts[-1], model=MODEL, max_tokens=max_tokens, temperature=0.0,
                            logprobs=TOP_LOGPROBS)
        served = [sorted((t.logprob for t in lp.top), reverse=True)
                  for m in client._stub.Generate(req, timeout=300) for lp in m.logprobs]
    check([len(t) for t in served] == [len(t) for t in windowed],
          f"logprobs: {[len(t) for t in served]} served, {[len(t) for t in windowed]} expected")

    def max_diff(ref_rows: list[list[float]]) -> float:
        return max(abs(a - b) for got, want in zip(served, ref_rows, strict=True)
                   for a, b in zip(got, want, strict=True))

    out["logprob_max_diff_windowed"] = max_diff(windowed)
    out["logprob_max_diff_without_windows"] = max_diff(unwindowed)
    check(out["logprob_max_diff_windowed"] < LOGPROB_TOL,
          f"long prompt: logprobs differ from the windowed forward by {out['logprob_max_diff_windowed']}")
    status, body = _http(up.http, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    check(status == 400 and body["error"]["code"] == "failed_precondition"
          and "no chat template" in body["error"]["message"],
          f"/v1/chat/completions without a template: HTTP {status} {body}")
    out["chat_refusal"] = body["error"]["message"]
    status, body = _http(up.http, "/v1/models")
    check(status == 200 and MODEL in [m["id"] for m in body["data"]], f"/v1/models: {body}")

    st = subprocess.run([*KVFLEET, "status", "--address", up.ray, "--json"], capture_output=True,
                        text=True, timeout=120)
    check(st.returncode == 0, f"kvfleet status: {st.stderr[-2000:]}")
    (app,) = json.loads(st.stdout)["applications"]
    check(app["model"] == MODEL, f"kvfleet status: application model {app['model']!r}")
    identities = {r["identity"] for r in app["replicas"] if r["state"] == "serving"}
    check(identities == {listed.identity}, f"kvfleet status: identities {identities} != the "
                                           f"router's {listed.identity}")
    out["identity"] = listed.identity
    out["status_text"] = subprocess.run([*KVFLEET, "status", "--address", up.ray],
                                        capture_output=True, text=True, timeout=120).stdout
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench gemma3_e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--up-arg", action="append", default=[],
                   help="an extra `kvfleet up` argument (repeatable), e.g. --up-arg=--kv-memory=512MiB")
    a = p.parse_args(argv)
    from bench.common.result_file import write_json
    from kvfleet.deploy.models import prepare_model

    record: dict = {"model": MODEL, "max_tokens": a.max_tokens}
    start = time.monotonic()
    model_dir = prepare_model(MODEL)
    record["prepare_s"] = round(time.monotonic() - start, 1)
    prompts = [SHORT, MEDIUM, LONG]
    ref_prompt, ref, record["transformers_generate_tok_s"], ref_logprobs = reference(
        model_dir, prompts, a.max_tokens)
    check(len(ref_prompt[-1]) > 512, f"the long prompt has {len(ref_prompt[-1])} tokens, not > 512")
    up = Up(a.up_arg)
    try:
        record["up_ready_s"] = round(up.wait_ready(a.ready_timeout), 1)
        record.update(run_checks(up, prompts, ref_prompt, ref, ref_logprobs, a.max_tokens))
        record["ok"] = True
    except CheckFailed as exc:
        record["ok"], record["failed"] = False, str(exc)
    finally:
        up.stop()
    print(record.pop("status_text", ""))
    print(json.dumps(record, indent=2))
    write_json("gemma3_e2e.json", record)
    if not record["ok"]:
        print(f"FAILED: {record['failed']} (kvfleet up log: {up.log.name})", file=sys.stderr)
    return 0 if record["ok"] else 1
