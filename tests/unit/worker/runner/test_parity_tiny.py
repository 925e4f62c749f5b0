"""Paged, chunked, batched forward == transformers' full-prefix forward, on tiny checkpoints.

fp32; every recorded logit row within 1e-4 x max(1, max|ref|) of transformers (see
paged_driver.scaled_error: <= 1 passes). Block tables come from a shuffled pool (never
contiguous); chunk widths are not multiples of the block size (4).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.worker.paged_driver import (
    BlockPool,
    Seq,
    decode,
    fork_siblings,
    prefill,
    random_prompt,
    reference_error,
    reference_logits,
    replay,
    runner_for,
    scaled_error,
    step,
)


def new_seq(pool: BlockPool, rid: str, prompt_len: int, seed: int, max_len: int = 64) -> Seq:
    return Seq(rid, random_prompt(prompt_len, seed), pool.take(-(-max_len // 4)))


def test_token_by_token(model_dir) -> None:
    runner = runner_for(model_dir)
    seq = new_seq(BlockPool(runner.num_blocks, seed=1), "a", 13, seed=1)
    prefill(runner, seq, [1] * 13)
    decode(runner, seq, 8)
    assert len(seq.logits) == 21
    assert reference_error(model_dir, seq) <= 1


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_token_by_token_each_decode_backend(tiny_mistral_dir, backend, monkeypatch) -> None:
    """Both decode-attention paths (the C kernel and the torch fallback), sliding window included."""
    from kvfleet.worker.runner import cpu_kernels

    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, backend)
    cpu_kernels.load.cache_clear()
    try:
        assert (cpu_kernels.load() is None) == (backend == "torch")
        runner = runner_for(tiny_mistral_dir)
        seq = new_seq(BlockPool(runner.num_blocks, seed=4), "a", 9, seed=4, max_len=48)
        prefill(runner, seq, [9])
        decode(runner, seq, 30)
        assert reference_error(tiny_mistral_dir, seq) <= 1
    finally:
        cpu_kernels.load.cache_clear()


def test_uneven_chunks_then_decode(model_dir) -> None:
    runner = runner_for(model_dir)
    seq = new_seq(BlockPool(runner.num_blocks, seed=2), "a", 35, seed=2)
    prefill(runner, seq, [5, 11, 16, 3])
    decode(runner, seq, 6)
    assert reference_error(model_dir, seq) <= 1


def test_mixed_batch_equals_each_alone(model_dir) -> None:
    """Prefill chunks and decodes of four requests share steps; each equals its solo run."""
    runner = runner_for(model_dir)
    pool = BlockPool(runner.num_blocks, seed=3)
    a, b, c, d = (new_seq(pool, r, n, seed=10 + i) for i, (r, n) in enumerate(
        [("a", 23), ("b", 9), ("c", 14), ("d", 3)]))
    step(runner, [(a, 10), (b, 9)])
    step(runner, [(b, 1), (a, 13), (c, 7)])
    step(runner, [(a, 1), (c, 7), (b, 1), (d, 3)])
    for _ in range(4):
        step(runner, [(d, 1), (c, 1), (a, 1), (b, 1)])
    step(runner, [(c, 1), (a, 1)])  # b and d left
    for seq in (a, b, c, d):
        assert reference_error(model_dir, seq) <= 1, seq.request_id
        alone = replay(runner, seq, pool.take(len(seq.block_table)))
        assert scaled_error(seq.logits, alone.logits) <= 1, seq.request_id


def test_copy_on_write_siblings(model_dir) -> None:
    """Two samples share a partly filled block; the scheduler copies it before the second writes."""
    runner = runner_for(model_dir)
    a, b = fork_siblings(runner, BlockPool(runner.num_blocks, seed=4), share_partial=False)
    step(runner, [(a, 1), (b, 1)], copies=((a.block_table[2], b.block_table[2]),))
    for _ in range(5):
        step(runner, [(b, 1), (a, 1)])
    assert reference_error(model_dir, a) <= 1
    assert reference_error(model_dir, b) <= 1


def test_non_contiguous_block_table_lands_in_those_blocks(tiny_llama_dir) -> None:
    """Blocks [7, 2, 9]: K/V of positions 0-9 land exactly there and nowhere else."""
    from kvfleet.worker.runner.model_runner import ModelRunner

    runner = ModelRunner(tiny_llama_dir, num_blocks=12, block_size=4)
    seq = Seq("a", random_prompt(10, seed=6), [7, 2, 9])
    prefill(runner, seq, [6, 4])
    assert reference_error(tiny_llama_dir, seq) <= 1
    written = runner.kv_cache.data.abs().sum(dim=(0, 1, 4, 5)) > 0  # (num_blocks, block_size)
    expected = torch.zeros(12, 4, dtype=torch.bool)
    expected[7] = expected[2] = True
    expected[9, :2] = True
    assert torch.equal(written, expected)


def test_sliding_window_beyond_window(tiny_mistral_dir) -> None:
    runner = runner_for(tiny_mistral_dir)
    assert runner.config.sliding_window == 8
    seq = new_seq(BlockPool(runner.num_blocks, seed=7), "a", 30, seed=7)
    prefill(runner, seq, [5, 11, 3, 7, 4])
    decode(runner, seq, 10)
    assert reference_error(tiny_mistral_dir, seq) <= 1


def test_bfloat16_runs_close_to_fp32(model_dir) -> None:
    """Not a parity claim (bf16 has ~3 significant digits): the dtype plumbing works end to end
    (Gemma's fp32 norm weights beside bf16 activations included). Within 5e-2 of the logit
    scale, or twice transformers' own bf16 error where that is larger (tiny gpt-oss: its
    SwiGLU clamp and sinks make bf16 itself drift further)."""
    from kvfleet.worker.runner.model_runner import ModelRunner

    runner = ModelRunner(model_dir, num_blocks=16, block_size=4, dtype=torch.bfloat16)
    assert runner.kv_cache.data.dtype == torch.bfloat16
    seq = Seq("a", random_prompt(12, seed=9), BlockPool(16, seed=9).take(5))
    prefill(runner, seq, [7, 5])
    decode(runner, seq, 3)
    tokens = seq.tokens[: max(seq.logits) + 1]
    with torch.no_grad():
        theirs = hf_model_bf16(model_dir)(torch.tensor([tokens])).logits[0].float()
    floor = scaled_error({p: theirs[p] for p in seq.logits}, reference_logits(model_dir, tokens))
    assert reference_error(model_dir, seq) < max(500, 2 * floor)


def hf_model_bf16(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
