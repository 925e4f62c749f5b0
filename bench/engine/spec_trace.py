"""Why a speculating row carries fewer drafts than it could: a per-step trace of the drafts
proposed, sized and accepted, beside the replay bound on the same answers (a debug tool).

    .venv/bin/python -m bench spec_trace [--workload edit] [--batches 1,4] [--max-tokens 96]
                                         [--mode ngram] [--speculative-tokens 7] [--steps]
                                         [--costs]

Runs the ``bench spec`` workload's requests (batch 1: two one after the other; batch 4: four
at once) with speculation on, wrapping the engine's :class:`Speculator` (its ``plan`` and
``verified``) to record, per step and row: ``k`` (drafts the row may carry: the
``--speculative-tokens`` cap, less near ``max_tokens``), the drafter's proposal length, the
drafts sizing kept, and the drafts accepted. Each draft slot a row leaves unused is booked to
one cause:

- ``max_tokens``: the row is near its end (``k`` below the cap);
- ``no match``: the drafter proposed nothing; ``short match``: its continuation ran out first;
- ``rows limit``: sizing without the few-row rule (:class:`QueryRows`) would have kept more;
- ``acceptance/cost``: the rest of sizing's cut (the row's estimated acceptance against the
  step-cost model's price of a draft).

``--costs``: beside each step, the step-cost model's price of one draft (seconds, and ÷ its
one-row decode price, the ratio sizing weighs) and the step's measured seconds; a summary of
the measured seconds by drafts in the step (decode-only steps), to compare with that price.

The **replay bound** drafts for the same answers with the same drafter at every position,
every proposal verified (no sizing): tokens per row-step a drafter of this kind could give at
``k``. The first token of each answer (the prefill's step) counts as one row-step on both sides.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter, defaultdict

from bench.engine import engine_runs as er
from bench.engine.spec_bench import workloads
from kvfleet.deploy.models import prepare_model
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.engine.speculative import sizing, speculator
from kvfleet.worker.engine.speculative.ngram import NgramIndex
from kvfleet.worker.step_cost.model import StepCost, StepShape

CAUSES = ("max_tokens", "no match", "short match", "rows limit", "acceptance/cost")


def replay(prompt: list[int], answer: list[int], k: int, max_tokens: int) -> tuple[int, int, int]:
    """(row-steps, drafted, accepted) of the engine's own-sequence n-gram drafter at ``k`` on
    ``answer``, every proposal verified (the first token: the prefill's row-step)."""
    index = NgramIndex(speculator.NGRAM_MIN, speculator.NGRAM_MAX)
    pos, steps, drafted, accepted = 1, 1, 0, 0
    while pos < len(answer):
        kk = min(k, max_tokens - pos - 1)
        d = index.propose(prompt + answer[:pos], kk) if kk > 0 else ()
        m = 0
        while m < len(d) and pos + m < len(answer) and d[m] == answer[pos + m]:
            m += 1
        steps, drafted, accepted = steps + 1, drafted + len(d), accepted + m
        pos += 1 + m
    return steps, drafted, accepted


class Tracer:
    """Wraps one engine's speculator; books each row's unused draft slots to a cause."""

    def __init__(self, spec: speculator.Speculator, show_steps: bool) -> None:
        self.spec, self.show = spec, show_steps
        self.slots = Counter()  # cause -> unused draft slots
        self.hist = Counter()  # (kept, accepted) -> verify rows
        self.kept = self.possible = 0
        self.step = 0
        plan, verified = spec.plan, spec.verified
        seen: list = []

        def traced_size(cands, base, sampled_rows, cost, tokens_left, query_rows=None):
            seen[:] = [cands, sizing.size_drafts(cands, base, sampled_rows, cost, tokens_left, None)]
            return sizing.size_drafts(cands, base, sampled_rows, cost, tokens_left, query_rows)

        speculator.size_drafts = traced_size

        def traced_plan(rows, base, sampled_rows, cost, tokens_left):
            out = plan(rows, base, sampled_rows, cost, tokens_left)
            cands, free = seen if seen else ([None] * len(rows), [0] * len(rows))
            self.step += 1
            line = []
            for s, c, d, f in zip(rows, cands, out, free, strict=True):
                k = min(spec.num_tokens, s.params.max_tokens - len(s.output_token_ids) - 1)
                p = 0 if c is None else c.max_drafts
                self.slots["max_tokens"] += spec.num_tokens - k
                self.slots["no match" if p == 0 else "short match"] += k - p
                self.slots["rows limit"] += max(0, min(f, p) - len(d))
                self.slots["acceptance/cost"] += p - max(len(d), min(f, p))
                self.kept += len(d)
                self.possible += spec.num_tokens
                first = "-" if c is None or c.first is None else f"{c.first:.2f}"
                cont = "-" if c is None else f"{c.rate:.2f}"
                line.append(f"{s.seq_id[-4:]}: k{k} p{p} d{len(d)} f={first} c={cont}")
            seen.clear()
            if self.show:
                print(f"  step {self.step:3d} rows {base.decode_rows} " + " | ".join(line))
            return out

        def traced_verified(seq, drafted, accepted):
            self.hist[(drafted, accepted)] += 1
            if self.show:
                print(f"    verified {seq.seq_id[-4:]}: {accepted}/{drafted}")
            return verified(seq, drafted, accepted)

        spec.plan, spec.verified = traced_plan, traced_verified


def trace_costs(cost: StepCost, show_steps: bool) -> dict[int, list[float]]:
    """Wrap ``cost.observe``: print each step's measured seconds beside the draft price the
    model held when it was planned (with ``show_steps``); measured seconds of decode-only
    steps by their drafts."""
    by_drafts: dict[int, list[float]] = defaultdict(list)
    observe = cost.observe

    def traced(shape: StepShape, measured_s: float) -> None:
        draft_s = cost.prior.draft_token_s * cost.draft_scale
        one_row_s = cost.predict_step_s(1, 0, 0)
        if shape.prefill_tokens == 0:
            by_drafts[shape.draft_tokens].append(measured_s)
        if show_steps:
            print(f"    cost: rows {shape.decode_rows} prefill {shape.prefill_tokens} drafts "
                  f"{shape.draft_tokens}: measured {measured_s * 1e3:.1f} ms, predicted "
                  f"{cost.predict_step_s(*shape) * 1e3:.1f} ms; a draft {draft_s * 1e3:.2f} ms "
                  f"({draft_s / one_row_s:.3f} of a one-row step; scales decode "
                  f"{cost.decode_scale:.3f} draft {cost.draft_scale:.3f})")
        observe(shape, measured_s)

    cost.observe = traced  # type: ignore[method-assign]
    return by_drafts


def run(factory: er.EngineFactory, prompts: list[list[int]], batch: int, max_tokens: int,
        mode: str, k: int, show_steps: bool, costs: bool = False) -> dict:
    engine = factory.engine(SchedulerConfig(max_num_seqs=8, speculative=mode, speculative_tokens=k))
    tracer = Tracer(engine.scheduler.spec, show_steps)
    by_drafts = trace_costs(engine.step_cost, show_steps) if costs else {}
    answers: dict[int, list[int]] = {}
    row_steps = 0
    for g in range(0, len(prompts), batch):
        for i, p in enumerate(prompts[g: g + batch]):
            params = SamplingParams(max_tokens=max_tokens).validate()
            engine.add_request(EngineRequest(f"r-{g + i}", tuple(p), params))
        while engine.has_work:
            for o in engine.step():
                if o.token_ids:
                    row_steps += 1
                    answers.setdefault(int(o.request_id.split("-")[1]), []).extend(o.token_ids)
    tokens = sum(len(a) for a in answers.values())
    rp = [replay(prompts[i], a, k, max_tokens) for i, a in answers.items()]
    c = engine.scheduler.spec.counts
    return {"tokens": tokens, "row_steps": row_steps, "tprs": tokens / row_steps,
            "drafted": c.drafted, "accepted": c.accepted, "slots": tracer.slots,
            "kept": tracer.kept, "possible": tracer.possible, "hist": tracer.hist,
            "replay_tprs": tokens / sum(r[0] for r in rp),
            "replay_acc": sum(r[2] for r in rp) / max(1, sum(r[1] for r in rp)),
            "answers": answers, "by_drafts": by_drafts,
            "draft_price": (engine.step_cost.prior.draft_token_s * engine.step_cost.draft_scale
                            / engine.step_cost.predict_step_s(1, 0, 0))}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench spec_trace", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="edit")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--mode", default="ngram")
    p.add_argument("--speculative-tokens", type=int, default=SchedulerConfig.speculative_tokens)
    p.add_argument("--steps", action="store_true", help="print every step's rows")
    p.add_argument("--costs", action="store_true",
                   help="the draft price beside measured step seconds (module docstring)")
    a = p.parse_args(argv)
    factory = er.EngineFactory(prepare_model(progress=False), 2048, SchedulerConfig())
    prompts = workloads(factory.tokenizer)[a.workload][0]
    for b in (int(x) for x in a.batches.split(",")):
        r = run(factory, prompts[:2] if b == 1 else prompts, b, a.max_tokens, a.mode,
                a.speculative_tokens, a.steps, a.costs)
        print(f"{a.workload} b{b} {a.mode} k={a.speculative_tokens}: tokens/row-step "
              f"{r['tprs']:.2f} (replay bound {r['replay_tprs']:.2f}, replay accepted "
              f"{r['replay_acc']:.0%}); drafted {r['drafted']} accepted {r['accepted']} "
              f"({r['accepted'] / max(1, r['drafted']):.0%}); draft slots kept "
              f"{r['kept']}/{r['possible']}", flush=True)
        unused = r["possible"] - r["kept"]
        print("  unused slots by cause: " + ", ".join(
            f"{c} {r['slots'][c]} ({r['slots'][c] / max(1, unused):.0%})" for c in CAUSES))
        hist = sorted(r["hist"].items())
        print("  verify rows (drafted, accepted): count  " + "  ".join(f"{k}:{v}" for k, v in hist))
        if a.costs:
            print(f"  a draft at the end: {r['draft_price']:.3f} of a one-row step; measured ms by "
                  "drafts (median, steps): " + "  ".join(
                      f"{d}:{statistics.median(v) * 1e3:.1f} ({len(v)})"
                      for d, v in sorted(r["by_drafts"].items())))
    return 0

