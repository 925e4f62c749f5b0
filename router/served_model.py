"""A model as the router serves it: tokenizer, chat template, cache identity, limits.

Loaded from the same model directory the workers load, so both derive the same identity and
the tokens the router hashes are the tokens the worker caches.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import tokenizers

from kvfleet.allocator.fingerprint import fingerprint_model_dir, read_chat_template, served_weights
from kvfleet.allocator.hashing import CacheIdentity, root_hash
from kvfleet.allocator.model_spec import ConfigError, load_config, served_context
from kvfleet.errors import FailedPrecondition, InvalidArgument
from kvfleet.router.chat_template import ChatTemplate

VALID_ROLES = ("system", "user", "assistant", "tool")
# A base model ships no chat format, and guessing one would feed it markup it never saw.
NO_TEMPLATE = ("messages: model {name!r} has no chat template (a base model): send a prompt "
               "(text, or /v1/completions), or give the model a template "
               "(kvfleet model prepare NAME --chat-template FILE, or chat_template.jinja in its "
               "directory) and restart")
_cached_root_hash = functools.lru_cache(maxsize=4096)(root_hash)
_with_adapter = functools.lru_cache(maxsize=1024)(CacheIdentity.with_adapter)


@dataclass
class ServedModel:
    """Everything the router needs to validate, tokenize and hash prompts for one model."""

    name: str
    model_dir: Path
    tokenizer: tokenizers.Tokenizer
    chat_template: Optional[ChatTemplate]
    identity: CacheIdentity
    max_context: int
    vocab_size: int
    block_size: int

    @classmethod
    def load(cls, name: str, model_dir: str | Path, block_size: int,
             kv_dtype: str = "float32", quantization: str = "none",
             quant_group_size: int = 32) -> "ServedModel":
        """Load tokenizer, chat template and identity from a model directory (the replicas'
        weight-only ``quantization`` is part of the identity: see ``served_weights``).

        Raises:
            FileNotFoundError: ``tokenizer.json`` is missing.
            ConfigError: ``config.json`` is missing, unreadable or gives no context.
        """
        d = Path(model_dir)
        config = load_config(d)
        tokenizer = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        source = read_chat_template(d)
        special = _special_tokens(d)
        fp = fingerprint_model_dir(d)
        identity = CacheIdentity(model=name, weights_fingerprint=served_weights(
                                     fp.weights, quantization, quant_group_size),
                                 tokenizer_fingerprint=fp.tokenizer,
                                 chat_template_fingerprint=fp.chat_template,
                                 kv_dtype=kv_dtype, block_size=block_size)
        return cls(name=name, model_dir=d, tokenizer=tokenizer,
                   chat_template=ChatTemplate(source, special) if source else None,
                   identity=identity, max_context=_context(config),
                   vocab_size=int(config["vocab_size"]), block_size=block_size)

    def root_hash(self, scope: str, cache_salt: str,
                  adapter: Optional[tuple[str, str]] = None) -> bytes:
        """The chain root for (tenant scope, salt) under this model's identity, or with
        ``adapter`` (name, revision) under the identity with that adapter; the last 4,096 are
        remembered (each costs a few hashes, and most requests repeat one)."""
        identity = self.identity if adapter is None else _with_adapter(self.identity, *adapter)
        return _cached_root_hash(identity.digest(), scope, cache_salt)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with the tokenizer's special tokens (thread-safe; releases
        the GIL while it runs)."""
        return self._encode(text, add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: only the batch call releases the GIL, so a router thread
        # tokenizing a large prompt no longer stops the event loop for as long as it takes.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_messages(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Render with the chat template (adding the assistant prompt) and tokenize once.

        Raises:
            FailedPrecondition: the model has no chat template (a base model).
            InvalidArgument: an unknown role, or an empty list.
        """
        if self.chat_template is None:
            raise FailedPrecondition(NO_TEMPLATE.format(name=self.name), field="messages")
        if not messages:
            raise InvalidArgument("messages must not be empty", field="messages")
        for i, m in enumerate(messages):
            if m["role"] not in VALID_ROLES:
                raise InvalidArgument(f"messages[{i}].role must be one of {VALID_ROLES}, "
                                      f"got {m['role']!r}", field=f"messages[{i}].role")
        text = self.chat_template.render(messages)
        # The template already wrote any special tokens; do not add them twice.
        return self._encode(text, add_special_tokens=False)


def _context(config: dict) -> int:
    """The context the workers serve (the allocator's reading: LongRoPE configs serve their
    original context), so the router refuses what a worker would."""
    context = served_context(config)
    if context is None:
        raise ConfigError("max_position_embeddings", "missing from config.json")
    return context


def _special_tokens(model_dir: Path) -> dict[str, str]:
    cfg = model_dir / "tokenizer_config.json"
    out = {"bos_token": "", "eos_token": ""}
    if cfg.exists():
        data = json.loads(cfg.read_text())
        for key in out:
            tok = data.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str):
                out[key] = tok
    return out
