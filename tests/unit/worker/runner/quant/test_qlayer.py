"""The one-call quantized decode layer (``quant/qlayer.c``), and all layers of a step in one
call (``quant/qstack.py``), against the model's Python layer: the same kernels in the same
order, so hidden states and written caches must be equal bit for bit, on decode-only steps
of one and several rows, short and past-the-window contexts, with QKV bias (Qwen2) and a
sliding window (Mistral). The engine-level exactness tests (``test_quant_exactness.py``)
then check its cache paths against full recomputation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfleet.worker.engine.step_plan import SeqChunk
from kvfleet.worker.runner import cpu_kernels
from kvfleet.worker.runner.kv_cache import KVCache
from kvfleet.worker.runner.model_runner import ModelRunner
from kvfleet.worker.runner.quant import kernels
from kvfleet.worker.runner.quant.config import QuantConfig
from kvfleet.worker.runner.quant.packed import quantize
from kvfleet.worker.runner.quant.qlayer import QuantDecodeLayer
from kvfleet.worker.runner.quant.qstack import QuantDecodeStack

BLOCK = 4


def _step(runner: ModelRunner, contexts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step after ``contexts`` cached tokens per row over a cache of random
    values: (hidden states, the cache after)."""
    g = torch.Generator().manual_seed(seed)
    runner.kv_cache.data.copy_(torch.randn(runner.kv_cache.data.shape, generator=g))
    groups = runner.layer_groups.num_groups
    chunks, next_block = [], 0
    for i, n in enumerate(contexts):
        used = n // BLOCK + 1
        table = tuple(range(next_block, next_block + used))
        next_block += used
        chunks.append(SeqChunk(f"s{i}", (int(torch.randint(100, (1,), generator=g)),), n, table,
                               group_tables=(table,) * (groups - 1)))
    meta = runner._metadata(tuple(chunks))
    ids = torch.tensor([c.token_ids[0] for c in chunks])
    with torch.inference_mode():
        hidden = runner.model.forward(ids, meta.positions, meta, runner.kv_cache)
    return hidden, runner.kv_cache.data.clone()


def _count(monkeypatch, cls: type) -> list[int]:
    """Each call of ``cls`` instances appends to the list returned."""
    calls: list[int] = []
    original = cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    return calls


@pytest.mark.parametrize("family, method", [("tiny_llama_dir", "int4"), ("tiny_llama_dir", "int8"),
                                            ("tiny_qwen2_dir", "int4"), ("tiny_mistral_dir", "int8")])
@pytest.mark.parametrize("contexts", [[5], [0, 3, 17, 30], [90]])
def test_one_call_layer_equals_the_python_layer(request, monkeypatch, family, method,
                                                contexts) -> None:
    """All layers in one call, then one call per layer, then the Python layer: all equal."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    runner = ModelRunner(request.getfixturevalue(family), num_blocks=32, block_size=BLOCK,
                         quantization=QuantConfig(method))
    calls, stacks = _count(monkeypatch, QuantDecodeLayer), _count(monkeypatch, QuantDecodeStack)
    hidden, cache = _step(runner, contexts, seed=len(contexts))
    assert (len(stacks), len(calls)) == (1, 0)  # every layer in the one call
    monkeypatch.setattr(runner.model, "_stack", lambda *a: None)  # one call per layer
    layer_hidden, layer_cache = _step(runner, contexts, seed=len(contexts))
    assert (len(stacks), len(calls)) == (1, runner.config.num_layers)
    for layer in runner.model.layers:  # back to the Python layer
        monkeypatch.setattr(layer, "_decode_shape", False)
        monkeypatch.setattr(layer, "_decode_call", None)
    want_hidden, want_cache = _step(runner, contexts, seed=len(contexts))
    assert (len(stacks), len(calls)) == (1, runner.config.num_layers)
    assert torch.equal(hidden, layer_hidden) and torch.equal(cache, layer_cache)
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("contexts", [[0, 3, 17, 30], [i % 11 for i in range(70)]])
def test_one_region_equals_the_python_layer_at_each_thread_count(tiny_llama_dir, monkeypatch, method,
                                                                 threads, contexts) -> None:
    """The one-call layers share one parallel region: at 1, 2 and 3 threads (a team that does
    not divide the work evenly), with few rows (small ops repeated by every thread) and more
    rows than that (small ops split, a barrier after each), the hidden states and caches are
    the Python layer's bit for bit."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    runner = ModelRunner(tiny_llama_dir, num_blocks=256, block_size=BLOCK,
                         quantization=QuantConfig(method))
    stacks = _count(monkeypatch, QuantDecodeStack)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        hidden, cache = _step(runner, contexts, seed=threads)
        assert len(stacks) == 1
        for layer in runner.model.layers:
            monkeypatch.setattr(layer, "_decode_shape", False)
            monkeypatch.setattr(layer, "_decode_call", None)
        monkeypatch.setattr(runner.model, "_stack", lambda *a: None)
        want_hidden, want_cache = _step(runner, contexts, seed=threads)
        assert len(stacks) == 1
    finally:
        torch.set_num_threads(before)
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a_replaced_projection_falls_back_per_layer(tiny_llama_dir, monkeypatch, method) -> None:
    """A wrapped projection (as LoRA puts over one) takes its layer off the C path: the step
    then runs layer by layer, the others still one call each, to the all-layers result; with
    the projection restored the step is one call again. A new cache rebuilds the call."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    runner = ModelRunner(tiny_llama_dir, num_blocks=32, block_size=BLOCK,
                         quantization=QuantConfig(method))
    calls, stacks = _count(monkeypatch, QuantDecodeLayer), _count(monkeypatch, QuantDecodeStack)
    contexts = [3, 20]
    want = _step(runner, contexts, seed=1)
    assert (len(stacks), len(calls)) == (1, 0)
    layer = runner.model.layers[1]
    inner = layer.o
    wrapped: list[int] = []
    layer.o = lambda x: wrapped.append(1) or inner(x)
    got = _step(runner, contexts, seed=1)
    assert (len(stacks), len(calls), len(wrapped)) == (1, runner.config.num_layers - 1, 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    layer.o = inner
    got = _step(runner, contexts, seed=1)
    assert (len(stacks), len(wrapped)) == (2, 1)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    stack = runner.model._decode_stack
    runner.kv_cache = KVCache(runner.local_config, 32, BLOCK, torch.float32, runner.device,
                              runner.layer_groups)
    got = _step(runner, contexts, seed=1)
    assert runner.model._decode_stack is not stack and len(stacks) == 3
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("context", [5, 90])
def test_one_row_equal_at_one_and_two_threads(tiny_llama_dir, method, context) -> None:
    """One decode row: past enough keys its attention splits the KV heads across the
    threads, short of them it stays on one; either way the results are the one-thread
    run's bit for bit."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    runner = ModelRunner(tiny_llama_dir, num_blocks=32, block_size=BLOCK,
                         quantization=QuantConfig(method))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want_hidden, want_cache = _step(runner, [context], seed=context)
        torch.set_num_threads(2)
        hidden, cache = _step(runner, [context], seed=context)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(cache, want_cache)


def test_float_weights_and_prefill_keep_the_python_layer(tiny_llama_dir, monkeypatch) -> None:
    """fp32 projections never bind; a step with a prefill chunk has no decode rows."""
    runner = ModelRunner(tiny_llama_dir, num_blocks=32, block_size=BLOCK)
    layer = runner.model.layers[0]
    assert layer._decode_layer() is None
    quant = ModelRunner(tiny_llama_dir, num_blocks=32, block_size=BLOCK,
                        quantization=QuantConfig("int4"))
    meta = quant._metadata((SeqChunk("a", (1, 2, 3), 0, (0,)), SeqChunk("b", (4,), 5, (1, 2))))
    assert meta.decode_rows is None
    assert quant.model.layers[0]._decode_layer() is not None


def test_a_replaced_projection_rebinds(tiny_llama_dir) -> None:
    """A wrapper put over a projection after the first call (as LoRA does) is not bypassed."""
    runner = ModelRunner(tiny_llama_dir, num_blocks=32, block_size=BLOCK,
                         quantization=QuantConfig("int4"))
    layer = runner.model.layers[0]
    assert layer._decode_layer() is not None
    inner = layer.o
    layer.o = lambda x: inner(x)
    assert layer._decode_layer() is None
    layer.o = inner
    assert layer._decode_layer() is not None


@pytest.mark.parametrize("bits, group, half", [(8, 32, True), (4, 32, True), (4, 16, False),
                                               (8, 64, False)])
def test_embedding_rows_in_c_equal_the_torch_rows(bits, group, half) -> None:
    """Every row, fp16 and fp32 scales, a repeated index; an index out of range raises like
    ``F.embedding``."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(bits + group)
    w = quantize(torch.randn(70, 128, generator=g), bits, group)
    if not half:
        w = dataclasses.replace(w, scale=w.scale.float() * 1.0001,
                                offset=None if w.offset is None else w.offset.float() * 1.0001)
    index = torch.tensor([*range(70), 3, 3, 69])
    assert torch.equal(kernels.rows(w, index), w.rows(index))
    with pytest.raises(IndexError):
        kernels.rows(w, torch.tensor([70]))
    with pytest.raises(IndexError):
        kernels.rows(w, torch.tensor([-1]))


def test_a_paused_forward_resumes_to_the_same_state(tiny_llama_dir) -> None:
    """A layer-level pause settles the stream and the next layer starts without a delta: the
    one-call layer must then leave its input alone and end where the unpaused run ends."""
    runner = ModelRunner(tiny_llama_dir, num_blocks=32, block_size=BLOCK,
                         quantization=QuantConfig("int4"))
    chunks = tuple(SeqChunk(f"s{i}", (7 + i,), n, tuple(range(3 * i, 3 * i + 3)))
                   for i, n in enumerate((4, 9)))
    meta = runner._metadata(chunks)
    model = runner.model

    def run(pause: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer (``pause``: one layer per call, as a forward paused after each)."""
        runner.kv_cache.data.copy_(torch.randn(runner.kv_cache.data.shape,
                                               generator=torch.Generator().manual_seed(0)))
        with torch.inference_mode():
            hidden, cos, sin = model.embed(torch.tensor([7, 8]), meta.positions)
            layer = 0
            while layer < runner.config.num_layers:
                given, before = hidden, hidden.clone()
                hidden, layer = model.run_layers(given, cos, sin, meta, runner.kv_cache, layer,
                                                 lambda: pause)
                assert torch.equal(given, before)  # the resumed layer left its input alone
        return hidden, runner.kv_cache.data.clone()

    want = run(False)
    got = run(True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
