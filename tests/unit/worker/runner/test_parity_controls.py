"""Negative controls: each known way to get paged attention wrong must FAIL the parity check,
so a passing parity test means something. Also: the context limit is a clear error."""

from __future__ import annotations

import pytest
import torch

from kvfleet.errors import OutOfRange
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from tests.unit.worker.faults import install_positions_reset, install_top_left_mask
from tests.unit.worker.paged_driver import (
    BlockPool,
    Seq,
    decode,
    fork_siblings,
    prefill,
    random_prompt,
    reference_error,
    reference_logits,
    runner_for,
    scaled_error,
    step,
)


def _chunked_run(model_dir, seed: int) -> Seq:
    runner = runner_for(model_dir)
    seq = Seq("a", random_prompt(19, seed), BlockPool(runner.num_blocks, seed).take(8))
    prefill(runner, seq, [5, 11, 3])
    decode(runner, seq, 4)
    return seq


def test_positions_reset_to_zero_fails(tiny_llama_dir, monkeypatch) -> None:
    """RoPE positions restarting at 0 in every chunk (a 'reset at capacity' bug) is caught."""
    assert reference_error(tiny_llama_dir, _chunked_run(tiny_llama_dir, seed=20)) <= 1
    install_positions_reset(monkeypatch)
    assert reference_error(tiny_llama_dir, _chunked_run(tiny_llama_dir, seed=20)) > 1


def test_top_left_causal_mask_on_a_chunk_fails(tiny_llama_dir, monkeypatch) -> None:
    """A causal mask not shifted by the cached count is caught — and only chunks after the
    first are affected (for the first, top-left and shifted coincide)."""
    install_top_left_mask(monkeypatch)
    runner = runner_for(tiny_llama_dir)
    seq = Seq("a", random_prompt(19, 21), BlockPool(runner.num_blocks, 21).take(8))
    prefill(runner, seq, [5, 11, 3])
    ref = reference_logits(tiny_llama_dir, seq.tokens[:19])
    assert scaled_error({4: seq.logits[4]}, ref) <= 1
    assert scaled_error({15: seq.logits[15]}, ref) > 1


def test_sliding_window_ignored_fails(tiny_mistral_dir, monkeypatch) -> None:
    """Full attention where Mistral slides is caught once the sequence outgrows the window."""
    runner = runner_for(tiny_mistral_dir)
    for layer in runner.model.layers:
        monkeypatch.setattr(layer, "window", None)
    monkeypatch.setattr(runner, "_windows", (None,))  # the masks metadata builds per window
    assert reference_error(tiny_mistral_dir, _chunked_run(tiny_mistral_dir, seed=22)) > 1


@pytest.mark.parametrize("fault", ["shared block written in place", "copy omitted"])
def test_copy_on_write_faults_fail(tiny_llama_dir, fault) -> None:
    runner = runner_for(tiny_llama_dir)
    a, b = fork_siblings(runner, BlockPool(runner.num_blocks, seed=23),
                     share_partial=fault == "shared block written in place")
    step(runner, [(a, 1), (b, 1)])  # no block_copies
    for _ in range(3):
        step(runner, [(b, 1), (a, 1)])
    assert max(reference_error(tiny_llama_dir, a), reference_error(tiny_llama_dir, b)) > 1


def test_context_limit_is_a_clear_error(tiny_llama_dir) -> None:
    runner = runner_for(tiny_llama_dir)
    limit = runner.config.max_position_embeddings
    assert limit == 256
    table = tuple(BlockPool(runner.num_blocks, seed=24).take(limit // runner.block_size))
    before = runner.kv_cache.data.clone()
    with pytest.raises(OutOfRange, match=r"position 259 .*256"):
        runner.execute(StepPlan((SeqChunk("over", (5,) * 10, limit - 6, table),)))
    with pytest.raises(OutOfRange, match="position 256"):
        runner.execute(StepPlan((SeqChunk("ok", (5,), 3, table), SeqChunk("over", (5,), limit, table))))
    assert torch.equal(runner.kv_cache.data, before), "a rejected plan must write nothing"
    logits = runner.execute(StepPlan((SeqChunk("last", (5,), limit - 1, table),)))
    assert logits.shape == (1, runner.config.vocab_size) and torch.isfinite(logits).all()


def test_malformed_plans_are_rejected(tiny_llama_dir) -> None:
    from kvfleet.errors import InvalidArgument

    runner = runner_for(tiny_llama_dir)
    with pytest.raises(InvalidArgument, match="token_ids"):
        runner.execute(StepPlan((SeqChunk("a", (runner.config.vocab_size,), 0, (1,)),)))
    with pytest.raises(ValueError, match="block_table"):
        runner.execute(StepPlan((SeqChunk("a", (1,) * 5, 0, (1,)),)))
    with pytest.raises(ValueError, match="block_table"):
        runner.execute(StepPlan((SeqChunk("a", (1,), 0, (runner.num_blocks,)),)))
    assert runner.execute(StepPlan(())).shape == (0, runner.config.vocab_size)
