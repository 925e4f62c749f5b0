"""Priority classes and tenant fairness under the ITL target on a virtual clock.

    .venv/bin/python -m bench class_sim [--itl-target-ms 150 (0: none)] [--seconds 120] [--seeds 0,1,2]
        [--flood-prompt 256] [--fair-slack 0.5 (< 0: off)]
        [--layer-yield [--model smollm2-135m-instruct] [--yield-cost-layers 0]
        [--merge-within-ms MS]] [--stall P,F] [--fair-only [--no-tenant-preempt]] [--fresh-phases]

One replica's real scheduler and block pool (16 running + 256 waiting, 640 blocks of 16), each
step lasting exactly what the benches' cost model says (``MEASURED × 0.05``: 16 ms a step,
0.625 ms a prefill token, 4.4 ms a decode row): what ``class_step`` does to the step's
contents, apart from a loaded host's noise and the router (``bench priority`` and
``bench.cluster.overload fair`` measure those too). Requests as there: prompts of 64 distinct token
ids, 16 output tokens; the worker's TTFT (arrival to the end of the step that samples the
first token). Per seed and with ``class_step`` off and on:

* **§2** ``priority``: an interactive Poisson trickle at 0.1 × capacity alone, then beside a
  batch flood at 10 × capacity (refused past 80 % of the replica's sequences, as the router's
  ``--priority-admit``). Interactive TTFT p99 both ÷ alone (target
  ≤ 1.5), batch completions/s alone − both against interactive's (target ≤).
* **§3** ``fair``: tenant B at 0.2 × capacity alone, then beside tenant A at 10 × with
  ``--flood-prompt`` tokens a prompt (default 256, the cluster bench's shape; both
  ``default``; ``tenant_share`` 0.5 of running and of waiting seats, running seats lent by
  service past it: ``seats_by_service``, ``--fixed-seats`` for the fixed cap); B's TTFT p99
  both ÷ alone (target ≤ 2); then both backlogged (16 closed-loop clients each, A's prompts 256 tokens):
  B's share of computed tokens (uncached prompt + output) in the middle half (fair 0.5 ± 10 %).
  The three phases run on one scheduler, each from 2 s after the last drained, as the cluster
  bench's run on one fleet: A's flood becomes backlogged beside a B that ran alone, its service
  counter where B's run left it (``--fresh-phases``: a fresh scheduler a phase, counters at 0).

``--layer-yield``: steps pause between decoder layers (as many as the model's config has) for
a nested step of a higher class, or in §3 of a less-served tenant (:class:`Yield`,
``worker/engine/layer_yield/nested.py``). ``--itl-target-ms 0``: no ITL target (the replicas'
defaults; ``class_step`` then has nothing to do, so its off and on rows agree).

``--stall P,F``: host-like noise, each step F × its modelled length with probability P, unknown
to the scheduler (:class:`Stall`). ``--fair-only``: §3 alone, class_step on, with B's wait in the
queue (arrival to first admission) and the preemptions (``--no-tenant-preempt``: without the
seat for the tenant behind, ``preemption.preempt_for_behind_tenant``, for its A/B).

Capacity: completions/s of 16 closed-loop default clients. JSON: ``bench/results/class_sim.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from dataclasses import dataclass, replace
from typing import Optional

from bench.common.result_file import RESULTS
from bench.common.stream_stats import pct
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.priority import BATCH, DEFAULT, INTERACTIVE
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.layer_yield.nested import may_yield, nested_step, yields_to
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduling.fair_bound import FAIR_SLACK
from kvfleet.worker.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.step_cost.model import MEASURED, StepCost

COST = MEASURED.scaled(0.05)
BLOCK = 16
# §3's flood prompts: 4 × the others, as ``bench overload fair``'s --flood-prompt-factor
FLOOD_PROMPT = 256
# §3 with carried phases: idle virtual seconds between them (``bench overload``'s drain sleep)
PHASE_GAP_S = 2.0


@dataclass(frozen=True)
class Stream:
    """Requests of one tenant: Poisson at ``rate`` /s, or ``clients`` closed loops."""

    tenant: str
    priority: int = DEFAULT
    rate: float = 0.0
    clients: int = 0
    prompt: int = 64
    admit: float = 1.0  # refused once the replica holds this fraction of its sequences
    share: float = 1.0  # refused once this tenant holds this fraction of them


@dataclass(frozen=True)
class Yield:
    """Layer-level yield on the virtual clock (``worker/engine/layer_yield/nested.py``): a step is
    ``layers`` equal slices; a request the step in flight yields to (``yields_to``: a better
    class; with ``tenant_share`` < 1 also a less-served tenant of its class) pauses it at the
    first layer boundary after its arrival, the real scheduler's
    nested step (``layer_yield.nested.nested_step``) runs, and the paused step's remaining
    time, plus ``cost_layers`` layers' share of it for pausing and resuming, follows (default
    0, as the cost-model executor: the runner resumes on the same tensors and redoes nothing;
    ``bench nested_cost`` measures it on the real runner).

    ``merge_within_s`` (None: never): catch-up-and-merge instead, where the nested rows' first
    tokens would still come within this many seconds of the oldest one's arrival: the nested
    rows run the paused step's done layers alone (that share of their own step, base
    included), then ride its remaining layers merged into it (adding only their rows' share)
    and sample at its end."""

    layers: int
    cost_layers: float = 0.0
    merge_within_s: Optional[float] = None


def _row_s(chunk) -> float:
    """Modelled seconds ``chunk`` adds to a step beyond the step base (its rows' terms)."""
    n = len(chunk.token_ids)
    rows = COST.decode_token_s if n == 1 else COST.prefill_token_s * n
    return rows + COST.context_token_s * (chunk.num_computed_tokens + n)


def _slowest(split: list[tuple[float, float, int, float]], n: int = 5) -> list[dict]:
    """The ``n`` longest TTFTs of ``split`` ((TTFT s, queue s, preemptions, arrival s into the
    run) a request), each as its wait in the queue (arrival to first admission), its prefill
    (first admission to the first token: the steps it ran in, a recompute's too) in ms, its
    preemptions and when it arrived (s from the run's start)."""
    return [{"ttft_ms": 1e3 * t, "queue_ms": 1e3 * q, "prefill_ms": 1e3 * (t - q), "preempted": k,
             "at_s": at} for t, q, k, at in sorted(split, reverse=True)[:n]]


@dataclass(frozen=True)
class Stall:
    """Host-like noise: each step (nested ones too) lasts ``factor`` × its modelled length with
    probability ``p``, unknown to the scheduler (its cost model still predicts the model's
    length). Drawn from a generator of its own, so the arrivals match a run without stalls."""

    p: float
    factor: float


def new_scheduler(config: SchedulerConfig, variant: Optional[dict] = None) -> Scheduler:
    """The simulated replica's scheduler: 640 blocks, the step-cost model without learning."""
    return Scheduler(config, KVCacheManager(640, BLOCK), StepCost(COST, alpha=0.0),
                     **(variant or {}))


def simulate(streams: list[Stream], config: SchedulerConfig, seconds: float, seed: int,
             layer_yield: Optional[Yield] = None, variant: Optional[dict] = None,
             stall: Optional[Stall] = None, sched: Optional[Scheduler] = None,
             start: float = 0.0, seq_base: int = 0) -> dict:
    """Run ``streams`` for ``seconds`` of virtual time; per tenant: TTFT p50/p99, the wait
    in the queue for a first admission p99 and token gap (ITL) p99 (ms) of requests arriving
    in the run, completions/s, computed tokens of requests finishing in the middle half;
    ``"_yields"``: nested steps run; ``"_preemptions"``: sequences preempted. ``variant``:
    the scheduler's ``class_step`` / ``seats_by_service`` (off for the A/B); ``stall``: host
    noise (None: none).

    ``sched`` (None: a fresh one, :func:`new_scheduler`): a scheduler that ran an earlier phase
    and is empty, continued from virtual time ``start`` with its tenant service and prefix
    cache as they are (a cluster bench's phases run on one fleet); the run then drains it
    (no new arrival, nothing recorded) and ``"_end"`` is when it is empty again, ``"_seqs"``
    ``seq_base`` plus the sequences it added (the next phase's ``seq_base``: ids stay unique)."""
    rng = random.Random(seed)
    stall_rng = random.Random(f"stall-{seed}")

    def stretch(step_s: float) -> float:
        return step_s * stall.factor if stall and stall_rng.random() < stall.p else step_s

    carried = sched is not None
    if sched is None:
        sched = new_scheduler(config, variant)
    arrivals: list[tuple[float, Stream]] = []
    for st in streams:
        t = 0.0
        while st.rate and (t := t + rng.expovariate(st.rate)) < seconds:
            arrivals.append((start + t, st))
        arrivals += [(start, st)] * st.clients
    arrivals.sort(key=lambda a: a[0])
    ttft: dict[str, list[float]] = {st.tenant: [] for st in streams}
    queued: dict[str, list[float]] = {st.tenant: [] for st in streams}  # arrival -> admission
    # (TTFT, queue, its preemptions before the first token, arrival) a request: the tail's split
    split: dict[str, list[tuple[float, float, int, float]]] = {st.tenant: [] for st in streams}
    gaps: dict[str, list[float]] = {st.tenant: [] for st in streams}
    last: dict[str, float] = {}  # seq_id -> when its last token came
    done = {st.tenant: 0 for st in streams}
    tokens = {st.tenant: 0 for st in streams}
    meta: dict[str, tuple[Stream, float]] = {}
    held = {st.tenant: 0 for st in streams}
    own = {st.tenant: 0.0 for st in streams}  # replica-seconds of each tenant's own work
    overhead = 0.0  # replica-seconds of pausing and resuming (no tenant's work)
    n = i = yields = preemptions = 0
    recording = True  # False while a carried scheduler drains after the run
    first_admitted: dict[str, float] = {}  # seq_id -> when it was first admitted

    def admitted(out: SchedulerOutput, now: float) -> None:
        nonlocal preemptions
        preemptions += len(out.preempted)
        for x in out.scheduled:
            first_admitted.setdefault(x.seq.seq_id, now)

    def arrive(until: float) -> None:
        nonlocal i, n
        while i < len(arrivals) and arrivals[i][0] <= until:
            t, st = arrivals[i]
            i += 1
            if (sched.num_unfinished >= st.admit * config.max_sequences
                    or held[st.tenant] >= st.share * config.max_sequences):
                if st.clients:  # a closed-loop client retries after 20 ms
                    arrivals.insert(i, (until + 0.02, st))
                    arrivals.sort(key=lambda a: a[0])
                continue
            n += 1
            sid = f"q{seq_base + n}"
            s = SequenceState(seq_id=sid, request_id=sid, index=0,
                              prompt_token_ids=[rng.randrange(1, 40000) for _ in range(st.prompt)],
                              params=SamplingParams(max_tokens=16, ignore_eos=True),
                              root_hash=b"s" * 16, block_size=BLOCK, arrival_seq=seq_base + n,
                              tenant=st.tenant, priority=st.priority)
            sched.add([s])
            held[st.tenant] += 1
            meta[s.seq_id] = (st, t)

    def charge(out: SchedulerOutput, seconds_: float) -> None:
        """Share ``seconds_`` of ``out``'s forward among its tenants by their rows' terms
        (the step base pro rata: a step of one tenant's rows is all its own)."""
        rows = [(meta[x.seq.seq_id][0].tenant, _row_s(c))
                for x, c in zip(out.scheduled, out.plan.chunks, strict=True)]
        total = sum(r for _, r in rows)
        for tenant, r in rows:
            own[tenant] += seconds_ * r / total if total > 0 else seconds_ / len(rows)

    def sample(out: SchedulerOutput, now: float) -> None:
        for x in out.scheduled:
            seq = x.seq
            if not (x.sample and seq.status is SeqStatus.RUNNING):
                continue
            st, t0 = meta[seq.seq_id]
            if not recording:
                pass
            elif not seq.output_token_ids:
                ttft[st.tenant].append(now - t0)
                queued[st.tenant].append(first_admitted[seq.seq_id] - t0)
                split[st.tenant].append((now - t0, first_admitted[seq.seq_id] - t0,
                                         seq.num_preemptions, t0 - start))
            else:
                gaps[st.tenant].append(now - last[seq.seq_id])
            last[seq.seq_id] = now
            seq.append_token(1)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq)
                del last[seq.seq_id]
                held[st.tenant] -= 1
                if not recording:
                    continue
                done[st.tenant] += 1
                if seconds / 4 <= now - start <= 3 * seconds / 4:
                    tokens[st.tenant] += seq.num_prompt_tokens - (seq.num_cached_tokens or 0) + 16
                if st.clients:
                    arrivals.insert(i, (now, st))

    def run_yielding(out: SchedulerOutput, start: float, yd: Yield) -> float:
        """Run ``out`` from ``start``, pausing for nested steps; returns its end (and samples
        a nested step merged into ``out``'s remaining layers at it)."""
        nonlocal yields, overhead
        modelled = max(COST.step_seconds(out.plan), 1e-3)
        total = stretch(modelled)
        layer = total / yd.layers
        t, progress = start, 0.0  # virtual now, seconds of ``out`` done
        charge(out, total)
        fair = config.tenant_share < 1
        while True:
            # the streams ``out`` yields to, as of the service charged so far
            to = {st for st in streams if yields_to(out, st.priority, *(
                (st.tenant, sched.service.service) if fair else ()))}
            if not to:
                break
            urgent = next((max(a[0], t) for a in itertools.islice(arrivals, i, None)
                           if a[1] in to), None)
            if may_yield(sched, out):
                urgent = t
            if urgent is None:
                break
            boundary = math.ceil((progress + urgent - t) / layer - 1e-9) * layer
            if boundary >= total - 1e-12:
                break  # the step ends first
            t, progress = t + boundary - progress, boundary
            arrive(t)  # the engine drains its inbox at the yield point
            nested = nested_step(sched, out, t)
            admitted(nested, t)
            if not nested.scheduled:
                break  # refused (no free seat or blocks): the step runs on whole
            yields += 1
            nested_s = stretch(max(COST.step_seconds(nested.plan), 1e-3))
            frac = progress / total  # layers of ``out`` done, as a fraction
            merged = COST.step_seconds(StepPlan(out.plan.chunks + nested.plan.chunks))
            rest = (1 - frac) * (merged - modelled)  # the nested rows' share of the rest
            end = t + frac * nested_s + yd.cost_layers * layer + total - progress + rest
            oldest = min(meta[x.seq.seq_id][1] for x in nested.scheduled)
            if yd.merge_within_s is not None and end - oldest <= yd.merge_within_s:
                # catch up to the paused layer alone, then ride the rest merged
                charge(nested, frac * nested_s + rest)
                overhead += yd.cost_layers * layer
                sched.on_step_done(nested)
                sample(nested, end)
                return end
            t += nested_s
            charge(nested, nested_s)
            sched.on_step_done(nested)
            sample(nested, t)
            t += yd.cost_layers * layer
            overhead += yd.cost_layers * layer
        return t + total - progress

    now = start
    while now < start + seconds or (carried and sched.num_unfinished):
        if now >= start + seconds and recording:
            recording = False  # drain: the next phase starts on an empty replica
            del arrivals[i:]
        arrive(now)
        if not sched.num_unfinished:
            now = arrivals[i][0] if i < len(arrivals) else start + seconds
            continue
        out = sched.schedule(now)
        admitted(out, now)
        if layer_yield is None:
            sched.on_step_done(out)
            step_s = stretch(max(COST.step_seconds(out.plan), 1e-3))
            charge(out, step_s)
            now += step_s
        else:
            now = run_yielding(out, now, layer_yield)
            sched.on_step_done(out)
        sample(out, now)
    res: dict = {t: {"ttft_p50_ms": 1e3 * pct(v, 0.5) if v else None,
                     "ttft_p99_ms": 1e3 * pct(v, 0.99) if v else None, "requests": len(v),
                     "queue_p99_ms": 1e3 * pct(queued[t], 0.99) if v else None,
                     "itl_p99_ms": 1e3 * pct(gaps[t], 0.99) if gaps[t] else None,
                     "completions_per_s": done[t] / seconds, "computed_tokens": tokens[t],
                     "own_replica_s": own[t], "slowest": _slowest(split[t])}
                 for t, v in ttft.items()}
    res["_yields"] = yields
    res["_preemptions"] = preemptions
    res["_overhead_replica_s"] = overhead
    res["_end"] = now
    res["_seqs"] = seq_base + n
    return res


def run_seed(base: SchedulerConfig, seconds: float, seed: int, seat_share: float = 0.5,
             seats_by_service: bool = True, layer_yield: Optional[Yield] = None,
             flood_prompt: int = FLOOD_PROMPT, fair_slack: Optional[float] = FAIR_SLACK,
             carry: bool = True) -> dict:
    """Both sections with ``class_step`` off and on, one seed (``seat_share``: §3's
    ``tenant_share``; ``seats_by_service`` False: a fixed cap of running seats;
    ``layer_yield``: steps pause between layers for a higher class, None: atomic steps;
    ``flood_prompt``: §3's tenant A's prompt tokens in the flood phase; ``fair_slack``: the
    scheduler's, None: off; ``carry``: §3's phases on one scheduler, :func:`fair_phases`)."""
    cap = simulate([Stream("c", clients=16)], base, seconds, seed, variant={"class_step": False})
    rate = cap["c"]["completions_per_s"]
    out: dict = {"capacity_per_s": rate}
    chat = Stream("chat", INTERACTIVE, rate=0.1 * rate)
    flood = Stream("batch", BATCH, rate=10 * rate, admit=0.8)
    b_alone = Stream("B", rate=0.2 * rate, share=seat_share)
    a_flood = Stream("A", rate=10 * rate, prompt=flood_prompt, share=seat_share)
    for on in (False, True):
        prio = base
        fair = replace(base, tenant_share=seat_share)
        ly, v = layer_yield, {"class_step": on, "seats_by_service": seats_by_service,
                              "fair_slack": fair_slack}
        alone = simulate([chat], prio, seconds, seed, ly, v)["chat"]
        batch = simulate([flood], prio, seconds, seed, ly, v)["batch"]
        both = simulate([chat, flood], prio, seconds, seed, ly, v)
        f_alone, f_both, backlog = fair_phases(
            fair, seconds, seed, ly, v, None, carry, [b_alone], [b_alone, a_flood],
            [Stream("B", clients=16, share=seat_share),
             Stream("A", clients=16, prompt=256, share=seat_share)])
        f_alone = f_alone["B"]
        total = backlog["A"]["computed_tokens"] + backlog["B"]["computed_tokens"]
        out["on" if on else "off"] = {
            "priority": {"alone": alone, "batch_alone": batch, "both": both,
                         "ttft_p99_ratio": both["chat"]["ttft_p99_ms"] / alone["ttft_p99_ms"],
                         "batch_drop_per_s": batch["completions_per_s"]
                         - both["batch"]["completions_per_s"],
                         "interactive_per_s": both["chat"]["completions_per_s"],
                         # the same two sides in replica-seconds a second: lost batch
                         # completions at batch-alone work each, against the interactive
                         # rows' own work (whole nested steps, shares of shared steps)
                         "batch_drop_replica_s_per_s": (
                             batch["completions_per_s"] - both["batch"]["completions_per_s"])
                         * batch["own_replica_s"] / max(1e-9, batch["completions_per_s"]
                                                        * seconds),
                         "interactive_replica_s_per_s": both["chat"]["own_replica_s"] / seconds,
                         "yield_overhead_replica_s_per_s": both["_overhead_replica_s"] / seconds,
                         "yields": both["_yields"]},
            "fair": {"alone": f_alone, "both": f_both, "backlogged": backlog,
                     "ttft_p99_ratio": f_both["B"]["ttft_p99_ms"] / f_alone["ttft_p99_ms"],
                     "b_token_share": backlog["B"]["computed_tokens"] / max(1, total)}}
    return out


def fair_phases(config: SchedulerConfig, seconds: float, seed: int, layer_yield: Optional[Yield],
                variant: dict, stall: Optional[Stall], carry: bool,
                *phases: list[Stream]) -> list[dict]:
    """§3's phases (alone, flood, backlogged), one :func:`simulate` each. ``carry``: on one
    scheduler, each phase starting ``PHASE_GAP_S`` after the last drained, as ``bench overload
    fair`` runs its phases on one fleet (a tenant's service counter, and so where a tenant that
    becomes backlogged starts, carries over); False: each on a fresh scheduler, counters at 0."""
    if not carry:
        return [simulate(ss, config, seconds, seed, layer_yield, variant, stall) for ss in phases]
    sched, start, seqs, runs = new_scheduler(config, variant), 0.0, 0, []
    for ss in phases:
        runs.append(simulate(ss, config, seconds, seed, layer_yield, variant, stall, sched,
                             start, seqs))
        start, seqs = runs[-1]["_end"] + PHASE_GAP_S, runs[-1]["_seqs"]
    return runs


def run_fair(base: SchedulerConfig, seconds: float, seed: int, seat_share: float,
             layer_yield: Optional[Yield], flood_prompt: int, variant: dict,
             stall: Optional[Stall], carry: bool = True) -> dict:
    """§3 alone, ``class_step`` on (the replicas' default), with ``stall`` on every phase
    but the capacity run (so the arrival rates match a run without stalls): B's TTFT and
    queue-wait p99 alone and beside A's flood, A's completions/s in the flood, preemptions;
    B's share of computed tokens when both are backlogged. ``carry``: :func:`fair_phases`'."""
    cap = simulate([Stream("c", clients=16)], base, seconds, seed, variant={"class_step": False})
    rate = cap["c"]["completions_per_s"]
    fair = replace(base, tenant_share=seat_share)
    b_alone = Stream("B", rate=0.2 * rate, share=seat_share)
    a_flood = Stream("A", rate=10 * rate, prompt=flood_prompt, share=seat_share)
    f_alone, f_both, backlog = fair_phases(
        fair, seconds, seed, layer_yield, variant, stall, carry,
        [b_alone], [b_alone, a_flood], [Stream("B", clients=16, share=seat_share),
                                        Stream("A", clients=16, prompt=256, share=seat_share)])
    f_alone = f_alone["B"]
    total = backlog["A"]["computed_tokens"] + backlog["B"]["computed_tokens"]
    return {"capacity_per_s": rate, "alone": f_alone, "both": f_both, "backlogged": backlog,
            "ttft_p99_ratio": f_both["B"]["ttft_p99_ms"] / f_alone["ttft_p99_ms"],
            "b_token_share": backlog["B"]["computed_tokens"] / max(1, total)}


def model_layers(name_or_dir: str) -> int:
    """Decoder layers of a model (a known name or an HF directory: ``num_hidden_layers``)."""
    from kvfleet.deploy.models import resolve_model
    from kvfleet.worker.runner.model_config import load_model_config

    return load_model_config(resolve_model(name_or_dir)[1]).num_layers


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="bench.sim.class_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--itl-target-ms", type=float, default=150.0,
                   help="the replica's ITL target (0: none, the defaults)")
    p.add_argument("--seconds", type=float, default=120.0, help="virtual seconds per phase")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--seat-share", type=float, default=0.5,
                   help="§3: replicas' tenant_share (of running and of waiting seats)")
    p.add_argument("--flood-prompt", type=int, default=FLOOD_PROMPT,
                   help="§3: tenant A's prompt tokens in the flood phase (default: the cluster "
                        "bench's shape, 4 × 64; 64: the shape of earlier runs)")
    p.add_argument("--fair-slack", type=float, default=FAIR_SLACK,
                   help="§3: over-served prefill's bound, × the decode rows' "
                        "step (fair_bound.py; < 0: off, the A/B)")
    p.add_argument("--fixed-seats", action="store_true",
                   help="§3: tenant_share caps running seats whatever the service (before)")
    p.add_argument("--layer-yield", action="store_true",
                   help="steps pause between layers for a nested step of a higher class")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="--layer-yield: the model whose config gives the number of layers")
    p.add_argument("--yield-cost-layers", type=float, default=0.0,
                   help="--layer-yield: what a pause adds to the paused step, in layers "
                        "(default 0: nothing is redone)")
    p.add_argument("--merge-within-ms", type=float, default=None,
                   help="--layer-yield: catch up and merge into the paused step when the "
                        "first tokens still come within this many ms of arrival (default: never)")
    p.add_argument("--stall", default=None, metavar="P,F",
                   help="host-like noise: each step lasts F × its modelled length with "
                        "probability P, unknown to the scheduler (e.g. 0.1,3)")
    p.add_argument("--fair-only", action="store_true",
                   help="§3 only, class_step on (the replicas' default)")
    p.add_argument("--no-tenant-preempt", action="store_true",
                   help="§3: no seat preemption for a tenant under its share (the A/B)")
    p.add_argument("--fresh-phases", action="store_true",
                   help="§3: each phase on a fresh scheduler, counters at 0 (before: the "
                        "default now carries the alone phase's scheduler into the flood and on)")
    p.add_argument("--json", default=None,
                   help="--fair-only: also write the runs to bench/results/JSON")
    a = p.parse_args(argv)
    stall = Stall(*map(float, a.stall.split(","))) if a.stall else None
    merge = None if a.merge_within_ms is None else a.merge_within_ms / 1e3
    ly = Yield(model_layers(a.model), a.yield_cost_layers, merge) if a.layer_yield else None
    base = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_waiting=256,
                           itl_target_ms=a.itl_target_ms or None)
    if a.fair_only:
        v = {"class_step": True, "seats_by_service": not a.fixed_seats,
             "fair_slack": None if a.fair_slack < 0 else a.fair_slack,
             "tenant_preempt": not a.no_tenant_preempt}
        fair_runs = {int(s): run_fair(base, a.seconds, int(s), a.seat_share, ly, a.flood_prompt,
                                      v, stall, not a.fresh_phases) for s in a.seeds.split(",")}
        print("seed | B TTFT p99 alone → flood (×) | B queue p99 alone → flood | A /s in flood "
              "| preemptions in flood | B token share backlogged | A ITL p99 backlogged "
              "| preemptions backlogged | A, B /s backlogged")
        for seed, f in fair_runs.items():
            print(f"{seed} | {f['alone']['ttft_p99_ms']:.0f} → {f['both']['B']['ttft_p99_ms']:.0f}"
                  f" ms ({f['ttft_p99_ratio']:.2f}×) | {f['alone']['queue_p99_ms']:.0f} → "
                  f"{f['both']['B']['queue_p99_ms']:.0f} ms | "
                  f"{f['both']['A']['completions_per_s']:.2f} | {f['both']['_preemptions']} | "
                  f"{f['b_token_share']:.3f} | {f['backlogged']['A']['itl_p99_ms']:.0f} ms | "
                  f"{f['backlogged']['_preemptions']} | {f['backlogged']['A']['completions_per_s']:.2f}, "
                  f"{f['backlogged']['B']['completions_per_s']:.2f}")
        print("seed | B's slowest 3 in the flood: TTFT = queue + prefill ms (preempted, arrival) "
              "| A ITL p99 in flood")
        for seed, f in fair_runs.items():
            tail = ", ".join(f"{x['ttft_ms']:.0f} = {x['queue_ms']:.0f} + {x['prefill_ms']:.0f}"
                             f" ({x['preempted']}, at {x['at_s']:.1f} s)"
                             for x in f["both"]["B"]["slowest"][:3])
            print(f"{seed} | {tail} | {f['both']['A']['itl_p99_ms']:.0f} ms")
        if a.json:
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / a.json).write_text(json.dumps({"args": vars(a), "runs": fair_runs},
                                                     indent=1) + "\n")
        return 0
    runs = {int(s): run_seed(base, a.seconds, int(s), a.seat_share, not a.fixed_seats, ly,
                             a.flood_prompt, None if a.fair_slack < 0 else a.fair_slack,
                             not a.fresh_phases)
            for s in a.seeds.split(",")}
    print("seed class_step | §2 chat TTFT p99 alone → both (×) | batch drop vs chat /s "
          "| batch ITL p99 | §3 B TTFT p99 alone → both (×) | B token share | A ITL p99 (backlogged) "
          "| §2 nested steps | §2 replica-s/s: batch lost vs interactive own + pauses")
    for seed, r in runs.items():
        for k in ("off", "on"):
            pr, fa = r[k]["priority"], r[k]["fair"]
            print(f"{seed} {k:3s} | {pr['alone']['ttft_p99_ms']:.0f} → "
                  f"{pr['both']['chat']['ttft_p99_ms']:.0f} ms ({pr['ttft_p99_ratio']:.2f}×) | "
                  f"{pr['batch_drop_per_s']:.2f} vs {pr['interactive_per_s']:.2f} | "
                  f"{pr['both']['batch']['itl_p99_ms']:.0f} ms | "
                  f"{fa['alone']['ttft_p99_ms']:.0f} → {fa['both']['B']['ttft_p99_ms']:.0f} ms "
                  f"({fa['ttft_p99_ratio']:.2f}×) | {fa['b_token_share']:.3f} | "
                  f"{fa['backlogged']['A']['itl_p99_ms']:.0f} ms | {pr['yields']} | "
                  f"{pr['batch_drop_replica_s_per_s']:.4f} vs "
                  f"{pr['interactive_replica_s_per_s']:.4f} + "
                  f"{pr['yield_overhead_replica_s_per_s']:.4f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = (("" if a.itl_target_ms == 150 else f"-itl{a.itl_target_ms:g}")
           + ("" if a.seat_share == 0.5 else f"-seats{a.seat_share:g}")
           + ("" if a.flood_prompt == FLOOD_PROMPT else f"-flood{a.flood_prompt}")
           + ("" if a.fair_slack == FAIR_SLACK else f"-slack{a.fair_slack:g}")
           + ("-fixed" if a.fixed_seats else "") + ("-yield" if a.layer_yield else "")
           + ("-fresh" if a.fresh_phases else "")
           + (f"{a.yield_cost_layers:g}" if a.layer_yield and a.yield_cost_layers else "")
           + (f"-merge{a.merge_within_ms:g}" if a.layer_yield and merge is not None else ""))
    path = RESULTS / f"class_sim{tag}.json"
    path.write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
