"""IncrementalDetokenizer against tokenizer.decode of the whole sequence, on two tokenizer kinds.

Both tokenizers are trained here in a few milliseconds, so the tests need no model files:
a GPT-2/SmolLM-style byte-level BPE and a Llama-2-style SentencePiece BPE ("▁" spaces, byte
fallback, a decoder that strips the first leading space).
"""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvfleet.worker.engine.output.detokenizer import IncrementalDetokenizer

CORPUS = ["héllo wörld 世界 🙂 hello world, the quick brown fox jumps over the lazy dog.",
          "Hello, hello! Wörld of 世界: 🙂🙂 done."] * 10
EOS = "<|endoftext|>"
# Characters the text strategies use; ж, €, 🎉 are not in CORPUS, so they need byte fallback.
ALPHABET = "abcdehlorw ,.!\néö世界🙂ж€🎉"


@functools.cache
def byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


@functools.cache
def sentencepiece() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", EOS], show_progress=False))
    spec = json.loads(tok.to_str())  # rewrite into Llama-2's tokenizer.json shape
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    spec["pre_tokenizer"] = None
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(spec))


TOKENIZERS = {"byte_level": byte_level, "sentencepiece": sentencepiece}


def stream(tok: Tokenizer, prompt: list[int], chunks: list[list[int]],
           skip_special_tokens: bool = True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
    return [detok.push(c) for c in chunks], detok.flush()


def expected_text(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> str:
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    head = tok.decode(prompt, skip_special_tokens=skip)
    assert full.startswith(head)
    return full[len(head):]


@st.composite
def chunked(draw, ids: list[int]) -> list[list[int]]:
    """``ids`` cut at random points into pieces (some empty: an engine step may add nothing)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(ids)), max_size=len(ids) + 2)))
    bounds = [0, *cuts, len(ids)]
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@given(data=st.data(), skip=st.booleans(), with_prompt=st.booleans())
def test_random_token_sequences_byte_level(data, skip: bool, with_prompt: bool) -> None:
    """Arbitrary ids, even invalid UTF-8: pushes + flush reproduce decode(all) exactly."""
    tok = byte_level()
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=40))
    prompt = tok.encode("héllo 世界, the").ids if with_prompt else []
    pieces, tail = stream(tok, prompt, data.draw(chunked(ids)), skip)
    assert "".join(pieces) + tail == expected_text(tok, prompt, ids, skip)


@given(data=st.data(), with_prompt=st.booleans())
def test_random_token_sequences_sentencepiece(data, with_prompt: bool) -> None:
    """Arbitrary (non-canonical) mixes of pieces and whole byte-fallback characters.

    Byte-fallback groups that are invalid UTF-8 are left out: the decoder turns a whole run of
    byte tokens into U+FFFDs when any of it is invalid, which no windowed decoder reproduces.
    """
    tok = sentencepiece()
    pieces_ids = [i for t, i in tok.get_vocab().items() if not t.startswith("<")]
    unit = st.one_of(st.sampled_from(pieces_ids).map(lambda i: [i]),
                     st.sampled_from("ж€🎉é").map(lambda c: byte_ids("sentencepiece", c.encode())))
    ids = [i for u in data.draw(st.lists(unit, max_size=30)) for i in u]
    prompt = tok.encode("hello wörld").ids if with_prompt else []
    pieces, tail = stream(tok, prompt, data.draw(chunked(ids)))
    assert all("\ufffd" not in p for p in pieces) and tail == ""
    assert "".join(pieces) == expected_text(tok, prompt, ids)


@pytest.mark.parametrize("name", TOKENIZERS)
@given(data=st.data())
def test_valid_text_never_emits_replacement_char(name: str, data) -> None:
    """One text's tokens, split into prompt and output at a random character boundary."""
    tok = TOKENIZERS[name]()
    text = data.draw(st.text(ALPHABET, min_size=1, max_size=50))
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    split = data.draw(st.integers(0, len(ids) - 1))
    while split and not (text.startswith(tok.decode(ids[:split]))
                         and not tok.decode(ids[:split]).endswith("\ufffd")):
        split -= 1  # a prompt ending inside a character is another test's business
    prompt, output = ids[:split], ids[split:]
    pieces, tail = stream(tok, prompt, data.draw(chunked(output)))
    assert all("\ufffd" not in p for p in pieces)
    assert tail == ""
    assert "".join(pieces) == expected_text(tok, prompt, output)


def test_prompt_context_window_does_not_cut_a_byte_fallback_run() -> None:
    """The last 5 prompt tokens start inside a character made of byte-fallback tokens."""
    tok = sentencepiece()
    prompt = tok.encode("hello жжжж").ids  # ж is not in the vocab: 2 byte tokens each
    assert tok.id_to_token(prompt[-5]) == "<0xB6>"
    output = byte_ids("sentencepiece", "жж".encode())
    pieces, tail = stream(tok, prompt, [[t] for t in output])
    assert pieces == ["", "ж", "", "ж"] and tail == ""


def gpt2_byte_to_char() -> dict[int, str]:
    """Byte-level BPE's byte -> char map (GPT-2's ``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + len(table) - len(printable))
    return table


def byte_ids(name: str, data: bytes) -> list[int]:
    """One single-byte token per byte of ``data``."""
    tok = TOKENIZERS[name]()
    if name == "sentencepiece":
        ids = [tok.token_to_id(f"<0x{b:02X}>") for b in data]
    else:
        table = gpt2_byte_to_char()
        ids = [tok.token_to_id(table[b]) for b in data]
    assert None not in ids
    return ids


@pytest.mark.parametrize("name", TOKENIZERS)
def test_emoji_split_across_byte_tokens(name: str) -> None:
    tok = TOKENIZERS[name]()
    emoji = byte_ids(name, "🙂".encode())
    assert len(emoji) == 4 and tok.decode(emoji) == "🙂"
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.push([t]) for t in emoji] == ["", "", "", "🙂"]
    assert detok.flush() == ""


def test_text_before_an_incomplete_character_is_not_held() -> None:
    tok = byte_level()
    emoji = byte_ids("byte_level", "🙂".encode())
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(tok.encode("ab").ids + emoji[:2]) == "ab"
    assert detok.push(emoji[2:3]) == ""
    assert detok.push(emoji[3:] + tok.encode("c").ids) == "🙂c"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_truly_invalid_bytes_come_out_at_flush(name: str) -> None:
    tok = TOKENIZERS[name]()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(byte_ids(name, b"\xe4\xb8")) == ""
    assert detok.flush() == tok.decode(byte_ids(name, b"\xe4\xb8"))
    assert set(tok.decode(byte_ids(name, b"\xe4\xb8"))) == {"\ufffd"}


def test_sentencepiece_keeps_leading_space_after_context() -> None:
    tok = sentencepiece()
    prompt, world = tok.encode("hello").ids, tok.encode("world").ids
    assert tok.id_to_token(world[0]).startswith("▁") and tok.decode(world) == "world"
    assert "".join(stream(tok, prompt, [[t] for t in world])[0]) == " world"
    # With no prompt the first space is stripped, exactly as decode() does.
    assert "".join(stream(tok, [], [[t] for t in world])[0]) == "world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(skip: bool) -> None:
    tok = byte_level()
    eos = tok.token_to_id(EOS)
    pieces, tail = stream(tok, [], [tok.encode("hi").ids, [eos]], skip_special_tokens=skip)
    assert pieces == ["hi", "" if skip else EOS] and tail == ""
