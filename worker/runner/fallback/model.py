"""A Hugging Face ``*ForCausalLM`` behind the runner's :class:`~kvfleet.worker.runner.models.CausalLM`.

The base model runs in one call over the step's flattened tokens (batch 1, ``T`` tokens,
``position_ids`` the absolute positions), its attention layers calling
:func:`~.attention.paged_attention_forward` with the step's metadata and KV cache passed as
forward kwargs. The logits are the class's own forward over given hidden states: a shallow
copy of the ``*ForCausalLM`` whose base model is :class:`_GivenHidden` runs the class's head
code (its ``lm_head`` and whatever it applies after: Granite's ``logits_scaling``, Cohere's
``logit_scale``, soft-capping), so no family's head is restated here. :meth:`embed` does no
arithmetic (the class embeds inside its forward): its ``hidden`` is the token ids and
``cos``/``sin`` the positions.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvfleet.worker.runner.attention import AttentionMetadata, GroupedMetadata
from kvfleet.worker.runner.fallback.attention import register
from kvfleet.worker.runner.fallback.tp import check_plan, local_kv_heads, shard_by_plan
from kvfleet.worker.runner.kv_cache import KVCache
from kvfleet.worker.runner.model_config import ModelConfig
from kvfleet.worker.runner.models.linear import Projection

_LOAD_LOCK = threading.Lock()

class _GivenHidden(torch.nn.Module):
    """Stands in for the base model under the head copy: returns the states it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


class TransformersCausalLM:
    """``hf``: a ``*ForCausalLM`` loaded with ``attn_implementation`` :data:`~.attention.NAME`;
    ``windows[i]``: layer ``i``'s sliding window (kvfleet's reading, the one the step's masks
    were built for); ``lm_head``: whether this rank computes logits."""

    def __init__(self, hf, config: ModelConfig, lm_head: bool = True) -> None:
        self.hf = hf
        self.base = hf.base_model
        self.layers: Sequence[Any] = list(self.base.layers)
        self.vocab_size = config.vocab_size
        self.windows = config.sliding_windows
        self.holds_lm_head = lm_head
        self._given = _GivenHidden()
        self._head = copy.copy(hf)  # shares the head's weights and config, not the base model
        self._head._modules = {**hf._modules, hf.base_model_prefix: self._given}

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(T,)`` ids and positions, passed through to :meth:`run_layers`."""
        return input_ids, positions, positions

    def run_layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   meta: AttentionMetadata | GroupedMetadata, kv_cache: KVCache, start: int = 0,
                   should_yield: Callable[[], bool] | None = None) -> tuple[torch.Tensor, int]:
        """Every layer in one call (``hidden``: the ids, ``cos``: the positions, see
        :meth:`embed`) → ``(T, hidden_size)`` final-normed states and ``len(layers)``; it never
        pauses (``--layer-yield on`` is refused for it at start; ``auto`` gets no pause). One
        layer group only (the runner refuses layer groups for the fallback), so ``meta`` is
        never grouped."""
        assert start == 0, "the transformers fallback runs its layers in one call"
        assert isinstance(meta, AttentionMetadata), "layer groups need the native decoder"
        out = self.base(input_ids=hidden[None], position_ids=cos[None], use_cache=False,
                        kvfleet_meta=meta, kvfleet_cache=kv_cache, kvfleet_windows=self.windows)
        return out.last_hidden_state[0], len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | GroupedMetadata, kv_cache: KVCache) -> torch.Tensor:
        return self.run_layers(input_ids, positions, positions, meta, kv_cache)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, hidden_size)`` (final norm applied by the base model) → ``(N, vocab_size)``,
        through the class's own forward after its base model (see the module docstring)."""
        if not self.holds_lm_head:
            return hidden.new_empty(0, self.vocab_size)
        self._given.hidden = hidden[None]
        try:
            ids = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            return self._head(input_ids=ids, use_cache=False, logits_to_keep=0).logits[0]
        finally:
            self._given.hidden = None

    def projections(self) -> Iterator[Projection]:
        """None: the class's linears are plain ``nn.Linear`` parameters (:meth:`parameters`)."""
        return iter(())

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.hf.parameters()

    def weight_bytes_per_decode(self) -> int:
        """Every weight but the embedding table's rows (one per token; a tied LM head counts)."""
        embed = self.hf.get_input_embeddings().weight
        tied = self.hf.lm_head.weight is embed
        return sum(p.nbytes for p in self.hf.parameters() if p is not embed) + (
            embed.nbytes if tied else 0)


def build_fallback(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
                   device: torch.device, tp: int = 1, rank: int = 0,
                   reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
                   ) -> tuple[TransformersCausalLM, ModelConfig]:
    """Load ``config.architecture``'s class from ``model_dir`` with the paged attention
    registered, sharded for ``rank`` of ``tp`` by its plan; returns the model and the local
    config the rank's KV cache is built from (its KV heads).

    Raises:
        UnsupportedModel, ShardingError: see :func:`~.check.check_fallback`.
    """
    import transformers

    from kvfleet.worker.runner.fallback.check import model_class

    cls = model_class(config.architecture)
    transformers.utils.logging.disable_progress_bar()  # a replica's log is not a terminal
    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    plan = dict(hf_config.base_model_tp_plan or {})
    check_plan(plan, config, tp)
    # from_pretrained swaps process-wide state while it loads (weight init, tying), so two
    # ranks loading at once in one process (thread ranks) could leave it changed for later loads.
    with _LOAD_LOCK:
        hf = cls.from_pretrained(model_dir, config=hf_config, dtype=dtype,
                                 attn_implementation=register())
    hf.eval().requires_grad_(False)
    if tp > 1:
        shard_by_plan(hf.base_model, plan, tp, rank, reduce)
    hf.to(device)
    local = dataclasses.replace(config, num_heads=config.num_heads // tp,
                                num_kv_heads=local_kv_heads(plan, config, tp))
    return TransformersCausalLM(hf, config, lm_head=rank == 0), local
