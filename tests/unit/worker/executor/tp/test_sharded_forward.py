"""Sharded forward (threads + gloo) against transformers: every layout, the byte counts, and
the negative controls that must fail."""

from __future__ import annotations

import pytest
import torch

from kvfleet.allocator.kv_bytes import ShardingError
from kvfleet.deploy.budget import build_parser, compute_budget
from kvfleet.worker.runner.kv_cache import kv_bytes_per_block
from kvfleet.worker.runner.model_config import load_model_config
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.tp.layout import ShardLayout, shard_layout
from tests.unit.worker.executor.tp.threaded_group import BLOCK_SIZE, prefill_plans, run_group
from tests.unit.worker.paged_driver import random_prompt, reference_logits, scaled_error

TOKENS = random_prompt(23, seed=11)


def _error(model_dir, logits) -> float:
    ref = reference_logits(model_dir, TOKENS)
    return scaled_error({12: logits[0][0], 22: logits[1][0]}, ref)


CASES = [("tiny_llama_dir", 2), ("tiny_llama_dir", 4),  # 4 q / 2 KV heads: split, replicated
         ("llama_8q4kv_dir", 2), ("llama_8q4kv_dir", 4), ("llama_8q2kv_dir", 4),
         ("tiny_qwen2_dir", 2), ("tiny_mistral_dir", 2), ("tiny_llama3_dir", 2),
         ("tiny_qwen3_dir", 2), ("tiny_qwen3_dir", 4),
         ("tiny_gemma3_dir", 2), ("tiny_gemma3_dir", 4),  # 1 KV head: replicated 2 and 4 times
         ("tiny_phi3_dir", 2), ("tiny_phi3_dir", 4),  # fused qkv_proj split, then replicated
         # every expert's intermediate dim split (Qwen3-MoE's dense layer 1 too); gpt-oss's
         # stacked, interleaved gate_up, sinks per query head, biases on rank 0; 1 KV head a rank
         ("tiny_qwen3_moe_dir", 2), ("tiny_qwen3_moe_dir", 4), ("tiny_mixtral_dir", 2),
         ("tiny_gpt_oss_dir", 2), ("tiny_gpt_oss_dir", 4)]


@pytest.mark.parametrize("fixture, tp", CASES)
def test_sharded_logits_match_transformers(request, fixture, tp) -> None:
    model_dir = request.getfixturevalue(fixture)
    logits, runners = run_group(model_dir, tp, prefill_plans(TOKENS, 13))
    assert _error(model_dir, logits) <= 1
    config = load_model_config(model_dir)
    per_block = kv_bytes_per_block(config, BLOCK_SIZE, torch.float32, tp)
    assert {r.kv_cache.nbytes for r in runners} == {16 * per_block}
    # ... `kvfleet budget --tp`'s per-rank bytes per token, for 16 blocks of 4 tokens (the
    # paged cache keeps a sliding layer's old blocks, so per token, not the windowed total)
    budget = compute_budget(build_parser().parse_args(
        [str(model_dir), "--tp", str(tp), "--kv-dtype", "fp32", "--block-size", str(BLOCK_SIZE)]))
    assert budget["bytes_per_token_per_rank"] * BLOCK_SIZE * 16 == 16 * per_block
    assert {r.num_blocks for r in runners} == {16}
    assert all(r.model.layers[0].num_kv_heads == shard_layout(config, tp, 0).local_kv_heads
               for r in runners)


def test_a_rank_holds_its_share_of_the_weights(llama_8q4kv_dir) -> None:
    """Per rank: the sharded projections ÷ T, plus what every rank replicates (embedding,
    norms) and rank 0's LM head."""
    full = ModelRunner(llama_8q4kv_dir, 16, BLOCK_SIZE, one_row_weights=False)
    _, runners = run_group(llama_8q4kv_dir, 2, prefill_plans(TOKENS, 13))
    m = full.model
    replicated = sum(p.nbytes for p in m.parameters())  # embedding + norms
    projections = full.weight_nbytes() - replicated - m.lm_head.nbytes
    for r in runners:
        head = m.lm_head.nbytes if r.rank == 0 else 0
        assert r.weight_nbytes() == projections // 2 + replicated + head
    assert runners[1].model.lm_head.held_nbytes == 0  # a head that holds nothing


def test_fused_qkv_shard_is_q_k_v_of_the_rank(llama_8q4kv_dir) -> None:
    """Rank 1's fused QKV is [q heads 4..7 | KV heads 2..3 | same for V], not a contiguous slice."""
    full = ModelRunner(llama_8q4kv_dir, 16, BLOCK_SIZE, one_row_weights=False)
    _, runners = run_group(llama_8q4kv_dir, 2, prefill_plans(TOKENS, 13))
    d = full.config.head_dim
    x = torch.randn(3, full.config.hidden_size)
    whole = full.model.layers[0].qkv(x)
    q, k, v = whole.split([8 * d, 4 * d, 4 * d], dim=-1)
    want = torch.cat([q[:, 4 * d:], k[:, 2 * d:], v[:, 2 * d:]], dim=-1)
    torch.testing.assert_close(runners[1].model.layers[0].qkv(x), want, rtol=1e-5, atol=1e-5)


def test_negative_control_wrong_kv_head_under_replication(llama_8q2kv_dir, monkeypatch) -> None:
    """tp=4 over 2 KV heads: ranks 0, 1 hold head 0 and ranks 2, 3 head 1. A rank that takes
    its neighbour's head must be caught."""
    right = ShardLayout.kv_heads.fget

    def wrong(self):
        heads = right(self)
        return range((heads.start + 1) % self.num_kv_heads, (heads.start + 1) % self.num_kv_heads + 1)

    monkeypatch.setattr(ShardLayout, "kv_heads", property(wrong))
    logits, _ = run_group(llama_8q2kv_dir, 4, prefill_plans(TOKENS, 13))
    assert _error(llama_8q2kv_dir, logits) > 10


def test_negative_control_row_parallel_without_all_reduce(llama_8q4kv_dir) -> None:
    logits, _ = run_group(llama_8q4kv_dir, 2, prefill_plans(TOKENS, 13), reduce=lambda comm: lambda t: t)
    assert _error(llama_8q4kv_dir, logits) > 10


def test_smollm2_refuses_tp2_naming_both_head_counts(smollm2_dir) -> None:
    with pytest.raises(ShardingError) as err:
        shard_layout(load_model_config(smollm2_dir), 2, 0)
    assert "9 query heads" in str(err.value) and "3 KV heads" in str(err.value)
    assert "tp sizes that work: 1, 3)" in str(err.value)  # 9 splits the heads, not the MLP
    with pytest.raises(ShardingError, match="^intermediate_size: 1536 MLP columns"):
        shard_layout(load_model_config(smollm2_dir), 9, 0)


def test_layout_ranges() -> None:
    split = [ShardLayout(2, r, 8, 4, 16, 64) for r in range(2)]
    assert [(l.q_heads, l.kv_heads, l.ffn_columns) for l in split] == [
        (range(0, 4), range(0, 2), range(0, 32)), (range(4, 8), range(2, 4), range(32, 64))]
    rep = [ShardLayout(4, r, 8, 2, 16, 64) for r in range(4)]
    assert [l.kv_heads for l in rep] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    # every rank's query heads read the KV head it holds (GQA group of 4 query heads)
    assert all(h // 4 in l.kv_heads for l in rep for h in l.q_heads)
