"""Speculative decoding on SmolLM2: output tok/s with drafts off vs on, same requests, one run.

    .venv/bin/python -m bench spec [--quick] [--modes ngram,suffix] [--workloads edit,quote,none]
                                   [--batches 1,4] [--max-tokens N] [--out DIR]
    .venv/bin/python -m bench spec --identity 200 [--modes ngram,suffix] [--max-tokens N]

Three workloads, each at batch 1 (two requests one after the other) and batch 4 (four at
once), greedy: **edit** (about 300 tokens of this repository's code, to be copied with a
rename, the answer opened with the code's first line: the answer copies most of its prompt;
320 tokens, room for the whole ~300-token copy, measured answer lengths in docs/speculative.md),
**quote** (a passage of the Declaration of Independence, to be quoted and explained),
**none** (short poems: nothing to copy). Per cell: output tok/s, the ratio to ``off``, the
same ratio over the decode phase only (a group's steps after each of its requests emitted its
first token: the prompts' prefill, which drafts cannot speed up, left out), drafts accepted ÷
drafted, output tokens per row-step, and whether every answer equals the ``off`` answer token
for token. The host's load average
is recorded beside the numbers (timings on a shared machine move with it).

``--identity N``: no timing; ``N`` greedy requests varied over the three workloads (other code
slices and renames, other passages, other poem forms and topics), all submitted at once to an
engine of up to 8 rows, with speculation off and then with each mode: how many answers are
token-for-token identical, and for each divergence its first position and the top-2 logprob
gap there (the logit gap) on the plain path and on the speculative one — a divergence is
benign only where that gap is within fp32 noise.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.common.plots import lines_plot
from bench.common.result_file import RESULTS, ROOT, write_json
from bench.engine import engine_runs as er
from kvfleet.deploy.models import prepare_model
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig

CODE_FILES = ("allocator/block_pool.py", "worker/engine/output/stop_checker.py",
              "allocator/units.py", "worker/step_cost/host_lock.py")
RENAMES = (("block_id", "bid"), ("text", "chunk"), ("tokens", "toks"), ("path", "where"))
TOPICS = ("the sea at night", "a lost key", "autumn in a small town", "a robot learning to paint")
MORE_TOPICS = ("a train at dawn", "an old library", "winter birds", "a city in the rain",
               "the first snow", "a lighthouse keeper")
FORMS = ("short poem", "haiku sequence", "limerick", "four-line rhyme", "sonnet", "short story",
         "song verse", "free-verse poem")


def _chat(tok, text: str, answer_start: str = "") -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
                      f"{answer_start}").ids


def _edit(tok, code: str, old: str, new: str) -> list[int]:
    """An edit request: the code, the rename, and the answer opened with the code's first line
    (a client-side answer prefix, as edit tools send). SmolLM2-135M asked only to "rewrite"
    code answers with new code of its own; told to copy and so started, it copies with
    small drifts, which is the traffic an edit workload stands for."""
    first = code.lstrip("\n").split("\n", 1)[0]
    return _chat(tok, f"Copy this Python code exactly, but rename `{old}` to `{new}`.\n\n"
                      f"```python\n{code}\n```", f"```python\n{first}\n")


def _slice(tok, text: str, tokens: int) -> str:
    ids = tok.encode(text).ids[:tokens]
    return tok.decode(ids)


def workloads(tok) -> dict[str, tuple[list[list[int]], int]]:
    """name → (four prompts, max_tokens)."""
    edit = []
    for f, (old, new) in zip(CODE_FILES, RENAMES, strict=True):
        code = _slice(tok, (ROOT / f).read_text().split('"""', 2)[-1], 300)
        edit.append(_edit(tok, code, old, new))
    text = (Path(__file__).parent / "data" / "declaration_of_independence.txt").read_text()
    words = text.split()
    quote = [_chat(tok, "Quote the first three sentences of this passage exactly, then say in "
                        "one line what they mean.\n\n" + _slice(tok, " ".join(words[i * 220:]), 300))
             for i in range(4)]
    none = [_chat(tok, f"Write a short poem about {t}.") for t in TOPICS]
    return {"edit": (edit, 320), "quote": (quote, 128), "none": (none, 128)}


def identity_prompts(tok, n: int) -> list[list[int]]:
    """``n`` greedy prompts cycling over edit, quote and nothing-to-copy, each one different."""
    text = (Path(__file__).parent / "data" / "declaration_of_independence.txt").read_text().split()
    sources = [(ROOT / f).read_text().split('"""', 2)[-1] for f in CODE_FILES]
    topics = TOPICS + MORE_TOPICS
    out = []
    for i in range(n):
        k = i // 3
        if i % 3 == 0:
            src = sources[k % len(sources)]
            code = _slice(tok, tok.decode(tok.encode(src).ids[40 * (k // len(sources)):]), 300)
            old, new = RENAMES[(k + k // len(sources)) % len(RENAMES)]
            out.append(_edit(tok, code, old, new))
        elif i % 3 == 1:
            out.append(_chat(tok, "Quote the first three sentences of this passage exactly, then "
                                  "say in one line what they mean.\n\n"
                                  + _slice(tok, " ".join(text[(37 * k) % (len(text) - 400):]), 300)))
        else:
            out.append(_chat(tok, f"Write a {FORMS[k % len(FORMS)]} about "
                                  f"{topics[(k // len(FORMS) + k) % len(topics)]}."))
    return out


def run_all(factory: er.EngineFactory, prompts: list[list[int]], max_tokens: int, mode: str
            ) -> dict[int, tuple[list[int], list]]:
    """Every prompt submitted at once (greedy, top-2 logprobs); answer index → (tokens,
    per-token logprobs)."""
    engine = factory.engine(SchedulerConfig(max_num_seqs=8, speculative=mode))
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, logprobs=2).validate()
        engine.add_request(EngineRequest(f"{mode}-{i}", tuple(p), params))
    answers: dict[int, tuple[list[int], list]] = {i: ([], []) for i in range(len(prompts))}
    while engine.has_work:
        for o in engine.step():
            toks, lps = answers[int(o.request_id.split("-", 1)[1])]
            toks.extend(o.token_ids)
            lps.extend(o.logprobs)
    return answers


def _gap(lp) -> float | None:
    return lp.top[0][1] - lp.top[1][1] if len(lp.top) >= 2 else None


def identity(factory: er.EngineFactory, n: int, max_tokens: int, modes: list[str]) -> dict:
    """The ``--identity`` check (module docstring); prints and returns its record."""
    prompts = identity_prompts(factory.tokenizer, n)
    loads = [os.getloadavg()[0]]
    off = run_all(factory, prompts, max_tokens, "off")
    record: dict = {"requests": n, "max_tokens": max_tokens, "modes": {}}
    for mode in modes:
        on = run_all(factory, prompts, max_tokens, mode)
        loads.append(os.getloadavg()[0])
        diverged = []
        for i, (want, want_lp) in off.items():
            got, got_lp = on[i]
            if got == want:
                continue
            at = next((j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                      min(len(want), len(got)))
            diverged.append({"request": i, "workload": ("edit", "quote", "none")[i % 3], "at": at,
                             "plain_gap": _gap(want_lp[at]) if at < len(want_lp) else None,
                             "spec_gap": _gap(got_lp[at]) if at < len(got_lp) else None})
        same = n - len(diverged)
        record["modes"][mode] = {"identical": same, "divergences": diverged}
        print(f"identity {mode}: {same}/{n} identical", flush=True)
        for d in diverged:
            print(f"  request {d['request']} ({d['workload']}) diverges at token {d['at']}: top-2 "
                  f"logprob gap plain {d['plain_gap']}, speculative {d['spec_gap']}", flush=True)
    record["load_avg_1m"] = loads
    return record


def run_cell(factory: er.EngineFactory, prompts: list[list[int]], max_tokens: int,
             batch: int, mode: str, draft_tokens: int = SchedulerConfig.speculative_tokens) -> dict:
    """``prompts`` in groups of ``batch`` submitted at once; one engine for the cell, drafting
    at most ``draft_tokens`` a row a step."""
    engine = factory.engine(SchedulerConfig(max_num_seqs=8, speculative=mode,
                                            speculative_tokens=draft_tokens))
    answers: dict[str, list[int]] = {}
    row_steps = 0
    # the decode phase: a group's steps after each of its requests has emitted its first token
    # (no prompt left to compute: only decode and verify steps)
    decode_s, decode_tokens, decode_row_steps = 0.0, 0, 0
    t0 = time.perf_counter()
    for g in range(0, len(prompts), batch):
        for i, p in enumerate(prompts[g: g + batch]):
            params = SamplingParams(max_tokens=max_tokens).validate()  # greedy
            engine.add_request(EngineRequest(f"{mode}-{g + i}", tuple(p), params))
        while engine.has_work:
            s0 = time.perf_counter()
            outs = engine.step()
            step_s = time.perf_counter() - s0
            emitted = [o for o in outs if o.token_ids]
            row_steps += len(emitted)
            if all(str(g + i) in answers for i in range(len(prompts[g: g + batch]))):
                decode_s += step_s
                decode_tokens += sum(len(o.token_ids) for o in emitted)
                decode_row_steps += len(emitted)
            for o in outs:
                answers.setdefault(o.request_id.split("-", 1)[1], []).extend(o.token_ids)
    wall = time.perf_counter() - t0
    counts = engine.scheduler.spec.counts
    tokens = sum(len(a) for a in answers.values())
    return {"mode": mode, "batch": batch, "wall_s": wall, "output_tokens": tokens,
            "tok_s": tokens / wall, "tokens_per_row_step": tokens / max(1, row_steps),
            "decode_tok_s": decode_tokens / decode_s if decode_s else None,
            "decode_tokens_per_row_step": decode_tokens / max(1, decode_row_steps),
            "drafted": counts.drafted, "accepted": counts.accepted,
            "acceptance": counts.accepted / counts.drafted if counts.drafted else None,
            "answers": answers}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench spec", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="batch 1 only, shorter answers")
    p.add_argument("--modes", default="ngram,suffix")
    p.add_argument("--workloads", default="edit,quote,none")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="answer length for every workload (default: each workload's own)")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--identity", type=int, default=0, metavar="N",
                   help="no timing: N greedy requests, off vs each mode, token for token")
    p.add_argument("--speculative-tokens", type=int, default=SchedulerConfig.speculative_tokens,
                   help="the most drafts a row carries a step (the replica's --speculative-tokens)")
    a = p.parse_args(argv)
    model_dir = prepare_model(progress=False)
    factory = er.EngineFactory(model_dir, 2048, SchedulerConfig())
    if a.identity:
        record = identity(factory, a.identity, a.max_tokens or 64, a.modes.split(","))
        a.out.mkdir(parents=True, exist_ok=True)
        if a.out == RESULTS:
            write_json("spec_identity.json", record)
        else:
            (a.out / "spec_identity.json").write_text(json.dumps(record, indent=2) + "\n")
        return 0 if all(m["identical"] == a.identity for m in record["modes"].values()) else 1
    loads = [os.getloadavg()]
    run_cell(factory, [_chat(factory.tokenizer, "Say hi.")], 8, 1, "off")  # warm-up
    rows = []
    modes = ["off", *a.modes.split(",")]
    chosen_workloads = a.workloads.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    for name, (prompts, max_tokens) in workloads(factory.tokenizer).items():
        if name not in chosen_workloads:
            continue
        max_tokens = a.max_tokens or (max_tokens // 3 if a.quick else max_tokens)
        for batch in ((1,) if a.quick else batches):
            chosen = prompts[:2] if batch == 1 else prompts
            cells = {m: run_cell(factory, chosen, max_tokens, batch, m, a.speculative_tokens)
                     for m in modes}
            off = cells["off"]
            for m, c in cells.items():
                same = sum(c["answers"][k] == off["answers"][k] for k in off["answers"])
                row = {k: v for k, v in c.items() if k != "answers"}
                row.update(workload=name, ratio=c["tok_s"] / off["tok_s"],
                           decode_ratio=(c["decode_tok_s"] / off["decode_tok_s"]
                                         if c["decode_tok_s"] and off["decode_tok_s"] else None),
                           identical=f"{same}/{len(off['answers'])}")
                rows.append(row)
                acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
                dr = "-" if row["decode_ratio"] is None else f"{row['decode_ratio']:.2f}"
                print(f"{name:6s} b{batch} {m:7s} {row['tok_s']:7.1f} tok/s  ×{row['ratio']:.2f}  "
                      f"(decode phase ×{dr})  "
                      f"accept {acc:>4s}  tok/row-step {row['tokens_per_row_step']:.2f}  "
                      f"identical {row['identical']}", flush=True)
            loads.append(os.getloadavg())
    record = {"model": str(model_dir.name), "speculative_tokens": a.speculative_tokens, "rows": rows,
              "load_avg_1m": [x[0] for x in loads],
              "cpus": os.cpu_count()}
    a.out.mkdir(parents=True, exist_ok=True)
    if a.out == RESULTS:
        write_json("spec.json", record)
    else:
        (a.out / "spec.json").write_text(json.dumps(record, indent=2) + "\n")
    series = {f"{w} {m}": ([r["batch"] for r in rows if r["workload"] == w and r["mode"] == m],
                           [r["ratio"] for r in rows if r["workload"] == w and r["mode"] == m])
              for w in chosen_workloads for m in modes if m != "off"}
    if not a.quick:
        lines_plot(a.out / "spec.png", series, "speculative decoding: output tok/s ÷ off (SmolLM2)",
                   "batch", "× off")
    return 0
