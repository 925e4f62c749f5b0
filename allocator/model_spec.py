"""Read a HuggingFace ``config.json`` into a per-layer KV-cache spec (pure Python).

Everything comes from the config's fields plus the documented rules of each architecture family
(the defaults and layer layouts its HuggingFace ``*Config`` class defines, ``_ARCHITECTURES``);
there is no table of known models. Precedence:

- KV heads: explicit override (``--num-kv-heads``) > ``num_key_value_heads`` > the
  architecture's documented default (Llama, GPT-2: MHA; Falcon: ``multi_query`` rules) > error.
- head width: ``head_dim`` when present (Gemma-2-27B: 128, not 4608 / 32 = 144), else
  ``hidden_size / num_attention_heads``. GPT-2 aliases: ``n_layer``, ``n_head``, ``n_embd``,
  ``n_positions``.
- MLA (DeepSeek-V2/V3): with ``kv_lora_rank`` set, a layer caches one latent of
  ``kv_lora_rank + qk_rope_head_dim`` elements per token, whatever ``num_key_value_heads`` says.
- sliding windows: ``layer_types`` when present, else the architecture rule;
  ``use_sliding_window: false`` disables a window.
- hybrids (Jamba): only ``i % attn_layer_period == attn_layer_offset`` layers are attention; the
  Mamba layers' fixed per-request state is a separate term.
- context: ``max_position_embeddings``, except under LongRoPE (``rope_type`` ``longrope``/``su``)
  with distinct ``short_factor`` and ``long_factor``: ``original_max_position_embeddings``. Past
  it, transformers rotates the *whole* sequence with the long factors (the choice depends on the
  sequence's length), so keys cached while the sequence was shorter would be rotated wrongly;
  kvfleet serves the range where one rotation holds and budgets the same context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, overload


class ConfigError(ValueError):
    """A config.json kvfleet cannot budget; ``field`` names the offending config field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class AttentionLayer:
    """The KV cache of one attention layer, per token.

    Ordinary (MHA / GQA / MQA) layers store K and V: ``2 * num_kv_heads * head_dim`` elements
    per token. An MLA layer stores one compressed latent of ``latent_dim`` elements per token
    (no factor 2; ``num_kv_heads`` is then 1 and ``head_dim`` 0). ``window`` is how many of the
    most recent tokens the layer keeps (sliding / local attention); None keeps the whole context.
    """

    index: int
    num_kv_heads: int
    head_dim: int
    window: int | None = None
    latent_dim: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.latent_dim is not None

    @property
    def elements_per_token(self) -> int:
        """Cached elements per token of this layer (K + V, or the MLA latent)."""
        if self.latent_dim is not None:
            return self.latent_dim
        return 2 * self.num_kv_heads * self.head_dim

    def retained_tokens(self, num_tokens: int) -> int:
        """Tokens this layer keeps for a sequence of ``num_tokens``: min(T, window)."""
        return num_tokens if self.window is None else min(num_tokens, self.window)


@dataclass(frozen=True)
class RecurrentState:
    """Fixed per-request state of a hybrid model's Mamba layers (does not grow with tokens).

    Per layer: a conv state of ``inner_dim x conv_kernel`` plus an SSM state of
    ``inner_dim x state_size`` elements — the shapes of ``mamba_ssm``'s
    ``allocate_inference_cache`` and of HuggingFace's Jamba cache
    (``inner_dim = mamba_expand * hidden_size``).
    """

    num_layers: int
    inner_dim: int
    conv_kernel: int
    state_size: int

    @property
    def elements(self) -> int:
        """Elements per request over all recurrent layers."""
        return self.num_layers * self.inner_dim * (self.conv_kernel + self.state_size)


@dataclass(frozen=True)
class ModelKVSpec:
    """Per-layer KV-cache shape of a model, derived from its config.json.

    ``layers`` lists the attention layers only (a hybrid's Mamba layers are in ``recurrent``).
    """

    model_type: str
    num_hidden_layers: int
    num_attention_heads: int
    layers: tuple[AttentionLayer, ...]
    max_position_embeddings: int | None
    recurrent: RecurrentState | None = None

    @property
    def is_mla(self) -> bool:
        return any(layer.is_mla for layer in self.layers)

    @property
    def num_kv_heads(self) -> int:
        """KV heads of an attention layer (every layer of one model has the same count here)."""
        return self.layers[0].num_kv_heads if self.layers else 0

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(layer.window for layer in self.layers)


# ---- reading fields ----------------------------------------------------------------------------

@overload
def _positive_int(cfg: Mapping[str, Any], *names: str, required: Literal[True] = True) -> int: ...
@overload
def _positive_int(cfg: Mapping[str, Any], *names: str, required: bool) -> int | None: ...


def _positive_int(cfg: Mapping[str, Any], *names: str, required: bool = True) -> int | None:
    """The first of ``names`` (aliases) with a non-null value, checked to be a positive int."""
    name = next((n for n in names if cfg.get(n) is not None), None)
    if name is None:
        if required:
            raise ConfigError(names[0], "missing from config.json")
        return None
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, f"must be a positive integer, got {value!r}")
    return value


def load_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A config dict from a mapping, a ``config.json`` path, or a model directory.

    A composite (multimodal) config's ``text_config`` is used when the top level has no layers.

    Raises:
        ConfigError: the file cannot be read or is not a JSON object.
    """
    if isinstance(source, Mapping):
        cfg = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError("config.json", f"cannot read {path}: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ConfigError("config.json", f"{path} is not a JSON object")
    text = cfg.get("text_config")
    if isinstance(text, dict) and _positive_int(cfg, "num_hidden_layers", "n_layer",
                                                required=False) is None:
        cfg = {"model_type": cfg.get("model_type", ""), **text}
    return cfg


# ---- architecture rules ------------------------------------------------------------------------

FULL, SLIDING, MAMBA = "full", "sliding", "mamba"


def _mha(cfg: Mapping[str, Any]) -> int:
    """MHA: one KV head per query head (LlamaConfig's documented default; GPT-2 has no GQA)."""
    return _positive_int(cfg, "num_attention_heads", "n_head")


def _falcon_kv_heads(cfg: Mapping[str, Any]) -> int:
    """FalconConfig / FalconAttention: ``num_kv_heads`` (default: all heads) under the new
    decoder architecture or without multi-query; one shared KV head under ``multi_query``
    (its default is True)."""
    if cfg.get("new_decoder_architecture") or not cfg.get("multi_query", True):
        return _positive_int(cfg, "num_kv_heads", required=False) or _mha(cfg)
    return 1


def _all_full(cfg: Mapping[str, Any], n: int) -> list[str]:
    return [FULL] * n


def _window_everywhere(cfg: Mapping[str, Any], n: int) -> list[str]:
    """Mistral / Mixtral: ``sliding_window`` (when not null) applies to every layer."""
    return [SLIDING if cfg.get("sliding_window") is not None else FULL] * n


def _qwen2_windows(cfg: Mapping[str, Any], n: int) -> list[str]:
    """Qwen2 / Qwen3: a window only with ``use_sliding_window: true`` (default false), and then
    only on layers ``i >= max_window_layers`` (Qwen2Config builds ``layer_types`` this way)."""
    if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
        return [FULL] * n
    first = cfg.get("max_window_layers", 28)
    return [SLIDING if i >= first else FULL for i in range(n)]


def _gemma2_alternating(cfg: Mapping[str, Any], n: int) -> list[str]:
    """Gemma-2: layers alternate local (sliding, even index) and global (odd index)."""
    _positive_int(cfg, "sliding_window")
    return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]


def _gemma3_pattern(cfg: Mapping[str, Any], n: int) -> list[str]:
    """Gemma-3: every ``sliding_window_pattern``-th layer (default 6) is global, others local."""
    _positive_int(cfg, "sliding_window")
    period = _positive_int(cfg, "sliding_window_pattern", required=False) or 6
    return [SLIDING if (i + 1) % period else FULL for i in range(n)]


def _jamba_layers(cfg: Mapping[str, Any], n: int) -> list[str]:
    """Jamba: attention where ``i % attn_layer_period == attn_layer_offset``, Mamba elsewhere."""
    period = _positive_int(cfg, "attn_layer_period")
    offset = cfg.get("attn_layer_offset")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise ConfigError("attn_layer_offset",
                          f"must be an integer in [0, {period}), got {offset!r}")
    return [FULL if i % period == offset else MAMBA for i in range(n)]


def _jamba_state(cfg: Mapping[str, Any], num_layers: int) -> RecurrentState:
    hidden = _positive_int(cfg, "hidden_size")
    return RecurrentState(
        num_layers=num_layers,
        inner_dim=_positive_int(cfg, "mamba_expand") * hidden,
        conv_kernel=_positive_int(cfg, "mamba_d_conv"),
        state_size=_positive_int(cfg, "mamba_d_state"),
    )


@dataclass(frozen=True)
class _Architecture:
    """Documented rules of one architecture family, keyed by ``model_type``."""

    layer_kinds: Callable[[Mapping[str, Any], int], list[str]] = _all_full
    default_kv_heads: Callable[[Mapping[str, Any]], int] | None = None
    recurrent_state: Callable[[Mapping[str, Any], int], RecurrentState] | None = None


_QWEN = _Architecture(layer_kinds=_qwen2_windows)
_MISTRAL = _Architecture(layer_kinds=_window_everywhere)
_GEMMA3 = _Architecture(layer_kinds=_gemma3_pattern)
_ARCHITECTURES: dict[str, _Architecture] = {
    "llama": _Architecture(default_kv_heads=_mha),
    "gpt2": _Architecture(default_kv_heads=_mha),
    "falcon": _Architecture(default_kv_heads=_falcon_kv_heads),
    "mistral": _MISTRAL, "mixtral": _MISTRAL, "phi3": _MISTRAL,
    "qwen2": _QWEN, "qwen2_moe": _QWEN, "qwen3": _QWEN, "qwen3_moe": _QWEN,
    "gemma": _Architecture(),
    "gemma2": _Architecture(layer_kinds=_gemma2_alternating),
    "gemma3": _GEMMA3, "gemma3_text": _GEMMA3,
    "deepseek_v2": _Architecture(), "deepseek_v3": _Architecture(),
    "jamba": _Architecture(layer_kinds=_jamba_layers, recurrent_state=_jamba_state),
}
_LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING}


def _layer_kinds(cfg: Mapping[str, Any], arch: _Architecture | None, model_type: str,
                 n: int) -> list[str]:
    listed = cfg.get("layer_types")
    if listed is not None:
        if not isinstance(listed, list) or len(listed) != n:
            raise ConfigError("layer_types", f"must list one type for each of the {n} layers")
        unknown = sorted({t for t in listed if t not in _LAYER_TYPES})
        if unknown:
            raise ConfigError("layer_types", f"unsupported layer types {unknown}")
        kinds = [_LAYER_TYPES[t] for t in listed]
        if cfg.get("use_sliding_window") is False:  # Qwen2: the flag overrides the list
            kinds = [FULL] * n
        return kinds
    if arch is not None:
        return arch.layer_kinds(cfg, n)
    if cfg.get("sliding_window") is not None and cfg.get("use_sliding_window", True):
        raise ConfigError(
            "sliding_window",
            f"architecture {model_type!r} has no documented rule for which layers use the "
            "window; add a layer_types list to the config",
        )
    return [FULL] * n


def _kv_heads(cfg: Mapping[str, Any], arch: _Architecture | None, model_type: str,
              override: int | None) -> int:
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override <= 0:
            raise ConfigError("--num-kv-heads", f"must be a positive integer, got {override!r}")
        return override
    explicit = _positive_int(cfg, "num_key_value_heads", required=False)
    if explicit is not None:
        return explicit
    if arch is not None and arch.default_kv_heads is not None:
        return arch.default_kv_heads(cfg)
    raise ConfigError(
        "num_key_value_heads",
        f"missing, and architecture {model_type!r} documents no default; "
        "pass the KV head count explicitly (--num-kv-heads N)",
    )


def _head_dim(cfg: Mapping[str, Any], num_heads: int) -> int:
    explicit = _positive_int(cfg, "head_dim", required=False)
    if explicit is not None:
        return explicit
    hidden = _positive_int(cfg, "hidden_size", "n_embd")
    if hidden % num_heads:
        raise ConfigError("head_dim", f"missing and hidden_size {hidden} is not a multiple of "
                                      f"num_attention_heads {num_heads}")
    return hidden // num_heads


def rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config with one RoPE for every layer: transformers 4.x's
    ``rope_scaling`` (+ ``rope_theta``), overridden by 5.x's ``rope_parameters``; a config
    whose ``rope_parameters`` is keyed by layer type (Gemma 3) returns its entries as they are."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    return params


def served_context(cfg: Mapping[str, Any]) -> int | None:
    """The context kvfleet serves for ``cfg`` (tokens; None when the config gives none): see
    the module docstring (LongRoPE).

    Raises:
        ConfigError: a LongRoPE config without ``original_max_position_embeddings``.
    """
    limit = _positive_int(cfg, "max_position_embeddings", "n_positions", required=False)
    params = rope_parameters(cfg)
    if params.get("rope_type", params.get("type")) not in ("longrope", "su"):
        return limit
    if params.get("short_factor") == params.get("long_factor"):
        return limit
    original = (_positive_int(params, "original_max_position_embeddings", required=False)
                or _positive_int(cfg, "original_max_position_embeddings"))
    return original if limit is None else min(limit, original)


def spec_from_config(source: str | Path | Mapping[str, Any],
                     num_kv_heads: int | None = None) -> ModelKVSpec:
    """Derive the per-layer KV spec of a model from its ``config.json`` (path, directory or dict).

    ``num_kv_heads`` overrides the config's KV head count (CLI ``--num-kv-heads``).

    Raises:
        ConfigError: a field is missing or malformed, or the architecture's rules are unknown
            where they matter; the message names the field.
    """
    cfg = load_config(source)
    model_type = str(cfg.get("model_type", ""))
    arch = _ARCHITECTURES.get(model_type)
    n = _positive_int(cfg, "num_hidden_layers", "n_layer")
    heads = _positive_int(cfg, "num_attention_heads", "n_head")
    kinds = _layer_kinds(cfg, arch, model_type, n)
    window = _positive_int(cfg, "sliding_window") if SLIDING in kinds else None
    latent = None
    if cfg.get("kv_lora_rank") is not None:
        latent = _positive_int(cfg, "kv_lora_rank") + _positive_int(cfg, "qk_rope_head_dim")
        kv_heads, head_dim = 1, 0
    else:
        kv_heads = _kv_heads(cfg, arch, model_type, num_kv_heads)
        head_dim = _head_dim(cfg, heads)
    layers = tuple(
        AttentionLayer(i, kv_heads, head_dim, window if kind == SLIDING else None, latent)
        for i, kind in enumerate(kinds) if kind != MAMBA
    )
    num_mamba = kinds.count(MAMBA)
    recurrent = None
    if num_mamba:
        assert arch is not None and arch.recurrent_state is not None
        recurrent = arch.recurrent_state(cfg, num_mamba)
    return ModelKVSpec(
        model_type=model_type,
        num_hidden_layers=n,
        num_attention_heads=heads,
        layers=layers,
        max_position_embeddings=served_context(cfg),
        recurrent=recurrent,
    )
