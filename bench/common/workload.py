"""The benchmark's workload: prefix groups, popularity, Poisson arrivals.

A request = one group's shared prefix (a system prompt, a long history) + a unique suffix, as
token ids. Prefixes and suffixes are seeded random ids from a plain-token range, so every
policy sees exactly the same request stream in the same order at the same offsets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

TOKEN_RANGE = (1000, 40000)  # plain BPE tokens of SmolLM2's vocabulary: no special tokens


@dataclass(frozen=True)
class Workload:
    """``groups`` prefixes of ``prefix_tokens`` tokens, each request adds ``suffix_tokens``.

    ``zipf_s`` = 0 for uniform group popularity, else P(group k) ∝ 1 / (k+1)^s.
    """

    groups: int = 32
    prefix_tokens: int = 1024
    suffix_tokens: int = 64
    output_tokens: int = 16
    zipf_s: float = 0.0
    seed: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens

    def weights(self) -> list[float]:
        return [1.0 / (k + 1) ** self.zipf_s for k in range(self.groups)]

    def prefix_blocks(self, block_size: int) -> int:
        return self.prefix_tokens // block_size

    def cache_pressure(self, block_size: int, replica_blocks: int) -> float:
        """Prefix KV demand ÷ one replica's KV capacity (both in blocks)."""
        return self.groups * self.prefix_blocks(block_size) / replica_blocks


@dataclass(frozen=True)
class Request:
    index: int
    group: int
    token_ids: tuple[int, ...]
    offset_s: float  # arrival time from the start of the run (seconds)


def requests(w: Workload, rate_per_s: float, count: int, seed: int | None = None) -> list[Request]:
    """``count`` requests with Poisson arrivals at ``rate_per_s`` (``inf``: all at offset 0)."""
    rng = random.Random(w.seed if seed is None else seed)
    prefix_rng = random.Random(w.seed * 7919 + 17)  # prefixes do not depend on the stream seed
    prefixes = [tuple(prefix_rng.randrange(*TOKEN_RANGE) for _ in range(w.prefix_tokens))
                for _ in range(w.groups)]
    weights = w.weights()
    out, t = [], 0.0
    for i in range(count):
        g = rng.choices(range(w.groups), weights)[0]
        suffix = tuple(rng.randrange(*TOKEN_RANGE) for _ in range(w.suffix_tokens))
        out.append(Request(i, g, prefixes[g] + suffix, t))
        if rate_per_s != float("inf"):
            t += rng.expovariate(rate_per_s)
    return out


def stream(w: Workload, seed: int = 0) -> Iterator[Request]:
    """An endless stream (closed-loop runs): arrival offsets are 0."""
    i = 0
    while True:
        yield from requests(w, float("inf"), 256, seed=seed * 1_000_003 + i)
        i += 1


@dataclass(frozen=True)
class B2BWorkload:
    """The llm-d "B2B" shape: ``groups`` customers, each with a long system prompt shared by its
    ``users_per_group`` users; a user's requests repeat their own context after it, then a
    unique question. ``prompt = system + user context + question`` tokens."""

    groups: int = 8
    users_per_group: int = 4
    system_tokens: int = 2048
    user_tokens: int = 256
    question_tokens: int = 64
    output_tokens: int = 16
    seed: int = 0

    @property
    def prompt_tokens(self) -> int:
        return self.system_tokens + self.user_tokens + self.question_tokens

    def cache_blocks(self, block_size: int) -> int:
        """KV blocks the shared parts take (system prompts + user contexts)."""
        per_group = self.system_tokens + self.users_per_group * self.user_tokens
        return self.groups * per_group // block_size


def b2b_requests(w: B2BWorkload, phases: list[tuple[float, int]], seed: int | None = None,
                 hot_share: float = 0.0) -> list[Request]:
    """Poisson arrivals in ``phases`` of (rate per second, requests), one after another (a
    ramp); a request picks a group and a user uniformly — or, with probability ``hot_share``,
    group 0 (a hot customer; 0: the stream is the uniform one). ``Request.group`` is the
    group."""
    rng = random.Random(w.seed if seed is None else seed)
    shared = random.Random(w.seed * 7919 + 29)

    def tokens(n: int, r: random.Random) -> tuple[int, ...]:
        return tuple(r.randrange(*TOKEN_RANGE) for _ in range(n))

    systems = [tokens(w.system_tokens, shared) for _ in range(w.groups)]
    users = [[tokens(w.user_tokens, shared) for _ in range(w.users_per_group)]
             for _ in range(w.groups)]
    out: list[Request] = []
    t = 0.0
    for rate, count in phases:
        for _ in range(count):
            t += rng.expovariate(rate)
            g, u = rng.randrange(w.groups), rng.randrange(w.users_per_group)
            if hot_share and rng.random() < hot_share:
                g = 0
            out.append(Request(len(out), g, systems[g] + users[g][u] + tokens(w.question_tokens, rng), t))
    return out
