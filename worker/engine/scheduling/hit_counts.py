"""Prompt tokens admitted and where their cached part came from: the device pool or the node's
host tier (metrics: hit rate by tier)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HitCounts:
    """Token counts since the engine started, taken at each sequence's first admission (a
    sequence sent back by a failed tier restore is counted again when it is readmitted)."""

    prompt_tokens: int = 0  # prompt tokens of admitted sequences
    device: int = 0         # of them, reused from the device pool
    host: int = 0           # of them, restored from the node's host tier

    def admitted(self, prompt_tokens: int, device_tokens: int, host_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.device += device_tokens
        self.host += host_tokens

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "device": self.device, "host": self.host}
