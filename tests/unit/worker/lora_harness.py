"""The engine harness with LoRA adapters: one runner with adapter slots per model, an engine
whose :class:`AdapterResidency` serves the given adapter directories, and peft's reference
logits per request."""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

from kvfleet.allocator.hashing import CacheIdentity
from kvfleet.worker.engine.adapters.residency import AdapterResidency
from kvfleet.worker.engine.engine import EngineRequest
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.model_runner import ModelRunner
from tests.fixtures.adapters import peft_logits
from tests.unit.worker import engine_harness
from tests.unit.worker.engine_harness import BLOCK_SIZE, RecordingExecutor, Result, seq_tokens
from tests.unit.worker.paged_driver import scaled_error

MAX_LORAS = 4
MAX_LORA_RANK = 16
IDENTITY = CacheIdentity("tiny", "w", "t", "c", "float32", BLOCK_SIZE)


@functools.cache
def lora_runner_for(model_dir: Path) -> ModelRunner:
    """One runner with :data:`MAX_LORAS` adapter slots per model per session (each engine's
    residency reloads what it uses, so slots left by other tests do not matter)."""
    return ModelRunner(model_dir, num_blocks=160, block_size=BLOCK_SIZE, one_row_weights=False,
                       max_loras=MAX_LORAS)


def make_lora_engine(model_dir: Path, adapters: dict[str, Path], max_loras: int = MAX_LORAS,
                     wrap=None, **scheduler):
    """``(engine, recording runner, residency)`` serving ``adapters`` (name → directory);
    ``wrap(runner)``, when given, wraps the runner the engine calls (negative controls)."""
    runner = lora_runner_for(Path(model_dir))
    catalog = {n: check_adapter(n, d, runner.config, MAX_LORA_RANK) for n, d in adapters.items()}
    residency = AdapterResidency(runner, catalog, max_loras)
    engine, rec = engine_harness.make_engine(model_dir, runner=wrap(runner) if wrap else runner,
                                             adapters=residency, identity=IDENTITY, **scheduler)
    return engine, rec, residency


def preload(residency: AdapterResidency, names, timeout_s: float = 120.0) -> None:
    """Load ``names`` into slots before a run. Loads are asynchronous (a thread; on TP, the
    rank processes), so a test that asserts which steps mix adapters must not depend on
    how long a load takes.

    Raises:
        AssertionError: an adapter not resident within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    for name in names:
        while (slot := residency.acquire(name)) is None:
            assert time.monotonic() < deadline, f"adapter {name!r} did not load"
            residency.wait(0.05)
        residency.release(slot)


def with_adapter(req: EngineRequest, adapter: str) -> EngineRequest:
    return dataclasses.replace(req, adapter=adapter)


def lora_error(model_dir: Path, adapter_dir: Path | None, rec: RecordingExecutor,
               req: EngineRequest, res: Result) -> float:
    """Every logits row the engine computed for ``req`` against peft (base: transformers)
    on its own tokens, in tolerances (<= 1 passes)."""
    rows = rec.verified(f"{req.request_id}#0", seq_tokens(req, res))
    assert rows, f"no logits recorded for {req.request_id}"
    tokens = seq_tokens(req, res)[: max(p for p, _ in rows) + 1]
    ref = peft_logits(model_dir, adapter_dir, tokens)
    return max(scaled_error({p: row}, ref) for p, row in rows)
