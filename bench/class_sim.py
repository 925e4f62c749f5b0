"""Priority classes and tenant fairness under the ITL target on a virtual clock (issue 25 §2, §3).

    .venv/bin/python -m bench class_sim [--itl-target-ms 150] [--seconds 120] [--seeds 0,1,2]

One replica's real scheduler and block pool (16 running + 256 waiting, 640 blocks of 16), each
step lasting exactly what the benches' cost model says (``MEASURED × 0.05``: 16 ms a step,
0.625 ms a prefill token, 4.4 ms a decode row): what ``class_step`` does to the step's
contents, apart from a loaded host's noise and the router (``bench priority`` and
``bench.overload fair`` measure those too). Requests as there: prompts of 64 distinct token
ids, 16 output tokens; the worker's TTFT (arrival to the end of the step that samples the
first token). Per seed and with ``class_step`` off and on:

* **§2** ``priority``: an interactive Poisson trickle at 0.1 × capacity alone, then beside a
  batch flood at 10 × capacity (refused past 80 % of the replica's sequences, as the router's
  ``--priority-admit``); ``--preempt-streaming``. Interactive TTFT p99 both ÷ alone (target
  ≤ 1.5), batch completions/s alone − both against interactive's (target ≤).
* **§3** ``fair``: tenant B at 0.2 × capacity alone, then beside tenant A at 10 × (both
  ``default``; ``tenant_share`` 0.5 of running and of waiting seats, running seats lent by
  service past it: ``seats_by_service``, ``--fixed-seats`` for the fixed cap); B's TTFT p99
  both ÷ alone (target ≤ 2); then both backlogged (16 closed-loop clients each, A's prompts 256 tokens):
  B's share of computed tokens (uncached prompt + output) in the middle half (fair 0.5 ± 10 %).

Capacity: completions/s of 16 closed-loop default clients. JSON: ``bench/results/class_sim.json``.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from bench.engine_bench import pct
from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.priority import BATCH, DEFAULT, INTERACTIVE
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.request import SeqStatus, SequenceState
from kvfleet.worker.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.worker.engine.step_cost import MEASURED, StepCost

COST = MEASURED.scaled(0.05)
BLOCK = 16
RESULTS = Path(__file__).parent / "results"


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


def simulate(streams: list[Stream], config: SchedulerConfig, seconds: float, seed: int) -> dict:
    """Run ``streams`` for ``seconds`` of virtual time; per tenant: TTFT p50/p99 and token
    gap (ITL) p99 (ms) of requests arriving in the run, completions/s, computed tokens of
    requests finishing in the middle half."""
    rng = random.Random(seed)
    sched = Scheduler(config, KVCacheManager(640, BLOCK), StepCost(COST, alpha=0.0))
    arrivals: list[tuple[float, Stream]] = []
    for st in streams:
        t = 0.0
        while st.rate and (t := t + rng.expovariate(st.rate)) < seconds:
            arrivals.append((t, st))
        arrivals += [(0.0, st)] * st.clients
    arrivals.sort(key=lambda a: a[0])
    ttft: dict[str, list[float]] = {st.tenant: [] for st in streams}
    gaps: dict[str, list[float]] = {st.tenant: [] for st in streams}
    last: dict[str, float] = {}  # seq_id -> when its last token came
    done = {st.tenant: 0 for st in streams}
    tokens = {st.tenant: 0 for st in streams}
    meta: dict[str, tuple[Stream, float]] = {}
    held = {st.tenant: 0 for st in streams}
    now, n, i = 0.0, 0, 0
    while now < seconds:
        while i < len(arrivals) and arrivals[i][0] <= now:
            t, st = arrivals[i]
            i += 1
            if (sched.num_unfinished >= st.admit * config.max_sequences
                    or held[st.tenant] >= st.share * config.max_sequences):
                if st.clients:  # a closed-loop client retries after 20 ms
                    arrivals.insert(i, (now + 0.02, st))
                    arrivals.sort(key=lambda a: a[0])
                continue
            n += 1
            s = SequenceState(seq_id=f"q{n}", request_id=f"q{n}", index=0,
                              prompt_token_ids=[rng.randrange(1, 40000) for _ in range(st.prompt)],
                              params=SamplingParams(max_tokens=16, ignore_eos=True),
                              root_hash=b"s" * 16, block_size=BLOCK, arrival_seq=n,
                              tenant=st.tenant, priority=st.priority)
            sched.add([s])
            held[st.tenant] += 1
            meta[s.seq_id] = (st, t)
        if not sched.num_unfinished:
            now = arrivals[i][0] if i < len(arrivals) else seconds
            continue
        out = sched.schedule(now)
        sched.on_step_done(out)
        now += max(COST.step_seconds(out.plan), 1e-3)
        for x in out.scheduled:
            seq = x.seq
            if not (x.sample and seq.status is SeqStatus.RUNNING):
                continue
            st, t0 = meta[seq.seq_id]
            if not seq.output_token_ids:
                ttft[st.tenant].append(now - t0)
            else:
                gaps[st.tenant].append(now - last[seq.seq_id])
            last[seq.seq_id] = now
            seq.append_token(1)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq)
                del last[seq.seq_id]
                held[st.tenant] -= 1
                done[st.tenant] += 1
                if seconds / 4 <= now <= 3 * seconds / 4:
                    tokens[st.tenant] += seq.num_prompt_tokens - (seq.num_cached_tokens or 0) + 16
                if st.clients:
                    arrivals.insert(i, (now, st))
    return {t: {"ttft_p50_ms": 1e3 * pct(v, 0.5) if v else None,
                "ttft_p99_ms": 1e3 * pct(v, 0.99) if v else None, "requests": len(v),
                "itl_p99_ms": 1e3 * pct(gaps[t], 0.99) if gaps[t] else None,
                "completions_per_s": done[t] / seconds, "computed_tokens": tokens[t]}
            for t, v in ttft.items()}


def run_seed(base: SchedulerConfig, seconds: float, seed: int, seat_share: float = 0.5,
             seats_by_service: bool = True) -> dict:
    """Both sections with ``class_step`` off and on, one seed (``seat_share``: §3's
    ``tenant_share``; ``seats_by_service`` False: a fixed cap of running seats)."""
    cap = simulate([Stream("c", clients=16)], replace(base, class_step=False), seconds, seed)
    rate = cap["c"]["completions_per_s"]
    out: dict = {"capacity_per_s": rate}
    chat = Stream("chat", INTERACTIVE, rate=0.1 * rate)
    flood = Stream("batch", BATCH, rate=10 * rate, admit=0.8)
    b_alone = Stream("B", rate=0.2 * rate, share=seat_share)
    a_flood = Stream("A", rate=10 * rate, share=seat_share)
    for on in (False, True):
        prio = replace(base, class_step=on, preempt_streaming=True)
        fair = replace(base, class_step=on, tenant_share=seat_share,
                       seats_by_service=seats_by_service)
        alone = simulate([chat], prio, seconds, seed)["chat"]
        batch = simulate([flood], prio, seconds, seed)["batch"]
        both = simulate([chat, flood], prio, seconds, seed)
        f_alone = simulate([b_alone], fair, seconds, seed)["B"]
        f_both = simulate([b_alone, a_flood], fair, seconds, seed)
        backlog = simulate([Stream("B", clients=16, share=seat_share),
                            Stream("A", clients=16, prompt=256, share=seat_share)],
                           fair, seconds, seed)
        total = sum(v["computed_tokens"] for v in backlog.values())
        out["on" if on else "off"] = {
            "priority": {"alone": alone, "batch_alone": batch, "both": both,
                         "ttft_p99_ratio": both["chat"]["ttft_p99_ms"] / alone["ttft_p99_ms"],
                         "batch_drop_per_s": batch["completions_per_s"]
                         - both["batch"]["completions_per_s"],
                         "interactive_per_s": both["chat"]["completions_per_s"]},
            "fair": {"alone": f_alone, "both": f_both, "backlogged": backlog,
                     "ttft_p99_ratio": f_both["B"]["ttft_p99_ms"] / f_alone["ttft_p99_ms"],
                     "b_token_share": backlog["B"]["computed_tokens"] / max(1, total)}}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="bench.class_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--itl-target-ms", type=float, default=150.0)
    p.add_argument("--seconds", type=float, default=120.0, help="virtual seconds per phase")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--seat-share", type=float, default=0.5,
                   help="§3: replicas' tenant_share (of running and of waiting seats)")
    p.add_argument("--fixed-seats", action="store_true",
                   help="§3: tenant_share caps running seats whatever the service (before)")
    a = p.parse_args(argv)
    base = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_waiting=256,
                           itl_target_ms=a.itl_target_ms)
    runs = {int(s): run_seed(base, a.seconds, int(s), a.seat_share, not a.fixed_seats)
            for s in a.seeds.split(",")}
    print("seed class_step | §2 chat TTFT p99 alone → both (×) | batch drop vs chat /s "
          "| batch ITL p99 | §3 B TTFT p99 alone → both (×) | B token share | A ITL p99 (backlogged)")
    for seed, r in runs.items():
        for k in ("off", "on"):
            pr, fa = r[k]["priority"], r[k]["fair"]
            print(f"{seed} {k:3s} | {pr['alone']['ttft_p99_ms']:.0f} → "
                  f"{pr['both']['chat']['ttft_p99_ms']:.0f} ms ({pr['ttft_p99_ratio']:.2f}×) | "
                  f"{pr['batch_drop_per_s']:.2f} vs {pr['interactive_per_s']:.2f} | "
                  f"{pr['both']['batch']['itl_p99_ms']:.0f} ms | "
                  f"{fa['alone']['ttft_p99_ms']:.0f} → {fa['both']['B']['ttft_p99_ms']:.0f} ms "
                  f"({fa['ttft_p99_ratio']:.2f}×) | {fa['b_token_share']:.3f} | "
                  f"{fa['backlogged']['A']['itl_p99_ms']:.0f} ms")
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = ("" if a.seat_share == 0.5 else f"-seats{a.seat_share:g}") + ("-fixed" if a.fixed_seats else "")
    path = RESULTS / f"class_sim{tag}.json"
    path.write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
