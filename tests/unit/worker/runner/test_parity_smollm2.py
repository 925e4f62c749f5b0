"""The real default model (SmolLM2-135M-Instruct, 30 layers, GQA 9/3) against transformers."""

from __future__ import annotations

import jinja2
import pytest
from tokenizers import Tokenizer

from tests.unit.worker.paged_driver import BlockPool, Seq, decode, prefill, reference_error, runner_for, step

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def runner(smollm2_dir):
    return runner_for(smollm2_dir, block_size=BLOCK_SIZE, num_blocks=64)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


def chat_prompt(smollm2_dir, question: str) -> str:
    template = jinja2.Environment().from_string((smollm2_dir / "chat_template.jinja").read_text())
    return template.render(messages=[{"role": "user", "content": question}], add_generation_prompt=True)


def test_config_is_what_the_gguf_said(runner) -> None:
    c = runner.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (30, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope.theta == 1e5 and c.eos_token_ids == (2,)


def test_prefill_then_decode(runner, tokenizer, smollm2_dir) -> None:
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs into").ids
    assert 15 <= len(prompt) <= 25
    seq = Seq("a", prompt, BlockPool(64, seed=30).take(3))
    prefill(runner, seq, [len(prompt)])
    decode(runner, seq, 8)
    assert reference_error(smollm2_dir, seq) <= 1


def test_uneven_chunks_beside_a_decoding_request(runner, tokenizer, smollm2_dir) -> None:
    pool = BlockPool(64, seed=31)
    text = ("Paged attention splits the key value cache of a language model into fixed size blocks,"
            " so that memory")
    a = Seq("a", tokenizer.encode(text).ids, pool.take(3))
    b = Seq("b", tokenizer.encode("Once upon a time, in a small village by the sea,").ids, pool.take(3))
    step(runner, [(b, len(b.tokens))])
    widths = [5, 11, len(a.tokens) - 16]
    for w in widths:
        step(runner, [(b, 1), (a, w)])  # a's prefill chunks share steps with b's decodes
    for _ in range(6):
        step(runner, [(a, 1), (b, 1)])
    assert reference_error(smollm2_dir, a) <= 1
    assert reference_error(smollm2_dir, b) <= 1


def test_greedy_answer_names_paris(runner, tokenizer, smollm2_dir) -> None:
    ids = tokenizer.encode(chat_prompt(smollm2_dir, "What is the capital of France?")).ids
    seq = Seq("paris", ids, BlockPool(64, seed=32).take(4))
    prefill(runner, seq, [len(ids)])
    while seq.tokens[-1] not in runner.config.eos_token_ids and len(seq.tokens) - len(ids) < 16:
        decode(runner, seq, 1)
    answer = tokenizer.decode(seq.tokens[len(ids):])
    assert "Paris" in answer, answer
