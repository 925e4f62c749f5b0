"""Paged attention against a dense per-request reference, on random tensors (no model)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.worker.engine.step_plan import SeqChunk
from kvfleet.worker.runner import cpu_kernels
from kvfleet.worker.runner.attention import build_attention_metadata, causal_mask, paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 8, 4


def dense_reference(q, k, v, window):
    """q ``(n, HEADS, DIM)`` at positions ``ctx - n .. ctx - 1``; k, v ``(ctx, KV_HEADS, DIM)``."""
    n, ctx = q.shape[0], k.shape[0]
    qp = torch.arange(ctx - n, ctx)[:, None]
    kp = torch.arange(ctx)[None, :]
    allowed = (kp <= qp) & ((kp > qp - window) if window else True)
    rep = HEADS // KV_HEADS
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) / DIM**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(rep, 1)).reshape(n, -1)


def _attend(chunks, parts, key_cache, value_cache, window, use_kernel=None):
    """Run one step: ``parts`` = per chunk (q, k, v) of its new tokens."""
    meta = build_attention_metadata(tuple(chunks), BLOCK, (window,), use_kernel=use_kernel)
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    return meta, paged_attention(q, k, v, key_cache, value_cache, meta, window)


def test_decode_kernel_builds_here() -> None:
    """CI machines have a C compiler: the kernel path must really be the one that runs."""
    assert cpu_kernels.load() is not None
    meta = build_attention_metadata((SeqChunk("a", (0,), 3, (1,)),), BLOCK, (None,))
    assert meta.decode_kernel is not None
    # Loading it must not switch the process to flush-denormals-to-zero (a -ffast-math build would).
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0


@pytest.mark.parametrize("use_kernel", [True, False], ids=["c-kernel", "torch"])
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batch_matches_dense(window, use_kernel) -> None:
    g = torch.Generator().manual_seed(0)
    key_cache = torch.zeros(20, BLOCK, KV_HEADS, DIM)
    value_cache = torch.zeros_like(key_cache)
    # (cached tokens, new tokens, block table): decodes, a chunk after a cache, a fresh prefill.
    layout = [(9, 1, (7, 2, 9)), (0, 1, (4,)), (6, 7, (11, 0, 13, 5)), (0, 5, (3, 17)),
              (13, 1, (1, 8, 6, 16))]
    full = [(torch.randn(c + n, HEADS, DIM, generator=g), torch.randn(c + n, KV_HEADS, DIM, generator=g),
             torch.randn(c + n, KV_HEADS, DIM, generator=g)) for c, n, _ in layout]

    # Step 1 writes the cached prefixes; step 2 is the mixed batch under test.
    first = [(SeqChunk(str(i), (0,) * c, 0, bt), [t[:c] for t in full[i]])
             for i, (c, _, bt) in enumerate(layout) if c]
    _attend([c for c, _ in first], [p for _, p in first], key_cache, value_cache, window, use_kernel)
    chunks = [SeqChunk(str(i), (0,) * n, c, bt) for i, (c, n, bt) in enumerate(layout)]
    parts = [[t[c:] for t in full[i]] for i, (c, _, _) in enumerate(layout)]
    meta, out = _attend(chunks, parts, key_cache, value_cache, window, use_kernel)
    assert (meta.decode_kernel is not None) == use_kernel

    assert meta.decode_token_indices.tolist() == [0, 1, 14]
    for i, (c, _, _) in enumerate(layout):
        q, k, v = full[i]
        s, e = meta.query_start[i], meta.query_start[i + 1]
        torch.testing.assert_close(out[s:e], dense_reference(q[c:], k, v, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,freed", [(None, False), (5, False), (5, True)],
                         ids=["full", "window", "window-holes"])
def test_verify_chunk_rows_are_decodes(window, freed) -> None:
    """On the kernel path a verify chunk (a decode row and its drafts) runs each row as the
    decode at its position: the rows join the decode list, match the dense reference, and
    equal bit for bit the same tokens decoded one step at a time. With ``freed`` the blocks
    before the window are holes (-1) and each row reads from the first block it sees."""
    g = torch.Generator().manual_seed(3)
    cached, n, table = 9, 4, (7, 2, 9, 12)
    q, k, v = (torch.randn(cached + n, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    other = [torch.randn(6 + 2, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)]
    caches = [(torch.zeros(20, BLOCK, KV_HEADS, DIM), torch.zeros(20, BLOCK, KV_HEADS, DIM))
              for _ in range(2)]

    def step(chunks, parts, cache):
        meta = build_attention_metadata(tuple(chunks), BLOCK, (window,),
                                        freed_window=window if freed else None)
        qs, ks, vs = (torch.cat([p[i] for p in parts]) for i in range(3))
        return meta, paged_attention(qs, ks, vs, *cache, meta, window)

    for cache in caches:  # the cached prefixes: the verify row's and a continued chunk's
        step([SeqChunk("v", (0,) * cached, 0, table), SeqChunk("p", (0,) * 6, 0, (11, 0))],
             [[t[:cached] for t in (q, k, v)], [t[:6] for t in other]], cache)
    held = table
    if freed:  # what a released sliding group's table holds: -1 before the window
        held = tuple(-1 if b < (cached - window + 1) // BLOCK else x for b, x in enumerate(table))
    verify = SeqChunk("v", (0,) * n, cached, held, num_draft_tokens=n - 1)
    meta, out = step([SeqChunk("p", (0,) * 2, 6, (11, 0)), verify],
                     [[t[6:] for t in other], [t[cached:] for t in (q, k, v)]], caches[0])
    assert meta.decode_kernel is not None
    assert meta.decode_token_indices.tolist() == [2, 3, 4, 5] and meta.prefill == (0,)
    torch.testing.assert_close(out[2:], dense_reference(q[cached:], k, v, window), rtol=1e-5, atol=1e-5)
    for j in range(n):  # the same tokens, one decode a step
        _, one = step([SeqChunk("v", (0,), cached + j, held)],
                      [[t[cached + j: cached + j + 1] for t in (q, k, v)]], caches[1])
        assert torch.equal(one[0], out[2 + j])


def test_verify_chunk_stays_a_prefill_chunk_off_the_kernel() -> None:
    """Without the kernel (GPU, torch path) a verify chunk attends as a continued prefill chunk."""
    chunks = (SeqChunk("v", (0,) * 3, 5, (1, 2), num_draft_tokens=2),)
    meta = build_attention_metadata(chunks, BLOCK, (None,), use_kernel=False)
    assert meta.prefill == (0,) and meta.decode_token_indices.numel() == 0


def test_causal_mask_is_offset_by_the_cached_count() -> None:
    m = causal_mask(num_computed=3, q_len=2, window=None)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    w = causal_mask(num_computed=3, q_len=2, window=2)
    assert w.tolist() == [[False, False, True, True, False], [False, False, False, True, True]]


def test_slot_mapping_follows_the_block_table() -> None:
    chunks = (SeqChunk("a", (0,) * 3, 2, (7, 2, 9)), SeqChunk("b", (0,), 4, (5, 1)))
    meta = build_attention_metadata(chunks, 4, (None,))
    # a: positions 2, 3 in block 7, position 4 in block 2; b: position 4 in block 1.
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 1 * 4 + 0]
    assert meta.positions.tolist() == [2, 3, 4, 4]
    assert meta.last_token_indices.tolist() == [2, 3]


def test_decodes_read_exactly_their_own_blocks() -> None:
    """No padding to the longest context: each decode reads its own used blocks, in order."""
    chunks = (SeqChunk("a", (0,), 9, (7, 2, 9, 4)), SeqChunk("p", (0,) * 3, 0, (5,)),
              SeqChunk("b", (0,), 3, (1, 8)))
    meta = build_attention_metadata(chunks, 4, (None, 2), use_kernel=False)
    # a: 10 keys in blocks 7, 2, 9 (block 4 not yet used); b: 4 keys in block 1 only.
    assert [t.tolist() for t in meta.decode_tables] == [[7, 2, 9], [1]]
    assert meta.decode_context == (10, 4) and meta.decode_token_indices.tolist() == [0, 4]
    inf = float("-inf")
    assert meta.decode_bias[None] == (None, None)
    assert meta.decode_bias[2][0].tolist() == [[inf] * 8 + [0.0] * 2]
    assert meta.prefill == (1,) and meta.prefill_computed == (0,)


def test_decode_kernel_arguments() -> None:
    """The C kernel gets the same used blocks, contexts and window starts."""
    chunks = (SeqChunk("a", (0,), 9, (7, 2, 9, 4)), SeqChunk("p", (0,) * 3, 0, (5,)),
              SeqChunk("b", (0,), 3, (1, 8)))
    k = build_attention_metadata(chunks, 4, (None, 2), use_kernel=True).decode_kernel
    assert k.tables.tolist() == [7, 2, 9, 1] and k.table_start.tolist() == [0, 3, 4]
    assert k.context.tolist() == [10, 4]
    assert k.first_key[None].tolist() == [0, 0] and k.first_key[2].tolist() == [8, 2]


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 16), (9, 3, 64), (8, 8, 64), (8, 2, 64), (12, 2, 64)])
def test_decode_kernel_long_context_gqa_and_strided_rows(heads, kv_heads, dim) -> None:
    """Many blocks, 1-6 query heads per KV head (head_dim 64 with up to 4 takes the kernel's
    register path for the values), a query view with a row stride (as the model passes q
    sliced out of q|k), against the dense reference."""
    g = torch.Generator().manual_seed(1)
    bs = 16
    ctx = 300
    table = torch.randperm(40, generator=g)[: -(-ctx // bs)].tolist()
    key_cache = torch.randn(40, bs, kv_heads, dim, generator=g)
    value_cache = torch.randn(40, bs, kv_heads, dim, generator=g)
    qk = torch.randn(1, heads + kv_heads, dim, generator=g)
    q = qk[:, :heads]  # row stride (heads + kv_heads) * dim
    k_new, v_new = qk[:, heads:], torch.randn(1, kv_heads, dim, generator=g)
    meta = build_attention_metadata((SeqChunk("a", (0,), ctx - 1, tuple(table)),), bs, (None, 100),
                                    use_kernel=True)
    for window in (None, 100):
        out = paged_attention(q, k_new, v_new, key_cache, value_cache, meta, window).view(1, heads, dim)
        keys = key_cache[table].view(-1, kv_heads, dim)[:ctx]
        values = value_cache[table].view(-1, kv_heads, dim)[:ctx]
        lo = 0 if window is None else ctx - window
        rep = heads // kv_heads
        scores = torch.einsum("hd,khd->hk", q[0], keys.repeat_interleave(rep, 1)) / dim**0.5
        scores[:, :lo] = float("-inf")
        ref = torch.einsum("hk,khd->hd", scores.softmax(-1), values.repeat_interleave(rep, 1))
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 16)])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_kernel_rows_walked_together_equal_lone_decodes(heads, kv_heads, dim, sinks) -> None:
    """Consecutive decodes over the same blocks (a verify chunk's rows, rows sharing a cached
    prefix, windowed rows) walked together at 1-3 threads give each row bit for bit what it
    gives decoded alone; their contexts cross block and 16-key boundaries."""
    if cpu_kernels.load() is None:
        pytest.skip("no C kernels here")
    g = torch.Generator().manual_seed(5)
    bs, nb = 16, 64
    key_cache, value_cache = (torch.randn(nb, bs, kv_heads, dim, generator=g) for _ in range(2))
    perm = torch.randperm(nb, generator=g)
    a, b, c = perm[:30], perm[30:40], perm[40:]
    rows = [(a, 0, 395 + j) for j in range(8)] + [(b, 0, 150), (a, 0, 333)]
    rows += [(c, 100, 300 + j) for j in range(5)] + [(c, 0, 15 + j) for j in range(3)]
    q = torch.randn(len(rows), heads, dim, generator=g)
    tables = torch.cat([t for t, _, _ in rows]).long()
    table_start = torch.tensor([0] + [len(t) for t, _, _ in rows]).cumsum(0)
    first = torch.tensor([f for _, f, _ in rows])
    ctx = torch.tensor([n for _, _, n in rows])
    sink = torch.randn(heads, generator=g) if sinks else None
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            out = torch.full_like(q, float("nan"))
            cpu_kernels.decode_attention(q, key_cache, value_cache, out, torch.arange(len(rows)), tables,
                                         table_start, first, ctx, 0.125, sink)
            for d in range(len(rows)):
                one = torch.full_like(q[:1], float("nan"))
                cpu_kernels.decode_attention(q[d:d + 1], key_cache, value_cache, one, torch.zeros(1).long(),
                                             tables, table_start[d:d + 2], first[d:d + 1], ctx[d:d + 1],
                                             0.125, sink)
                assert torch.equal(one[0], out[d]), (n_threads, d)
    finally:
        torch.set_num_threads(threads)
