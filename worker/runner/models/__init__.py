"""Model families: ``config.json`` architecture name → the module that implements it.

:data:`REGISTRY` is derived from :data:`kvfleet.worker.runner.model_families.FAMILIES` (the
one table of families: architectures, module, config rules). A family's module has
``build_model(config, weights, dtype, device, one_row_copy, lm_head)`` returning a
:class:`CausalLM`. Modules are imported on first use; this package itself imports no torch, so
``kvfleet up`` can check a model before anything heavy loads (:func:`check_model_dir`).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvfleet.worker.runner.model_config import ModelConfig, UnsupportedModel, load_model_config
from kvfleet.worker.runner.model_families import FAMILIES

if TYPE_CHECKING:
    import torch

    from kvfleet.worker.runner.attention import AttentionMetadata, GroupedMetadata
    from kvfleet.worker.runner.fallback.check import FallbackRequest
    from kvfleet.worker.runner.kv_cache import KVCache
    from kvfleet.worker.runner.models.linear import Projection

REGISTRY: dict[str, str] = {arch: family.module for family in FAMILIES.values()
                            for arch in family.architectures}


# The projections a decoder layer holds, by name → the checkpoint's modules fused into it, in
# output-column order. Each is a ``Projection`` ``(T, in) → (T, out)`` that the runner may
# replace by a wrapper of it (tensor parallelism, LoRA) after building: a decoder layer's
# ``projection_holders()`` maps each projection it has to the object holding it as an attribute
# (the layer for attention's, its ``mlp`` slot for a dense MLP's), and a wrapper replaces it
# with ``setattr(holder, name, wrap(getattr(holder, name)))``.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",),
}


def check_model_dir(model_dir: str | Path, model_impl: str = "native",
                    request: FallbackRequest | None = None) -> ModelConfig:
    """Read ``model_dir``'s config and check that it can be served: a registered family builds
    it (torch-free), or under ``model_impl`` ``transformers``/``auto`` for an unregistered one,
    the Hugging Face class can run behind the paged attention as ``request`` asks (tp,
    quantization, layer yield; this imports transformers,
    :func:`~kvfleet.worker.runner.fallback.check.check_fallback`).

    Raises:
        FileNotFoundError: no ``config.json``.
        UnsupportedModel, ConfigError: see :func:`~.model_config.parse_model_config` and
            :func:`~kvfleet.worker.runner.fallback.check.check_fallback`.
        ShardingError: the fallback's heads do not split over ``request.tp``.
    """
    config = load_model_config(model_dir, model_impl)
    if config.impl == "transformers":
        from kvfleet.worker.runner.fallback.check import FallbackRequest, check_fallback

        raw = json.loads((Path(model_dir) / "config.json").read_text())
        check_fallback(model_dir, config, raw, request or FallbackRequest())
        return config
    _module_for(config)
    return config


def _module_for(config: ModelConfig) -> str:
    module_name = REGISTRY.get(config.architecture)
    if module_name is None:
        raise UnsupportedModel(
            f"architectures: {config.architecture!r} is not supported ({', '.join(sorted(REGISTRY))})"
        )
    return module_name


class CausalLM(Protocol):
    """What the model runner calls; the model knows nothing of paging beyond ``meta``, nor of
    ranks or adapters (those wrap its projections, see :data:`PROJECTIONS`)."""

    layers: Sequence[Any]  # decoder layers, each with projection_holders() (see PROJECTIONS)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | GroupedMetadata, kv_cache: KVCache) -> torch.Tensor:
        """``input_ids``/``positions`` ``(T,)`` → hidden states ``(T, hidden_size)``."""
        ...

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(T,)`` ids and positions → ``(hidden, cos, sin)``, the input of :meth:`run_layers`
        (``cos``/``sin``: the model's RoPE rows, opaque to the runner)."""
        ...

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata | GroupedMetadata, kv_cache: KVCache, start: int = 0,
                   should_yield: Callable[[], bool] | None = None) -> tuple[torch.Tensor, int]:
        """Layers ``start..`` (stopping after one when ``should_yield()``) → ``(hidden,
        next_layer)``; ``next_layer == len(layers)`` once all ran."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(N, hidden_size)`` → logits ``(N, vocab_size)`` (final norm included);
        ``(0, vocab_size)`` from a model built without an LM head."""
        ...

    def projections(self) -> Iterator[Projection]:
        """Every projection: each layer's, then the LM head."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The tensors held outside projections (embedding, norms)."""
        ...

    def weight_bytes_per_decode(self) -> int:
        """Bytes of weights one decode step reads (the embedding table counts one row)."""
        ...


def build_model(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                dtype: torch.dtype, device: torch.device | str,
                one_row_copy: bool = False, lm_head: bool = True) -> CausalLM:
    """Instantiate the family that implements ``config.architecture`` from HF-named weights
    (``one_row_copy``: keep a second copy of each weight for steps of a few rows, see
    :class:`~kvfleet.worker.runner.models.linear.Linear`; ``lm_head=False``: no LM head, for a
    model that only computes hidden states).

    Raises:
        UnsupportedModel: no registered family for the architecture.
    """
    return importlib.import_module(_module_for(config)).build_model(config, weights, dtype, device,
                                                            one_row_copy, lm_head)
