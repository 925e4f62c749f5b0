"""Paged attention over per-layer KV caches, for a flattened varlen batch of chunks.

Cache layout per layer: ``key_cache``/``value_cache`` of shape
``(num_blocks, block_size, num_kv_heads, head_dim)``; token ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size`` of the flattened cache.

A chunk of ``q`` new tokens after ``c`` cached ones: its ``j``-th query sits at absolute
position ``c + j`` and sees keys ``0 .. c + j`` (a causal mask shifted right by ``c``, never the
top-left square), and with a sliding window ``w`` only keys ``> c + j - w``.

One-token chunks (decodes) run as one padded batch; longer chunks (prefill) one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfleet.worker.step_plan import SeqChunk


@dataclass(frozen=True)
class AttentionMetadata:
    """The batch layout of one step, built once and shared by every layer.

    ``T`` = new tokens in the step, ``B`` = chunks, ``D`` = one-token chunks, ``L`` = padded
    key length of the decode batch (a multiple of ``block_size``).
    """

    positions: torch.Tensor  # (T,) int64 absolute position of each new token
    slot_mapping: torch.Tensor  # (T,) int64 flat cache slot each new token's K/V is written to
    query_start: tuple[int, ...]  # (B + 1,) offsets of each chunk's tokens in the flat batch
    last_token_indices: torch.Tensor  # (B,) int64 index of each chunk's last token
    # Decodes: token indices (D,), block tables (D, L / block_size), masks per window (D, 1, 1, L).
    decode_token_indices: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_masks: dict[int | None, torch.Tensor]
    # Prefill chunks: chunk indices, block tables covering each context, masks per window (q, c + q).
    prefill: tuple[int, ...]
    prefill_block_tables: tuple[torch.Tensor, ...]
    prefill_masks: dict[int | None, tuple[torch.Tensor, ...]]


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


def _decode_mask(context_lens: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """Bool ``(D, 1, 1, length)``: the keys ``0 .. ctx - 1`` of each decode (padding masked)."""
    k_pos = torch.arange(length)[None, :]
    ctx = context_lens[:, None]
    mask = k_pos < ctx
    if window is not None:
        mask &= k_pos >= ctx - window
    return mask[:, None, None, :]


def build_attention_metadata(
    chunks: tuple[SeqChunk, ...],
    block_size: int,
    windows: tuple[int | None, ...],
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Turn a step's chunks into the tensors every layer needs (``windows``: distinct per layer)."""
    q_lens = [len(c.token_ids) for c in chunks]
    computed = [c.num_computed_tokens for c in chunks]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    num_blocks = [-(-(c + n) // block_size) for c, n in zip(computed, q_lens, strict=True)]
    width = max(num_blocks, default=1)
    # Padding entries point at block 0: only ever read under a False mask.
    padded = [list(c.block_table[:n]) + [0] * (width - n) for c, n in zip(chunks, num_blocks, strict=True)]
    tables = torch.tensor(padded, dtype=torch.long).reshape(len(chunks), width)

    seq = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(q_lens, dtype=torch.long))
    start_t = torch.tensor(starts[:-1], dtype=torch.long)
    positions = torch.arange(starts[-1]) - start_t[seq] + torch.tensor(computed, dtype=torch.long)[seq]
    slots = tables[seq, positions // block_size] * block_size + positions % block_size

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    prefill = [i for i, n in enumerate(q_lens) if n > 1]
    d_width = max((num_blocks[i] for i in decode), default=0)
    d_ctx = torch.tensor([computed[i] + 1 for i in decode], dtype=torch.long)
    return AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slots.to(device),
        query_start=tuple(starts),
        last_token_indices=torch.tensor(starts[1:], dtype=torch.long, device=device) - 1,
        decode_token_indices=torch.tensor([starts[i] for i in decode], dtype=torch.long, device=device),
        decode_block_tables=tables[decode, :d_width].to(device),
        decode_masks={w: _decode_mask(d_ctx, d_width * block_size, w).to(device) for w in windows},
        prefill=tuple(prefill),
        prefill_block_tables=tuple(tables[i, : num_blocks[i]].to(device) for i in prefill),
        prefill_masks={
            w: tuple(causal_mask(computed[i], q_lens[i], w).to(device) for i in prefill) for w in windows
        },
    )


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new ``key``/``value`` ``(T, num_kv_heads, head_dim)`` at their flat slots."""
    kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every query to its own request's keys.

    Args:
        query: ``(T, num_heads, head_dim)``, RoPE applied.
        key, value: ``(T, num_kv_heads, head_dim)``, RoPE applied to ``key``.
        key_cache, value_cache: ``(num_blocks, block_size, num_kv_heads, head_dim)``, updated in place.
        window: this layer's sliding window in tokens, or ``None``.

    Returns:
        ``(T, num_heads * head_dim)`` attention output.
    """
    write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    out = torch.empty_like(query)

    if meta.decode_token_indices.numel():
        idx = meta.decode_token_indices
        d = idx.numel()
        # (D, blocks, block_size, kv_heads, head_dim) → (D, kv_heads, L, head_dim)
        k = key_cache[meta.decode_block_tables].view(d, -1, kv_heads, head_dim).transpose(1, 2)
        v = value_cache[meta.decode_block_tables].view(d, -1, kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            query[idx].unsqueeze(2), k, v, attn_mask=meta.decode_masks[window], enable_gqa=True
        )
        out[idx] = o.squeeze(2)

    masks = meta.prefill_masks[window]
    for i, table, mask in zip(meta.prefill, meta.prefill_block_tables, masks, strict=True):
        start, end = meta.query_start[i], meta.query_start[i + 1]
        ctx = mask.shape[1]
        k = key_cache[table].view(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)
        v = value_cache[table].view(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)
        q = query[start:end].transpose(0, 1)  # (num_heads, q, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)
