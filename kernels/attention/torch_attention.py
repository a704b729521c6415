"""Vectorised torch paged attention and KV-cache write: `TorchBackend`, the CPU path for
dtypes the numba kernel cannot hold (bf16, fp16), and the prefill path of `NumbaBackend`
(`kernels/attention/numba_attention.py`), which subclasses it and replaces only the decodes.

Same layouts and results as `kernels/attention/reference.py` (the specification), but without a
Python loop over decode requests. `TorchBackend.prepare` turns a step's metadata into a
`TorchAttentionPlan` once; every layer's `attend` then runs:

  * decode requests (one new token each), sorted by context length and attended in chunks
    of about `decode_chunk_bytes` of K/V, so each chunk's copy is read back from the L2
    cache. A chunk's K/V are gathered whole block by whole block (one contiguous copy per
    block) into a padded copy `[n, padded_len, num_kv_heads, head_dim]`; sorting keeps the
    padding to about a block per request. Padded rows (past a request's `seq_len`; the
    cache may hold anything there, NaN included) are zeroed and masked out of the softmax.
    Each chunk is one `scaled_dot_product_attention` call (its fused CPU kernel, grouped
    query heads included).
  * prefill chunks (more than one new token) through `scaled_dot_product_attention` over
    their own gathered K/V with a bottom-right-aligned causal mask (token j of a chunk of
    q_len sits at position seq_len - q_len + j and sees positions 0..that one). Chunks go one
    request at a time: a step holds few of them and each is large.

Softmax runs in float32 (float64 for float64 queries) as in the reference; the output has
the query's dtype. Rows of `out` that no request owns are left untouched.

A quantized cache (`kv_scales` given, `kv_quant.py`) is gathered the same way, int8 or fp8,
with its scales block by block beside it, and dequantized in the copy (q * scale, in the
accumulation dtype) before SDPA reads it: the gathered copy is the only one in float.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import AttentionBackend
from .kv_quant import KVScales, dequantize, gather_kv, write_kv_quantized
from .metadata import AttentionMetadata
from .reference import first_visible, visible

DEFAULT_DECODE_CHUNK_BYTES = 1 << 21
"""Gathered K+V bytes per decode chunk: requests are attended a few at a time so that their
gathered copy is still in the L2 cache when attention reads it (one pass over all of them at
once, hundreds of MB at a few hundred requests, measured 2-3x slower on this CPU)."""


def write_kv_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # same shape as key_cache
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot < 0 means "do not write"
) -> None:
    """Scatter each token's K and V into its cache slot (in place), as `write_kv_ref`. The
    caches may be stored in any order (`AttentionBackend.kv_cache`)."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    slots = slot_mapping.long()
    if key.shape[0] and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots,
                                                               key.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
            0, slots, value.to(value_cache.dtype))
        return
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)


class PrefillChunk(NamedTuple):
    """A request with more than one new token this step: one SDPA call."""

    request: int  # row of the metadata's block_tables / seq_lens
    q_start: int  # its query rows are [q_start, q_end)
    q_end: int
    seq_len: int  # cached tokens including the new ones


@dataclass
class DecodeChunk:
    """Decode requests of similar length attended together, and where their data is.

    Their K/V are gathered block by block into a padded copy
    `[num_seqs, padded_len, num_kv_heads, head_dim]`: request r's row j is cached position
    `starts[r] + j`, where `starts[r]` is 0, or with a sliding window the start of the block
    that holds its first visible position (the blocks before it are never read), and
    `padded_len` is the chunk's longest such span rounded up to whole blocks. Rows outside a
    request's visible positions (past its `seq_len`, whole blocks of table padding, the part
    of its first block before the window) may hold anything, NaN included: `pad_rows` names
    them so they are zeroed after the gather, and `mask` keeps them out of the softmax.
    """

    token_rows: torch.Tensor  # [num_seqs] int64: the requests' query rows
    blocks: torch.Tensor  # [num_seqs * padded_len / block_size] int64 block ids, row-major
    pad_rows: torch.Tensor  # int64 rows of the gathered copy (viewed [n * padded_len, -1])
    mask: torch.Tensor  # [num_seqs, 1, 1, padded_len] additive: 0 attended, -inf padding
    num_seqs: int
    padded_len: int


@dataclass
class TorchAttentionPlan:
    """`TorchBackend`'s view of one step, built once by `prepare` and read by every layer."""

    decode_chunks: list[DecodeChunk]
    """The decode requests, shortest context first, cut into chunks of about
    `decode_chunk_bytes` of gathered K/V (empty when the step has no decodes), for layers
    without a sliding window."""
    prefills: list[PrefillChunk]
    """The requests with more than one new token, in batch order."""
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None
    """K and V gather buffers [blocks of the largest chunk, block elements], allocated by the
    first layer and reused by every chunk of every layer of this step (fresh large
    allocations page-fault)."""
    decode_requests: list[tuple[int, int]] = field(default_factory=list)
    """(request, query row) of every decode, as `decode_chunks` were cut from them."""
    windowed_chunks: dict[int, list[DecodeChunk]] = field(default_factory=dict)
    """Sliding window -> the decode chunks of layers with that window, built by the first
    such layer of the step (only the window's blocks are gathered)."""


class TorchBackend(AttentionBackend):
    """`attention_backend=torch`: every request through `scaled_dot_product_attention` on
    gathered K/V (see the module docstring). Any dtype, any device; the CPU default for
    bf16/fp16."""

    name = "torch"
    decode_chunk_bytes: int
    """Gathered K+V bytes per decode chunk (at least one request per chunk whatever the
    budget); see `DEFAULT_DECODE_CHUNK_BYTES`."""

    def __init__(self, decode_chunk_bytes: int = DEFAULT_DECODE_CHUNK_BYTES):
        self.decode_chunk_bytes = decode_chunk_bytes

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping,
                 kv_scales=None) -> None:
        if kv_scales is not None:
            write_kv_quantized(key, value, key_cache, value_cache, kv_scales, slot_mapping)
        else:
            write_kv_torch(key, value, key_cache, value_cache, slot_mapping)

    def prepare(self, meta: AttentionMetadata, block_size: int, num_kv_heads: int,
                head_dim: int, dtype: torch.dtype) -> TorchAttentionPlan:
        """The decode chunks (requests sorted by length, index tensors built) and the
        prefill chunks of this step."""
        decodes, prefills = split_requests(meta)
        plan = TorchAttentionPlan([], prefills, decode_requests=decodes)
        plan.decode_chunks = self._decode_chunks(meta, plan, block_size, num_kv_heads,
                                                 head_dim, dtype, None)
        return plan

    def _decode_chunks(self, meta: AttentionMetadata, plan: TorchAttentionPlan,
                       block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       window: int | None) -> list[DecodeChunk]:
        """The step's decodes, sorted by the span they read, cut into chunks by bytes."""
        lens = meta.seq_lens.tolist()
        spans = [_span(n, window, block_size)[1] for n in lens]
        decodes = sorted(plan.decode_requests, key=lambda d: spans[d[0]])  # little padding
        acc = _acc_dtype(dtype)
        bytes_per_slot = 2 * num_kv_heads * head_dim * acc.itemsize  # K and V of one position
        return [_decode_chunk_index(meta.block_tables, members, lens, block_size, acc, window)
                for members in self._chunk_by_bytes(decodes, spans, block_size,
                                                    bytes_per_slot)]

    def _chunk_by_bytes(self, decodes: list[tuple[int, int]], lens: list[int],
                        block_size: int, bytes_per_slot: int) -> list[list[tuple[int, int]]]:
        """Consecutive runs of the (length-sorted) decodes whose padded K/V fit the budget."""
        chunks, first = [], 0
        while first < len(decodes):
            last = first + 1  # sorted ascending: the chunk's last request is its longest
            while (last < len(decodes) and (last + 1 - first) * bytes_per_slot
                   * _round_up(lens[decodes[last][0]], block_size) <= self.decode_chunk_bytes):
                last += 1
            chunks.append(decodes[first:last])
            first = last
        return chunks

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, plan: TorchAttentionPlan, scale: float,
               out: torch.Tensor | None = None, *, sliding_window: int | None = None,
               soft_cap: float | None = None,
               kv_scales: KVScales | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(query)
        if sliding_window is None and soft_cap is None:
            self._attend_decodes(query, key_cache, value_cache, plan, scale, out, kv_scales)
        else:
            self._attend_windowed_decodes(query, key_cache, value_cache, meta, plan, scale,
                                          out, sliding_window, soft_cap, kv_scales)
        for chunk in plan.prefills:
            _prefill(query, key_cache, value_cache, meta.block_tables[chunk.request], chunk,
                     scale, out, sliding_window, soft_cap, kv_scales)
        return out

    def _attend_decodes(self, query, key_cache, value_cache, plan: TorchAttentionPlan,
                        scale: float, out: torch.Tensor,
                        kv_scales: KVScales | None = None) -> None:
        """One new token per decode request, a chunk at a time."""
        self._attend_chunks(query, key_cache, value_cache, plan, plan.decode_chunks, scale,
                            out, None, kv_scales)

    def _attend_windowed_decodes(self, query, key_cache, value_cache, meta, plan, scale, out,
                                 window: int | None, soft_cap: float | None,
                                 kv_scales: KVScales | None = None) -> None:
        """The decodes of a layer with a window or a cap: the window's own chunks (built
        once a step per window), then the chunks through SDPA or, capped, by hand."""
        chunks = plan.decode_chunks
        if window is not None and plan.decode_requests:
            chunks = plan.windowed_chunks.get(window)
            if chunks is None:
                chunks = plan.windowed_chunks[window] = self._decode_chunks(
                    meta, plan, key_cache.shape[1], key_cache.shape[2], key_cache.shape[3],
                    query.dtype, window)
        self._attend_chunks(query, key_cache, value_cache, plan, chunks, scale, out, soft_cap,
                            kv_scales)

    @staticmethod
    def _attend_chunks(query, key_cache, value_cache, plan: TorchAttentionPlan,
                       chunks: list[DecodeChunk], scale: float, out: torch.Tensor,
                       soft_cap: float | None, kv_scales: KVScales | None = None) -> None:
        if not chunks:
            return
        rows = max(chunk.blocks.numel() for chunk in chunks)
        if plan.workspace is None or plan.workspace[0].shape[0] < rows:
            plan.workspace = tuple(torch.empty(rows, key_cache[0].numel(),
                                               dtype=key_cache.dtype, device=key_cache.device)
                                   for _ in range(2))
        for chunk in chunks:
            result = _decode_chunk(query.index_select(0, chunk.token_rows), key_cache,
                                   value_cache, chunk, scale, _acc_dtype(query.dtype),
                                   plan.workspace, soft_cap, kv_scales)
            out.index_copy_(0, chunk.token_rows, result.to(out.dtype))


def split_requests(meta: AttentionMetadata) -> tuple[list[tuple[int, int]], list[PrefillChunk]]:
    """The step's decode requests as (request, query row) pairs, and its prefill chunks, both
    in batch order. Requests with no new token are in neither."""
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    decodes = [(i, qsl[i]) for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    prefills = [PrefillChunk(i, qsl[i], qsl[i + 1], lens[i]) for i in range(len(lens))
                if qsl[i + 1] - qsl[i] > 1]
    return decodes, prefills


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _span(seq_len: int, window: int | None, block_size: int) -> tuple[int, int]:
    """(first position read, positions read) of a decode over `seq_len` cached positions:
    from the start of the block holding its first visible position."""
    start = first_visible(seq_len - 1, window) // block_size * block_size
    return start, seq_len - start


def _decode_chunk_index(block_tables: torch.Tensor, members: list[tuple[int, int]],
                        all_lens: list[int], block_size: int, acc: torch.dtype,
                        window: int | None = None) -> DecodeChunk:
    """The index tensors of one chunk of (request, query row) decodes."""
    device = block_tables.device
    lens = [all_lens[request] for request, _ in members]
    starts, spans = zip(*(_span(n, window, block_size) for n in lens))
    num, padded_len = len(members), _round_up(max(spans), block_size)
    width = padded_len // block_size
    requests = torch.tensor([request for request, _ in members], device=device)
    first_blocks = torch.tensor(starts, device=device) // block_size
    columns = first_blocks.unsqueeze(1) + torch.arange(width, device=device).unsqueeze(0)
    tables = block_tables.index_select(0, requests)
    inside = columns < tables.shape[1]
    blocks = torch.where(inside, tables.gather(1, columns.clamp(max=tables.shape[1] - 1)), 0)
    positions = (torch.tensor(starts, device=device).unsqueeze(1)
                 + torch.arange(padded_len, device=device).unsqueeze(0))  # [n, padded_len]
    q_pos = torch.tensor(lens, device=device).unsqueeze(1) - 1
    valid = visible(q_pos, positions, window)
    return DecodeChunk(
        token_rows=torch.tensor([row for _, row in members], device=device),
        blocks=blocks.reshape(-1).long(),
        pad_rows=(~valid).view(-1).nonzero().squeeze(1),
        mask=torch.zeros(num, 1, 1, padded_len, dtype=acc, device=device).masked_fill_(
            ~valid.view(num, 1, 1, padded_len), float("-inf")),
        num_seqs=num, padded_len=padded_len)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax and products run in float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _decode_chunk(q, key_cache, value_cache, chunk: DecodeChunk, scale, acc, workspace,
                  soft_cap: float | None = None, kv_scales: KVScales | None = None):
    """q [n, heads, d] of one chunk's requests -> [n, heads, d] in `acc` dtype."""
    num, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    shape = (num, chunk.padded_len, num_kv_heads, head_dim)
    gathered = []
    for i, (cache, buffer) in enumerate(zip((key_cache, value_cache), workspace)):
        # whole blocks: one contiguous copy of block_size * kv_heads * head_dim per block
        kv = buffer[:chunk.blocks.numel()]
        torch.index_select(cache.view(cache.shape[0], -1), 0, chunk.blocks, out=kv)
        kv = kv.view(shape)
        if kv_scales is not None:  # dequantized with the blocks' scales, in a float copy
            rows = kv_scales[i].view(cache.shape[0], -1).index_select(0, chunk.blocks)
            kv = dequantize(kv, rows.view(shape[:3]), acc)
        if chunk.pad_rows.numel():
            kv.view(num * chunk.padded_len, -1).index_fill_(0, chunk.pad_rows, 0)
        gathered.append(kv.to(acc).transpose(1, 2))  # [n, kv_heads, padded_len, d] view
    q = q.to(acc).view(num, num_heads, 1, head_dim)
    if soft_cap is not None:
        return _capped_attention(q, gathered[0], gathered[1], chunk.mask, scale,
                                 soft_cap).view(num, num_heads, head_dim)
    o = F.scaled_dot_product_attention(
        q, gathered[0], gathered[1],
        attn_mask=chunk.mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
    return o.view(num, num_heads, head_dim)


def _capped_attention(q, k, v, mask, scale: float, soft_cap: float) -> torch.Tensor:
    """SDPA's result with soft-capped scores, by hand (SDPA has no cap): q [b, heads, t, d],
    k/v [b, kv_heads, n, d], mask additive or boolean (True: attended), broadcast to
    [b, heads, t, n]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = soft_cap * torch.tanh(scores / soft_cap)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _prefill(query, key_cache, value_cache, table, chunk: PrefillChunk, scale, out,
             window: int | None = None, soft_cap: float | None = None,
             kv_scales: KVScales | None = None):
    """A chunk of q_len > 1 new tokens of one request: SDPA with a bottom-right causal mask
    (and the window's, reading only the blocks from the one holding the chunk's first
    visible position). `table` is the request's block-table row."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    acc = _acc_dtype(query.dtype)
    q_start, q_end, seq_len = chunk.q_start, chunk.q_end, chunk.seq_len
    q_len = q_end - q_start
    first = first_visible(seq_len - q_len, window) // block_size
    base = first * block_size
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = table[first:num_blocks].long()
    # [blocks, block_size, kv_heads, d] -> [kv_heads, seq_len - base, d]
    k, v = gather_kv(key_cache, value_cache, kv_scales, blocks, acc)
    k = k.reshape(-1, num_kv_heads, head_dim)[:seq_len - base]
    v = v.reshape(-1, num_kv_heads, head_dim)[:seq_len - base]
    k, v = k.transpose(0, 1).to(acc), v.transpose(0, 1).to(acc)
    q = query[q_start:q_end].transpose(0, 1).to(acc)  # [heads, q_len, d]
    mask = _causal_mask(q_len, seq_len, query.device, window, base)
    if soft_cap is not None:
        if "is_causal" in mask:
            mask = {"attn_mask": _visible_mask(q_len, seq_len, query.device, None, 0)}
        o = _capped_attention(q[None], k[None], v[None], mask["attn_mask"], scale, soft_cap)
    else:
        # 4-D [1, heads, tokens, d]: on the CPU only batched inputs take the fused (flash)
        # kernel, ~5x faster at 512 tokens than the unfused fallback that 3-D inputs get
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale,
                                           enable_gqa=num_heads != num_kv_heads, **mask)
    out[q_start:q_end] = o[0].transpose(0, 1).to(out.dtype)


def _causal_mask(q_len: int, seq_len: int, device, window: int | None = None,
                 base: int = 0) -> dict:
    """SDPA's mask arguments for q_len new tokens at the end of seq_len (keys from position
    `base`): `is_causal` when the chunk is the whole sequence and there is no window (its
    flash kernel then skips the blocks above the diagonal: bit-identical output, 25% faster
    at 512 tokens and 35% at 1024 on this CPU), otherwise an explicit bottom-right-aligned
    mask (`is_causal` aligns top-left)."""
    if q_len == seq_len and window is None:
        return {"is_causal": True}
    return {"attn_mask": _visible_mask(q_len, seq_len, device, window, base)}


def _visible_mask(q_len: int, seq_len: int, device, window: int | None,
                  base: int) -> torch.Tensor:
    """[q_len, seq_len - base] booleans: True where the key is visible to the query."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
    return visible(q_pos, torch.arange(base, seq_len, device=device).unsqueeze(0), window)
