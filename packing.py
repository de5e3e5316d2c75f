"""Sequence packing (training; paper Appendix A.1): several samples one after another in a row of at most
--max-seq-len tokens, each attending as it would alone. `pack_rows` chooses the rows (first fit, in
order); `segment_positions` and `packed_mask` keep every sample to itself in the model: its rotary
positions restart at 0 (the prefixes carry no rotary, so a sample sees them as it would alone), and its
queries see all Lp prefix slots of its row's branch (Eq. 1 per sample), then its own tokens causally,
nothing of the other samples. The mask is dense on CPU and a flex_attention BlockMask on CUDA, which
lets the kernel skip every block no query sees.

    rows = pack_rows([len(s) for s in samples], max_len=32768)          # data/batches.py
    positions = segment_positions(segments)                             # parvl.ParVL.hidden_from_ids
    mask = packed_mask(segments, rows, prefix_len, flex=x.is_cuda)      # llm.LLM.forward

A packed row's segments [B,T] number its samples 0, 1, ... in order, and the padding after the last
sample is one more segment (so ids never decrease along a row). Shape legend: aggregate.py's.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from aggregate import Rows, prefix_mask, to_rows

BLOCK = 128  # flex_attention's block size, on both axes


def pack_rows(lengths: list[int], max_len: int) -> list[list[int]]:
    """First fit in order: the indices of the samples in each row, every row at most max_len tokens."""
    rows, used = [], []
    for i, n in enumerate(lengths):
        assert n <= max_len, (n, max_len)  # SFTData skips longer rows as too_long
        r = next((r for r, u in enumerate(used) if u + n <= max_len), len(rows))
        if r == len(rows):
            rows.append([]), used.append(0)
        rows[r].append(i)
        used[r] += n
    return rows


def segment_positions(segments: torch.Tensor) -> torch.Tensor:
    """Rotary positions [B,T] that restart at 0 at the first token of every segment (no host sync)."""
    t = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)  # [B,T]
    first = torch.ones_like(segments, dtype=torch.bool)
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    # t - index of the segment's first token
    return t - torch.where(first, t, 0).cummax(dim=1).values


def packed_mask(
    segments: torch.Tensor, rows: Rows, prefix_len: int, flex: bool
) -> torch.Tensor | BlockMask:
    """The packed-row mask over [prefix slots; tokens] for every row: dense [R,1,T,Lp+T] bool (SDPA
    with a mask), or flex=True a BlockMask of 128 x 128 blocks that lets flex_attention skip every
    block no query sees (on CUDA; flex_attention has no backward on CPU). Key slot k is visible to
    query q iff k < Lp (a prefix slot) or token t = k - Lp has q's segment and t <= q."""
    seg = to_rows(segments, rows).contiguous()  # [R,T]
    R, T = seg.shape
    Lp, S = prefix_len, prefix_len + T
    if not flex:
        q = torch.arange(T, device=seg.device)[:, None]  # [T,1]
        k = torch.arange(S, device=seg.device)[None, :]  # [1,S]
        t = k[:, :T]  # [1,T] token slots
        # [R,1,T,Lp+T]
        return prefix_mask(((seg[:, :, None] == seg[:, None, :]) & (t <= q))[:, None], Lp)

    def mask_mod(b, h, q, k):  # prefix_mask's predicate, one (row, query, key slot) at a time
        t = (k - Lp).clamp(min=0)
        return (k < Lp) | ((seg[b, q] == seg[b, t]) & (t <= q))

    # Which blocks hold a visible pair (partial) and which only visible pairs (full, no mask_mod call),
    # computed from each query's visible slots [0, Lp) and [Lp + start, Lp + q] with start its
    # segment's first token; built directly, so no [T,S] mask is ever materialised.
    n = BLOCK
    nq, nk = -(-T // n), -(-S // n)
    q = torch.arange(nq * n, device=seg.device)  # [nq*n] queries, the last block padded
    start = torch.arange(T, device=seg.device) - segment_positions(seg)  # [R,T]
    start = torch.cat([start, start.new_zeros(R, nq * n - T)], 1)[:, :, None]  # [R,nq*n,1]
    a = torch.arange(nk, device=seg.device) * n  # [nk] first slot of each key block
    b = (a + n).clamp(max=S) - 1  # last slot
    real = (q < T)[None, :, None]  # [1,nq*n,1]
    hi = Lp + q[None, :, None]  # last visible token slot
    some = real & ((a < Lp) | (torch.maximum(a, Lp + start) <= torch.minimum(b, hi)))  # [R,nq*n,nk]
    # with start 0 the prefix and the tokens are contiguous
    lo = torch.where(start > 0, Lp + start, 0)
    # edge blocks stay partial
    every = real & ((b < Lp) | ((a >= lo) & (b <= hi))) & (b - a + 1 == n)
    some = some.view(R, nq, n, nk).any(2)[:, None]  # [R,1,nq,nk]
    full = every.view(R, nq, n, nk).all(2)[:, None]
    partial = some & ~full

    # [R,1,nq,nk] bool -> per query block: count, then the block indices in order
    def ordered(blocks):
        order = torch.argsort(blocks.int(), dim=-1, descending=True, stable=True).int()
        return blocks.sum(-1, dtype=torch.int32), order

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=n, mask_mod=mask_mod, seq_lengths=(T, S)
    )
