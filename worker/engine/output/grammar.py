"""Structured output on the worker: constraints compiled by xgrammar, token masks per row.

:class:`GrammarCache` compiles a :class:`~kvfleet.constraint.Constraint` on its own thread pool
(never the engine thread), keyed by the constraint's digest, LRU-bounded to ``cache_size``
entries, each compile bounded by ``max_compile_s``. A request awaits its own compile; others
are not held. :class:`RowMatcher` follows one sample's output; :func:`mask_logits` applies the
masks of a batch's constrained rows in one call, leaving free rows untouched.

Why xgrammar rather than llguidance: filling and applying a batch's masks costs it a fraction
of llguidance's per step, and the per-step cost is what a decode loop pays (compiles take
about as long with either; measured in docs/structured_output.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import tokenizers
import torch

from kvfleet.constraint import Constraint, GrammarConfig
from kvfleet.errors import InvalidArgument

DEFAULT_MAX_COMPILE_S = 10.0
_DEFAULT_CONFIG = GrammarConfig()
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
DEFAULT_CACHE_SIZE = 256


def _xgr():
    """xgrammar, imported on first use (its import takes seconds: not on the replica's start)."""
    import xgrammar

    return xgrammar


@dataclass
class CompileStats:
    """Counters of one cache: hits, compiles and their durations (seconds)."""

    hits: int = 0
    misses: int = 0
    compile_s: list[float] = field(default_factory=list)


class GrammarCache:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe.

    Args:
        tokenizer: the served model's tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's: extra ids are never
            allowed by a constraint).
        stop_token_ids: the tokens that end a constrained output once it is complete (EOS).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int,
                 stop_token_ids: Sequence[int], config: GrammarConfig = _DEFAULT_CONFIG) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop = list(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._inflight: dict[str, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(config.threads, "kvfleet-grammar")
        self.stats = CompileStats()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                vocab = self._tokenizer.get_vocab(with_added_tokens=True)
                encoded = [""] * max(vocab.values(), default=-1) + [""]
                for token, i in vocab.items():
                    encoded[i] = token
                meta = xgr.TokenizerInfo._detect_metadata_from_hf(self._tokenizer.to_str())
                info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=self.vocab_size,
                                         stop_token_ids=self._stop,
                                         add_prefix_space=meta["add_prefix_space"])
                # Our LRU bounds the cache; xgrammar's own would grow without one.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar (an ``xgrammar.CompiledGrammar``), from the cache or compiled now.

        Raises:
            InvalidArgument: it does not compile, or admits no output (naming ``constraint.field``).
        """
        key = constraint.digest
        with self._lock:
            if (hit := self._hit(key)) is not None:
                return hit
        start = time.monotonic()
        compiled = self._compile(constraint)
        took = time.monotonic() - start
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_s.append(took)
            if took <= self.config.max_compile_s:  # an over-long compile stays refused next time
                self._cache[key] = compiled
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
        return compiled

    def _hit(self, key: str) -> Any:
        """The cached grammar for ``key`` (counted as a hit, made most recent), else None.
        Call with ``_lock`` held."""
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.stats.hits += 1
        return compiled

    async def compile_async(self, constraint: Constraint) -> Any:
        """:meth:`compile` on the cache's threads, waiting at most ``max_compile_s``.

        Concurrent requests for one digest share one compile. Raises InvalidArgument (as
        :meth:`compile`, or when the compile takes longer than ``max_compile_s``).
        """
        key = constraint.digest
        with self._lock:
            if (hit := self._hit(key)) is not None:
                return hit
            fut = self._inflight.get(key)
            if fut is None:
                fut = self._inflight[key] = self._pool.submit(self.compile, constraint)
                fut.add_done_callback(lambda _f: self._inflight.pop(key, None))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)),
                                          self.config.max_compile_s)
        except asyncio.TimeoutError:
            raise InvalidArgument(
                f"{constraint.field or constraint.kind}: compiling took more than "
                f"{self.config.max_compile_s} s (--max-grammar-compile-s)",
                field=constraint.field or constraint.kind) from None

    def _compile(self, c: Constraint) -> Any:
        c.validate()
        xgr, comp = _xgr(), self._get_compiler()
        name = c.field or c.kind
        try:
            if c.kind == "json_object":
                compiled = comp.compile_builtin_json_grammar()
            elif c.kind == "json_schema":
                compiled = comp.compile_json_schema(c.spec, any_whitespace=False, strict_mode=True)
            elif c.kind == "regex":
                compiled = comp.compile_regex(c.spec)
            else:
                compiled = comp.compile_grammar(c.spec, root_rule_name="root")
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its reason
            text = str(exc).strip()
            # "[time] /project/cpp/file.cc:123: reason" -> "reason"
            reason = _LOCATION.sub("", text.splitlines()[0]) if text else type(exc).__name__
            raise InvalidArgument(f"{name} does not compile: {reason}", field=name) from None
        if c.kind == "grammar" and not root_is_productive(str(xgr.Grammar.from_ebnf(c.spec))):
            raise InvalidArgument(f"{name} admits no output: rule root derives no finite string "
                                  "(no accepting path)", field=name)
        # A grammar with no accepting path allows no first token (and is not already complete).
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        if not bool(mask.any()) and not matcher.is_completed():
            raise InvalidArgument(f"{name} admits no output (no accepting path)", field=name)
        return compiled

    def close(self) -> None:
        """Stop the compile threads (a compile in progress finishes)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_.-]*|[()|]|\S')


def root_is_productive(normalized: str) -> bool:
    """Whether rule ``root`` of a normalized xgrammar EBNF (``str(Grammar)``) derives a finite
    string. A rule is productive when one of its alternatives has only productive items
    (literals, character classes, productive rules); computed as a fixpoint. Constructs this
    reader does not know count as productive, so it never refuses a grammar that has output.
    """
    rules: dict[str, list[str]] = {}
    for line in normalized.splitlines():
        head, sep, body = line.partition(" ::= ")
        if sep:
            rules[head.strip()] = _TOKEN.findall(body)
    productive: set[str] = set()

    def expr(toks: list[str], i: int) -> tuple[bool, int]:
        ok, i = alt(toks, i)
        while i < len(toks) and toks[i] == "|":
            more, i = alt(toks, i + 1)
            ok = ok or more
        return ok, i

    def alt(toks: list[str], i: int) -> tuple[bool, int]:
        ok = True
        while i < len(toks) and toks[i] not in ("|", ")"):
            if toks[i] == "(":
                sub, i = expr(toks, i + 1)
                i += 1  # the closing parenthesis
            else:
                t = toks[i]
                sub = t not in rules or t in productive  # literal, class or unknown: productive
                i += 1
            ok = ok and sub
        return ok, i

    changed = True
    while changed:
        changed = False
        for name, toks in rules.items():
            if name not in productive and expr(toks, 0)[0]:
                productive.add(name)
                changed = True
    return "root" not in rules or "root" in productive


def schema_text(schema: Any) -> str:
    """Canonical JSON text of a schema object (one digest per schema, whatever its key order)."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


class RowMatcher:
    """One sample's grammar state: the tokens it may take next, advanced token by token.

    The state is a function of the sample's output tokens only, which preemption by recompute
    keeps: a recomputed sequence continues from the same state.
    """

    def __init__(self, compiled: Any) -> None:
        self._m = _xgr().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the next token into ``bitmask[row]`` (int32 words)."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return bool(self._m.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The output is complete and its stop token was taken: nothing more may follow."""
        return bool(self._m.is_terminated())


def mask_logits(logits: torch.Tensor, matchers: Sequence[Optional[RowMatcher]]) -> torch.Tensor:
    """Logits with every constrained row's disallowed tokens at ``-inf``.

    Args:
        logits: (R, V) float, one row per entry of ``matchers``; not modified.
        matchers: the row's matcher, or None for a free row (left exactly as it was).
    Returns:
        ``logits`` itself when no row is constrained, else a float32 (R, V) copy.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    xgr = _xgr()
    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab)  # (R, ceil(V / 32)) int32
    for i in rows:
        matchers[i].fill(bitmask, i)  # type: ignore[union-attr]
    out = logits.float().clone()
    if out.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab, indices=rows)
    else:
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=vocab,
                                        indices=rows, backend="torch_native")
    return out
