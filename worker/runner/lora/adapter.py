"""A PEFT adapter directory checked against the base model, its content revision, and its
weights read (one tensor-parallel rank's share) and fused into this engine's projections.

Files: ``adapter_config.json`` (:mod:`.config`) and ``adapter_model.safetensors`` — only
safetensors: a pickled ``adapter_model.bin`` is never loaded. Tensors are named as PEFT saves
them, ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (``[r, in]``) and
``…lora_B.weight`` (``[out, r]``).

**Revision.** sha256 (128 bits, hex) of the canonical config JSON and every byte of the weights
file, each tagged: the same files give the same revision on every replica whatever the order
they were loaded in; new weights under the same name give a new one. Every load (each slot
(re)load, on every tensor-parallel rank) reads the files once, recomputes the revision from
those very bytes and refuses them (FAILED_PRECONDITION naming the file) unless it is the
registered one: files changed on disk never run under an old revision's block hashes.

**Fusion.** The model runs fused Q|K|V and gate|up projections, so an adapter's updates to a
fused group become one stacked ``A`` ``[in, R]`` (the members' ``A^T`` side by side, R = the
sum of their ranks) and one block-diagonal ``B`` ``[R, out]`` (member ``m``'s ``B^T``, already
multiplied by its scale, in its rows and its output columns; zeros elsewhere). ``x @ A @ B``
is then every member's ``scale * x @ A_m^T @ B_m^T`` at once, in place in the fused output.

**Tensor parallelism** (the sharding rule): a column-parallel projection (q, k, v, gate, up)
splits its LoRA ``B`` by output columns, exactly as its base weight (under KV-head replication
the k/v columns follow the head map: a rank takes its KV head's columns); its ``A`` is
replicated. A row-parallel projection (o, down) splits its ``A`` by input rows and replicates
``B``: each rank's ``x_r @ A_r @ B`` is a partial sum, added before the layer's all-reduce.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from kvfleet.errors import FailedPrecondition
from kvfleet.worker.runner.lora.config import (
    CONFIG_FILE,
    AdapterConfig,
    AdapterError,
    TargetSpec,
    expert_module,
    parse_adapter_config,
)
from kvfleet.worker.runner.model_config import ModelConfig
from kvfleet.worker.runner.models import PROJECTIONS
from kvfleet.worker.runner.tp.layout import COLUMN, SPLITS, ShardLayout

WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: ``name`` as served, its directory, revision and resolved config."""

    name: str
    path: str
    revision: str
    config: AdapterConfig

    @property
    def rank(self) -> int:
        return self.config.max_rank


def _in_out(config: ModelConfig, module: str) -> tuple[int, int]:
    h, q, kv, ffn = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}[module]


def _tensor_name(key: str, which: str) -> str:
    return f"{_PREFIX}{key}.lora_{which}.weight"


def _weights_path(adapter_dir: Path) -> Path:
    path = adapter_dir / WEIGHTS_FILE
    if not path.is_file():
        pickled = adapter_dir / "adapter_model.bin"
        hint = f" ({pickled.name} is never loaded: pickled weights can run code)" if pickled.exists() else ""
        raise AdapterError(f"{path}: not found{hint}")
    return path


def revision_of(canonical_config: str, weights: Path | bytes) -> str:
    """The adapter's content revision (see the module docstring), 32 hex digits; ``weights``
    is the weights file or its bytes."""
    digest = hashlib.sha256()
    weights_bytes = weights if isinstance(weights, bytes) else weights.read_bytes()
    for kind, payload in ((b"adapter_config", canonical_config.encode()),
                          (b"adapter_weights", weights_bytes)):
        digest.update(struct.pack("<I", len(kind)) + kind + struct.pack("<Q", len(payload)))
        digest.update(payload)
    return digest.hexdigest()[:32]


def check_adapter(name: str, adapter_dir: str | Path, model: ModelConfig,
                  max_lora_rank: int) -> AdapterSpec:
    """Check an adapter directory against the base model without reading its weights
    (config + safetensors header), and compute its revision.

    Raises:
        AdapterError: naming the file and the field or tensor at fault: a refused config
            field, a rank above ``max_lora_rank``, a targeted module without both tensors, a
            shape that does not match the base model, or a tensor the config does not target.
    """
    d = Path(adapter_dir)
    sparse = frozenset(i for i, s in enumerate(model.moe.sparse) if s) if model.moe else frozenset()
    cfg = parse_adapter_config(d, model.num_layers, sparse)
    cfg_path = d / CONFIG_FILE
    for t in cfg.targets:
        if t.rank > max_lora_rank:
            raise AdapterError(f"{cfg_path}: field 'r' (rank {t.rank} of {t.key}) exceeds "
                               f"--max-lora-rank {max_lora_rank}")
    path = _weights_path(d)
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for a corrupt header
        raise AdapterError(f"{path}: not a readable safetensors file ({exc})") from exc
    expected = {}
    for t in cfg.targets:
        fan_in, fan_out = _in_out(model, t.module)
        expected[_tensor_name(t.key, "A")] = (t.rank, fan_in)
        expected[_tensor_name(t.key, "B")] = (fan_out, t.rank)
    for tensor, shape in expected.items():
        if tensor not in shapes:
            raise AdapterError(f"{path}: tensor {tensor} missing (the config targets it)")
        if shapes[tensor] != shape:
            raise AdapterError(f"{path}: tensor {tensor} has shape {list(shapes[tensor])}, the base "
                               f"model and 'r' imply {list(shape)}")
    extra = sorted(set(shapes) - set(expected))
    experts = [t for t in extra if expert_module(t) is not None]
    if experts:
        raise AdapterError(f"{path}: tensor {experts[0]} targets expert weights (module "
                           f"{expert_module(experts[0])}): LoRA on a mixture-of-experts block's "
                           f"experts or router is not supported; attention and dense-MLP "
                           f"adapters are")
    if extra:
        raise AdapterError(f"{path}: tensor {extra[0]} is not a LoRA update of a targeted "
                           f"projection ({len(extra)} such tensors)")
    return AdapterSpec(name, str(d), revision_of(cfg.canonical, path), cfg)


def read_adapter(spec: AdapterSpec, model: ModelConfig, layout: ShardLayout,
                 dtype: torch.dtype, device: torch.device | str
                 ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """This rank's fused LoRA weights: ``(layer, group)`` → ``(A [in, R], B [R, out])`` with
    in/out this rank's sizes of the fused projection (see the module docstring); groups (the
    model's ``PROJECTIONS``) the adapter does not target are absent.

    ``model`` is the whole model's config, ``layout`` this rank's (tp=1: the whole model).
    """
    local = layout.local_config(model)
    by_layer: dict[int, dict[str, TargetSpec]] = {}
    for t in spec.config.targets:
        by_layer.setdefault(t.layer, {})[t.module] = t
    out = {}
    with verified_tensors(spec) as f:  # the verified bytes, never a second read of the file
        for layer, targets in by_layer.items():
            for group, members in PROJECTIONS.items():
                chosen = [m for m in members if m in targets]
                if not chosen:
                    continue
                widths = [_in_out(local, m)[1] for m in members]
                a_parts, b_parts = [], []
                for m in chosen:
                    t = targets[m]
                    a, b = _read_pair(f, t.key, m, layout)
                    a_parts.append(a.t())
                    col = sum(widths[: members.index(m)])
                    block = torch.zeros(t.rank, sum(widths), dtype=torch.float32)
                    block[:, col: col + widths[members.index(m)]] = b.t().float() * t.scale
                    b_parts.append(block)
                a_cat = torch.cat(a_parts, dim=1).to(device=device, dtype=dtype).contiguous()
                b_cat = torch.cat(b_parts, dim=0).to(device=device, dtype=dtype).contiguous()
                out[(layer, group)] = (a_cat, b_cat)
    return out


def _read_pair(f, key: str, module: str, layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [r, in_local], B [out_local, r])`` of one projection for this rank."""
    a_name, b_name = _tensor_name(key, "A"), _tensor_name(key, "B")
    split = SPLITS.get(module)
    if layout.tp == 1 or split is None:
        return f.get_tensor(a_name), f.get_tensor(b_name)
    span = layout.span(split.part)
    if split.axis == COLUMN:  # B's output rows split, A replicated
        return f.get_tensor(a_name), f.get_slice(b_name)[span.start:span.stop]
    return f.get_slice(a_name)[:, span.start:span.stop], f.get_tensor(b_name)  # row: A's input


class _Tensors:
    """Tensors by name with the two accessors :func:`_read_pair` uses (a safetensors file's
    ``get_tensor`` / ``get_slice``), over tensors already in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    get_slice = get_tensor  # a tensor slices like a safetensors slice


@contextlib.contextmanager
def verified_tensors(spec: AdapterSpec) -> Iterator[_Tensors]:
    """``spec``'s weights, read once and checked to be the registered revision (used like
    ``safe_open``).

    Raises:
        FailedPrecondition: a file is gone, unreadable, or no longer what was registered
            (the message names the file and both revisions).
    """
    d = Path(spec.path)
    cfg_path, weights_path = d / CONFIG_FILE, d / WEIGHTS_FILE
    try:
        raw_config, data = cfg_path.read_text(), weights_path.read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"adapter {spec.name!r} revision {spec.revision}: "
                                 f"{exc.filename or d}: cannot be read ({exc.strerror or exc})",
                                 field="adapter") from None
    try:
        canonical = json.dumps(json.loads(raw_config), sort_keys=True, separators=(",", ":"))
    except ValueError:
        canonical = raw_config  # not JSON any more: a changed file, reported below
    revision = revision_of(canonical, data)
    if revision != spec.revision:
        changed = cfg_path if canonical != spec.config.canonical else weights_path
        raise FailedPrecondition(
            f"adapter {spec.name!r}: {changed} changed on disk since it was registered "
            f"(revision {spec.revision}, now {revision}); load it again to serve the new files",
            field="adapter")
    yield _Tensors(load_safetensors(data))
