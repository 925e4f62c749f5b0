"""Drive the real Scheduler + Engine over a real ModelRunner and capture the logits it computed.

:class:`RecordingExecutor` wraps the executor the engine calls: for every chunk of every plan it
keeps ``(position, logits row)`` — the logits of the chunk's last token, i.e. what the engine
sampled from (or, mid-prefill, what it computed and discarded). Positions recomputed after a
preemption are recorded again, so every computation is checked, not just the last.
``reference_error`` compares them with transformers' full-prefix forward over the sequence's
final tokens (``paged_driver.scaled_error``: <= 1 passes).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import tokenizers
import torch

from kvfleet.allocator.kv_cache_manager import KVCacheManager
from kvfleet.sampling_params import SamplingParams
from kvfleet.worker.engine.engine import Engine, EngineRequest
from kvfleet.worker.engine.output.outputs import SeqOutput
from kvfleet.worker.engine.request import FinishReason
from kvfleet.worker.engine.scheduling.scheduler import SchedulerConfig
from kvfleet.worker.engine.step_plan import StepPlan
from kvfleet.worker.executor.base import Executor
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.step_cost.model import CostModel, StepCost
from tests.unit.worker.paged_driver import random_prompt, reference_logits, runner_for, scaled_error

BLOCK_SIZE = 4
_ids = itertools.count()
# An ITL target that changes chunk boundaries, with a fixed (never corrected) cost model: 10 s
# a token against a 65 s target leaves 6 tokens a step, decode rows included, and the floor
# paces a prompt within 1.5 × its modelled time without the target (minutes), counted in
# real time from its turn: the test's steps never make it late, so chunking does not depend on
# the clock.
ITL_TARGET = {"itl_target_ms": 65_000.0,
              "step_cost": StepCost(CostModel(0.0, 10.0, 10.0, "test: 10 s a token"), alpha=0.0)}
# The same with a GEMM-path cost past 3 query rows (20 s): steps of 4 rows and more predict a
# jump, which moves the chunk boundaries again (the outputs must not move).
ITL_TARGET_GEMM = {"itl_target_ms": 65_000.0,
                   "step_cost": StepCost(CostModel(0.0, 10.0, 10.0, "test: 10 s a token, 20 s past 3 rows",
                                                   gemm_step_s=20.0, few_rows=3), alpha=0.0)}


def as_executor(runner: ModelRunner | Executor) -> Executor:
    """``runner`` as an executor (a plain runner runs in process)."""
    return LocalExecutor(runner) if isinstance(runner, ModelRunner) else runner


class RecordingExecutor:
    """The engine's executor, recording each chunk's last-token logits by sequence id (every
    other call goes to the wrapped executor)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.logits: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self.inputs: dict[str, list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
        self.plans: list[StepPlan] = []

    def __getattr__(self, name: str):
        return getattr(self.executor, name)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        return self._record(plan, self.executor.execute(plan))

    def execute_pausable(self, plan: StepPlan, should_yield):
        """A paused forward is recorded when it completes (:meth:`resume`)."""
        return self._record(plan, self.executor.execute_pausable(plan, should_yield))

    def resume(self, paused, should_yield=None):
        return self._record(paused.plan, self.executor.resume(paused, should_yield))

    def _record(self, plan: StepPlan, out):
        if not isinstance(out, torch.Tensor):
            return out  # paused
        self.plans.append(plan)
        assert len(out) == plan.num_logit_rows
        offsets = plan.logit_offsets()
        for k, chunk in enumerate(plan.chunks):
            n = len(chunk.token_ids)
            for j, row in zip(range(n - chunk.num_logit_rows, n), out[offsets[k]: offsets[k + 1]],
                              strict=True):
                self.logits[chunk.seq_id].append((chunk.num_computed_tokens + j, row.clone()))
                self.inputs[chunk.seq_id].append(
                    (chunk.num_computed_tokens, chunk.token_ids[: j + 1]))
        return out

    def verified(self, seq_id: str, tokens: list[int]) -> list[tuple[int, torch.Tensor]]:
        """The rows of ``seq_id`` computed on its own final ``tokens`` (a rejected draft's
        row, computed on a token the sequence did not keep, was discarded: left out)."""
        return [pr for pr, (start, inp) in zip(self.logits[seq_id], self.inputs[seq_id],
                                                strict=True)
                if tuple(tokens[start: start + len(inp)]) == inp]


@dataclass
class Result:
    """Everything one sample streamed."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    last: SeqOutput | None = None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.last.finish_reason if self.last else None


def make_engine(model_dir: Path, num_blocks: int = 150, runner: ModelRunner | Executor | None = None,
                adapters=None, identity=None, step_cost: StepCost | None = None,
                tier=None, windows=None,
                **scheduler) -> tuple[Engine, RecordingExecutor]:
    """A fresh engine (new KV cache manager) over the session's shared runner for ``model_dir``
    (``adapters``, ``identity``, ``step_cost``, ``tier``: see :class:`Engine`; ``windows``: the
    manager's layer-group windows, by default the runner's; ``scheduler``: the
    :class:`SchedulerConfig` fields, e.g. ``**ITL_TARGET``'s).

    Sharing the runner's KV tensor across tests is safe: a new manager has no cached blocks,
    so every slot a test reads was written by that test.
    """
    runner = as_executor(runner or runner_for(Path(model_dir), block_size=BLOCK_SIZE))
    assert num_blocks <= runner.num_blocks
    rec = RecordingExecutor(runner)
    # The manager's layer groups are the runner's (one full group unless it was built with some).
    groups = getattr(runner, "layer_groups", None)
    kv = KVCacheManager(num_blocks, runner.block_size,
                        windows=windows or (groups.windows if groups else (None,)))
    tok = tokenizers.Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    cfg = runner.config
    digest = identity.digest() if identity is not None else b"engine-test-identity"
    engine = Engine(rec, kv, tok, digest, cfg.eos_token_ids, cfg.max_position_embeddings,
                    cfg.vocab_size, SchedulerConfig(**scheduler), adapters=adapters,
                    identity=identity, step_cost=step_cost, tier=tier)
    return engine, rec


def request(prompt: list[int], max_tokens: int = 8, rid: str | None = None,
            deadline: float | None = None, **params) -> EngineRequest:
    params.setdefault("ignore_eos", True)
    return EngineRequest(rid or f"req{next(_ids)}", tuple(prompt),
                         SamplingParams(max_tokens=max_tokens, **params).validate(), deadline=deadline)


def prompt(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed)


def collect(results: dict[tuple[str, int], Result], outputs: Iterable[SeqOutput]) -> None:
    for o in outputs:
        r = results.setdefault((o.request_id, o.index), Result())
        r.token_ids += o.token_ids
        r.text += o.text
        r.logprobs += o.logprobs
        if o.finished:
            assert r.last is None, f"{o.request_id}#{o.index} finished twice"
            r.last = o


def run(engine: Engine, arrivals: dict[int, list[EngineRequest]] | list[EngineRequest],
        budgets: Callable[[int], int] | None = None, max_steps: int = 2000,
        on_step: Callable[[int, Engine], None] | None = None) -> dict[tuple[str, int], Result]:
    """Step until idle. ``arrivals[k]`` join before step ``k``; ``budgets(k)`` (if given) sets
    ``max_num_batched_tokens`` for step ``k``; ``on_step(k, engine)`` runs before step ``k``."""
    if isinstance(arrivals, list):
        arrivals = {0: arrivals}
    results: dict[tuple[str, int], Result] = {}
    last_arrival = max(arrivals, default=0)
    for k in range(max_steps):
        for req in arrivals.get(k, ()):
            engine.add_request(req)
        if on_step is not None:
            on_step(k, engine)
        if budgets is not None:
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config,
                                                          max_num_batched_tokens=budgets(k))
        collect(results, engine.step())
        engine.kv.check_invariants()
        if k >= last_arrival and not engine.has_work:
            break
    else:
        raise AssertionError(f"engine still busy after {max_steps} steps")
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks, "blocks leaked"
    return results


def run_alone(model_dir: Path, req: EngineRequest) -> Result:
    """``req`` run to the end on a fresh engine of its own (default settings): what a batch
    must reproduce."""
    engine, _ = make_engine(model_dir)
    return run(engine, [req])[(req.request_id, 0)]


def run_preempting(engine: Engine, reqs: list[EngineRequest]
                   ) -> tuple[dict[tuple[str, int], Result], list[str]]:
    """:func:`run` ``reqs``, also listing the seq ids seen waiting after a preemption (before
    each step, repeats kept); asserts the workload forced at least one."""
    preempted: list[str] = []

    def watch(k: int, eng: Engine) -> None:
        preempted.extend(s.seq_id for s in eng.scheduler.waiting if s.num_preemptions)

    results = run(engine, reqs, on_step=watch)
    assert preempted, "the workload must force a preemption"
    return results, preempted


def seq_tokens(req: EngineRequest, res: Result) -> list[int]:
    return list(req.prompt_token_ids) + res.token_ids


def reference_error(model_dir: Path, rec: RecordingExecutor, seq_id: str, tokens: list[int]) -> float:
    """Every logits row the engine computed for ``seq_id`` against transformers on ``tokens``."""
    rows = rec.verified(seq_id, tokens)
    assert rows, f"no logits recorded for {seq_id}"
    ref = reference_logits(model_dir, tokens[: max(p for p, _ in rows) + 1])
    return max(scaled_error({p: row}, ref) for p, row in rows)


def positions(rec: RecordingExecutor, seq_id: str) -> list[int]:
    return [p for p, _ in rec.logits[seq_id]]


def by_position(rec: RecordingExecutor, seq_id: str) -> dict[int, torch.Tensor]:
    return dict(rec.logits[seq_id])
