"""``kvfleet status``: one cluster's replicas as Ray Serve and the Redis registry see them
together, its routers and its Redis.

Serve knows every replica process (starting, running, stopping, recovering); the registry
knows what each kvfleet replica serves and its load. A replica's ``state``:

- ``starting``: Serve is starting it (not registered yet);
- ``serving`` / ``draining``: as its registry entry says;
- ``failed``: Serve runs or recovers it but it is not registered (a failed rank, a completed
  drain: Serve replaces it at its next health check), or it is registered but no Serve replica
  hosts it any more (a killed process; its entry expires with its heartbeat).
"""

from __future__ import annotations

from typing import Iterable, Optional

from kvfleet.allocator.units import format_bytes
from kvfleet.deploy.registry_view import RegistryEntry

_STARTING = {"STARTING", "PENDING_MIGRATION", "UPDATING"}


def replica_rows(serve_replicas: Iterable[dict], entries: Iterable[RegistryEntry],
                 tp: int) -> list[dict]:
    """One row per kvfleet replica (and per unregistered Serve replica), sorted by id.

    Args:
        serve_replicas: ``serve_control.serve_replicas(app)`` of one application.
        entries: the registry's entries of that application's model.
        tp: the application's tensor-parallel size (for replicas not registered yet).
    """
    hosts = {r["replica_id"]: r for r in serve_replicas}
    rows, hosted = [], set()
    for e in entries:
        host = hosts.get(e.info.serve_replica)
        if host is not None:
            hosted.add(host["replica_id"])
        rows.append(_registered_row(e, host))
    for sid, host in hosts.items():
        if sid in hosted or host["state"] == "STOPPING":
            continue  # a stopping replica with no entry has drained: nothing to show
        rows.append({"replica_id": f"(serve {sid})", "serve_replica": sid, "epoch": 0,
                     "state": "starting" if host["state"] in _STARTING else "failed",
                     "serve_state": host["state"], "tp": tp, "ranks": [], "adapters": [],
                     "running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 0,
                     "queue_delay_s": None, "spec_acceptance": None, "prefix_hit_rate_1m": 0.0,
                     "heartbeat_age_s": None, "address": "",
                     "pid": host.get("pid"), "identity": ""})
    return sorted(rows, key=lambda r: r["replica_id"])


def _registered_row(e: RegistryEntry, host: Optional[dict]) -> dict:
    info, load = e.info, e.load
    return {
        "replica_id": info.replica_id, "serve_replica": info.serve_replica, "epoch": info.epoch,
        "state": info.state if host is not None else "failed",
        "serve_state": host["state"] if host is not None else "GONE",
        "tp": info.tensor_parallel_size,
        # Per rank what Router.ClusterStatus carries: check a TP split against `kvfleet
        # budget --tp` (bytes; num_blocks is the same on every rank).
        "ranks": [{"rank": r.get("rank"), "node": r.get("node_id", ""),
                   "device": r.get("device", ""), "pid": r.get("pid"),
                   "kv_bytes": int(r.get("kv_bytes", 0)), "num_blocks": int(r.get("num_blocks", 0)),
                   "weight_bytes": int(r.get("weight_bytes", 0))} for r in info.ranks],
        "adapters": [{"name": n, "revision": rev, "resident": n in info.resident_adapters}
                     for n, rev in info.adapters],
        "running": load.running if load else 0, "waiting": load.waiting if load else 0,
        "kv_blocks_used": (load.num_total_blocks - load.num_free_blocks) if load else 0,
        "kv_blocks_total": load.num_total_blocks if load else 0,
        # Predicted wait before a new request's prefill starts (None: not advertised).
        "queue_delay_s": load.queue_delay_s if load else None,
        # Speculative decoding since the replica started: accepted ÷ drafted (None: none).
        "spec_acceptance": load.spec_acceptance if load else None,
        "prefix_hit_rate_1m": info.prefix_hit_rate,
        "heartbeat_age_s": None if e.heartbeat_age_s is None else round(e.heartbeat_age_s, 2),
        "address": info.address, "pid": host.get("pid") if host else None,
        "identity": info.identity,
    }


def format_status(status: dict) -> str:
    """The human-readable table of :func:`kvfleet.deploy.cli`'s ``status`` dict."""
    lines = []
    for app in status["applications"]:
        lines.append(f"{app['model']} (Serve application {app['app']}, revision "
                     f"{app['revision'] or '-'}, {app['serve_status']}): "
                     f"{app['target_replicas']} replicas wanted")
        lines += autoscale_lines(app.get("autoscale"))
        lines.append(f"  {'REPLICA':<28} {'EPOCH':>5} {'STATE':<9} {'TP':>2} {'RUN':>4} "
                     f"{'WAIT':>4} {'QDELAY':>7} {'KV USED':>11} {'HIT 1m':>6} {'SPEC':>5} "
                     f"{'BEAT':>6}  RANKS")
        for r in app["replicas"]:
            beat = "-" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.1f}s"
            delay = r.get("queue_delay_s")
            qdelay = "-" if delay is None else f"{delay:.2f}s"
            acc = r.get("spec_acceptance")
            spec = "-" if acc is None else f"{acc:.0%}"
            ranks = ", ".join(f"{k['rank']}:{(k['node'] or '?')[:8]}/{k['device']}"
                              for k in r["ranks"]) or "-"
            lines.append(f"  {r['replica_id']:<28} {r['epoch']:>5} {r['state']:<9} {r['tp']:>2} "
                         f"{r['running']:>4} {r['waiting']:>4} {qdelay:>7} "
                         f"{r['kv_blocks_used']:>5}/{r['kv_blocks_total']:<5} "
                         f"{r['prefix_hit_rate_1m']:>6.0%} {spec:>5} {beat:>6}  {ranks}")
            for k in r["ranks"]:
                if k.get("kv_bytes") or k.get("weight_bytes"):
                    lines.append(f"    rank {k['rank']}: KV {format_bytes(k['kv_bytes'])} "
                                 f"({k['num_blocks']} blocks), weights "
                                 f"{format_bytes(k['weight_bytes'])}")
            if r.get("adapters"):
                lines.append("    adapters: " + ", ".join(
                    f"{a['name']}@{a['revision'][:12]}{' (resident)' if a['resident'] else ''}"
                    for a in r["adapters"]))
        tls = app.get("internal_tls")
        if tls:
            lines.append(f"  internal TLS {tls['dir']}: " + ", ".join(
                f"{name} " + (f"expires in {c['days_left']:g} days ({c['expires'][:10]})"
                              if "days_left" in c else f"unreadable here ({c['error']})")
                for name, c in tls["certificates"].items()))
    for t in status.get("kv_tiers", ()):
        where = f"kv host tier on node {t['node'][:8]} ({t.get('namespace', '')})"
        if "error" in t:
            lines.append(f"{where}: {t['error']}")
            continue
        lines.append(f"{where}: {format_bytes(t['bytes_used'])} of "
                     f"{format_bytes(t['capacity_bytes'])} ({t['blocks']} block shards), "
                     f"{t['stored']} written back, {t['restored']} restored, "
                     f"{t['evicted']} evicted")
    for r in status["routers"]:
        http = f", HTTP {r['http_address']}" if r.get("http_address") else ""
        lines.append(f"router {r['router_id']} at {r['address']}{http} (policy {r['policy']}, "
                     f"pid {r['pid']})")
    if not status["routers"]:
        lines.append("router: none present")
    lines += identity_mismatches(status)
    redis = status["redis"]
    lines.append(f"redis {redis['address']}: {'up' if redis['up'] else 'UNREACHABLE'}")
    return "\n".join(lines)


def identity_mismatches(status: dict) -> list[str]:
    """One line per registered replica whose model identity no present router of its model
    holds: those routers never dispatch to it (``kvfleet upgrade --model-dir`` changed the
    replicas' model directory but not the routers')."""
    held: dict[str, set[str]] = {}
    for r in status["routers"]:
        held.setdefault(r.get("model", ""), set()).add(r.get("identity", ""))
    out = []
    for app in status["applications"]:
        routers = held.get(app["model"])
        for r in app["replicas"]:
            if routers and r["epoch"] and r.get("identity", "") not in routers:
                out.append(f"IDENTITY MISMATCH: replica {r['replica_id']} serves {app['model']} "
                           f"under identity {r.get('identity', '')[:16] or '(none)'}, the routers "
                           f"hold {', '.join(sorted(i[:16] or '(none)' for i in routers))}: they do "
                           f"not dispatch to it (restart the routers with the replicas' model)")
    return out


def autoscale_lines(auto: Optional[dict]) -> list[str]:
    """``kvfleet status``'s autoscaling line of one application ([] when not autoscaled)."""
    if not auto:
        return []
    head = f"  autoscale {auto['min']}..{auto['max']}"
    d = auto.get("decision")
    if d is None:
        return [head + ": no decision yet (replicas report every metrics interval)"]
    line = (head + f": target {d['target']}, current {d['current']}; last decision "
                   f"{d['reason']} ({d['detail']}) {d['age_s']:g} s ago")
    change = d.get("last_change")
    if change:
        line += f"; last change {change['from']} → {change['to']} ({change['reason']})"
    return [line]
