"""The per-replica prefix-hit rate over the last minute (``kvfleet status``)."""

from kvfleet.worker.engine.output.outputs import SeqOutput, Usage
from kvfleet.worker.replica.hit_window import HitWindow


def _done(prompt: int, cached: int, index: int = 0) -> SeqOutput:
    return SeqOutput("r", index, (), "", usage=Usage(prompt_tokens=prompt,
                                                     cached_prompt_tokens=cached,
                                                     completion_tokens=1))


def test_rate_counts_sample_zero_and_forgets_after_the_window() -> None:
    w = HitWindow(window_s=60)
    assert w.rate(now=0) == 0.0
    w.record(_done(100, 0), now=0)
    w.record(_done(100, 50), now=30)
    w.record(_done(100, 100, index=1), now=30)  # a second sample: its prompt counted once
    assert w.rate(now=30) == 0.25
    assert w.rate(now=61) == 0.5  # the first request left the window
    assert w.rate(now=200) == 0.0
