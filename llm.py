"""The Qwen3 decoder of InternVL3.5 (and the Qwen2/2.5 decoder of InternVL3), in plain PyTorch; the
Qwen3-MoE decoder of 30B-A3B and 241B-A28B is the same with moe.py's routed experts as the MLP of its
sparse layers.

Qwen3: RMSNorm pre-norm blocks, grouped-query attention with a per-head RMSNorm on q and k
before rotary embeddings, SwiGLU MLP, no biases, untied lm_head. Qwen2/2.5 is the same with
q/k/v biases and no q/k norm; `LLMConfig` selects between them. ParVL (paper, "Method") runs
Pl branches of this decoder folded into the batch dimension, each with learned key/value
prefixes in every layer, and fuses them after the final norm, before the shared lm_head; so
`LLM.forward` returns normalised hidden states and the caller applies `lm_head`.

Decoding follows gpt-fast: a static KV cache per layer, allocated once and written in place at
`input_pos`, rotary tables computed once. A decode step attends over the cache slots written so far
rounded up to a bucket of slots (engine.GenerateConfig.bucket), under a boolean mask, not over the
whole allocated cache.

Parameter names mirror the official `language_model.*` keys. Shape legend: aggregate.py's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from aggregate import (
    PrefixKV,
    Rows,
    mean_branches,
    prefix_attention,
    prefix_mask,
    shared_kv_attention,
    shared_kv_mask,
    to_rows,
)
from config import LLMConfig
from moe import SparseMoE
from packing import packed_mask


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen's RMSNorm: normalise in fp32, cast back to the input dtype, then scale (order matters in bf16)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(
    head_dim: int, max_pos: int, theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_pos, D] in fp32 for rotate-half RoPE (both halves carry the same angles)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    )
    angles = torch.outer(torch.arange(max_pos, device=device).float(), inv_freq)  # [max_pos,D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [max_pos,D]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,H,T,D], cos/sin [B,T,D] already in x's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B,1,T,D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def causal_mask(key_valid: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask [B,1,T,S]: query at slot q_pos[t] sees keys at slots <= q_pos[t] that are
    not padding (key_valid [B,S] False). A query always sees itself, so padded rows stay finite."""
    k_idx = torch.arange(key_valid.shape[1], device=key_valid.device)[None, :]  # [1,S]
    q_idx = q_pos[:, None]  # [T,1]
    mask = (k_idx <= q_idx) & (key_valid[:, None, :] | (k_idx == q_idx))  # [B,T,S]
    return mask[:, None]  # [B,1,T,S]


def prompt_positions(
    valid: torch.Tensor, padded: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary positions [B,T] and the causal mask over token slots [B,1,T,T] of prompts whose padding is
    marked False in valid [B,T]: every prompt starts at position 0. padded False (no row is padded)
    gives mask None, which keeps SDPA's fused causal kernels; None reads it off valid (a host sync)."""
    if padded is None:
        padded = not bool(valid.all())
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [B,T], 0 at each prompt's first token
    return positions, causal_mask(
        valid, torch.arange(valid.shape[1], device=valid.device)
    ) if padded else None


class KVCache(nn.Module):
    """Static per-layer cache [rows,Hkv,S,D], written in place (no torch.cat: CUDA graphs need fixed
    shapes). The first `offset` slots hold the learned prefixes; token i lives at slot offset + i.

    Standard layout: one cache row per LLM row (aggregate.Rows), offset = Lp, each seeded with its
    row's branch prefix. Shared KV (ParVL Appendix C.2): one row per sample, offset = P*Lp, slots
    p*Lp..(p+1)*Lp-1 hold branch p's prefix and the token K/V are the fp32 mean over branches."""

    def __init__(
        self, rows: int, num_kv_heads: int, slots: int, head_dim: int, offset: int, dtype, device
    ):
        super().__init__()
        shape = (rows, num_kv_heads, slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.offset = offset

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # input_pos [T] cache slots; k, v [rows,Hkv,T,D]
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Attention(PrefixKV):
    """Causal GQA self-attention. With P > 1 branches each branch owns learned key/value prefixes
    [P,Hkv,Lp,D] that live directly in the key space (no RoPE, no k norm); each row attends with its
    own branch's prefix in front of its keys (Eq. 1, aggregate.prefix_attention): token i sees all
    Lp prefix slots and tokens 0..i (causal, bottom-right)."""

    def __init__(self, cfg: LLMConfig, branches: int = 1, prefix_len: int = 0):
        super().__init__()
        self.cfg = cfg
        H, Hkv, D, C = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(C, H * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(C, Hkv * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(C, Hkv * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.add_prefixes(branches, Hkv, prefix_len, D)  # ParScale's names and layout
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: torch.Tensor,  # [R,T,C] rows (aggregate.Rows)
        cos: torch.Tensor,  # [R,T,D]
        sin: torch.Tensor,  # [R,T,D]
        rows: Rows,
        mask: torch.Tensor
        | None,  # [R,1,T,S] bool over [prefix slots; token slots] (shared KV: see LLM.forward)
        input_pos: torch.Tensor
        | None,  # [T] cache slots to write (prefix offset included), None = no cache
    ) -> torch.Tensor:
        cfg = self.cfg
        R, T, _ = x.shape
        q = self.q_proj(x).view(R, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(R, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(R, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3: per-head norm over D, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [R,H,T,D], [R,Hkv,T,D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if input_pos is None:  # no cache (training, scoring): the prefixes go in front here
            pk, pv = self.row_prefixes(rows, k.dtype)  # [R,Hkv,Lp,D]
            out = prefix_attention(q, k, v, pk, pv, causal=True, mask=mask)
        else:  # the cache was seeded with the prefixes (LLM.seed_prefixes)
            cache = self.kv_cache
            if rows.shared_kv:  # one token K/V per sample: the fp32 mean over its branches
                # [B,Hkv,T,D]
                k, v = (mean_branches(k, rows.per_item), mean_branches(v, rows.per_item))
            k_all, v_all = cache.update(input_pos, k, v)  # [rows,Hkv,S_max,D]
            # mask None: prefill from token 0
            S = mask.shape[-1] if mask is not None else cache.offset + T
            k, v = k_all[:, :, :S], v_all[:, :, :S]
            if rows.shared_kv:
                out = shared_kv_attention(q, k, v, rows.per_item, mask)
            else:
                out = prefix_attention(q, k, v, causal=True, mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(R, T, -1))  # [R,T,H*D] -> [R,T,C]


class MLP(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        C, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, I, bias=False)
        self.up_proj = nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Block(nn.Module):
    """One decoder layer; its MLP is Qwen3-MoE's routed experts where the config makes layer `index`
    sparse (LLMConfig.is_sparse), else the dense SwiGLU."""

    def __init__(self, cfg: LLMConfig, branches: int = 1, prefix_len: int = 0, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, branches, prefix_len)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_sparse(index) else MLP(cfg)

    def forward(self, x, cos, sin, rows, mask, input_pos) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, rows, mask, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """`language_model.model`: embeddings, blocks, final norm, and the rotary tables."""

    def __init__(self, cfg: LLMConfig, branches: int = 1, prefix_len: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Block(cfg, branches, prefix_len, i) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.init_rope()

    def init_rope(self, device=None) -> None:
        """(Re)build the rotary tables, e.g. after a model built on the meta device is materialised.
        InternVL3 configs may carry dynamic-NTK rope_scaling; it only acts past max_position_embeddings,
        which no sequence here reaches (the tables end there), so plain RoPE is exact."""
        cos, sin = rope_tables(
            self.cfg.head_dim, self.cfg.max_position_embeddings, self.cfg.rope_theta, device
        )
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_pos,D] fp32
        self.register_buffer("rope_sin", sin, persistent=False)


class LLM(nn.Module):
    """`language_model`: a Qwen3ForCausalLM (or Qwen2), optionally with P prefix-conditioned branches.
    `forward` folds the samples into rows (aggregate.to_rows) and returns every row's final-normed
    hidden states; the caller unfolds them (aggregate.to_items) and applies lm_head."""

    def __init__(self, cfg: LLMConfig, branches: int = 1, prefix_len: int = 0):
        super().__init__()
        self.cfg = cfg
        self.branches = branches
        self.prefix_len = prefix_len if branches > 1 else 0
        self.model = Decoder(cfg, branches, prefix_len)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def setup_cache(self, rows: Rows, max_len: int, dtype=None, device=None) -> None:
        """Allocate one static KV cache per layer for `rows` (aggregate.Rows) and `max_len` tokens, and
        seed the prefixes in front (see KVCache for the two layouts)."""
        w = self.model.embed_tokens.weight
        cfg, Lp = self.cfg, self.prefix_len
        R = len(rows.branch)
        n, offset = (R // rows.per_item, rows.per_item * Lp) if rows.shared_kv else (R, Lp)
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(
                n,
                cfg.num_kv_heads,
                offset + max_len,
                cfg.head_dim,
                offset,
                dtype or w.dtype,
                device or w.device,
            )
        self.seed_prefixes(rows)

    @torch.no_grad()
    def seed_prefixes(self, rows: Rows) -> None:
        """Copy the (current) learned prefixes of each row's branch into the first cache slots."""
        for layer in self.model.layers:
            attn, c = layer.self_attn, layer.self_attn.kv_cache
            if attn.prefix_k is None:
                continue
            if rows.shared_kv:  # every sample: slots p*Lp.. hold branch p's prefix
                # [P,Hkv,Lp,D] -> [1,Hkv,P*Lp,D]
                c.k[:, :, : c.offset] = (
                    attn.prefix_k.transpose(0, 1).flatten(1, 2).unsqueeze(0).to(c.k.dtype)
                )
                c.v[:, :, : c.offset] = (
                    attn.prefix_v.transpose(0, 1).flatten(1, 2).unsqueeze(0).to(c.v.dtype)
                )
            else:  # [R,Hkv,Lp,D]
                c.k[:, :, : c.offset], c.v[:, :, : c.offset] = attn.row_prefixes(rows, c.k.dtype)

    def forward(
        self,
        x: torch.Tensor,  # [B,T,C] input embeddings
        positions: torch.Tensor,  # [B,T] rotary positions (start at 0 per sample)
        mask: torch.Tensor
        | None = None,  # [B,1,T,S] bool over token slots; None = causal, no padding
        input_pos: torch.Tensor | None = None,  # [T] token slots in the cache; None = no cache
        rows: Rows | None = None,  # which branch each row runs (aggregate.Rows); None: all P, dense
        segments: torch.Tensor
        | None = None,  # [B,T] packed rows: the sample of each token (packing.packed_mask)
    ) -> (
        torch.Tensor
    ):  # [R,T,C] final-normed hidden states of every row ([P*B,T,C] dense, branch-major)
        dec, Lp = self.model, self.prefix_len
        B, T, _ = x.shape
        if rows is None:
            rows = Rows.choose(None, self.branches, B, x.device)
        if input_pos is not None:
            input_pos = input_pos + dec.layers[0].self_attn.kv_cache.offset
        cos = dec.rope_cos[positions].to(x.dtype)  # [B,T,D], cast like the reference does
        sin = dec.rope_sin[positions].to(x.dtype)
        x, cos, sin = to_rows(x, rows), to_rows(cos, rows), to_rows(sin, rows)  # [R,T,...]
        # samples packed in rows, no cache: the mask covers the prefix slots too
        if segments is not None:
            assert mask is None and input_pos is None, "packed rows take no mask and no cache"
            # CUDA: a BlockMask for flex_attention
            mask = packed_mask(segments, rows, Lp, flex=x.is_cuda)
        elif rows.shared_kv:
            mask = shared_kv_mask(mask, B, T, rows.per_item, Lp, x.device)
        elif mask is not None and Lp > 0:  # the prefix slots are visible to every token
            mask = to_rows(prefix_mask(mask, Lp), rows)  # [R,1,T,Lp+S]
        elif mask is not None:
            mask = to_rows(mask, rows)
        for layer in dec.layers:
            x = layer(x, cos, sin, rows, mask, input_pos)
        return dec.norm(x)
