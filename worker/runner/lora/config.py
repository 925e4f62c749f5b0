"""A PEFT LoRA ``adapter_config.json`` resolved against one base model: which projection of
which layer the adapter targets, with what rank and scale.

PEFT's config has many fields; each one either has a meaning here or is refused by name, so
an adapter never loads with a feature silently dropped:

- ``r``, ``lora_alpha``, ``use_rslora`` (scale ``alpha / sqrt(r)`` instead of ``alpha / r``),
  ``rank_pattern`` / ``alpha_pattern`` (per-module overrides, PEFT's key matching),
  ``target_modules`` (a list of module names or full keys, a regex matched against the whole
  key, or ``"all-linear"``), ``layers_to_transform`` (+ ``layers_pattern`` ``"layers"``):
  supported.
- ``use_dora``, ``modules_to_save``, ``bias`` other than ``"none"``, ``lora_bias``,
  ``fan_in_fan_out``, ``exclude_modules``, ``layer_replication``, ``trainable_token_indices``,
  ``target_parameters``, ``use_qalora``, ``alora_invocation_tokens``, ``megatron_config``,
  ``use_bdlora``, ``arrow_config``, ``velora_config``, ``monteclora_config``, ``kasa_config``:
  refused when set (they change the forward in ways this engine does not implement).
- Training-only fields (dropout, initialisation, task type, provenance) are ignored.
- Any other field is refused when it holds a non-empty value: a newer PEFT feature must not
  pass unnoticed.

Module keys follow PEFT's naming relative to the base model: ``model.layers.{i}.self_attn.q_proj``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

CONFIG_FILE = "adapter_config.json"

# This engine's projections: PEFT module name → (path inside a layer, fused group, position).
MODULES: dict[str, tuple[str, str, int]] = {
    "q_proj": ("self_attn.q_proj", "qkv", 0), "k_proj": ("self_attn.k_proj", "qkv", 1),
    "v_proj": ("self_attn.v_proj", "qkv", 2), "o_proj": ("self_attn.o_proj", "o", 0),
    "gate_proj": ("mlp.gate_proj", "gate_up", 0), "up_proj": ("mlp.up_proj", "gate_up", 1),
    "down_proj": ("mlp.down_proj", "down", 0),
}
GROUPS = ("qkv", "o", "gate_up", "down")
# A mixture-of-experts block's modules (router and experts, the three families' names): LoRA
# on them is refused (the experts are not projections here, see models/moe.py).
EXPERT_MODULES = ("experts", "gate", "router", "block_sparse_moe", "w1", "w2", "w3",
                  "gate_up_proj")
_EXPERT_KEY = re.compile(r"\.(experts|block_sparse_moe|router)\.|\.mlp\.gate$|\.mlp\.gate\.")


def expert_module(key: str) -> str | None:
    """The expert/router module a PEFT key or tensor name points into (``model.layers.0.mlp.
    experts.3.gate_proj``), or None."""
    if _EXPERT_KEY.search(key) is None:
        return None
    return key.split(".lora_")[0].removeprefix("base_model.model.")

_REFUSED = {  # field → the value that means "not used"
    "use_dora": False, "modules_to_save": None, "bias": "none", "lora_bias": False,
    "fan_in_fan_out": False, "exclude_modules": None, "layer_replication": None,
    "trainable_token_indices": None, "target_parameters": None, "use_qalora": False,
    "alora_invocation_tokens": None, "megatron_config": None, "use_bdlora": None,
    "arrow_config": None, "velora_config": None, "monteclora_config": None, "kasa_config": None,
}
_IGNORED = frozenset({  # training-time or provenance only: no effect on the forward
    "lora_dropout", "init_lora_weights", "task_type", "base_model_name_or_path", "revision",
    "inference_mode", "auto_mapping", "peft_version", "loftq_config", "eva_config",
    "corda_config", "runtime_config", "megatron_core", "qalora_group_size", "lora_ga_config",
    "ensure_weight_tying",
})
_HANDLED = frozenset({"peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern",
                      "alpha_pattern", "target_modules", "layers_to_transform",
                      "layers_pattern"})


class AdapterError(ValueError):
    """A LoRA adapter this engine refuses; the message names the file and the field."""


@dataclass(frozen=True)
class TargetSpec:
    """One targeted projection: layer index, PEFT module name, rank and scale (alpha / r,
    or alpha / sqrt(r) under rsLoRA)."""

    layer: int
    module: str
    rank: int
    scale: float

    @property
    def key(self) -> str:
        return f"model.layers.{self.layer}.{MODULES[self.module][0]}"


@dataclass(frozen=True)
class AdapterConfig:
    """A parsed, resolved adapter config: ``targets`` in (layer, module) order."""

    targets: tuple[TargetSpec, ...]
    use_rslora: bool
    max_rank: int
    canonical: str  # the config file's JSON, canonical (sorted keys): part of the revision


def scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """LoRA's output scale: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _pattern_key(patterns: Mapping[str, Any], key: str) -> str | None:
    """PEFT's lookup of a ``rank_pattern`` / ``alpha_pattern`` entry for a module key: the
    first pattern equal to the key or matching a dotted suffix of it as a regex."""
    for pattern in patterns:
        if pattern == key or re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return None


def _targeted(targets: str | list[str], key: str, layer: int, layers: list[int] | None) -> bool:
    """PEFT's rule: a regex must match the whole key; a list entry equal to the key targets it,
    one matching a dotted suffix targets it in ``layers_to_transform`` (all layers if None)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    return any(key.endswith("." + t) for t in targets) and (layers is None or layer in layers)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: not found (a PEFT adapter directory holds {CONFIG_FILE})") from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: must hold a JSON object")
    return raw


Bad = Callable[[str, str], AdapterError]  # (field, why) → the error naming the file


def _check_fields(raw: dict[str, Any], bad: Bad) -> None:
    """Refuse another PEFT type, a refused field that is set, or an unknown non-empty one."""
    if raw.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"is {raw['peft_type']!r}; only LORA adapters are served")
    for field, unused in _REFUSED.items():
        value = raw.get(field, unused)
        if value != unused and value not in (None, [], {}, False):
            raise bad(field, f"= {value!r} is not supported by kvfleet's LoRA forward")
    for field, value in raw.items():
        if field not in _HANDLED and field not in _IGNORED and field not in _REFUSED \
                and value not in (None, [], {}, False, ""):
            raise bad(field, f"= {value!r} is unknown to kvfleet; refusing rather than ignoring it")


def _target_modules(raw: dict[str, Any], num_layers: int, bad: Bad,
                    moe: bool = False) -> str | list[str]:
    """``target_modules`` checked: a regex, or a list of module names or keys of this model
    (``moe``: names of expert or router modules refused as such)."""
    targets = raw.get("target_modules")
    if moe and isinstance(targets, list):
        experts = [t for t in targets if isinstance(t, str) and (
            t.split(".")[-1] in EXPERT_MODULES or expert_module(t) is not None)]
        if experts:
            raise bad("target_modules", f"targets expert weights ({', '.join(experts)}): LoRA on "
                      "a mixture-of-experts block's experts or router is not supported (attention "
                      "and dense-MLP adapters are)")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(MODULES)
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise bad("target_modules", f"is not a valid regex ({exc})") from exc
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        known = {m for m in MODULES} | {f"model.layers.{i}.{p}" for i in range(num_layers)
                                         for p, _, _ in MODULES.values()}
        missing = [t for t in targets if t not in known
                   and not any(k.endswith("." + t) for k in known)]
        if missing:
            raise bad("target_modules", f"names module(s) the model lacks: {', '.join(missing)} "
                      f"(LoRA targets here: {', '.join(MODULES)})")
    else:
        raise bad("target_modules", f"must be a list of names, a regex or 'all-linear', got {targets!r}")
    return targets


def _layers_to_transform(raw: dict[str, Any], targets: str | list[str], num_layers: int,
                         bad: Bad) -> list[int] | None:
    """``layers_to_transform`` checked (None: every layer), and ``layers_pattern`` refused
    unless it names this model's ``layers``."""
    layers = raw.get("layers_to_transform")
    if layers is not None:
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
            raise bad("layers_to_transform", f"must be an integer or a list of them, got {layers!r}")
        if isinstance(targets, str):  # PEFT applies it to list targets only
            layers = None
        elif any(not 0 <= i < num_layers for i in layers):
            raise bad("layers_to_transform", f"= {layers} outside the model's {num_layers} layers")
    pattern = raw.get("layers_pattern")
    if pattern not in (None, "", [], "layers", ["layers"]):
        raise bad("layers_pattern", f"= {pattern!r}; this model's layers are named 'layers'")
    return layers


def parse_adapter_config(adapter_dir: str | Path, num_layers: int,
                         sparse_layers: frozenset[int] = frozenset()) -> AdapterConfig:
    """Read and resolve ``adapter_dir/adapter_config.json`` for a model of ``num_layers``
    Llama-family layers; in ``sparse_layers`` (a mixture-of-experts model's) the MLP slot holds
    experts, which have no ``gate_proj``/``up_proj``/``down_proj`` module an adapter could
    target (PEFT matches module names that exist: those layers get no MLP target).

    Raises:
        AdapterError: the file is missing or malformed, a field is refused (see the module
            docstring), a target module names a module the model lacks, or it targets nothing.
    """
    path = Path(adapter_dir) / CONFIG_FILE
    raw = _read_json(path)

    def bad(field: str, why: str) -> AdapterError:
        return AdapterError(f"{path}: field {field!r} {why}")

    params = raw.get("target_parameters")
    if sparse_layers and params:  # PEFT's all-linear on a MoE model adds the experts' tensors
        raise bad("target_parameters", f"= {params!r} targets expert weights: LoRA on a "
                  "mixture-of-experts block's experts or router is not supported (attention "
                  "and dense-MLP adapters are)")
    _check_fields(raw, bad)
    r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise bad("r", f"must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    rslora = bool(raw.get("use_rslora", False))
    ranks, alphas = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
    targets = _target_modules(raw, num_layers, bad, bool(sparse_layers))
    layers = _layers_to_transform(raw, targets, num_layers, bad)
    specs = []
    for i in range(num_layers):
        for module, (sub, _, _) in MODULES.items():
            if i in sparse_layers and sub.startswith("mlp."):
                continue
            key = f"model.layers.{i}.{sub}"
            if not _targeted(targets, key, i, layers):
                continue
            rk = _pattern_key(ranks, key)
            ak = _pattern_key(alphas, key)
            rank, a = ranks[rk] if rk else r, alphas[ak] if ak else alpha
            if not isinstance(rank, int) or rank <= 0:
                raise bad("rank_pattern", f"[{rk!r}] must be a positive integer, got {rank!r}")
            specs.append(TargetSpec(i, module, rank, scaling(a, rank, rslora)))
    if not specs:
        raise bad("target_modules", f"= {raw.get('target_modules')!r} matches no projection of the model")
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    return AdapterConfig(tuple(specs), rslora, max(s.rank for s in specs), canonical)
