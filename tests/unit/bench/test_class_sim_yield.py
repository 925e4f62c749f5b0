"""bench/sim/class_sim.py with layer-level yield on the virtual clock: the paused steps' nested
steps run, the interactive tail shortens, and a workload of one class never yields."""

from __future__ import annotations

from bench.sim.class_sim import Stream, Yield, simulate
from kvfleet.priority import BATCH, INTERACTIVE
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig

CONFIG = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_waiting=256,
                         itl_target_ms=150)
CHAT = Stream("chat", INTERACTIVE, rate=0.8)
FLOOD = Stream("batch", BATCH, rate=80, admit=0.8)


def test_nested_steps_shorten_the_interactive_tail_beside_a_flood():
    atomic = simulate([CHAT, FLOOD], CONFIG, 30, seed=0)
    paused = simulate([CHAT, FLOOD], CONFIG, 30, seed=0, layer_yield=Yield(30))
    assert atomic["_yields"] == 0 and paused["_yields"] >= 10
    assert paused["chat"]["requests"] == atomic["chat"]["requests"]
    assert paused["chat"]["ttft_p99_ms"] < 0.8 * atomic["chat"]["ttft_p99_ms"]
    assert paused["batch"]["completions_per_s"] > 0.8 * atomic["batch"]["completions_per_s"]


def test_one_class_never_yields_and_runs_as_with_atomic_steps():
    flood = [Stream("A", rate=40, share=0.5), Stream("B", rate=2, share=0.5)]
    atomic = simulate(flood, CONFIG, 20, seed=1)
    paused = simulate(flood, CONFIG, 20, seed=1, layer_yield=Yield(30))
    assert paused == {**atomic, "_yields": 0}


def test_replica_seconds_add_up_to_the_busy_time():
    """Every modelled second of a saturated replica is charged once: to a tenant's rows
    (shared steps pro rata, nested steps whole) or to the pauses."""
    for ly in (None, Yield(30, cost_layers=1.0)):
        r = simulate([CHAT, FLOOD], CONFIG, 30, seed=0, layer_yield=ly)
        charged = (r["chat"]["own_replica_s"] + r["batch"]["own_replica_s"]
                   + r["_overhead_replica_s"])
        assert 29.5 < charged < 30.5  # the flood keeps it busy; the last step may run past
        assert r["chat"]["own_replica_s"] > 0 and r["batch"]["own_replica_s"] > 0
    assert r["_overhead_replica_s"] > 0 and r["_yields"] >= 10
    assert ly is not None


def test_catch_up_and_merge_trades_the_nested_base_for_the_paused_steps_rest():
    """Merged into the paused step, the nested rows pay its done layers' share of their own
    step and then only their rows: less replica time a request, but their first tokens wait
    for the paused step's end."""
    nested = simulate([CHAT, FLOOD], CONFIG, 30, seed=0, layer_yield=Yield(30))
    merged = simulate([CHAT, FLOOD], CONFIG, 30, seed=0,
                      layer_yield=Yield(30, merge_within_s=float("inf")))
    assert merged["_yields"] >= 10

    def own_per_request(r: dict) -> float:
        return r["chat"]["own_replica_s"] / r["chat"]["requests"]

    assert own_per_request(merged) < own_per_request(nested)
    assert merged["chat"]["ttft_p50_ms"] > nested["chat"]["ttft_p50_ms"]
