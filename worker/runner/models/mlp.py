"""The MLP slot of a decoder layer: ``(T, hidden_size) → (T, hidden_size)``.

A decoder layer holds its MLP as ``layer.mlp`` and calls it on the normed hidden state; the
dense gated MLP here is what every family fills it with today. A sparse (mixture-of-experts)
block takes the same slot: it is called the same way (``forward``), and the layer's
``projection_holders()`` lists the projections the slot holds (``PROJECTIONS`` here), which is
how tensor parallelism and LoRA find what to wrap (:data:`kvfleet.worker.runner.models.PROJECTIONS`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet.worker.runner import layer_ops
from kvfleet.worker.runner.model_config import ModelConfig
from kvfleet.worker.runner.models.linear import Projection, projection
from kvfleet.worker.runner.models.moe import SparseMoE

# config.json activation name → the gate's activation (applied in place where it can be).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DenseMLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU with silu, GeGLU with gelu).

    Loaded as ``gate_up_weight`` ``[hidden, 2 * intermediate]`` (columns gate | up) and
    ``down_weight`` ``[intermediate, hidden]``; :meth:`pack` turns them into projections."""

    gate_up: Projection
    down: Projection
    PROJECTIONS = ("gate_up", "down")

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.silu = activation == "silu"
        self.gate_up_weight = _weight(hidden_size, 2 * intermediate_size)
        self.down_weight = _weight(intermediate_size, hidden_size)

    def pack(self, one_row_copy: bool = False) -> None:
        """Replace the loaded matrices by projections (:func:`~.linear.projection`;
        ``one_row_copy``: see :class:`~.linear.Linear`)."""
        for name in self.PROJECTIONS:
            setattr(self, name, projection(getattr(self, f"{name}_weight"), None, one_row_copy))
            delattr(self, f"{name}_weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(T, hidden_size)`` (normed) → ``(T, hidden_size)``."""
        if self.silu and layer_ops.applies(x):
            return self.down(layer_ops.silu_mul(self.gate_up(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate).mul_(up))


def mlp_for_layer(config: ModelConfig, layer_idx: int) -> nn.Module:
    """What fills layer ``layer_idx``'s MLP slot: the dense gated MLP, or in a
    mixture-of-experts family's sparse layers its :class:`~.moe.SparseMoE` (same ``forward``,
    ``pack`` and ``PROJECTIONS``; checkpoint tensors read by
    :func:`kvfleet.worker.runner.models.checkpoint.mlp_tensors`)."""
    moe = config.moe
    if moe is not None and moe.sparse[layer_idx]:
        return SparseMoE(config.hidden_size, moe, moe.intermediate_size,
                         ACTIVATIONS[config.style.activation])
    return DenseMLP(config.hidden_size, config.intermediate_size, config.style.activation)
