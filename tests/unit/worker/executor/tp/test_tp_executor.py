"""The TP executor over thread ranks (real RankWorkers, real gloo, no Ray): engine exactness
through the plan diff, adapters prepared off the step stream, bytes per decode step, and a
pickle payload on the plan broadcast that must not run."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
import torch

import kvfleet.worker.runner.model_runner as model_runner_module
import tests.unit.worker.engine.test_engine_exactness as exact
from kvfleet.worker.engine.step_plan import SeqChunk, StepPlan
from kvfleet.worker.executor.local import LocalExecutor
from kvfleet.worker.executor.tp import rank_worker
from kvfleet.worker.executor.tp.comm import RankComm
from kvfleet.worker.executor.tp.wire import decode_call
from kvfleet.worker.runner.lora.adapter import check_adapter
from kvfleet.worker.runner.model_runner import ModelRunner
from tests.unit.worker import engine_harness
from tests.unit.worker.executor.tp.rank_threads import on_ranks
from tests.unit.worker.executor.tp.thread_executor import thread_executor

BLOCK = 4


@pytest.fixture
def tp2_threads(model_dir, monkeypatch):
    """The engine harness's runner becomes a tp=2 thread-rank executor (of ``model_dir``)."""
    with thread_executor(model_dir, 2) as ex:
        monkeypatch.setattr(engine_harness, "runner_for", lambda model_dir, block_size=4: ex)
        yield ex


@pytest.fixture(params=["tokens", "itl-target"])
def budget(request) -> dict:
    """The step budgets of the exactness scenarios (their chunk boundaries differ)."""
    return exact.ITL_TARGET if request.param == "itl-target" else {}


LLAMA = pytest.mark.parametrize("model_dir", ["tiny_llama_dir"], indirect=True)
# Llama under both budgets; each family whose decoder differs under the token budget.
FAMILIES_TP2 = pytest.mark.parametrize("model_dir, budget", [
    ("tiny_llama_dir", "tokens"), ("tiny_llama_dir", "itl-target"),
    *((f, "tokens") for f in ("tiny_qwen3_dir", "tiny_gemma3_dir", "tiny_phi3_dir",
                              "tiny_qwen3_moe_dir", "tiny_gpt_oss_dir"))],
    indirect=True)


@FAMILIES_TP2
def test_preempted_then_resumed_through_the_plan_diff(tp2_threads, model_dir, budget) -> None:
    """Sequences leave (preempted) and come back with new tables: rank 1 rebuilds each table."""
    exact.test_preempted_then_resumed(model_dir, budget)


@FAMILIES_TP2
def test_copy_on_write_through_the_plan_diff(tp2_threads, model_dir, budget) -> None:
    exact.test_n2_siblings_after_copy_on_write(model_dir, budget)


@LLAMA
def test_mixed_batch_through_the_plan_diff(tp2_threads, model_dir, budget) -> None:
    exact.test_mixed_batch_of_eight_joining_and_leaving_equals_each_alone(model_dir, budget)


@LLAMA
def test_rows_sitting_out_a_step_through_the_plan_diff(tp2_threads, model_dir) -> None:
    """Rows left out of a plan (class_step) are forgotten by rank 1 and sent whole again."""
    exact.test_rows_sitting_out_for_a_higher_class_or_less_served_tenant(model_dir)


def _decode_plans(context: int, steps: int, slot: int = 0, block: int = BLOCK) -> list[StepPlan]:
    """A ``context``-token prefill, then ``steps`` one-token decodes of one sequence."""
    tokens = [(7 * i + 3) % 100 for i in range(context + steps)]
    table = tuple(range(-(-(context + steps) // block)))
    plans = [StepPlan((SeqChunk("s", tuple(tokens[:context]), 0, table[: -(-context // block)],
                                slot),))]
    for n in range(context, context + steps):
        plans.append(StepPlan((SeqChunk("s", (tokens[n],), n, table[: n // block + 1], slot),)))
    return plans


def test_a_slow_adapter_read_on_rank_1_delays_no_step(tiny_llama_dir, tiny_adapters,
                                                      monkeypatch) -> None:
    """Item 21(a): while rank 1 still reads an adapter, base-model steps run on both ranks;
    once the load returns, a step that uses the slot matches tp=1 with the adapter."""
    reading, gate = threading.Event(), threading.Event()
    real = rank_worker.read_adapter

    def slow_on_rank_1(spec, config, layout, *args):
        if layout is not None and layout.rank == 1:
            reading.set()
            assert gate.wait(60), "the test never released the read"
        return real(spec, config, layout, *args)

    # Both names: wherever a rank's read happens, rank 1's is held.
    monkeypatch.setattr(rank_worker, "read_adapter", slow_on_rank_1)
    monkeypatch.setattr(model_runner_module, "read_adapter", slow_on_rank_1)
    one = LocalExecutor(ModelRunner(tiny_llama_dir, 160, BLOCK, one_row_weights=False, max_loras=1))
    with thread_executor(tiny_llama_dir, 2, max_loras=1) as ex:
        spec = check_adapter("qv", tiny_adapters["qv"], ex.config, 16)
        loader = threading.Thread(target=ex.load_adapter, args=(1, spec))
        loader.start()
        assert reading.wait(60)
        base = [ex.execute(p) for p in _decode_plans(9, 3)]  # rank 1 is still reading
        assert not gate.is_set() and loader.is_alive()
        gate.set()
        loader.join(60)
        assert not loader.is_alive()
        one.load_adapter(1, spec)
        lora = [ex.execute(p) for p in _decode_plans(11, 2, slot=1)]
    for got, plan in zip(base, _decode_plans(9, 3)):
        torch.testing.assert_close(got, one.execute(plan), atol=1e-4, rtol=1e-4)
    for got, plan in zip(lora, _decode_plans(11, 2, slot=1)):
        torch.testing.assert_close(got, one.execute(plan), atol=1e-4, rtol=1e-4)


def _bytes_per_decode_step(ex, context: int, steps: int) -> list[int]:
    plans = _decode_plans(context, steps, block=ex.block_size)
    ex.execute(plans[0])
    sent = []
    for plan in plans[1:]:
        before = ex.group.comm.times.snapshot()
        ex.execute(plan)
        sent.append(ex.group.comm.times.minus(before).send_bytes)
    return sent


def test_decode_steps_send_constant_bytes_whatever_the_context(tiny_llama_long_dir) -> None:
    """Item 21(d): a decode step sends its token and the blocks it appends, never the whole
    table: bytes per step do not grow with the context (16 decodes from 32 and from 4,096
    tokens, 16-token blocks: each crosses one block boundary at the same step)."""
    with thread_executor(tiny_llama_long_dir, 2, num_blocks=300, block_size=16) as ex:
        short = _bytes_per_decode_step(ex, 32, 16)
        long = _bytes_per_decode_step(ex, 4096, 16)
    pickled = len(pickle.dumps(_decode_plans(4096, 1, block=16)[1], protocol=pickle.HIGHEST_PROTOCOL))
    print(f"\nbytes per decode step: context 32 {short}, context 4096 {long}; "
          f"a pickled plan at 4096: {pickled}")
    assert long == short  # the same steps at another context: the same bytes
    assert max(long) < pickled  # less than the 257-block table alone


class _Runs:
    """A pickle payload whose decoding would call :func:`_ran`."""

    def __reduce__(self):
        return (_ran, ())


RAN: list[bool] = []


def _ran() -> None:
    RAN.append(True)


def test_a_pickle_payload_on_the_broadcast_never_runs() -> None:
    """Item 21(c): a process on the group's store that broadcasts a pickle payload gets a
    refused message on the other ranks, never a call."""
    payload = pickle.dumps(_Runs())

    def body(comm: RankComm):
        if comm.rank == 0:  # raw bytes in the message framing: 8-byte length, then data
            buf = torch.zeros_like(comm._buf)
            buf[:8] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")), dtype=torch.uint8)
            buf[8: 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            comm.cpu.broadcast(buf, 0).wait()
            return None
        try:
            return decode_call(comm.recv())  # a plain ValueError before any decoding
        except ValueError as exc:
            return exc

    results, _ = on_ranks(2, body)
    assert RAN == []
    assert isinstance(results[1], ValueError)


def test_messages_decode_to_integers_only() -> None:
    """What a rank receives is an int64 array; a call's arguments are int64 arrays."""
    def body(comm: RankComm):
        if comm.rank == 0:
            from kvfleet.worker.executor.tp.wire import encode_call

            comm.send(encode_call("step", np.arange(3)))
            return None
        msg = comm.recv()
        return msg.dtype, decode_call(msg)

    results, _ = on_ranks(2, body)
    dtype, (method, args) = results[1]
    assert dtype == np.dtype("<i8") and method == "step" and args[0].tolist() == [0, 1, 2]
