"""``kvfleet budget CONFIG_JSON``: KV-cache bytes, per-rank share and admission capacity.

Everything is derived from the model's ``config.json`` (:mod:`kvfleet.allocator.model_spec`)
and the flags; nothing is looked up in a table of models. Human output is a short table with a
unit on every number; ``--json`` prints one object of integers (bytes unless the key says
tokens/requests/blocks). Errors print one line on stderr naming the field or flag and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvfleet.allocator.kv_budget import (
    QUANTIZED_WEIGHTS,
    WEIGHT_FORMATS,
    plan_capacity,
    reserve_slots,
)
from kvfleet.allocator.kv_bytes import (
    KV_DTYPE_BYTES,
    bytes_per_token,
    dtype_bytes,
    kv_bytes,
    rank_spec,
    recurrent_state_bytes,
    request_scale_bytes,
    scale_bytes_per_token,
)
from kvfleet.allocator.lora_bytes import lora_slot_bytes
from kvfleet.allocator.model_spec import ConfigError, ModelKVSpec, load_config, spec_from_config
from kvfleet.allocator.param_count import ParamCount, is_moe, param_count
from kvfleet.allocator.units import describe_bytes, format_bytes, parse_count, parse_size
from kvfleet.arg_types import even_int

PROG = "kvfleet budget"
DEFAULT_BLOCK_SIZE = 16
DTYPES = tuple(KV_DTYPE_BYTES)


class UsageError(ValueError):
    """A malformed command line (argparse's message names the flag)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="KV-cache bytes and admission capacity from a "
                                        "HuggingFace config.json (GB = 10^9, GiB = 2^30).")
    p.add_argument("config", metavar="CONFIG_JSON", help="config.json or a model directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--context", type=int, metavar="T",
                   help="tokens per request, prompt + output (default: max_position_embeddings)")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="requests (default 1)")
    p.add_argument("--kv-dtype", choices=DTYPES, default="bf16",
                   help="KV storage dtype, a serving choice (default bf16)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="N",
                   help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--memory", metavar="SIZE",
                   help="usable memory per device: 80GB, 24GiB or bytes (enables capacity)")
    p.add_argument("--reserve", metavar="SIZE", default="0",
                   help="measured non-KV reserve per device (default 0)")
    p.add_argument("--params", metavar="N", help="parameter count: 7e9, 7B or an integer, or "
                   "'config' to count it from config.json (a mixture-of-experts model's every "
                   "expert included)")
    p.add_argument("--margin", type=float, default=0.0, metavar="FRACTION",
                   help="fraction of --memory kept free (default 0)")
    p.add_argument("--weights", "--weight-dtype", dest="weight_dtype", choices=WEIGHT_FORMATS,
                   default="bf16", help="weight storage: a float dtype, or int8 / int4 "
                   "(kvfleet --quantization: codes plus fp16 group scales, int4 also fp16 group "
                   "offsets) (default bf16)")
    p.add_argument("--quant-group-size", type=even_int("--quant-group-size"), default=32, metavar="N",
                   help="weights per scale for --weights int8/int4 (default 32)")
    p.add_argument("--num-kv-heads", type=int, metavar="N",
                   help="override the config's KV head count")
    p.add_argument("--max-loras", type=int, default=0, metavar="N",
                   help="LoRA adapter slots per replica, counted at --max-lora-rank with every "
                        "projection targeted, in --weights (bf16 for int8/int4: adapters stay "
                        "float) (default 0)")
    p.add_argument("--max-lora-rank", type=int, default=64, metavar="R",
                   help="largest adapter rank a slot holds (default 64)")
    p.add_argument("--kv-host-memory", metavar="SIZE",
                   help="host KV tier per node (kvfleet up --kv-host-memory): blocks it holds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _check_positive(value: int, flag: str) -> None:
    if value <= 0:
        raise UsageError(f"{flag}: must be a positive integer, got {value}")


def _context(spec: ModelKVSpec, context: int | None) -> int:
    limit = spec.max_position_embeddings
    if context is None:
        if limit is None:
            raise UsageError("--context: the config has no max_position_embeddings; "
                             "pass --context T")
        return limit
    _check_positive(context, "--context")
    if limit is not None and context > limit:
        raise UsageError(f"--context: {context} tokens exceed the model's "
                         f"max_position_embeddings ({limit})")
    return context


def describe_spec(spec: ModelKVSpec) -> str:
    """One line: ``llama: 32 attention layers of 32, 8 KV heads x 128, full context``."""
    n = len(spec.layers)
    text = f"{spec.model_type}: {n} attention layers of {spec.num_hidden_layers}"
    if spec.is_mla:
        text += f", MLA latent of {spec.layers[0].latent_dim} elements"
    elif spec.layers:
        text += f", {spec.num_kv_heads} KV heads x {spec.layers[0].head_dim}"
    windows = [w for w in spec.windows if w is not None]
    if windows:
        spans = "/".join(str(w) for w in sorted(set(windows)))
        text += f", {len(windows)} sliding ({spans} tokens) + {n - len(windows)} full"
    else:
        text += ", full context"
    if spec.recurrent is not None:
        text += f", {spec.recurrent.num_layers} Mamba layers"
    return text


def _counted(config: Any, required: bool) -> ParamCount | None:
    """The config's parameter count, or None where it cannot be read and is not ``required``
    (a mixture-of-experts config's errors always surface: its expert fields are the budget's)."""
    cfg = load_config(config)
    try:
        return param_count(cfg)
    except ConfigError:
        if required or is_moe(cfg):
            raise
        return None


def compute_budget(args: argparse.Namespace) -> dict[str, Any]:
    """The report of one ``kvfleet budget`` call (the ``--json`` object)."""
    for flag in ("tp", "batch", "block_size"):
        _check_positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    spec = spec_from_config(args.config, num_kv_heads=args.num_kv_heads)
    counted = _counted(args.config, args.params == "config")
    rank = rank_spec(spec, args.tp)
    t, b, dtype = _context(spec, args.context), args.batch, args.kv_dtype
    reservation = reserve_slots([t], args.block_size)
    report: dict[str, Any] = {
        "model_type": spec.model_type,
        "description": describe_spec(spec),
        "kv_dtype": dtype,
        "tp": args.tp,
        "context": t,
        "batch": b,
        "block_size": args.block_size,
        "num_attention_layers": len(spec.layers),
        "num_kv_heads": spec.num_kv_heads,
        "kv_heads_per_rank": rank.num_kv_heads,
        "bytes_per_token": bytes_per_token(spec, dtype),
        "bytes_per_token_per_rank": bytes_per_token(rank, dtype),
        "kv_bytes": kv_bytes(spec, [t] * b, dtype),
        "kv_bytes_per_rank": kv_bytes(rank, [t] * b, dtype),
        "scale_bytes_per_token": scale_bytes_per_token(spec, dtype),
        "scale_bytes_per_token_per_rank": scale_bytes_per_token(rank, dtype),
        "scale_bytes": b * request_scale_bytes(spec, t, dtype),
        "recurrent_state_bytes_per_request": recurrent_state_bytes(spec, dtype),
        "recurrent_state_bytes_per_request_per_rank": recurrent_state_bytes(rank, dtype),
        "reserved_tokens_per_request": reservation.reserved_tokens,
        "tail_waste_tokens": reservation.tail_waste_tokens,
    }
    if counted is not None:  # held (every expert once) and run per token
        report.update(params=counted.total, active_params=counted.active)
    lora_bytes = lora_bytes_per_rank = 0
    if args.max_loras:
        _check_positive(args.max_loras, "--max-loras")
        _check_positive(args.max_lora_rank, "--max-lora-rank")
        adapter_dtype = "bf16" if args.weight_dtype in QUANTIZED_WEIGHTS else args.weight_dtype
        slot, slot_per_rank = lora_slot_bytes(args.config, args.max_lora_rank,
                                              dtype_bytes(adapter_dtype, "--weights"), args.tp)
        lora_bytes, lora_bytes_per_rank = args.max_loras * slot, args.max_loras * slot_per_rank
        report.update(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      lora_slot_bytes=slot, lora_bytes=lora_bytes,
                      lora_bytes_per_rank=lora_bytes_per_rank)
    if args.memory is not None:
        plan = plan_capacity(
            spec, memory_bytes=parse_size(args.memory, "--memory"), tokens_per_request=t,
            tp=args.tp, num_params=_num_params(args.params, counted),
            weight_dtype=args.weight_dtype, kv_dtype=dtype,
            reserve_bytes=parse_size(args.reserve, "--reserve") + lora_bytes_per_rank,
            margin=args.margin,
            block_size=args.block_size, quant_group_size=args.quant_group_size)
        report.update(
            memory_bytes=plan.memory_bytes, weights_bytes=plan.weights_bytes,
            weights=args.weight_dtype,
            reserve_bytes=plan.reserve_bytes, margin_bytes=plan.margin_bytes,
            available_kv_bytes=plan.available_kv_bytes, shortfall_bytes=plan.shortfall_bytes,
            block_bytes=plan.block_bytes, num_blocks=plan.num_blocks,
            request_bytes=plan.request_bytes,
            max_concurrent_requests=plan.max_concurrent_requests)
    elif args.params is not None:
        raise UsageError("--params: only used with --memory (capacity needs the device size)")
    if args.kv_host_memory is not None:
        host = parse_size(args.kv_host_memory, "--kv-host-memory")
        block = args.block_size * bytes_per_token(spec, dtype)  # every rank's shard of a block
        report.update(kv_host_memory_bytes=host, host_tier_blocks=host // block,
                      host_tier_tokens=host // block * args.block_size)
    return report


def _num_params(flag: str | None, counted: ParamCount | None) -> int | None:
    if flag == "config":
        assert counted is not None
        return counted.total
    return parse_count(flag, "--params") if flag else None


def _pair(total: int, per_rank: int, tp: int) -> str:
    text = describe_bytes(total)
    return text if tp == 1 else f"{text}; per rank {describe_bytes(per_rank)}"


def format_table(r: dict[str, Any]) -> str:
    """The human-readable table of a report from :func:`compute_budget`."""
    rows = [
        ("model", r["description"]),
        ("kv dtype", f"{r['kv_dtype']} ({dtype_bytes(r['kv_dtype'])} B/element), "
                     f"tp {r['tp']}, block {r['block_size']} tokens"),
        ("KV per token", _pair(r["bytes_per_token"], r["bytes_per_token_per_rank"], r["tp"])),
        (f"KV {r['batch']} x {r['context']} tokens",
         _pair(r["kv_bytes"], r["kv_bytes_per_rank"], r["tp"])),
    ]
    if r["scale_bytes_per_token"]:
        rows.append(("scales per token", _pair(r["scale_bytes_per_token"],
                                               r["scale_bytes_per_token_per_rank"], r["tp"])))
    if r["recurrent_state_bytes_per_request"]:
        rows.append(("recurrent state", _pair(r["recurrent_state_bytes_per_request"],
                                              r["recurrent_state_bytes_per_request_per_rank"],
                                              r["tp"]) + " per request"))
    if r.get("max_loras"):
        rows.append((f"LoRA {r['max_loras']} x rank {r['max_lora_rank']}",
                     _pair(r["lora_bytes"], r["lora_bytes_per_rank"], r["tp"])
                     + " (in the reserve below)" * ("memory_bytes" in r)))
    if "params" in r:
        rows.append(("parameters", f"{r['params'] / 1e9:.2f}B held, {r['active_params'] / 1e9:.2f}B "
                                   "run per token"))
    rows.append(("reserved/request", f"{r['reserved_tokens_per_request']} tokens "
                                     f"({r['tail_waste_tokens']} tokens tail waste)"))
    if "memory_bytes" in r:
        rows += [
            ("usable memory", f"{describe_bytes(r['memory_bytes'])} per device"),
            ("weights", f"{describe_bytes(r['weights_bytes'])} per rank ({r['weights']})"),
            ("reserve + margin", f"{describe_bytes(r['reserve_bytes'])} + "
                                 f"{describe_bytes(r['margin_bytes'])}"),
            ("available for KV", f"{describe_bytes(r['available_kv_bytes'])} per rank"),
        ]
        if r["shortfall_bytes"]:
            rows.append(("DOES NOT FIT", "weights + reserve + margin exceed usable memory by "
                                         f"{describe_bytes(r['shortfall_bytes'])}"))
        rows.append(("capacity", f"{r['max_concurrent_requests']} requests of {r['context']} "
                                 f"tokens ({r['num_blocks']} blocks of {r['block_size']} tokens,"
                                 f" {format_bytes(r['block_bytes'])} each)"))
    if "kv_host_memory_bytes" in r:
        rows.append(("host KV tier", f"{describe_bytes(r['kv_host_memory_bytes'])} per node: "
                                     f"{r['host_tier_blocks']} blocks "
                                     f"({r['host_tier_tokens']} tokens, every rank's shard)"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def main(argv: list[str]) -> int:
    """Run ``kvfleet budget`` with ``argv`` (without the program and subcommand names)."""
    try:
        args = build_parser().parse_args(argv)
        report = compute_budget(args)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except ValueError as exc:
        message = " ".join(str(exc).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
