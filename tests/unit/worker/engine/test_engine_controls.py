"""Negative controls through the engine path: each known way to get a step wrong must make the
engine-level exactness check FAIL (and the same run passes without the fault), so a passing
exactness test means something."""

from __future__ import annotations

from kvfleet.worker.engine.scheduling.blocks import BlockAdmission
from tests.unit.worker.engine_harness import make_engine, prompt, reference_error, request, run, seq_tokens
from tests.unit.worker.faults import install_positions_reset, install_top_left_mask

WIDTHS = [5, 11, 3, 7]


def _chunked_error(model_dir) -> float:
    engine, rec = make_engine(model_dir)
    req = request(prompt(26, seed=50), max_tokens=5)
    res = run(engine, [req], budgets=lambda k: WIDTHS[k] if k < len(WIDTHS) else 64)
    return reference_error(model_dir, rec, f"{req.request_id}#0", seq_tokens(req, res[(req.request_id, 0)]))


def test_top_left_mask_on_a_chunk_fails(tiny_llama_dir, monkeypatch) -> None:
    assert _chunked_error(tiny_llama_dir) <= 1
    install_top_left_mask(monkeypatch)
    assert _chunked_error(tiny_llama_dir) > 1


def test_positions_reset_to_zero_fails(tiny_llama_dir, monkeypatch) -> None:
    install_positions_reset(monkeypatch)
    assert _chunked_error(tiny_llama_dir) > 1


def _sibling_errors(model_dir) -> list[float]:
    engine, rec = make_engine(model_dir)
    req = request(prompt(10, seed=51), max_tokens=8, n=2, temperature=1.0, seed=3)
    results = run(engine, [req])
    return [reference_error(model_dir, rec, f"{req.request_id}#{i}",
                            seq_tokens(req, results[(req.request_id, i)])) for i in range(2)]


def test_shared_block_written_in_place_fails(tiny_llama_dir, monkeypatch) -> None:
    """Siblings sharing the prompt's partial block: skipping copy-on-write lets the first
    writer's token land in the block the other still reads."""
    assert max(_sibling_errors(tiny_llama_dir)) <= 1
    monkeypatch.setattr(BlockAdmission, "pending_copy", lambda self, seq: 0)
    assert max(_sibling_errors(tiny_llama_dir)) > 1
