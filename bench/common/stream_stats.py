"""Percentiles of client-side gaps, and the stream table's row (ITL and long-prompt TTFT)."""

from __future__ import annotations

from typing import Sequence


def pct(xs: Sequence[float], q: float) -> float:
    """The element at rank ``int(q * len(xs))`` of ``xs`` sorted (``q`` in [0, 1]; the last one
    at most); NaN for an empty sequence."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def stream_row(itl: Sequence[float], ttft: Sequence[float], tokens_per_s: float) -> dict:
    """One run of the stream table: the decode streams' inter-token gaps ``itl`` (s) as p50,
    p99 and p99 ÷ p50, output ``tokens_per_s``, and the long prompts' ``ttft`` (s) as p50 and
    p99 with their count. Keys end in ``_s`` where the value is seconds."""
    return {"itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
            "itl_p99_over_p50": pct(itl, 0.99) / pct(itl, 0.5),
            "tokens_per_s": tokens_per_s, "long_ttft_p50_s": pct(ttft, 0.5),
            "long_ttft_p99_s": pct(ttft, 0.99), "long_prompts": len(ttft)}
