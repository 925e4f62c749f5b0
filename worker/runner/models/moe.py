"""The sparse mixture-of-experts block that fills an MLP slot (Qwen3-MoE, Mixtral, gpt-oss).

A router scores every expert per token and keeps the ``top_k``; each expert is a gated MLP.
Tokens are grouped by expert (one stable sort of the ``T * top_k`` choices), and each expert
that any token chose runs one matmul over all of its tokens: the loop is over the experts a
step touches (at most ``min(E, T * top_k)``), never over tokens, so a decode step's cost grows
with ``top_k``, not with the number of experts. The weighted outputs are summed back per
token with one ``index_add_``.

Tensor parallelism splits every expert's intermediate dimension over the ranks (gate/up by
column, down by row, each rank holding its slice of every expert), so each rank computes a
partial sum of every token's output; :attr:`SparseMoE.reduce` (set by
:func:`kvfleet.worker.runner.tp.linear.parallelize`) sums them, one all-reduce per layer as a
dense MLP's ``down``. The router is replicated: every rank routes alike.

Expert weights stay float tensors (``[in, out]`` stacked per expert), not projections: LoRA
does not wrap them and ``--quantization`` leaves them float (docs/quantization.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvfleet.worker.runner.model_families import MoeSpec


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class SparseMoE(nn.Module):
    """``(T, hidden)`` → ``(T, hidden)`` through ``moe.top_k`` of ``moe.num_experts`` experts.

    Loaded as ``router_weight`` ``[hidden, E]`` (+ ``router_bias`` ``(E,)``), ``gate_up``
    ``[E, hidden, 2 * I]`` (each expert's columns gate | up), ``down`` ``[E, I, hidden]``
    (+ ``gate_up_bias`` ``[E, 2 * I]``, ``down_bias`` ``[E, hidden]`` where ``moe.bias``),
    with ``I`` this rank's share of ``moe.intermediate_size``.
    """

    PROJECTIONS: tuple[str, ...] = ()  # nothing for LoRA or TP to wrap (see the module docstring)

    def __init__(self, hidden_size: int, moe: MoeSpec, intermediate_size: int,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        e, i = moe.num_experts, intermediate_size
        self.top_k, self.num_experts = moe.top_k, e
        self.softmax_first = moe.router == "softmax_topk"
        self.norm_topk_prob = moe.norm_topk_prob
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha
        self.act = act
        self.router_weight = _weight(hidden_size, e)
        self.router_bias = _weight(e) if moe.bias else None
        self.gate_up = _weight(e, hidden_size, 2 * i)
        self.down = _weight(e, i, hidden_size)
        self.gate_up_bias = _weight(e, 2 * i) if moe.bias else None
        self.down_bias = _weight(e, hidden_size) if moe.bias else None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _identity

    def pack(self, one_row_copy: bool = False) -> None:
        """Nothing to pack: experts run as batched slices of the stacked weights."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(T, hidden)`` → ``(weights (T, top_k) in x's dtype, experts (T, top_k))``.
        Router logits in fp32 whatever the model dtype: a bf16 product can flip a near-tied
        choice, which moves the output by a whole expert."""
        logits = x.float() @ self.router_weight.float()
        if self.router_bias is not None:
            logits = logits + self.router_bias.float()
        if self.softmax_first:  # softmax over every expert in fp32, then the top-k
            top, idx = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
            if self.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return top.to(x.dtype), idx
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(x.dtype), idx

    def _gated(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        if self.limit is None:
            return self.act(gate) * up
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(T, hidden)`` (normed) → ``(T, hidden)``, summed over the ranks."""
        weights, experts = self.route(x)
        flat = experts.flatten()  # (T * top_k,), token t's choices at t * top_k ..
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, token)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            h = rows[start:end] @ self.gate_up[e]
            if self.gate_up_bias is not None:
                h = h + self.gate_up_bias[e]
            y = self._gated(h) @ self.down[e]
            if self.down_bias is not None:
                y = y + self.down_bias[e]
            out[start:end] = y
            start = end
        out.mul_(weights.flatten().index_select(0, order).unsqueeze(1))
        return self.reduce(torch.zeros_like(x).index_add_(0, token, out))

    def expert_bytes(self) -> int:
        """Bytes of every expert's weights (and biases) this block holds."""
        held = (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
        return sum(t.nbytes for t in held if t is not None)

