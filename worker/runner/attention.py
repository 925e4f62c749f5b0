"""Paged attention over per-layer KV caches, for a flattened varlen batch of chunks.

Cache layout per layer: ``key_cache``/``value_cache`` of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``; token ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size`` of the flattened cache.

A chunk of ``q`` new tokens after ``c`` cached ones: its ``j``-th query sits at absolute
position ``c + j`` and sees keys ``0 .. c + j`` (a causal mask shifted right by ``c``, never the
top-left square), and with a sliding window ``w`` only keys ``> c + j - w``.

Three paths, chosen per chunk when the step's metadata is built:

* **decodes** (one-token chunks), fp32 on CPU: one call of the C kernel in
  :mod:`.cpu_kernels` per layer for all of them and for every row of each verify chunk (a
  decode row carrying drafts, ``SeqChunk.num_draft_tokens``), each row as the decode at its
  position would run (same keys, same output, bit for bit), reading keys and values in place
  through the block tables. Elsewhere (or without a C compiler) each decode gathers exactly its own
  blocks and runs one SDPA call — no padding to the longest context in the batch (on the
  SmolLM2 benchmark this beat one padded batched kernel, length-bucketed padded kernels, a
  flattened all-blocks formulation and hand-written bmm/softmax/bmm);
* **fresh prefill chunks** (nothing cached before them) attend to their own new K/V — no
  cache read, a plain causal mask (SDPA's flash kernel);
* **continued prefill chunks** (after a cached prefix or an earlier chunk) read their whole
  context from the cache under the rectangular, offset causal mask (SDPA with that mask).

GQA is never materialised: query heads ``h * g .. h * g + g - 1`` share KV head ``h``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfleet.allocator.units import cdiv
from kvfleet.worker.engine.step_plan import SeqChunk
from kvfleet.worker.runner import cpu_kernels
from kvfleet.worker.runner.decode_rows import DecodeRows


@dataclass(frozen=True)
class DecodeKernelArgs:
    """The C decode kernel's inputs for one step (int64 CPU tensors; ``D`` decodes)."""

    tables: torch.Tensor  # the decodes' used blocks, concatenated in table order
    table_start: torch.Tensor  # (D + 1,) offsets into ``tables``
    context: torch.Tensor  # (D,) keys each decode sees without a window (its position + 1)
    first_key: dict[int | None, torch.Tensor]  # window → (D,) first visible key


@dataclass(frozen=True)
class AttentionMetadata:
    """The batch layout of one step, built once and shared by every layer.

    ``T`` = new tokens in the step, ``B`` = chunks, ``D`` = decode rows (one-token chunks and, on
    the kernel path, every row of a verify chunk).
    """

    positions: torch.Tensor  # (T,) int64 absolute position of each new token
    slot_mapping: torch.Tensor  # (T,) int64 flat cache slot each new token's K/V is written to
    query_start: tuple[int, ...]  # (B + 1,) offsets of each chunk's tokens in the flat batch
    last_token_indices: torch.Tensor  # (B,) int64 index of each chunk's last token
    # Decodes: token index; then either the C kernel's arguments, or for the torch path the
    # blocks holding each decode's keys (table order), its key count, and per window an
    # additive (1, ctx) mask or None where every key is visible.
    decode_token_indices: torch.Tensor  # (D,)
    decode_kernel: DecodeKernelArgs | None
    decode_tables: tuple[torch.Tensor, ...]
    decode_context: tuple[int, ...]
    decode_bias: dict[int | None, tuple[torch.Tensor | None, ...]]
    # Prefill chunks (more than one token): chunk indices, cached counts, context tables, masks.
    prefill: tuple[int, ...]
    prefill_computed: tuple[int, ...]
    prefill_block_tables: tuple[torch.Tensor, ...]
    prefill_skip: tuple[int, ...]  # leading keys of each chunk's context not read (holes)
    # window → per chunk additive (q, c + q - skipped keys) 0/-inf: the causal mask, offset
    # and windowed (None for a fresh chunk, which needs only the plain causal square)
    prefill_bias: dict[int | None, tuple[torch.Tensor | None, ...]]

    def layer(self, i: int) -> "AttentionMetadata":
        """The metadata layer ``i`` reads: this one (one layer group)."""
        return self

    @functools.cached_property
    def decode_rows(self) -> DecodeRows | None:
        """The decode kernel's arguments as one struct when every row of the step is a
        decode through it (for fused decode layers), else None; built on first use, so once
        a step however many layers read it."""
        k = self.decode_kernel
        if k is None or self.prefill or self.decode_token_indices.shape[0] != self.slot_mapping.shape[0]:
            return None
        return DecodeRows(self.slot_mapping, self.decode_token_indices, k.tables, k.table_start,
                          k.context, k.first_key)


@dataclass(frozen=True)
class GroupedMetadata:
    """One :class:`AttentionMetadata` per layer group (their block tables differ), and which
    group each layer is in; ``positions`` and ``last_token_indices`` are every group's."""

    groups: tuple[AttentionMetadata, ...]
    group_of: tuple[int, ...]  # layer → group

    def layer(self, i: int) -> AttentionMetadata:
        return self.groups[self.group_of[i]]

    @property
    def positions(self) -> torch.Tensor:
        return self.groups[0].positions

    @property
    def last_token_indices(self) -> torch.Tensor:
        return self.groups[0].last_token_indices


def causal_mask(num_computed: int, q_len: int, window: int | None) -> torch.Tensor:
    """Bool ``(q_len, num_computed + q_len)``: True where query ``j`` may attend key ``k``.

    ``k <= num_computed + j`` (rectangular, offset by the cached count), and within the window.
    """
    q_pos = torch.arange(num_computed, num_computed + q_len)[:, None]
    k_pos = torch.arange(num_computed + q_len)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _additive(keep: torch.Tensor) -> torch.Tensor:
    """Bool keep-mask → float 0 where kept, -inf elsewhere."""
    return torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))


def _prefill_bias(chunk: SeqChunk, window: int | None, device, dtype,
                  skip: int = 0) -> torch.Tensor | None:
    """The chunk's additive mask, or None for a fresh chunk that a plain causal mask serves;
    ``skip``: leading keys left out of the context (released blocks, all masked anyway)."""
    n, computed = len(chunk.token_ids), chunk.num_computed_tokens
    if computed == 0 and (window is None or window >= n):
        return None
    return _additive(causal_mask(computed, n, window)[:, skip:]).to(device, dtype)


def _decode_bias(ctx: int, window: int | None, device, dtype) -> torch.Tensor | None:
    """Additive ``(1, ctx)`` keeping the last ``window`` keys, or None when all are visible."""
    if window is None or window >= ctx:
        return None
    return _additive(torch.arange(ctx) >= ctx - window)[None].to(device, dtype)


def build_attention_metadata(
    chunks: tuple[SeqChunk, ...],
    block_size: int,
    windows: tuple[int | None, ...],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    use_kernel: bool | None = None,
    group: int = 0,
    freed_window: int | None = None,
) -> AttentionMetadata:
    """Turn a step's chunks into the tensors every layer needs (``windows``: distinct per
    layer; ``dtype``: the model's, for the additive masks; ``use_kernel``: decode through the
    C kernel — by default wherever it applies (fp32 on CPU, library loaded), never elsewhere;
    see :mod:`.cpu_kernels`).

    ``group``: the layer group whose tables to read (``SeqChunk.tables()``); ``freed_window``:
    that group's window when its blocks before the window may be released (holes), so each
    chunk reads its context from the first block its first query sees, never a hole."""
    applies = (torch.device(device).type == "cpu" and dtype == torch.float32
               and cpu_kernels.load() is not None)
    use_kernel = applies if use_kernel is None else use_kernel and applies  # never on GPU memory
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    decode: list[tuple[int, int]] = []  # (chunk, row): a query row through the decode path
    prefill: list[int] = []
    tables = [c.block_table if group == 0 else c.group_tables[group - 1] for c in chunks]
    for i, c in enumerate(chunks):
        n, start = len(c.token_ids), c.num_computed_tokens
        table = tables[i]
        positions += range(start, start + n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        starts.append(starts[-1] + n)
        if n == 1:
            decode.append((i, 0))
        elif use_kernel and c.num_draft_tokens:
            # A verify chunk's row j attends keys 0 .. start + j, as a decode at that position
            # would (the chunk's K/V is written before attention): through the kernel each row
            # costs a decode's read of its keys, and gets exactly a decode's output.
            decode += ((i, j) for j in range(n))
        else:
            prefill.append(i)

    def first_block(num_computed: int) -> int:  # the first block a query at num_computed sees
        if freed_window is None:
            return 0
        return max(0, num_computed - freed_window + 1) // block_size

    # Decodes: keys from the first block the window reaches; context counted from there.
    query_at = [chunks[i].num_computed_tokens + j for i, j in decode]
    skip = [first_block(p) for p in query_at]
    ctx = [p + 1 - f * block_size for p, f in zip(query_at, skip, strict=True)]
    used = [tables[i][f: f + cdiv(n, block_size)]
            for (i, _), f, n in zip(decode, skip, ctx, strict=True)]

    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    kernel = None
    if use_kernel and decode:
        kernel = DecodeKernelArgs(
            tables=tensor([b for table in used for b in table]),
            table_start=tensor([0, *itertools.accumulate(len(t) for t in used)]),
            context=tensor(ctx),
            first_key={w: tensor([0 if w is None else max(0, n - w) for n in ctx]) for w in windows},
        )

    pre_tables, pre_skip = [], []
    for i in prefill:
        c = chunks[i]
        context = c.num_computed_tokens + len(c.token_ids)
        f = first_block(c.num_computed_tokens) if c.num_computed_tokens else 0
        pre_skip.append(f * block_size)
        pre_tables.append(tensor(tables[i][f: cdiv(context, block_size)]))
    return AttentionMetadata(
        positions=tensor(positions),
        slot_mapping=tensor(slots),
        query_start=tuple(starts),
        last_token_indices=tensor([s - 1 for s in starts[1:]]),
        decode_token_indices=tensor([starts[i] + j for i, j in decode]),
        decode_kernel=kernel,
        decode_tables=() if use_kernel else tuple(tensor(t) for t in used),
        decode_context=tuple(ctx),
        decode_bias={w: () if use_kernel else tuple(_decode_bias(n, w, device, dtype) for n in ctx)
                     for w in windows},
        prefill=tuple(prefill),
        prefill_computed=tuple(chunks[i].num_computed_tokens for i in prefill),
        prefill_block_tables=tuple(pre_tables),
        prefill_bias={w: tuple(_prefill_bias(chunks[i], w, device, dtype, k)
                               for i, k in zip(prefill, pre_skip, strict=True))
                      for w in windows},
        prefill_skip=tuple(pre_skip),
    )


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new ``key``/``value`` ``(T, num_kv_heads, head_dim)`` at their flat slots."""
    kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache[blocks]`` as ``(len(blocks), block_size * kv_heads * head_dim)``: gathering whole
    rows of a 2-D view copies each block in one piece (several times faster than 4-D)."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


def _sdpa(q, k, v, mask, causal, scale, sinks):
    """SDPA of ``q`` ``(heads, n, d)`` over ``k``/``v`` ``(kv_heads, ctx, d)``; with ``sinks``
    ``(heads,)`` each head's sink joins the softmax as one more key whose logit is the sink
    and whose value is zero (a zero key under an additive mask holding the sink), so it
    only adds to the denominator. Returns ``(heads, n, d)``."""
    if sinks is not None:
        heads, n, ctx = q.shape[0], q.shape[1], k.shape[1]
        if mask is None:
            mask = torch.zeros(n, ctx, dtype=q.dtype, device=q.device)
            if causal:
                mask.masked_fill_(~causal_mask(ctx - n, n, None).to(q.device), float("-inf"))
        mask = torch.cat([mask.to(q.dtype).expand(heads, n, ctx),
                          sinks.to(q.dtype).view(heads, 1, 1).expand(heads, n, 1)], dim=-1)
        k = torch.cat([k, k.new_zeros(k.shape[0], 1, k.shape[2])], dim=1)
        v = torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[2])], dim=1)
        causal = False
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                          is_causal=causal, scale=scale, enable_gqa=True)[0]


def _prefill_attention(query, key, value, key_cache, value_cache, meta, window, out, scale,
                       sinks=None):
    """Each prefill chunk on its own through SDPA (GQA without repeated K/V): a fresh chunk
    over its own new K/V with a plain causal mask, a continued one over its cached context
    with the offset (and windowed) additive mask from the metadata."""
    kv_heads, head_dim = key_cache.shape[2:]
    for i, computed, table, bias, skip in zip(meta.prefill, meta.prefill_computed,
                                              meta.prefill_block_tables, meta.prefill_bias[window],
                                              meta.prefill_skip, strict=True):
        start, end = meta.query_start[i], meta.query_start[i + 1]
        n = end - start
        causal = bias is None
        if computed == 0:
            k, v = key[start:end], value[start:end]
        else:
            ctx = computed + n - skip
            k = _gather(key_cache, table).view(-1, kv_heads, head_dim)[:ctx]
            v = _gather(value_cache, table).view(-1, kv_heads, head_dim)[:ctx]
        o = _sdpa(query[start:end].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                  None if causal else bias, causal, scale, sinks)  # (heads, n, d)
        out[start:end] = o.transpose(0, 1)


def _decode_attention(query, key_cache, value_cache, meta, window, out, scale, sinks=None):
    """Each decode against exactly its own keys (no padding to the longest context), one SDPA
    call per decode (GQA without repeated K/V)."""
    kv_heads, head_dim = key_cache.shape[2:]
    num_heads = query.shape[1]
    for idx, table, ctx, bias in zip(meta.decode_token_indices.tolist(), meta.decode_tables,
                                     meta.decode_context, meta.decode_bias[window], strict=True):
        k = _gather(key_cache, table).view(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)
        v = _gather(value_cache, table).view(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)
        out[idx] = _sdpa(query[idx].view(num_heads, 1, head_dim), k, v, bias, False, scale,
                         sinks).view(num_heads, head_dim)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    kv_written: bool = False,
) -> torch.Tensor:
    """Write this step's K/V into the cache (unless ``kv_written``: the caller stored them at
    ``meta.slot_mapping`` already), then attend every query to its own request's keys.

    Args:
        query: ``(T, num_heads, head_dim)``, RoPE applied.
        key, value: ``(T, num_kv_heads, head_dim)``, RoPE applied to ``key``.
        key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``, updated in place.
        window: this layer's sliding window in tokens, or ``None``.
        scale: this layer's softmax scale (``None``: ``head_dim ** -0.5``).
        sinks: ``(num_heads,)`` per-head sink logits joining every softmax's denominator
            (gpt-oss), or ``None``.

    Returns:
        ``(T, num_heads * head_dim)`` attention output.
    """
    if not kv_written:
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = query.new_empty(num_tokens, num_heads, head_dim)
    if meta.decode_kernel is not None:
        k = meta.decode_kernel
        cpu_kernels.decode_attention(query, key_cache, value_cache, out, meta.decode_token_indices,
                                       k.tables, k.table_start, k.first_key[window], k.context, scale,
                                       sinks)
    elif meta.decode_token_indices.numel():
        _decode_attention(query, key_cache, value_cache, meta, window, out, scale, sinks)
    if meta.prefill:
        _prefill_attention(query, key, value, key_cache, value_cache, meta, window, out, scale,
                           sinks)
    return out.view(num_tokens, num_heads * head_dim)
