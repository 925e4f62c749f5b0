"""Fitting the step-cost model (:mod:`kvfleet.worker.step_cost.model`) from timed steps.

Two users: a replica at start-up (:func:`load_or_calibrate`: a few timed steps on its own
executor, bounded in seconds, cached on disk) and ``python -m bench.calibrate`` (the constants
the cost-model executor runs with). Both time plans with :func:`measure` and fit them with
:func:`fit`.

**Cache.** One JSON file per :class:`CalibrationKey` — the served model's cache-identity
digest (weights, tokenizer, dtype, block size), the device (``cpu:<processor>:<cpus>`` or the
CUDA device name), ``tp``, dtype, torch threads, the KV cache's layer-group layout (a
windowed layout's steps read other pages than one group's) and :data:`FORMAT` — named by the key's
digest: ``<cache dir>/<digest>.json``, holding the key itself, the fitted constants and the
samples. A changed model, device or setting is a new file; delete one to recalibrate.

Calibration writes KV into blocks of the (still empty) pool: no request owns or has cached
them, so nothing reads what it wrote before a request overwrites it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from hashlib import sha256
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import torch

from kvfleet.allocator.units import cdiv
from kvfleet.cpus import available_cpus, cpu_model
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.runner.models.linear import FEW_ROWS
from kvfleet.worker.step_cost.fit import StepSample, fit
from kvfleet.worker.step_cost.host_lock import host_lock
from kvfleet.worker.step_cost.model import MEASURED, CostModel, plan_shape

log = logging.getLogger(__name__)
FORMAT = 4  # bump when the model form, the plans or the fit change: old cache files stop matching
DEFAULT_BUDGET_S = 20.0
STARTUP_REPEATS = 4  # passes: the first two always run, the others within the budget
LOCK_WAIT_S = 180.0  # longest wait for another replica's calibration of the same key


class _Runs(Protocol):
    def execute(self, plan: StepPlan) -> torch.Tensor: ...


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibration is valid for (module docstring); :meth:`digest` names its file."""

    model_digest: str  # hex of the served model's CacheIdentity digest
    device: str
    tp: int
    dtype: str
    threads: int
    format: int = FORMAT
    layout: str = ""  # the KV cache's layer groups (LayerGroups.layout_key; "": none)

    def fields(self) -> dict:
        """The key as stored in its file; without groups ``layout`` is left out, so a cache
        written before layouts were keyed still matches."""
        out = asdict(self)
        if not self.layout:
            del out["layout"]
        return out

    def digest(self) -> str:
        return sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()[:32]


def device_name(device: str) -> str:
    """The device a calibration was timed on: the CUDA device's name, or the CPU's."""
    if device.startswith("cuda"):
        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu:{cpu_model()}:{available_cpus():g}"


def _chunk(rid: str, n: int, ctx: int, first_block: int, block_size: int, vocab: int) -> SeqChunk:
    blocks = cdiv(ctx + n, block_size)
    return SeqChunk(rid, tuple(1 + (i % (vocab - 1)) for i in range(n)), ctx,
                    tuple(range(first_block, first_block + blocks)))


def calibration_plans(block_size: int, prefill_sizes: Iterable[int], contexts: Iterable[int],
                      decode_batches: Iterable[int], decode_context: int, vocab: int = 1100
                      ) -> Iterator[StepPlan]:
    """Plans of one prefill chunk per (context, size), then decode batches at
    ``decode_context``; block tables are disjoint ranges from block 0."""
    for ctx in contexts:
        for n in prefill_sizes:
            yield StepPlan((_chunk("p", n, ctx, 0, block_size, vocab),))
    for batch in decode_batches:
        per = cdiv(decode_context + 1, block_size)
        yield StepPlan(tuple(_chunk(f"d{i}", 1, decode_context, i * per, block_size, vocab)
                             for i in range(batch)))


def startup_plans(num_blocks: int, block_size: int, max_model_len: int, vocab: int) -> list[StepPlan]:
    """The start-up calibration's shapes, sized to fit the KV pool and the context: decode
    batches of 1, 4 and up to 16 rows at a short context and 1 and 4 at a long one, prefill
    chunks of 16-256 tokens from an empty prefix and 64-128 after a long one, steps mixing
    decode rows with a chunk of 16, 32 and :data:`~kvfleet.worker.runner.models.linear.FEW_ROWS`
    tokens (the scheduler's usual step: the chunks an ITL target schedules stay within the
    few-row kernel's reach, the last is just past it), and verify steps (one decode row
    carrying 4 speculative drafts, four rows carrying 1 each: the shapes the sizing rule picks
    on CPU, within the few-row kernel), so each of the base, decode, prefill, context, draft
    and GEMM-path terms varies on its own in more than one shape (the last: prefill chunks of
    64 tokens and under and the first two mixed steps within the kernel's reach, the 128- and
    256-token chunks and the last mixed step past it)."""
    slots = num_blocks * block_size
    long_ctx = max(1, min(1024, max_model_len - 257, slots // 2 - 256))
    short_ctx = min(16, long_ctx)
    batch = max(2, min(16, num_blocks // max(1, cdiv(short_ctx + 1, block_size))))
    plans: list[StepPlan] = []
    for b, ctx in ((1, short_ctx), (min(4, batch), short_ctx), (batch, short_ctx), (1, long_ctx),
                   (4, long_ctx)):
        plans += calibration_plans(block_size, [], [], [b], ctx, vocab)
    for n, ctx in ((16, 0), (64, 0), (256, 0), (64, long_ctx), (128, long_ctx)):
        plans += calibration_plans(block_size, [n], [ctx], [], 0, vocab)
    plans += [mixed_plan(min(4, batch), short_ctx, n, block_size, vocab) for n in (16, 32, FEW_ROWS)]
    plans += [_verify(1, short_ctx, 4, block_size, vocab),
              _verify(min(4, batch), short_ctx, 1, block_size, vocab)]
    return [p for p in plans  # a pool or context too small for a shape skips it
            if all(max(c.block_table) < num_blocks
                   and c.num_computed_tokens + len(c.token_ids) <= max_model_len for c in p.chunks)]


def with_group_tables(plan: StepPlan, num_groups: int) -> StepPlan:
    """``plan`` for a KV cache of ``num_groups`` layer groups: every group reads and writes
    the chunk's one table (the groups' pages then overlap, which only timing runs may do)."""
    return replace(plan, chunks=tuple(replace(c, group_tables=(c.block_table,) * (num_groups - 1))
                                      for c in plan.chunks))


def few_rows_of(device: str) -> int:
    """The few-row kernel's reach on ``device`` (a :func:`device_name`): :data:`FEW_ROWS` on
    CPU, 0 elsewhere (no such kernel: one path). Where the kernel does not load on a CPU every
    step takes the GEMM path and the fit leaves that term near 0."""
    return FEW_ROWS if device.startswith("cpu") else 0


def mixed_plan(rows: int, ctx: int, n: int, block_size: int, vocab: int = 1100) -> StepPlan:
    """``rows`` decode rows at ``ctx`` tokens of context beside an ``n``-token chunk from an
    empty prefix, on disjoint block ranges from block 0."""
    per = cdiv(ctx + 1, block_size)
    decodes = tuple(_chunk(f"d{i}", 1, ctx, i * per, block_size, vocab) for i in range(rows))
    return StepPlan(decodes + (_chunk("p", n, 0, rows * per, block_size, vocab),))


def _verify(rows: int, ctx: int, drafts: int, block_size: int, vocab: int) -> StepPlan:
    per = cdiv(ctx + 1 + drafts, block_size)
    return StepPlan(tuple(replace(_chunk(f"v{i}", 1 + drafts, ctx, i * per, block_size, vocab),
                                  num_draft_tokens=drafts) for i in range(rows)))


def measure(runner: _Runs, plans: Iterable[StepPlan], repeats: int = 3,
            budget_s: float = float("inf")) -> list[StepSample]:
    """Best wall time of ``runner.execute`` per plan over up to ``repeats`` interleaved passes
    (every plan once per pass; the minimum is the time least disturbed by a busy neighbour,
    and never a shape's first call, which packs weights and compiles kernels, while it has
    a second). The first two passes always complete; later ones stop once ``budget_s`` has
    passed (those plans keep the repeats they had).

    Raises:
        ValueError: ``repeats`` < 2.
    """
    if repeats < 2:
        raise ValueError(f"repeats must be >= 2 (the first call of a shape warms it up), got {repeats}")
    plans = list(plans)
    start = time.perf_counter()
    best = [float("inf")] * len(plans)
    for rep in range(repeats):
        order = range(len(plans)) if rep % 2 == 0 else reversed(range(len(plans)))
        for i in order:  # alternate directions: a slow stretch favours no end of the list
            if rep > 1 and time.perf_counter() - start > budget_s:
                break
            t0 = time.perf_counter()
            runner.execute(plans[i])
            best[i] = min(best[i], time.perf_counter() - t0)
    out = []
    for plan, seconds in zip(plans, best, strict=True):
        shape = plan_shape(plan)
        out.append(StepSample(shape.prefill_tokens, shape.decode_rows, shape.context_tokens, seconds,
                              shape.draft_tokens))
    return out


def load_or_calibrate(executor, key: CalibrationKey, cache_dir: Path | None,
                      budget_s: float = DEFAULT_BUDGET_S, reference: CostModel = MEASURED) -> CostModel:
    """The cached calibration for ``key`` under ``cache_dir``, else a fresh one (a few timed
    steps on ``executor``, about ``budget_s`` seconds at most beyond one warm-up and one
    timed pass over the shapes), written there. ``cache_dir`` None: calibrate, cache nothing.
    ``reference``: the constants whose ratios bound a degenerate fit (:func:`.fit.fit`).
    Replicas of one key starting together on a host calibrate once: the first holds a lock
    file beside the cache entry while it measures, the others wait for its result (up to
    :data:`LOCK_WAIT_S`) instead of timing forwards beside it, which would also skew both
    measurements. An unreadable or unwritable cache or lock only costs a recalibration
    (logged), never a failed start."""
    path = cache_dir / f"{key.digest()}.json" if cache_dir is not None else None
    cached = _read_cache(path, key)
    if cached is not None:
        return cached
    with host_lock(path.with_suffix(".lock") if path is not None else None, LOCK_WAIT_S):
        cached = _read_cache(path, key)  # another replica finished while this one waited
        if cached is not None:
            return cached
        return _calibrate(executor, key, path, budget_s, reference)


def _read_cache(path: Path | None, key: CalibrationKey) -> CostModel | None:
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key.fields():
            return CostModel.from_json(data["cost_model"], str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("step-cost cache %s unreadable (%s): recalibrating", path, exc)
    return None


def _calibrate(executor, key: CalibrationKey, path: Path | None, budget_s: float,
               reference: CostModel) -> CostModel:
    cfg = executor.config
    plans = startup_plans(executor.num_blocks, executor.block_size,
                          cfg.max_position_embeddings, cfg.vocab_size)
    groups = getattr(executor, "layer_groups", None)  # a cost-model executor has none
    if groups is not None and groups.num_groups > 1:
        plans = [with_group_tables(p, groups.num_groups) for p in plans]
    t0 = time.perf_counter()
    samples = measure(executor, plans, repeats=STARTUP_REPEATS, budget_s=budget_s)
    cost = fit(samples, f"start-up calibration {key.device} tp={key.tp} {key.dtype} "
                        f"{key.threads} thread(s), {time.strftime('%Y-%m-%d')}", reference,
               few_rows_of(key.device))
    log.info("step cost calibrated in %.1f s over %d shapes: %s", time.perf_counter() - t0,
             len(samples), cost)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key.fields(), "cost_model": cost.to_json(),
                                       "samples": [asdict(s) for s in samples]}, indent=2) + "\n")
            tmp.replace(path)
        except OSError as exc:
            log.warning("step-cost cache %s not written (%s)", path, exc)
    return cost
