"""Structured output on the worker: constraints compiled by xgrammar, cached by digest.

:class:`GrammarCache` compiles a :class:`~kvfleet.constraint.Constraint` (its canonical spec)
on the compile threads of :class:`~.compile_queue.CompileQueue` (never the engine thread; a
tenant runs its share of them, in turn with the others), keyed by the constraint's digest,
LRU-bounded to ``cache_size`` entries. A compile waits a bounded time for a thread and runs a
bounded time (``max_compile_s``); a digest whose compile, or whose token mask in a step
(:mod:`.masks`), went past its bound is refused from then on, so resending it costs nothing.
A request awaits its own compile; others are not held.

Why xgrammar rather than llguidance: filling and applying a batch's masks costs it a fraction
of llguidance's per step, and the per-step cost is what a decode loop pays (compiles take
about as long with either; measured in docs/structured_output.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import tokenizers

from kvfleet.constraint import Constraint, GrammarConfig
from kvfleet.errors import InvalidArgument, ResourceExhausted
from kvfleet.worker.engine.output.compile_queue import CompileJob, CompileQueue
from kvfleet.worker.engine.output.ebnf_check import root_is_productive

_DEFAULT_CONFIG = GrammarConfig()
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def xgrammar_module():
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
        compiler: the compile itself, ``Constraint -> compiled grammar`` (default: xgrammar's,
            :meth:`_compile`; tests pass a fake).
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int,
                 stop_token_ids: Sequence[int], config: GrammarConfig = _DEFAULT_CONFIG,
                 compiler: Optional[Callable[[Constraint], Any]] = None) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop = list(stop_token_ids)
        self._compiler: Any = None
        self._compile_fn = compiler or self._compile
        self._compiler_lock = threading.Lock()  # building the compiler takes seconds: not _lock
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        # Digests refused from now on (a compile or a mask past its bound) -> why, LRU-bounded.
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._inflight: dict[str, CompileJob] = {}
        self._queue = CompileQueue(config.threads, config.tenant_compiles, config.max_queued)
        self.stats = CompileStats()

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = xgrammar_module()
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
        """The compiled grammar (an ``xgrammar.CompiledGrammar``), from the cache or compiled now
        (on the calling thread). A compile longer than ``max_compile_s`` is not cached and its
        digest is refused from then on.

        Raises:
            InvalidArgument: it does not compile, admits no output, or its digest was refused
                (naming ``constraint.field``).
        """
        key = constraint.digest
        with self._lock:
            if (hit := self._hit(key)) is not None:
                return hit
            self._check_refused(key, constraint)
        start = time.monotonic()
        compiled = self._compile_fn(constraint)
        took = time.monotonic() - start
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_s.append(took)
            if took > self.config.max_compile_s:
                self._refuse(key, self._too_slow_reason())
            else:
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

    async def compile_async(self, constraint: Constraint, tenant: str = "default") -> Any:
        """:meth:`compile` on the compile threads for ``tenant`` (:class:`CompileQueue`: its
        share of them, in turn with other tenants), waiting at most ``max_compile_s`` for a
        thread and ``max_compile_s`` for the compile. Concurrent requests for one digest share
        one compile; a request that stops waiting takes its compile out of the queue when no
        other awaits it.

        Raises:
            InvalidArgument: as :meth:`compile`, or the compile ran past ``max_compile_s``
                (its digest is refused from then on).
            ResourceExhausted: ``tenant`` has its limit of compiles queued, or no thread came
                free in time (retryable).
        """
        key = constraint.digest
        with self._lock:
            if (hit := self._hit(key)) is not None:
                return hit
            self._check_refused(key, constraint)
            job = self._inflight.get(key)
            fresh = job is None
            if job is None:
                job = self._inflight[key] = self._queue.submit(
                    tenant, functools.partial(self.compile, constraint))
            job.waiters += 1
        if fresh:  # outside _lock: the callback takes it, and may run at once
            job.result.add_done_callback(functools.partial(self._forget, key, job))
        try:
            return await self._await(job, key, constraint)
        finally:
            with self._lock:
                job.waiters -= 1
                idle = job.waiters == 0
            if idle:
                self._queue.withdraw(job)  # no-op once it started

    async def _await(self, job: CompileJob, key: str, constraint: Constraint) -> Any:
        """``job``'s grammar: at most ``max_compile_s`` for a thread, then for the compile."""
        bound, name = self.config.max_compile_s, constraint.field or constraint.kind
        try:
            began = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.started)), bound)
        except asyncio.TimeoutError:
            raise ResourceExhausted(
                f"{name}: no structured-output compile thread came free on this replica within "
                f"{bound} s (compiles of other requests are running); retry") from None
        left = max(0.0, began + bound - time.monotonic())
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.result)), left)
        except asyncio.TimeoutError:
            with self._lock:
                self._refuse(key, self._too_slow_reason())
            raise InvalidArgument(f"{name}: {self._too_slow_reason()}", field=name) from None

    def too_slow_to_mask(self, constraint: Optional[Constraint], took_s: float) -> InvalidArgument:
        """A row of ``constraint`` took ``took_s`` CPU seconds to fill its token mask, past
        ``mask_budget_ms``: its digest is refused from now on (and dropped from the cache).
        Returns the error that ends its request."""
        name = (constraint.field or constraint.kind) if constraint is not None else "constraint"
        reason = (f"filling its token mask took {took_s * 1e3:.0f} ms of CPU in one step, past "
                  f"the budget of {self.config.mask_budget_ms:g} ms a row "
                  "(--grammar-mask-budget-ms)")
        if constraint is not None:
            with self._lock:
                self._refuse(constraint.digest, reason)
                self._cache.pop(constraint.digest, None)
        return InvalidArgument(f"{name}: {reason}", field=name)

    def _too_slow_reason(self) -> str:
        return (f"compiling took more than {self.config.max_compile_s} s "
                "(--max-grammar-compile-s)")

    def _refuse(self, key: str, reason: str) -> None:
        """Remember ``key`` as refused for ``reason``. Call with ``_lock`` held."""
        self._refused[key] = reason
        self._refused.move_to_end(key)
        while len(self._refused) > self.config.cache_size:
            self._refused.popitem(last=False)

    def _check_refused(self, key: str, constraint: Constraint) -> None:
        """Raise InvalidArgument if ``key`` was refused. Call with ``_lock`` held."""
        reason = self._refused.get(key)
        if reason is not None:
            name = constraint.field or constraint.kind
            raise InvalidArgument(f"{name}: refused on this replica, an equivalent constraint "
                                  f"went past a bound: {reason}", field=name)

    def _forget(self, key: str, job: CompileJob, _done: concurrent.futures.Future) -> None:
        with self._lock:
            if self._inflight.get(key) is job:
                del self._inflight[key]

    def _compile(self, c: Constraint) -> Any:
        """xgrammar's compile of ``c`` (its :attr:`~Constraint.canonical_spec`)."""
        c.validate()
        xgr, comp = xgrammar_module(), self._get_compiler()
        name = c.field or c.kind
        try:
            if c.kind == "json_object":
                compiled = comp.compile_builtin_json_grammar()
            elif c.kind == "json_schema":
                compiled = comp.compile_json_schema(c.canonical_spec, any_whitespace=False,
                                                    strict_mode=True)
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
        self._queue.close()
