"""What one routing decision costs the router's CPU: ``policy.choose`` alone, in-process.

    .venv/bin/python -m bench.cluster.decision_cost [--blocks 68,2048] [--replicas 16]

Per prompt size (``--blocks`` blocks: a family's shared prefix and 4 blocks of its own),
every policy routes the same stream of requests from ``--families`` families over
``--replicas`` candidates whose reports carry the forecast (so ``predicted_ttft`` scores in
seconds, not its fallback); a replica shows a family's prefix in its index from the decision
after it was first sent there. The chains are hashed before the clock starts (the router
hashes them for every policy alike). Policies alternate round by round, each round with a
fresh policy instance (its memory warms inside the round), so drift on a loaded host hits
both alike; reported: the median over rounds of µs per decision, and the ratio to the first
policy. ``bench.cluster.router_cost --decisions`` runs the same.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from typing import Callable, Sequence

from kvfleet.index_keys import ReplicaInfo, ReplicaLoad
from kvfleet.router.policy import Candidate, RoutingPolicy, make_policy

SUFFIX_BLOCKS = 4  # a request's own blocks after its family's prefix


def chains(blocks: int, families: int, count: int, seed: int) -> list[tuple[int, list[bytes]]]:
    """``count`` (family, chain) pairs: each chain ``blocks`` long, its family's prefix
    then ``SUFFIX_BLOCKS`` of its own (chained like the router's hashes)."""
    if blocks <= SUFFIX_BLOCKS:
        raise ValueError(f"blocks must exceed {SUFFIX_BLOCKS}, got {blocks}")
    rng = random.Random(seed)
    prefixes = [_chain(b"family-%d" % f, blocks - SUFFIX_BLOCKS) for f in range(families)]
    out = []
    for i in range(count):
        f = rng.randrange(families)
        out.append((f, prefixes[f] + _chain(prefixes[f][-1] + b"%d" % i, SUFFIX_BLOCKS)))
    return out


def _chain(root: bytes, n: int) -> list[bytes]:
    out, h = [], root
    for i in range(n):
        h = hashlib.sha256(h + b"%d" % i).digest()[:16]
        out.append(h)
    return out


def run_once(policy: RoutingPolicy, stream: Sequence[tuple[int, list[bytes]]],
             replicas: int, prefix_blocks: int) -> float:
    """Seconds spent in ``policy.choose`` over ``stream``, decisions fed back into the
    candidates' index matches and loads."""
    infos = [ReplicaInfo(f"r{k:02d}", f"127.0.0.1:{k}", "m", 1, 16) for k in range(replicas)]
    holder: dict[int, int] = {}  # family → replica whose index shows its prefix
    inflight = [0] * replicas
    spent = 0.0
    for family, chain in stream:
        held = holder.get(family)
        cands = [Candidate(info, ReplicaLoad(inflight[k], 0, 500, 640, 0.0, 0.01 * inflight[k],
                                             0.0005 * (1 + k % 2)),
                           prefix_blocks if held == k else 0, inflight[k])
                 for k, info in enumerate(infos)]
        t0 = time.perf_counter()
        chosen = policy.choose(cands, chain)
        spent += time.perf_counter() - t0
        k = int(chosen.info.replica_id[1:])
        holder.setdefault(family, k)
        inflight[k] += 1
        inflight[random.Random(len(chain) + k).randrange(replicas)] -= 1  # one finishes
        inflight = [max(0, x) for x in inflight]
    return spent


def decision_cost(policies: dict[str, Callable[[], RoutingPolicy]], blocks: Sequence[int],
                  replicas: int = 16, families: int = 32, decisions: int = 1000,
                  rounds: int = 5) -> dict:
    """``{blocks: {policy: {"us": median µs per decision, "vs_first": ratio}}}`` over
    ``rounds`` interleaved rounds of ``decisions`` each (see the module docstring)."""
    out: dict = {}
    for n in blocks:
        stream = chains(n, families, decisions, seed=n)
        times: dict[str, list[float]] = {name: [] for name in policies}
        for _ in range(rounds):
            for name, make in policies.items():
                spent = run_once(make(), stream, replicas, n - SUFFIX_BLOCKS)
                times[name].append(spent / decisions * 1e6)
        first = statistics.median(next(iter(times.values())))
        out[n] = {name: {"us": statistics.median(t), "vs_first": statistics.median(t) / first}
                  for name, t in times.items()}
        for name, r in out[n].items():
            print(f"{n:5d} blocks  {name:16s} {r['us']:8.1f} µs/decision  "
                  f"({r['vs_first']:.2f}× the first)", flush=True)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of this measurement (``bench.cluster.router_cost --decisions`` takes them too)."""
    p.add_argument("--blocks", default="68,2048", help="prompt sizes in blocks")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--families", type=int, default=32)
    p.add_argument("--decisions", type=int, default=1000, help="per round and policy")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--policies", default="prefix_aware,predicted_ttft")


def measure(a: argparse.Namespace) -> dict:
    """Runs :func:`decision_cost` with parsed :func:`add_arguments` options."""
    names = a.policies.split(",")
    return decision_cost({n: (lambda n=n: make_policy(n)) for n in names},
                         [int(b) for b in a.blocks.split(",")], a.replicas, a.families,
                         a.decisions, a.rounds)


def main_defaults() -> dict:
    """:func:`measure` with every option at its default."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    return measure(p.parse_args([]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.cluster.decision_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    measure(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
