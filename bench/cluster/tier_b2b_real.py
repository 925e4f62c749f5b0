"""B2B on 2 real SmolLM2 replicas through the real router: host tier off / on, peer pull off / on.

    .venv/bin/python -m bench tier_b2b_real [--rate 0.2] [--count 36] [--quick]

Each configuration is a fresh fleet in this process: a private redis-server, a local Ray
(the node's host tier is its actor, one per node: this machine is one node, so both
replicas share it), two ``ReplicaServer`` (SmolLM2 fp32, one torch thread each) and one
``RouterServer`` (prefix_aware, host hits credited at its default weight), all as
``tests/integration/routing_fleet.py`` builds them. The B2B workload is
``bench/common/workload.py``'s, scaled to this machine: ``--groups`` system prompts of
``--system-tokens`` each shared by 2 users with ``--user-tokens`` of context, a unique
16-token question, 8 output tokens; its shared blocks are ~2.3× one replica's pool
(``--pool-blocks``). Poisson arrivals at ``--rate``, the same stream for every
configuration; the first ``--warmup`` requests are not counted.

Configurations:

* ``tier off``; ``tier on`` (``kv_peer_pull=False``); ``tier on + pull``:
  open loop over the B2B stream. Reported: client TTFT p50 / p90, hit rate (cached ÷ prompt
  tokens of the counted requests), prompt tokens admitted from the device / host tier
  (the workers' ``prefix_hits`` counters over the counted part), throughput (counted
  requests ÷ their span), pulls, and the routing tally (:class:`HintTally`: decisions routed
  away from the deepest device holder, those the chosen replica's own node tier covered,
  hints sent), and each request's TTFT breakdown (``bench/cluster/ttft_breakdown.py``). A name given
  more than once runs that often, interleaved in the order given (``"tier off,tier on,tier
  off,tier on"``: ``#1``, ``#2``); ``ratios`` then holds tier on ÷ off pooled and per pair.
  ``--load-penalty`` / ``--popularity-window`` set prefix_aware's knobs,
  ``--hot-share`` / ``--users`` a hot customer;
* ``fits, tier off`` / ``fits, tier on``, twice each alternately: a closed loop of 2 clients
  over a workload whose shared blocks fit one pool (``--fit-groups``), for the
  no-regression check (saturated requests/s).

Memory: ``ReplicaServer.stop()`` frees each replica's weights and KV cache (before it did, the
stopped replicas, held in reference cycles, kept ~2 GB per configuration: a run with
``--fit-rounds 3`` was OOM-killed in its 9th); the process stays near one fleet's size.

The machine's load average is recorded before and after each configuration. JSON in
``bench/results/tier_b2b_real.json``, TTFT CDFs in ``tier_b2b_real.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

import grpc

from bench.cluster.ttft_breakdown import PARTS, TtftProbe, tail_profile
from bench.common.plots import plot_ttft_cdfs
from bench.common.result_file import RESULTS, write_json
from bench.common.workload import B2BWorkload, Request, b2b_requests
from kvfleet.router.main import RouterConfig, RouterServer
from kvfleet.v1 import router_pb2, router_pb2_grpc
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.replica.replica import ReplicaConfig, ReplicaServer

MODEL = "smollm2"
START_TIMEOUT_S = 180.0
TIER_BYTES = 256 << 20  # ~360 SmolLM2 blocks: holds every shared block of the workload


@dataclass
class Sent:
    request: Request
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    cached: int = 0
    replica: str = ""
    error: str = ""
    parts: Optional[dict] = None  # TtftProbe.breakdown (open loop)


async def _one(stub, r: Request, t0: float, max_tokens: int, out: Sent) -> None:
    """Send ``r`` through the router at its offset (open loop) and record what came back."""
    req = router_pb2.GenerateRequest(request_id=f"b2b-{r.index}")
    req.token_ids.ids.extend(r.token_ids)
    req.sampling.max_tokens = max_tokens
    req.sampling.ignore_eos = True
    start = time.monotonic()
    try:
        async for m in stub.Generate(req):
            if out.ttft_s is None and m.token_ids:
                out.ttft_s = time.monotonic() - start
            if m.HasField("usage"):
                out.cached, out.replica = m.usage.cached_prompt_tokens, m.replica_id
        out.e2e_s = time.monotonic() - t0
    except grpc.aio.AioRpcError as exc:
        out.error = exc.code().name


def _kill_tier_actor(namespace: str) -> None:
    """The tier actor of a configuration's namespace is detached: it goes with the
    configuration (each starts with a fresh namespace, so an empty tier)."""
    from kvfleet.worker.kv_tier.node_tier import remove_node_tiers

    remove_node_tiers(namespace)


class RealFleet:
    """``count`` SmolLM2 replicas (default 2) and a router on one event loop (a fresh index
    namespace); ``replica_options``: more :class:`ReplicaConfig` fields for every replica."""

    def __init__(self, model_dir: str, redis_url: str, pool_blocks: int, tier: bool,
                 pull: bool, max_seqs: int = 2, policy_options: Optional[dict] = None,
                 count: int = 2, **replica_options) -> None:
        ns = self.namespace = f"tierbench-{uuid.uuid4().hex[:8]}:"
        sched = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=256)
        self.replicas = [ReplicaServer(ReplicaConfig(
            replica_id=f"rep-{i}", model_name=MODEL, model_dir=model_dir, num_blocks=pool_blocks,
            redis_url=redis_url, namespace=ns, heartbeat_interval_s=0.5, scheduler=sched,
            kv_host_memory_bytes=TIER_BYTES if tier else None, kv_peer_pull=pull,
            **replica_options))
            for i in range(count)]
        self.router = RouterServer(RouterConfig(redis_url=redis_url, model_name=MODEL,
                                                model_dir=model_dir, port=0, namespace=ns,
                                                policy="prefix_aware",  # its knobs are the flags'
                                                policy_options=policy_options or {}))

    async def __aenter__(self) -> "RealFleet":
        for r in self.replicas:  # bounded: a start that hangs raises where it waits
            await asyncio.wait_for(r.start(), START_TIMEOUT_S)
        await asyncio.wait_for(self.router.start(), START_TIMEOUT_S)
        for _ in range(200):
            await self.router.replicas.refresh()
            if len(self.router.replicas.replicas) == len(self.replicas):
                return self
            await asyncio.sleep(0.05)
        raise RuntimeError("the router did not see every replica")

    async def __aexit__(self, *exc) -> None:
        await self.router.stop(grace_s=0.1)
        for r in self.replicas:
            await r.stop(grace_s=0.1)
        _kill_tier_actor(self.namespace)

    def hits(self) -> dict[str, int]:
        """Prompt tokens admitted, and reused from the device / host tier, both replicas."""
        total = {"prompt_tokens": 0, "device": 0, "host": 0}
        for r in self.replicas:
            for k, v in r.service.loop.stats.get("prefix_hits", {}).items():
                total[k] += v
        return total

    def tier_counters(self) -> dict[str, dict]:
        """Each replica's ``kv_tier`` stats (write-backs, restores, lookups; absent: no tier)."""
        return {r.cfg.replica_id: r.service.loop.stats.get("kv_tier", {}) for r in self.replicas}

    def pulls(self) -> dict[str, float]:
        """Every replica's ``PullStats`` summed, and ``attempted``: hints that were pulled
        (landed, empty, refused or failed; ``skipped`` ones were recomputed without asking)."""
        out = {"pulls": 0, "pulled_blocks": 0, "skipped": 0, "refused": 0, "failed": 0,
               "timed_out": 0, "empty": 0}
        for r in self.replicas:
            if r.service.puller is not None:
                for k in out:
                    out[k] += getattr(r.service.puller.stats, k)
        out["attempted"] = out["pulls"] + out["refused"] + out["failed"] + out["empty"]
        return out

    def log_pulls(self) -> list[dict]:
        """From now on, one record per hinted request a replica's puller saw (appended to the
        list returned): blocks missing, the predicted pull and
        recompute seconds, the outcome (``landed``, ``empty``: the peer had none of them,
        ``skipped``: recomputed without asking, ``refused``, ``timed out``, ``failed``) and
        the seconds it took."""
        records: list[dict] = []
        for r in self.replicas:
            if r.service.puller is not None:
                r.service.puller.prepare = _logged(r.service.puller, records)
        return records


def _logged(puller, records: list[dict]):
    prepare = puller.prepare

    async def logged(req, hint):
        if hint is None:
            return await prepare(req, hint)
        st = puller.stats
        before = (st.pulls, st.skipped, st.refused, st.failed, st.timed_out, st.pulled_blocks,
                  st.empty)
        limit = min(hint.num_blocks, (len(req.prompt_token_ids) - 1) // puller.block_size)
        first = min(hint.first_block, limit)
        rec = {"blocks": limit - first, "tier_hint": bool(hint.tier_id),
               "predicted_pull_s": puller.cost.predict_s(limit - first),
               "predicted_recompute_s": puller.recompute_s(first, limit - first)}
        t0 = time.monotonic()
        out = await prepare(req, hint)
        after = (st.pulls, st.skipped, st.refused, st.failed, st.timed_out, st.pulled_blocks,
                 st.empty)
        d = [b - a for a, b in zip(before, after, strict=True)]
        rec["outcome"] = ("landed" if d[0] else "empty" if d[6] else "skipped" if d[1]
                          else "refused" if d[2] else "timed out" if d[4]
                          else "failed" if d[3] else "?")
        rec["pulled_blocks"], rec["seconds"] = d[5], time.monotonic() - t0
        records.append(rec)
        return out

    return logged


class HintTally:
    """Why a routed request did or did not carry a peer hint: wraps the router's
    ``pick_source`` (this process's router) and counts, per decision, whether the chosen
    replica's device match was below the deepest one (routed away), whether its own node
    tier made up the difference (no pull needed), and whether a hint went out."""

    def __init__(self) -> None:
        self.counts = {"decisions": 0, "routed_away": 0, "covered_by_own_tier": 0, "hints": 0}

    def __enter__(self) -> "HintTally":
        import kvfleet.router.core as core

        self._core, self._pick = core, core.pick_source

        def pick(candidates, chosen, tier_runs, *args, **kw):
            source = self._pick(candidates, chosen, tier_runs, *args, **kw)
            best = max((c.matched_blocks for c in candidates), default=0)
            c = self.counts
            c["decisions"] += 1
            if chosen.matched_blocks < best:
                c["routed_away"] += 1
                c["covered_by_own_tier"] += chosen.matched_blocks + chosen.host_blocks >= best
            c["hints"] += source is not None
            return source

        core.pick_source = pick
        return self

    def __exit__(self, *exc) -> None:
        self._core.pick_source = self._pick


def _pct(xs: Sequence[float], q: float) -> Optional[float]:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))] if s else None


def _load() -> float:
    return os.getloadavg()[0]


async def open_loop(fleet: RealFleet, reqs: list[Request], warmup: int, max_tokens: int,
                    probe: Optional[TtftProbe] = None) -> dict:
    """The B2B stream at its offsets; stats over the requests after ``warmup`` (with
    ``probe``: each request's TTFT breakdown, and its mean over all / the p90 tail)."""
    stub = router_pb2_grpc.RouterStub(channel := grpc.aio.insecure_channel(fleet.router.address))
    sent = [Sent(r) for r in reqs]
    t0 = time.monotonic()
    tasks, mark = [], None
    for s in sent:
        await asyncio.sleep(max(0.0, t0 + s.request.offset_s - time.monotonic()))
        if s.request.index == warmup:
            mark = fleet.hits()
        tasks.append(asyncio.create_task(_one(stub, s.request, t0, max_tokens, s)))
    await asyncio.gather(*tasks)
    await asyncio.sleep(0.6)  # the engines' last stats snapshots
    end = fleet.hits()
    await channel.close()
    out = _summary(sent[warmup:], mark or end, end) | {"pull": fleet.pulls(),
                                                        "kv_tier": fleet.tier_counters()}
    if probe is not None:
        rows = [{"index": s.request.index, "ttft_s": s.ttft_s, "cached": s.cached,
                 "replica": s.replica} | probe.breakdown(f"b2b-{s.request.index}", s.ttft_s)
                for s in sent[warmup:] if s.ttft_s is not None]
        out["requests"] = rows
        if any("queue_s" in q for q in rows):
            out["ttft_parts"] = tail_profile(rows)
    return out


async def closed_loop(fleet: RealFleet, reqs: list[Request], clients: int,
                      max_tokens: int) -> dict:
    """``clients`` loops sending ``reqs`` one after another; saturated throughput."""
    stub = router_pb2_grpc.RouterStub(channel := grpc.aio.insecure_channel(fleet.router.address))
    sent = [Sent(r) for r in reqs]
    queue = list(reversed(sent))
    t0, cpu0 = time.monotonic(), time.process_time()
    mark = fleet.hits()

    async def client() -> None:
        while queue:
            s = queue.pop()
            await _one(stub, s.request, t0, max_tokens, s)

    await asyncio.gather(*(client() for _ in range(clients)))
    span, cpu = time.monotonic() - t0, time.process_time() - cpu0
    await asyncio.sleep(0.6)
    out = _summary(sent, mark, fleet.hits())
    out["throughput_rps"] = len(sent) / span
    # CPU seconds of this process (engines, router) per request: less moved by other jobs'
    # load than requests/s (the tier actor's own CPU is not in it).
    out["cpu_s_per_request"] = cpu / len(sent)
    await channel.close()
    return out


def _summary(sent: list[Sent], mark: dict[str, int], end: dict[str, int]) -> dict:
    ok = [s for s in sent if not s.error and s.ttft_s is not None]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    first = min(s.request.offset_s for s in sent)
    last = max((s.e2e_s or 0.0) for s in ok) if ok else 0.0
    admitted = max(1, end["prompt_tokens"] - mark["prompt_tokens"])
    return {"n": len(sent), "errors": len(sent) - len(ok),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p90_s": _pct(ttft, 0.9),
            "hit_rate": sum(s.cached for s in ok) / max(1, sum(len(s.request.token_ids)
                                                             for s in ok)),
            "admitted_by_tier": {t: (end[t] - mark[t]) / admitted for t in ("device", "host")},
            "throughput_rps": len(ok) / max(1e-9, last - first),
            "per_replica": {r: sum(1 for s in ok if s.replica == r)
                            for r in sorted({s.replica for s in ok})},
            "ttfts_s": ttft}


B2B_CONFIGS = {"tier off": (False, False), "tier on": (True, False),
               "tier on + pull": (True, True)}


async def _run(a, model_dir: str, redis_url: str) -> dict:
    def workload(groups: int) -> B2BWorkload:
        return B2BWorkload(groups=groups, users_per_group=a.users, system_tokens=a.system_tokens,
                           user_tokens=a.user_tokens, question_tokens=16, output_tokens=8)

    b2b, fits = workload(a.groups), workload(a.fit_groups)
    out: dict = {"args": vars(a), "cpus": os.cpu_count(),
                 "b2b_blocks_over_pool": b2b.cache_blocks(16) / a.pool_blocks,
                 "fits_blocks_over_pool": fits.cache_blocks(16) / a.fit_pool_blocks,
                 "runs": {}}
    reqs = b2b_requests(b2b, [(a.rate, a.count)], seed=a.seed, hot_share=a.hot_share)
    for name in _labels(a.configs):
        tier, pull = B2B_CONFIGS[name.partition(" #")[0]]
        load0, t0 = _load(), time.monotonic()
        with HintTally() as tally:
            async with RealFleet(model_dir, redis_url, a.pool_blocks, tier, pull, a.max_seqs,
                                 {"popularity_window": a.popularity_window,
                                  "load_penalty_blocks": a.load_penalty}) as fleet:
                pull_log = fleet.log_pulls()
                with TtftProbe().attach(fleet.replicas) as probe:
                    r = await open_loop(fleet, reqs, a.warmup, b2b.output_tokens, probe)
                r["pull_log"] = pull_log
        r.update(load_before=load0, load_after=_load(), wall_s=time.monotonic() - t0,
                 routing=tally.counts)
        out["runs"][name] = r
        write_json(f"{a.out_name}.json", out)  # each configuration as it ends
        print(f"{name:18s} TTFT p50/p90 {r['ttft_p50_s']:.2f}/{r['ttft_p90_s']:.2f} s, hit "
              f"{r['hit_rate']:.3f} (admitted: device {r['admitted_by_tier']['device']:.3f} "
              f"host {r['admitted_by_tier']['host']:.3f}), {r['throughput_rps']:.3f} req/s, "
              f"errors {r['errors']}, pulls {r['pull']}, routing {r['routing']}, "
              f"load {load0:.1f}->{_load():.1f}",
              flush=True)
        if "ttft_parts" in r:
            _print_parts(r["ttft_parts"])
        for rec in r.get("pull_log", []):
            print(f"    hint: {rec['blocks']} blocks, predicted pull {rec['predicted_pull_s']:.2f}"
                  f" s vs recompute {rec['predicted_recompute_s']:.2f} s -> {rec['outcome']} "
                  f"({rec['pulled_blocks']} blocks, {rec['seconds']:.2f} s)", flush=True)
    if any(n.startswith("tier off") for n in out["runs"]):
        out["ratios"] = tier_ratios(out["runs"])
        write_json(f"{a.out_name}.json", out)
        print("tier on / tier off:", out["ratios"], flush=True)
    fit_reqs = b2b_requests(fits, [(1.0, a.fit_count)], seed=a.seed)
    for rnd in range(a.fit_rounds):  # alternated: the machine's load drifts
        for name, tier in (("fits, tier off", False), ("fits, tier on", True)):
            load0 = _load()
            async with RealFleet(model_dir, redis_url, a.fit_pool_blocks, tier, tier,
                                 a.max_seqs) as fleet:
                r = await closed_loop(fleet, fit_reqs, 2, fits.output_tokens)
            r.update(load_before=load0, load_after=_load())
            out["runs"][f"{name} #{rnd + 1}"] = r
            write_json(f"{a.out_name}.json", out)
            print(f"{name} #{rnd + 1}: {r['throughput_rps']:.3f} req/s, "
                  f"{r['cpu_s_per_request']:.2f} CPU s/req, hit {r['hit_rate']:.3f},"
                  f" TTFT p50 {r['ttft_p50_s']:.2f} s, load {load0:.1f}->{_load():.1f}", flush=True)
    return out


def _labels(configs: str) -> list[str]:
    """The configurations to run, in order; a name given more than once is numbered
    ("tier off #1", "tier off #2": interleaved repeats). Raises ValueError on an unknown one."""
    names = [n.strip() for n in configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(B2B_CONFIGS))
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; known: {sorted(B2B_CONFIGS)}")
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(f"{n} #{seen[n]}" if names.count(n) > 1 else n)
    return out


def tier_ratios(runs: dict[str, dict]) -> dict:
    """TTFT p50 / p90 and hit rate of ``tier on`` ÷ ``tier off``: pooled over every run of
    each kind (all their counted requests together), and per adjacent pair (``#k`` with
    ``#k``). Without a run of both kinds, empty."""
    kinds = {k: [r for n, r in runs.items() if n.partition(" #")[0] == k]
             for k in ("tier off", "tier on")}
    if not all(kinds.values()):
        return {}

    def stats(rs: list[dict]) -> dict:
        ttft = [t for r in rs for t in r["ttfts_s"]]
        reqs = [q for r in rs for q in r.get("requests", [])]
        return {"n": len(ttft), "p50": _pct(ttft, 0.5), "p90": _pct(ttft, 0.9),
                "hit": sum(r["hit_rate"] * r["n"] for r in rs) / sum(r["n"] for r in rs),
                "parts": tail_profile(reqs) if any("queue_s" in q for q in reqs) else {}}

    def ratio(on: dict, off: dict) -> dict:
        return {"p50": on["p50"] / off["p50"], "p90": on["p90"] / off["p90"],
                "hit": on["hit"] / off["hit"] if off["hit"] else None}

    off, on = stats(kinds["tier off"]), stats(kinds["tier on"])
    pairs = {}
    for n, r in runs.items():
        base, _, k = n.partition(" #")
        twin = f"tier off #{k}" if k else "tier off"
        if base == "tier on" and twin in runs:
            pairs[k or "1"] = ratio(stats([r]), stats([runs[twin]]))
    return {"pooled": {"tier off": off, "tier on": on, "on/off": ratio(on, off)},
            "pairs": pairs}


def _print_parts(parts: dict) -> None:
    for which in ("all", "tail"):
        p = parts[which]
        print(f"    {which:4s} mean TTFT {p['ttft_s']:.2f} s = "
              + ", ".join(f"{k[:-2]} {p[k]:.2f}" for k in PARTS), flush=True)


def on_local_cluster(body: Callable[[str, str], Awaitable[dict]]) -> dict:
    """``body(model_dir, redis_url)`` run to its end with SmolLM2 prepared, a private
    redis-server and a local Ray of 2 CPUs, both stopped afterwards whatever happened."""
    from kvfleet.deploy.models import prepare_model
    from kvfleet.deploy.ray_local import init_ray, shutdown_ray
    from kvfleet.deploy.redis_server import start_redis

    model_dir = str(prepare_model(progress=False))
    redis = start_redis()
    init_ray(num_cpus=2)
    try:
        return asyncio.run(body(model_dir, redis.url))
    finally:
        shutdown_ray()
        redis.stop()


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench tier_b2b_real",
                                description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=112)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--users", type=int, default=2, help="users per group")
    p.add_argument("--load-penalty", type=float, default=1.0,
                   help="prefix_aware's load_penalty_blocks: blocks one request of load is "
                        "worth (on this CPU a queued request costs seconds, 5-15 blocks' prefill)")
    p.add_argument("--popularity-window", type=int, default=256,
                   help="prefix_aware's popularity window (decisions): the router's default "
                        "spans the whole of a run this size; a hot prefix gets a second holder "
                        "once its share of ~this many decisions passes 1.25 fair shares")
    p.add_argument("--hot-share", type=float, default=0.0,
                   help="share of requests sent to group 0 (a hot prefix: the router copies "
                        "it to a second replica, the case a peer pull serves)")
    p.add_argument("--pool-blocks", type=int, default=24, help="KV blocks per replica")
    p.add_argument("--max-seqs", type=int, default=2, help="max_num_seqs per replica")
    p.add_argument("--rate", type=float, default=0.12, help="requests/s (Poisson)")
    p.add_argument("--count", type=int, default=24)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--fit-groups", type=int, default=1)
    p.add_argument("--fit-pool-blocks", type=int, default=48)
    p.add_argument("--fit-count", type=int, default=12)
    p.add_argument("--fit-rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(B2B_CONFIGS), help="B2B ones to run")
    p.add_argument("--out-name", default="tier_b2b_real", help="bench/results/NAME.{json,png}")
    p.add_argument("--quick", action="store_true", help="a smoke run: 6 requests, 1 fit round")
    a = p.parse_args(argv)
    if a.quick:
        a.count, a.warmup, a.fit_count, a.fit_rounds, a.rate = 6, 2, 4, 1, 1.0
    out = on_local_cluster(lambda model_dir, redis_url: _run(a, model_dir, redis_url))
    write_json(f"{a.out_name}.json", out)
    plot_ttft_cdfs({k: v["ttfts_s"] for k, v in out["runs"].items() if not k.startswith("fits")},
                   RESULTS / f"{a.out_name}.png", "B2B on 2 SmolLM2 replicas: TTFT")
    return 0
