"""Deliberate attention faults for the negative controls (runner-level and engine-level)."""

from __future__ import annotations

import dataclasses

import torch

from kvfleet.worker.runner import attention


def install_top_left_mask(monkeypatch) -> None:
    """Causal masks not shifted by the cached count (the classic chunked-prefill bug)."""

    def top_left(num_computed: int, q_len: int, window):
        return torch.arange(num_computed + q_len)[None, :] <= torch.arange(q_len)[:, None]

    monkeypatch.setattr(attention, "causal_mask", top_left)


def install_positions_reset(monkeypatch) -> None:
    """RoPE positions restarting at 0 in every chunk (a 'reset at capacity' bug)."""
    real = attention.build_attention_metadata

    def reset_positions(chunks, *args, **kwargs):
        meta = real(chunks, *args, **kwargs)
        starts = torch.tensor(meta.query_start)
        owner = torch.repeat_interleave(torch.arange(len(chunks)), starts.diff())
        return dataclasses.replace(meta, positions=torch.arange(len(owner)) - starts[owner])

    monkeypatch.setattr(attention, "build_attention_metadata", reset_positions)
