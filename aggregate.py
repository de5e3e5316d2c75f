"""The ParVL branch mechanism in one place: which branch each row runs, folding the branches into the
batch, prefix attention (Eq. 1) and its shared-KV variant (Appendix C.2), and fusing the branches
back token by token (Eq. 2).

Rows. A tower (the ViT over tiles, the LLM over samples) runs as a batch of rows; `Rows` says which
branch each row runs. Two layouts:
- dense: every item (tile or sample) runs all P branches. `to_rows` repeats the batch P times,
  branch-major (row p*B + b is branch p of item b), and `to_items` fuses the P rows of an item with
  the Aggregator. The ParVL model as trained.
- per item: each item runs one branch of its own (a fixed pair for every sample, or a router's
  choice per sample). Row b is item b running branch[b]; nothing is repeated or fused, so the
  other branches' compute is skipped (P x less than dense).
Either way every row gathers its own branch's prefixes, `prefix_k[rows.branch]` (or, for LoRA
vision branches, its own low-rank updates, `LoRA`): the attention code has one path. `to_rows`,
`to_items` and `per_branch` below are the only places rows and items are converted.

Prefix attention (Eq. 1): the row's learned prefix K/V [Lp] sit in front of its token K/V, queries
are not prefixed; the ViT attends bidirectionally, the LLM causally aligned bottom-right (token i
sees every prefix slot and tokens 0..i). Shared KV (C.2): one token K/V per sample, the fp32 mean
over its P branches, against which the P branch queries of a sample are stacked.

Aggregation (Eq. 2; ParScale's dynamic weighted sum): for every token the P branch states are
concatenated branch-major, c = [z_1; ...; z_P] (P*C), a two-layer SiLU MLP maps c to P logits, a
softmax over branches (in fp32) gives the weights, smoothed toward uniform, a' = (1 - lambda) a +
lambda / P, and the fused state is sum_k a'_k z_k. Mean aggregation (a' = 1/P) is the ablation of
Appendix D.1. The vision branches are fused before CLS removal and pixel shuffle, the language
branches after the final norm, before the lm_head.

Shape legend, the one every file of the project points to: B items (samples; in the ViT, tiles),
N tiles, M images, P branches (Pv vision, Pl language), R rows (aggregate.Rows: P*B dense, B per
item), T tokens (the queries), S key slots (prefix slots and tokens, or the cache's slots), Lp prefix
length, H / Hkv query / key-value heads, D head dim, C width (the LLM's; Cv the ViT's where both
appear), V vocabulary; px the tile side in pixels (448).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# A branch choice: None = all branches fused, an int = that branch for every item, or one branch
# per item (a sequence or a [B] int64 tensor).
Choice = None | int | Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class Rows:
    """Which branch each row of a tower's batch runs (see the module docstring).

    branch: [R] int64, the branch of every row. per_item: rows per item, P when dense, 1 per item.
    shared_kv: the dense rows of a sample share one mean-reduced token KV cache (LLM, C.2)."""

    branch: torch.Tensor
    per_item: int
    shared_kv: bool = False

    @property
    def dense(self) -> bool:
        return self.per_item > 1

    @staticmethod
    def choose(choice: Choice, branches: int, items: int, device, shared_kv: bool = False) -> Rows:
        """Rows for `items` items of a tower with `branches` branches. One branch per item has nothing
        to share, so shared_kv only changes the layout of dense rows."""
        if choice is None:
            # [P*B] branch-major
            index = torch.arange(branches, device=device).repeat_interleave(items)
            return Rows(index, branches, shared_kv and branches > 1)
        if isinstance(choice, int):
            choice = [choice] * items
        index = torch.as_tensor(choice, dtype=torch.long).to(device)
        if index.shape != (items,):
            raise ValueError(
                f"a branch per item: need {items} branch indices, got shape {tuple(index.shape)}"
            )
        if index.numel() and not (0 <= int(index.min()) and int(index.max()) < branches):
            raise ValueError(
                f"branch indices {index.tolist()} out of range: the model has {branches} "
                f"branch{'' if branches == 1 else 'es'}"
            )
        return Rows(index, 1)

    def per_tile(self, num_tiles: torch.Tensor) -> Rows:
        """Sample rows -> the rows of their tiles (num_tiles [B] tiles per sample, on the host)."""
        if self.dense:
            raise ValueError(
                "per_tile maps a branch per sample to its tiles; dense rows need no mapping"
            )
        index = self.branch.repeat_interleave(
            num_tiles.to(self.branch.device), output_size=int(num_tiles.sum())
        )
        return Rows(index, 1)


def to_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Items [B,...] -> rows [R,...]: repeated P times branch-major when dense, as is per item."""
    return x.repeat(rows.per_item, *([1] * (x.ndim - 1))) if rows.dense else x


def to_items(
    h: torch.Tensor, rows: Rows, aggregator: Aggregator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [R,T,C] -> items [B,T,C] and the branch weights [B,T,P] (None per item: nothing to fuse)."""
    if not rows.dense:
        return h, None
    return aggregator(h)


def per_branch(x: torch.Tensor, rows: Rows, branches: int) -> torch.Tensor:
    """The rows of all P = `branches` branches [R,...] -> [B,P,...]: every item's P branch values side by side, not
    fused (router.py's teacher scores each branch of a sample). P = 1 too: its rows are the items, [B,1,...]."""
    assert rows.per_item == branches, (
        f"per_branch reads the rows of all {branches} branches, not {rows.per_item}"
    )
    return x.view(rows.per_item, -1, *x.shape[1:]).transpose(0, 1)


def mean_branches(z: torch.Tensor, branches: int) -> torch.Tensor:
    """[P*B,...] branch-major -> [B,...] mean over branches in fp32, cast back (shared-KV reduction)."""
    return z.view(branches, -1, *z.shape[1:]).float().mean(0).to(z.dtype)


# -- attention --------------------------------------------------------------------------------


class PrefixKV(nn.Module):
    """An attention module with per-branch learned key/value prefixes (Eq. 1), for the ViT's and the
    LLM's attention alike: prefix_k, prefix_v [P,Hkv,Lp,D] on the module itself (ParScale's names, so
    the checkpoint keys are `...attn.prefix_k`), None with one branch or Lp = 0."""

    def add_prefixes(self, branches: int, kv_heads: int, length: int, head_dim: int) -> None:
        if branches > 1 and length > 0:
            self.prefix_k = nn.Parameter(torch.zeros(branches, kv_heads, length, head_dim))
            self.prefix_v = nn.Parameter(torch.zeros(branches, kv_heads, length, head_dim))
        else:
            self.prefix_k = self.prefix_v = None

    def row_prefixes(
        self, rows: Rows, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every row's own branch prefix, gathered once: [R,Hkv,Lp,D] keys and values in dtype (None, None
        without prefixes)."""
        if self.prefix_k is None:
            return None, None
        return self.prefix_k[rows.branch].to(dtype), self.prefix_v[rows.branch].to(dtype)


class LoRA(nn.Module):
    """Per-branch low-rank updates of one shared linear, the alternative to vision prefixes of Figure 3
    (Hu et al. 2022): row r adds scale * B_p A_p x to the shared W x, p = rows.branch[r], so dense
    rows fold the batch, per-item rows run their own branch's update alone, and W stays shared.
    lora_A [P,r,in], lora_B [P,out,r]; B starts at zero (ParVL.branch_init), so a fresh model is the
    shared one exactly. scale = alpha / r with alpha = 2r, as InternVL's wrap_backbone_lora sets it;
    dropout on the update's input while training (peft's lora_dropout: InternVL's 0.05), set by the trainer
    (train.py --lora-dropout), 0 for a module built alone."""

    def __init__(self, branches: int, rank: int, fan_in: int, fan_out: int):
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(branches, rank, fan_in))
        self.lora_B = nn.Parameter(torch.zeros(branches, fan_out, rank))
        self.scale, self.dropout = 2.0, 0.0

    def forward(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """x [R,T,in] -> every row's own branch's update [R,T,out]."""
        # [R,r,in], [R,out,r]
        a, b = (self.lora_A[rows.branch].to(x.dtype), self.lora_B[rows.branch].to(x.dtype))
        x = F.dropout(x, self.dropout, self.training)  # the update's input only; W x sees all of x
        return (x @ a.transpose(1, 2)) @ b.transpose(1, 2) * self.scale


def lora_linear(linear: nn.Linear, lora: LoRA | None, x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """A shared linear with, when the branches are LoRA ones, each row's own low-rank update."""
    return linear(x) if lora is None else linear(x) + lora(x, rows)


def prefix_mask(token_mask: torch.Tensor, prefix_len: int, branches: int = 1) -> torch.Tensor:
    """Eq. 1's rule for the prefix slots, the one place a mask writes it: every query sees every slot
    of its own branch's prefix. token_mask [B,1,T',S] over the token slots -> [B,1,T',Lp+S] over
    [prefix; tokens]. branches P > 1 is the shared-KV layout (C.2): the queries are the P branch
    queries of a sample stacked (row p*T + t, T' = P*T), the prefix slots are the P prefixes one after
    another, and branch p's queries see prefix block p only -> [B,1,P*T,P*Lp+S]. (Without any mask
    the same rule is SDPA's causal_lower_right in prefix_attention, and flex_attention's mask_mod in
    packing.packed_mask tests it slot by slot.)"""
    B, _, Tq, _ = token_mask.shape
    if branches == 1:
        return torch.cat([token_mask.new_ones(B, 1, Tq, prefix_len), token_mask], dim=-1)
    T = Tq // branches
    own = torch.eye(branches, dtype=torch.bool, device=token_mask.device)
    own = own.repeat_interleave(T, 0).repeat_interleave(prefix_len, 1)  # [P*T,P*Lp]
    return torch.cat([own.expand(B, 1, Tq, branches * prefix_len), token_mask], dim=-1)


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    *,
    causal: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 1: softmax(q [P_k; K]^T / sqrt(D)) [P_v; V] for q [R,H,T,D] over keys k, v [R,Hkv,S,D]
    (query head h reads kv head h // (H/Hkv)), with each row's prefix prefix_k/v [R,Hkv,Lp,D] put in
    front of its keys. prefix None: no prefix, or one already in the first key slots (a KV cache
    seeded with it). causal: aligned bottom-right, so every prefix slot is visible; mask [R,1,T,S']
    over all key slots (prefix included) replaces it when given (padding, decoding).

    SDPA is routed so that each case keeps a fused kernel:
    - causal, no mask, S == T: flash attention takes GQA directly (enable_gqa, nothing repeated);
    - one query token with a mask (decode): the H/Hkv query heads sharing a kv head are folded into
      the query axis, q -> [R,Hkv,G,D], so each kv head is read once by a plain masked SDPA (1.31 -> 0.20
      ms per call in bf16 on CPU, fp32 unchanged: docs/performance.md, "CPU decode");
    - otherwise (a mask, or prefix slots making S > T): the kernels that take a mask do not all take
      GQA, so the kv heads are repeated for this call rather than fall back to the math kernel;
    - a BlockMask (packed rows on CUDA, packing.packed_mask): flex_attention, compiled, GQA direct."""
    if prefix_k is not None:
        k, v = torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)  # [R,Hkv,Lp+S,D]
    R, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if isinstance(mask, BlockMask):
        # inside a compiled block flex_attention is traced in; eager calls take the compiled one
        flex = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
        return flex(q, k, v, block_mask=mask, enable_gqa=Hkv != H)
    if not causal and mask is None:  # the ViT: bidirectional over [prefix; tokens]
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=Hkv != H)
    if mask is None and S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if T == 1 and mask is not None:
        # mask [R,1,1,S]
        out = F.scaled_dot_product_attention(q.view(R, Hkv, H // Hkv, D), k, v, attn_mask=mask)
        return out.view(R, H, 1, D)
    if Hkv != H:
        # [R,H,S,D]
        k, v = (k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(T, S) if mask is None else mask
    )


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once: called eagerly it runs an unfused reference that materialises the
    scores (and has no backward on CPU)."""
    return torch.compile(flex_attention)


def shared_kv_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, branches: int, mask: torch.Tensor
) -> torch.Tensor:
    """Appendix C.2: q [P*B,H,T,D] (dense rows, branch-major) over a shared cache k, v [B,Hkv,P*Lp+S,D]
    whose slots p*Lp..(p+1)*Lp-1 hold branch p's prefix and whose token slots hold the mean-reduced
    token K/V. The P branch queries of a sample are stacked along the query axis, [B,H,P*T,D], so no
    branch copy of the cache is materialised; mask [B,1,P*T,P*Lp+S] (shared_kv_mask) lets branch p's
    queries see only prefix block p. Returns [P*B,H,T,D]."""
    P, T = branches, q.shape[2]
    q = q.view(P, -1, *q.shape[1:]).permute(1, 2, 0, 3, 4).flatten(2, 3)  # [B,H,P*T,D]
    out = prefix_attention(q, k, v, causal=True, mask=mask)  # [B,H,P*T,D]
    # [P*B,H,T,D]
    return out.view(out.shape[0], out.shape[1], P, T, -1).permute(2, 0, 1, 3, 4).flatten(0, 1)


def shared_kv_mask(
    mask: torch.Tensor | None, B: int, T: int, P: int, Lp: int, device
) -> torch.Tensor:
    """Mask [B,1,P*T,P*Lp+S] for shared-KV attention: query row p*T + t (branch p, token t) sees only
    branch p's prefix block and the token slots its token-level mask [B,1,T,S] allows."""
    if mask is None:  # prefill from token 0 without padding: plain causal over the T tokens
        mask = (
            torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None].expand(B, 1, T, T)
        )
    return prefix_mask(mask.repeat(1, 1, P, 1), Lp, P)


# -- aggregation ------------------------------------------------------------------------------


class Aggregator(nn.Module):
    """Eq. 2, the token-wise fusion of P branch states: a_t = softmax(g(c_t)) over the branch-major
    concat c_t (P*C), smoothed toward uniform, a'_t = (1 - lambda) a_t + lambda / P, and the fused
    z_t = sum_k a'_{t,k} z_{k,t}; kind "mean" is the fixed a' = 1/P of the ablation (Appendix D.1).
    kind and smoothing are ParConfig's aggregation and lambda_v / lambda_l, checked there."""

    def __init__(self, branches: int, width: int, smoothing: float = 0.0, kind: str = "mlp"):
        super().__init__()
        assert kind in ("mlp", "mean") and 0.0 <= smoothing <= 1.0, (kind, smoothing)
        self.branches, self.smoothing, self.kind = branches, smoothing, kind
        if kind == "mlp":  # ParScale's aggregate_layer: P*C -> C -> P
            self.mlp = nn.Sequential(
                nn.Linear(branches * width, width), nn.SiLU(), nn.Linear(width, branches)
            )

    def weights(self, z_PBTC: torch.Tensor) -> torch.Tensor:
        """Smoothed branch weights [B,T,P] in fp32 for branch states [P,B,T,C]."""
        P, B, T, C = z_PBTC.shape
        if self.kind == "mean":
            return z_PBTC.new_full((B, T, P), 1.0 / P, dtype=torch.float32)
        c_BTPC = z_PBTC.permute(1, 2, 0, 3).reshape(B, T, P * C)  # branch-major concat per token
        a_BTP = self.mlp(c_BTPC).float().softmax(dim=-1)  # softmax over branches in fp32
        return (1.0 - self.smoothing) * a_BTP + self.smoothing / P

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z [P*B,T,C] branch-major -> (fused [B,T,C] in z's dtype, weights [B,T,P] fp32)."""
        P = self.branches
        z_PBTC = z.view(P, z.shape[0] // P, *z.shape[1:])  # [P,B,T,C]
        w_BTP = self.weights(z_PBTC)
        fused_BTC = torch.einsum("btp,pbtc->btc", w_BTP, z_PBTC.float())  # weighted sum in fp32
        return fused_BTC.to(z.dtype), w_BTP

    def initial_values(self) -> dict[str, torch.Tensor]:
        """Start from uniform weights: the last layer is zero, so the MLP emits equal logits and the
        fused state is the plain mean of the branches until training moves it (fp32, on the CPU, drawn
        from the CPU generator; see parvl.ParVL.branch_init). Mean aggregation has no parameters."""
        if self.kind != "mlp":
            return {}
        (w0, b0), (w2, b2) = ((m.weight, m.bias) for m in (self.mlp[0], self.mlp[2]))
        return {
            "mlp.0.weight": torch.empty(w0.shape).normal_(std=0.02),
            "mlp.0.bias": torch.zeros(b0.shape),
            "mlp.2.weight": torch.zeros(w2.shape),
            "mlp.2.bias": torch.zeros(b2.shape),
        }


def entropy(w_BTP: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of branch weights [..., P]; log P means uniform, 0 means collapse."""
    return -(w_BTP * w_BTP.clamp_min(1e-12).log()).sum(-1).mean()
