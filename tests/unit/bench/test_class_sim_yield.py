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
