"""kv_bytes: the payload formula against the reference lesson's numbers, dtypes and TP ranks."""

import pytest

from kvfleet.allocator.kv_bytes import (
    DtypeError,
    ShardingError,
    bytes_per_token,
    dtype_bytes,
    kv_bytes,
    kv_heads_per_rank,
    rank_spec,
    recurrent_state_bytes,
    request_kv_bytes,
    request_scale_bytes,
    scale_bytes_per_token,
)
from kvfleet.allocator.model_spec import spec_from_config
from kvfleet.allocator.units import GiB, KiB, MiB

from .conftest import load, spec

TOY = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_key_value_heads": 2, "head_dim": 4, "hidden_size": 8}


def test_toy_hand_count_is_192_bytes_not_96():
    toy = spec_from_config(TOY)
    # 2 layers x (K + V) x 3 tokens x 2 heads x 4 dims = 96 elements, x 2 bytes (bf16)
    assert request_kv_bytes(toy, 3, "bf16") == 192
    assert 2 * 2 * 1 * 2 * 3 * 4 * 2 == 192


def test_llama_2_7b_4096_tokens_is_2_gib():
    assert request_kv_bytes(spec("llama-2-7b"), 4096) == 2 * GiB


def test_llama_3_8b():
    s = spec("llama-3-8b")
    assert bytes_per_token(s) == 131072 == 128 * KiB
    assert request_kv_bytes(s, 4096) == 512 * MiB


def test_gemma_2_27b_windows():
    s = spec("gemma-2-27b")
    assert bytes_per_token(s) == 376832 == 368 * KiB  # not 184 KiB (half the layers)
    for t in (1, 100, 4096):
        assert request_kv_bytes(s, t) == 376832 * t
    # beyond 4096 the 23 local layers stop growing: 2*23*16*128*2*(4096 + 8192)
    assert request_kv_bytes(s, 8192) == 2315255808 == 2 * 23 * 16 * 128 * 2 * (4096 + 8192)
    assert request_kv_bytes(s, 8192) / GiB == 2.15625


def test_gemma_2_27b_head_dim_144_would_be_wrong():
    cfg = load("gemma-2-27b")
    del cfg["head_dim"]
    assert bytes_per_token(spec_from_config(cfg)) == 376832 * 144 // 128


def test_qwen2_5_32b_twenty_requests_of_8192_tokens_is_40_gib():
    s = spec("qwen2.5-32b")
    assert bytes_per_token(s) == 262144
    assert kv_bytes(s, [8192] * 20) == 40 * GiB


def test_deepseek_v3_mla():
    s = spec("deepseek-v3")
    assert bytes_per_token(s) == 70272 == (512 + 64) * 61 * 2
    assert bytes_per_token(s) / KiB == 68.625
    assert 2048 / 576 == pytest.approx(3.556, abs=1e-3)  # per-layer elements vs 8-head GQA


def test_gpt2_xl_is_300_kib_per_token():
    assert bytes_per_token(spec("gpt2-xl")) == 307200 == 300 * KiB


def test_llama_3_1_405b_per_rank_and_fp8():
    s = spec("llama-3.1-405b")
    assert bytes_per_token(s) == 504 * KiB
    rank = rank_spec(s, 8)
    assert rank.num_kv_heads == 1
    assert bytes_per_token(rank) == 63 * KiB
    assert bytes_per_token(rank, "fp8") == 31.5 * KiB


def test_fp8_halves_the_payload_and_reports_scales_separately():
    s = spec("llama-3-8b")
    assert bytes_per_token(s, "fp8") == bytes_per_token(s, "bf16") // 2
    assert scale_bytes_per_token(s, "bf16") == 0
    assert scale_bytes_per_token(s, "fp8") == 32 * 2 * 8 * 4  # fp32 scale per token, head, K/V
    assert request_scale_bytes(s, 10, "fp8") == 10 * scale_bytes_per_token(s, "fp8")
    assert request_scale_bytes(s, 10, "bf16") == 0


def test_mla_fp8_scales_one_per_latent():
    assert scale_bytes_per_token(spec("deepseek-v3"), "fp8") == 61 * 4


@pytest.mark.parametrize("dtype, size", [("fp32", 4), ("fp16", 2), ("bf16", 2), ("fp8", 1)])
def test_dtype_bytes(dtype, size):
    assert dtype_bytes(dtype) == size
    assert bytes_per_token(spec("llama-2-7b"), dtype) == 2 * 32 * 32 * 128 * size


def test_unknown_dtype_names_the_flag():
    with pytest.raises(DtypeError, match="^--kv-dtype: "):
        dtype_bytes("int4")


def test_unequal_lengths_are_summed():
    s = spec("llama-3-8b")
    assert kv_bytes(s, [5, 3, 0]) == 8 * 131072
    with pytest.raises(ValueError):
        kv_bytes(s, [-1])


def test_mistral_window_caps_retained_tokens():
    s = spec("mistral-7b-v0.1")
    assert request_kv_bytes(s, 32768) == 4096 * 131072


@pytest.mark.parametrize("kv, heads, tp, per_rank", [
    (8, 32, 1, 8), (8, 32, 2, 4), (8, 32, 8, 1),  # split
    (8, 32, 16, 1), (8, 32, 32, 1),                # replicated: never below one head
    (1, 32, 4, 1),                                 # MQA: the one head replicated
])
def test_kv_heads_per_rank(kv, heads, tp, per_rank):
    assert kv_heads_per_rank(kv, heads, tp) == per_rank


def test_replicated_heads_do_not_shrink_per_rank_bytes():
    s = spec("llama-3-8b")
    assert bytes_per_token(rank_spec(s, 16)) == bytes_per_token(rank_spec(s, 8))


@pytest.mark.parametrize("kv, heads, tp, field", [
    (8, 32, 3, "num_attention_heads"),
    (6, 24, 4, "num_key_value_heads"),
    (8, 32, 0, "--tp"),
])
def test_kv_heads_per_rank_refusals_name_the_field(kv, heads, tp, field):
    with pytest.raises(ShardingError, match=f"^{field}: ") as err:
        kv_heads_per_rank(kv, heads, tp)
    assert err.value.field == field


def test_gpt2_xl_25_heads_do_not_split_over_two_ranks():
    with pytest.raises(ShardingError, match="^num_attention_heads: 25 query heads"):
        rank_spec(spec("gpt2-xl"), 2)


def test_mla_latent_is_replicated_per_rank():
    s = spec("deepseek-v3")
    assert bytes_per_token(rank_spec(s, 8)) == bytes_per_token(s) == 70272


def test_jamba_counts_attention_layers_and_a_separate_recurrent_term():
    s = spec("jamba-1.5-mini")
    assert bytes_per_token(s) == 2 * 4 * 8 * 128 * 2 == 16384
    # 256K context: 4 GiB of KV for the 4 attention layers (1:7 attention-to-Mamba)
    assert request_kv_bytes(s, 262144) == 4 * GiB
    assert recurrent_state_bytes(s) == 28 * 8192 * (4 + 16) * 2
    rank = rank_spec(s, 2)
    assert recurrent_state_bytes(rank) == recurrent_state_bytes(s) // 2
    assert recurrent_state_bytes(spec("llama-3-8b")) == 0
