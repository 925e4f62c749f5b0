"""Mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss): published configs read as the
engine runs them, the sparse block's routing against a per-token reference, gpt-oss's pieces
(YaRN tables, MXFP4 decoding, sinks in the C decode kernel) against transformers or the
format's definition, and what is refused by name (expert LoRA, a width that does not split).

Published configs (tests/fixtures/configs/, transcribed from the Hub's config.json):
Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1, openai/gpt-oss-20b.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvfleet.allocator.kv_bytes import ShardingError
from kvfleet.worker.runner import mxfp4
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.lora.config import AdapterError
from kvfleet.worker.runner.model_config import DecoderStyle, load_model_config, parse_model_config
from kvfleet.worker.runner.models.moe import SparseMoE
from kvfleet.worker.runner.models.rope import rope_tables
from kvfleet.worker.runner.tp.layout import shard_layout
from tests.unit.allocator.conftest import load
from tests.unit.worker.paged_driver import (
    BlockPool,
    Seq,
    decode,
    prefill,
    random_prompt,
    reference_error,
    scaled_error,
)


def test_qwen3_30b_a3b() -> None:
    c = parse_model_config(load("qwen3-30b-a3b"))
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size) == (128, 8, 768)
    assert m.router == "softmax_topk" and m.norm_topk_prob and m.prefix == "mlp"
    assert m.sparse == (True,) * 48 and not m.bias and m.swiglu_limit is None
    assert c.style == DecoderStyle(qk_norm=True) and (c.num_heads, c.num_kv_heads, c.head_dim) == (32, 4, 128)
    # decoder_sparse_step / mlp_only_layers: transformers' rule
    sparse = parse_model_config({**load("qwen3-30b-a3b"), "decoder_sparse_step": 2,
                                 "mlp_only_layers": [3]}).moe.sparse
    assert sparse[:6] == (False, True, False, False, False, True)


def test_mixtral_8x7b() -> None:
    c = parse_model_config(load("mixtral-8x7b-v0.1"))
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.prefix) == (8, 2, 14336, "block_sparse_moe")
    assert m.norm_topk_prob and m.sparse == (True,) * 32 and c.rms_norm_eps == 1e-5
    assert c.sliding_window is None


def test_gpt_oss_20b() -> None:
    c = parse_model_config(load("gpt-oss-20b"))
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size) == (32, 4, 2880)
    assert m.router == "topk_softmax" and m.bias and (m.swiglu_limit, m.swiglu_alpha) == (7.0, 1.702)
    assert c.style == DecoderStyle(attn_sinks=True) and c.qkv_bias and c.o_bias
    assert c.sliding_windows[:4] == (128, None, 128, None)
    s = c.rope.scaling
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("yarn", 32.0, 4096)
    assert not s.truncate
    assert s.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)


def test_yarn_tables_equal_transformers() -> None:
    """gpt-oss-20b's YaRN, and a truncated variant, against transformers' own inverse
    frequencies and attention factor."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate in (False, True):
        raw = load("gpt-oss-20b")
        raw["rope_scaling"] = {**raw["rope_scaling"], "truncate": truncate}
        ours = parse_model_config(raw).rope
        cfg = transformers.GptOssConfig(head_dim=64, hidden_size=2880, num_attention_heads=64,
                                        max_position_embeddings=131072,
                                        rope_parameters={**raw["rope_scaling"], "rope_theta": 150000.0})
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        positions = torch.tensor([0, 1, 7, 4095, 4096, 60000]).float()
        freqs = positions[:, None] * inv_freq[None]
        cos, sin = rope_tables(ours, 60001, torch.float32, "cpu")
        want = torch.cat([freqs, freqs], dim=-1)
        torch.testing.assert_close(cos[positions.long()], want.cos() * factor, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin[positions.long()], want.sin() * factor, rtol=1e-5, atol=1e-5)


def _block(router: str, norm: bool, limit: float | None = None, top_k: int = 2) -> SparseMoE:
    from kvfleet.worker.runner.model_families import MoeSpec

    torch.manual_seed(0)
    spec = MoeSpec(6, top_k, 8, router, norm, (True,), bias=limit is not None, swiglu_limit=limit)
    block = SparseMoE(16, spec, 8, torch.nn.functional.silu)
    for p in block.parameters():
        p.data = torch.randn_like(p) * 0.5
    return block


@pytest.mark.parametrize("router, norm, limit", [("softmax_topk", True, None),
                                                 ("softmax_topk", False, None),
                                                 ("topk_softmax", False, 0.8)])
def test_sparse_block_equals_a_per_token_reference(router, norm, limit) -> None:
    """Grouped by expert == each token through its own top-k experts one at a time."""
    block = _block(router, norm, limit)
    x = torch.randn(37, 16)
    got = block.forward(x)
    for t in range(37):
        logits = x[t] @ block.router_weight + (block.router_bias if limit is not None else 0)
        if router == "softmax_topk":
            w, idx = torch.topk(torch.softmax(logits, -1), 2)
            w = w / w.sum() if norm else w
        else:
            w, idx = torch.topk(logits, 2)
            w = torch.softmax(w, -1)
        want = torch.zeros(16)
        for weight, e in zip(w, idx.tolist(), strict=True):
            h = x[t] @ block.gate_up[e] + (block.gate_up_bias[e] if limit is not None else 0)
            gate, up = h.chunk(2)
            if limit is None:
                act = torch.nn.functional.silu(gate) * up
            else:
                gate = gate.clamp(max=limit)
                act = (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(1.702 * gate)
            y = act @ block.down[e] + (block.down_bias[e] if limit is not None else 0)
            want += weight * y
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_sparse_block_runs_only_the_experts_chosen() -> None:
    """One token at top-2 multiplies by two experts' weights, whatever the expert count."""
    block = _block("softmax_topk", True)

    class Recording:
        def __init__(self, t: torch.Tensor) -> None:
            self.t, self.seen = t, []

        def __getitem__(self, e: int) -> torch.Tensor:
            self.seen.append(e)
            return self.t[e]

    weights = block.gate_up
    del block.gate_up
    block.gate_up = rec = Recording(weights)
    x = torch.randn(1, 16)
    chosen = block.route(x)[1][0].sort().values.tolist()
    block.forward(x)
    assert rec.seen == chosen and len(chosen) == 2


def test_mxfp4_decodes_per_the_format() -> None:
    """Hand-built block: codes 0..15 and back, scale bytes 127 (×1), 129 (×4), 125 (×1/4); and
    random blocks equal transformers' own dequantizer."""
    codes = list(range(16)) + list(range(15, -1, -1))  # 32 values: one block
    packed = bytes(codes[i] | codes[i + 1] << 4 for i in range(0, 32, 2))
    blocks = torch.tensor(list(packed) * 3, dtype=torch.uint8).view(3, 1, 16)
    scales = torch.tensor([127, 129, 125], dtype=torch.uint8).view(3, 1)
    got = mxfp4.dequantize(blocks, scales)
    table = torch.tensor(mxfp4.E2M1)
    for row, mult in enumerate((1.0, 4.0, 0.25)):
        torch.testing.assert_close(got[row], table[torch.tensor(codes)] * mult, rtol=0, atol=0)

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (2, 6, 3), dtype=torch.uint8, generator=g)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    ours = mxfp4.dequantize_checkpoint({"w_blocks": blocks, "w_scales": scales}, torch.float32,
                                       lambda name, t: t)["w"]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def _mxfp4_pair(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes with ``w``'s ``[E, in, out]`` shape: ``[E, out, in/32, 16]`` blocks
    and scales around 2**-2."""
    e, n_in, n_out = w.shape
    blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(123, 127, (e, n_out, n_in // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory, tiny_gpt_oss_dir) -> tuple[Path, Path]:
    """``(mxfp4_dir, float_dir)``: the tiny gpt-oss with MXFP4 experts (quant_method mxfp4),
    and the same model with those experts decoded by transformers' dequantizer."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    packed, plain = root / "mxfp4", root / "float"
    weights = load_file(tiny_gpt_oss_dir / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    q, f = {}, {}
    for name, t in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _mxfp4_pair(t, g)
            q[name + "_blocks"], q[name + "_scales"] = blocks, scales
            f[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            q[name] = f[name] = t
    for d, tensors in ((packed, q), (plain, f)):
        d.mkdir()
        for other in tiny_gpt_oss_dir.iterdir():
            if other.name != "model.safetensors":
                (d / other.name).write_bytes(other.read_bytes())
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
    cfg = json.loads((packed / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(cfg))
    return packed, plain


def test_mxfp4_checkpoint_equals_transformers_on_its_decoded_weights(gpt_oss_mxfp4) -> None:
    from kvfleet.worker.runner.model_runner import ModelRunner

    packed, plain = gpt_oss_mxfp4
    runner = ModelRunner(packed, num_blocks=32, block_size=4)
    seq = Seq("a", random_prompt(21, seed=12), BlockPool(32, seed=12).take(8))
    prefill(runner, seq, [9, 12])
    decode(runner, seq, 4)
    assert reference_error(plain, seq) <= 1


def test_mxfp4_checkpoint_at_tp2(gpt_oss_mxfp4) -> None:
    """Each rank slices the decoded experts (never the packed blocks)."""
    from tests.unit.worker.executor.tp.threaded_group import prefill_plans, run_group
    from tests.unit.worker.paged_driver import reference_logits

    packed, plain = gpt_oss_mxfp4
    tokens = random_prompt(17, seed=13)
    logits, _ = run_group(packed, 2, prefill_plans(tokens, 9))
    ref = reference_logits(plain, tokens)
    assert scaled_error({8: logits[0][0], 16: logits[1][0]}, ref) <= 1


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_sinks_in_each_decode_backend(tiny_gpt_oss_dir, backend, monkeypatch) -> None:
    """Sinks in the C decode kernel and in the torch decode path, sliding layers included."""
    from kvfleet.worker.runner import cpu_kernels
    from kvfleet.worker.runner.model_runner import ModelRunner

    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, backend)
    cpu_kernels.load.cache_clear()
    try:
        assert (cpu_kernels.load() is None) == (backend == "torch")
        runner = ModelRunner(tiny_gpt_oss_dir, num_blocks=16, block_size=4)
        seq = Seq("a", random_prompt(5, seed=14), BlockPool(16, seed=14).take(12))
        prefill(runner, seq, [5])
        decode(runner, seq, 14)  # past the window of 8
        assert reference_error(tiny_gpt_oss_dir, seq) <= 1
        for layer in runner.model.layers:  # negative control: sinks dropped
            layer.sinks = None
        off = Seq("b", seq.tokens[:5], BlockPool(16, seed=15).take(12))
        prefill(runner, off, [5])
        decode(runner, off, 6)
        assert reference_error(tiny_gpt_oss_dir, off) > 10
    finally:
        cpu_kernels.load.cache_clear()


def test_expert_width_that_does_not_split_is_refused_naming_it() -> None:
    raw = {**load("qwen3-30b-a3b"), "moe_intermediate_size": 766}
    with pytest.raises(ShardingError, match="^moe_intermediate_size: 766 columns per expert"):
        shard_layout(parse_model_config(raw), 4, 0)
    assert shard_layout(parse_model_config(raw), 2, 1).expert_columns == range(383, 766)


def _adapter(d: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2,
                                                       "lora_alpha": 4, **config}))
    save_file(tensors, d / "adapter_model.safetensors")
    return d


def test_lora_on_experts_is_refused_naming_the_module(tmp_path, tiny_qwen3_moe_dir,
                                                      tiny_mixtral_dir, adapter_factory) -> None:
    qwen = load_model_config(tiny_qwen3_moe_dir)
    # PEFT's all-linear on Qwen3-MoE adds the experts' tensors as target_parameters
    with pytest.raises(AdapterError, match="'target_parameters' .*targets expert weights"):
        check_adapter("all", adapter_factory(tiny_qwen3_moe_dir, "all"), qwen, 16)
    # Mixtral's per-expert module names
    mixtral = load_model_config(tiny_mixtral_dir)
    d = _adapter(tmp_path / "w1", {"target_modules": ["q_proj", "w1"]}, {})
    with pytest.raises(AdapterError, match=r"'target_modules' targets expert weights \(w1\)"):
        check_adapter("w1", d, mixtral, 16)
    # an expert tensor beside an attention target
    h = qwen.hidden_size
    key = "base_model.model.model.layers.0.{}.lora_{}.weight"
    tensors = {key.format("self_attn.q_proj", "A"): torch.zeros(2, h),
               key.format("self_attn.q_proj", "B"): torch.zeros(qwen.q_size, 2),
               key.format("mlp.experts.3.gate_proj", "A"): torch.zeros(2, h)}
    d = _adapter(tmp_path / "tensor", {"target_modules": ["q_proj"], "layers_to_transform": [0]},
                 tensors)
    with pytest.raises(AdapterError, match=r"targets expert weights \(module "
                                           r"model\.layers\.0\.mlp\.experts\.3\.gate_proj\)"):
        check_adapter("tensor", d, qwen, 16)
