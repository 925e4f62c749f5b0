"""Incremental detokenisation: token ids in, text out, never a partial UTF-8 character.

Uses the prefix-offset / read-offset technique (TGI, vLLM): each push decodes a short window
``tokens[prefix_offset:]`` and returns what it adds beyond ``decode(tokens[prefix_offset:
read_offset])``. Decoding a window rather than single tokens is what keeps the leading space of
SentencePiece ("▁world" after "hello" is " world", alone it is "world") and reassembles
byte-level or byte-fallback tokens that each carry part of one character.

While the window's text ends in U+FFFD (an incomplete byte sequence so far), the offsets stay
put and only the text before that trailing run is emitted; the run is emitted once it resolves
(or by :meth:`IncrementalDetokenizer.flush`, as replacement characters, if it never does).
"""

from __future__ import annotations

from typing import Sequence

import tokenizers

# Prompt tokens decoded as context before the first output token (vLLM uses the same 5), and
# how many more to take so that the context does not start inside a character (which a
# byte-fallback decoder would turn, with the whole run of byte tokens, into U+FFFDs).
_PROMPT_CONTEXT_TOKENS = 5
_MAX_TOKENS_PER_CHAR = 4
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Detokenises one sample's output stream; one instance per sample.

    For output of valid UTF-8 text, the concatenation of every :meth:`push` and the final
    :meth:`flush` equals ``tokenizer.decode(prompt + output)`` minus the decoded prompt
    (``tokenizer.decode(output)`` with an empty prompt). A prompt that ends inside a
    multi-byte character is decoded as context only: that character's completion is not
    re-emitted.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        start = max(0, len(prompt_token_ids) - _PROMPT_CONTEXT_TOKENS)
        for _ in range(_MAX_TOKENS_PER_CHAR - 1):
            if start == 0 or not self._decode(prompt_token_ids[start:]).startswith(_REPLACEMENT):
                break
            start -= 1
        # The window: tokens[0] is at prefix_offset; _read is read_offset, relative to it.
        self._tokens: list[int] = list(prompt_token_ids[start:])
        self._read = len(self._tokens)
        self._sent = 0  # chars already emitted past decode(tokens[:read]) in this window

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special)

    def push(self, token_ids: Sequence[int]) -> str:
        """Append new output tokens; return the text they complete ("" while held back)."""
        self._tokens.extend(token_ids)
        prefix_len = len(self._decode(self._tokens[:self._read]))
        text = self._decode(self._tokens)
        stable = text.rstrip(_REPLACEMENT)
        start = prefix_len + self._sent
        if len(stable) < len(text):  # trailing incomplete sequence: emit only what precedes it
            new = stable[start:]
            self._sent += len(new)
            return new
        new = text[start:]
        if len(text) > prefix_len:  # else the new tokens decode to nothing yet: keep the window
            self._advance()
        return new

    def flush(self) -> str:
        """End of stream: everything still held back, incomplete sequences as U+FFFD."""
        text = self._decode(self._tokens)
        new = text[len(self._decode(self._tokens[:self._read])) + self._sent:]
        self._advance()
        return new

    def _advance(self) -> None:
        """Move prefix_offset to read_offset and read_offset to the end of the window."""
        del self._tokens[:self._read]
        self._read = len(self._tokens)
        self._sent = 0
