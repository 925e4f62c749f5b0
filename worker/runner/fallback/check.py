"""Whether the transformers fallback can serve a model, decided before anything starts.

The refusals name why: transformers not installed (the ``transformers`` extra), a class
transformers does not have, a class that does not take a registered attention function
(``_supports_attention_backend``), a config field the paged kernels do not compute, a
``--tp`` its ``base_model_tp_plan`` cannot give, and the serving features the fallback does not
have (layer-level yield, weight quantization).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.worker.runner.fallback.tp import check_plan
from kvfleet.worker.runner.model_config import ModelConfig, UnsupportedModel

# config.json fields whose feature the paged attention does not compute, when set.
UNSUPPORTED_FIELDS = ("attn_logit_softcapping", "use_bidirectional_attention", "alibi",
                      "position_embedding_type_alibi")


@dataclass(frozen=True)
class FallbackRequest:
    """What a replica asks of the fallback besides the model itself."""

    tp: int = 1
    quantization: str = "none"
    layer_yield: bool = False


def model_class(architecture: str):
    """transformers' class named ``architecture``.

    Raises:
        UnsupportedModel: transformers is not installed, or has no such class.
    """
    try:
        import transformers
    except ImportError:
        raise UnsupportedModel(f"architectures: {architecture!r} has no native family and "
                               f"transformers is not installed for --model-impl transformers "
                               f"(pip install 'kvfleet[transformers]')") from None
    cls = getattr(transformers, architecture, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise UnsupportedModel(f"architectures: {architecture!r} is neither a native family nor "
                               f"a class of transformers {transformers.__version__}")
    return cls


def tp_plan(model_dir: str | Path) -> dict[str, str] | None:
    """The model's ``base_model_tp_plan`` (from its transformers config class), or None."""
    import transformers

    plan = transformers.AutoConfig.from_pretrained(model_dir).base_model_tp_plan
    return dict(plan) if plan else None


def check_fallback(model_dir: str | Path, config: ModelConfig, raw: dict[str, Any],
                   request: FallbackRequest = FallbackRequest()) -> None:
    """Refuse, naming why, a model the fallback cannot serve as ``request`` asks.

    Raises:
        UnsupportedModel: see the module docstring (one line, the field or flag named).
        ShardingError: heads that do not split over ``request.tp``.
    """
    if request.layer_yield:
        raise UnsupportedModel("--layer-yield: --model-impl transformers runs the model's layers "
                               "in one call and cannot pause between them")
    if request.quantization != "none":
        raise UnsupportedModel(f"--quantization {request.quantization}: --model-impl "
                               f"transformers serves float weights only")
    for name in UNSUPPORTED_FIELDS:
        if raw.get(name):
            raise UnsupportedModel(f"{name}: {raw[name]!r} is not computed by kvfleet's paged "
                                   f"attention (--model-impl transformers)")
    cls = model_class(config.architecture)
    if not getattr(cls, "_supports_attention_backend", False):
        raise UnsupportedModel(f"architectures: {config.architecture} has no native family and "
                               f"its transformers class does not take a registered attention "
                               f"function (_supports_attention_backend is unset)")
    check_plan(tp_plan(model_dir) if request.tp > 1 else None, config, request.tp)


def kv_split(model_dir: str | Path, config: ModelConfig, tp: int) -> int:
    """Over how many ranks the fallback's KV heads split at ``tp``: ``tp`` when the plan splits
    ``k_proj``'s output, 1 when every rank caches every head (a gathered projection, OLMo 2) —
    the ``tp`` to size a rank's KV blocks with
    (:func:`kvfleet.worker.runner.kv_cache.num_blocks_for_memory`)."""
    from kvfleet.worker.runner.fallback.tp import local_kv_heads

    if tp == 1:
        return 1
    return config.num_kv_heads // local_kv_heads(tp_plan(model_dir), config, tp)
