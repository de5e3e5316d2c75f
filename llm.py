"""The Qwen3 decoder of InternVL3.5 (and the Qwen2/2.5 decoder of InternVL3), in plain PyTorch.

Qwen3: RMSNorm pre-norm blocks, grouped-query attention with a per-head RMSNorm on q and k
before rotary embeddings, SwiGLU MLP, no biases, untied lm_head. Qwen2/2.5 is the same with
q/k/v biases and no q/k norm; `LLMConfig` selects between them. ParVL (paper, "Method") runs
Pl branches of this decoder folded into the batch dimension, each with learned key/value
prefixes in every layer, and fuses them after the final norm, before the shared lm_head; so
`LLM.forward` returns normalised hidden states and the caller applies `lm_head`.

Decoding follows gpt-fast: a static KV cache per layer, allocated once and written in place at
`input_pos`, attention over the whole cache under a boolean mask, rotary tables computed once.

Parameter names mirror the official `language_model.*` keys. Shape legend: B batch (times
branches), T tokens, S cache length, C width, H / Hkv heads, D head dim, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from aggregate import mean_branches


@dataclass
class LLMConfig:
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128  # Qwen3 reads it from the config: heads x head_dim may differ from width
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    qkv_bias: bool = False  # Qwen2/2.5: True
    qk_norm: bool = True  # Qwen3: per-head RMSNorm on q and k before RoPE; Qwen2/2.5: False
    tie_word_embeddings: bool = False  # every InternVL3.5 size ships its own lm_head

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert self.head_dim % 2 == 0, self.head_dim


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


def rope_tables(head_dim: int, max_pos: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_pos, D] in fp32 for rotate-half RoPE (both halves carry the same angles)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
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


class KVCache(nn.Module):
    """Static per-layer cache [rows,Hkv,S,D], written in place (no torch.cat: CUDA graphs need fixed
    shapes). The first `offset` slots hold the learned prefixes; token i lives at slot offset + i.

    Standard layout: rows = active branches x batch (branch-major), offset = Lp, each row seeded
    with its branch's prefix. Shared KV (ParVL Appendix C.2): rows = batch, offset = P*Lp, slots
    p*Lp..(p+1)*Lp-1 hold branch p's prefix and the token K/V are the fp32 mean over branches."""

    def __init__(self, rows: int, num_kv_heads: int, slots: int, head_dim: int, dtype, device,
                 branches: int, offset: int, shared: bool, branch: int | None):
        super().__init__()
        shape = (rows, num_kv_heads, slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.branches, self.offset, self.shared, self.branch = branches, offset, shared, branch

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # input_pos [T] cache slots; k, v [rows,Hkv,T,D]
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Attention(nn.Module):
    """Causal GQA self-attention. With P > 1 branches each branch owns learned key/value prefixes
    [P,Hkv,Lp,D] that live directly in the key space (no RoPE, no k norm) and are prepended to the
    keys and values only: token i sees all Lp prefix slots and tokens 0..i (causal, bottom-right)."""

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
        if branches > 1 and prefix_len > 0:  # ParScale's names and layout
            self.prefix_k = nn.Parameter(torch.zeros(branches, Hkv, prefix_len, D))
            self.prefix_v = nn.Parameter(torch.zeros(branches, Hkv, prefix_len, D))
        else:
            self.prefix_k = self.prefix_v = None
        self.kv_cache: KVCache | None = None

    def prefixes(self, branch: int | None, rows: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefixes of the active branches expanded to branch-major rows: 2 x [rows,Hkv,Lp,D]."""
        pk, pv = self.prefix_k, self.prefix_v  # [P,Hkv,Lp,D]
        if branch is not None:
            pk, pv = pk[branch : branch + 1], pv[branch : branch + 1]
        n = rows // pk.shape[0]
        return pk.to(dtype).repeat_interleave(n, 0), pv.to(dtype).repeat_interleave(n, 0)

    def forward(
        self,
        x: torch.Tensor,  # [R,T,C], R = active branches x batch, branch-major
        cos: torch.Tensor,  # [R,T,D]
        sin: torch.Tensor,  # [R,T,D]
        mask: torch.Tensor | None,  # [R,1,T,S] bool over [prefix slots; token slots] (shared KV: see LLM.forward)
        input_pos: torch.Tensor | None,  # [T] cache slots to write (prefix offset included), None = no cache
        branch: int | None = None,  # the one active branch, None = all
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
        cache = self.kv_cache
        shared = input_pos is not None and cache.shared
        if shared:
            # one token K/V per sample (fp32 mean over branches); the P branch queries of a sample are
            # stacked along the query axis so attention never materialises P copies of the cache
            P = cache.branches
            k, v = mean_branches(k, P), mean_branches(v, P)  # [B,Hkv,T,D]
            q = q.view(P, R // P, *q.shape[1:]).permute(1, 2, 0, 3, 4).flatten(2, 3)  # [B,H,P*T,D]
        if input_pos is not None:
            assert cache is not None, "call LLM.setup_cache before decoding with input_pos"
            k_all, v_all = cache.update(input_pos, k, v)  # [rows,Hkv,S_max,D], prefixes seeded in front
            S = mask.shape[-1] if mask is not None else cache.offset + T  # mask None: prefill from token 0
            k, v = k_all[:, :, :S], v_all[:, :, :S]
        elif self.prefix_k is not None:
            pk, pv = self.prefixes(branch, R, k.dtype)
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)  # [R,Hkv,Lp+T,D]
        out = attention(q, k, v, mask)
        if shared:  # [B,H,P*T,D] -> [P*B,H,T,D]
            out = out.view(out.shape[0], out.shape[1], P, T, -1).permute(2, 0, 1, 3, 4).flatten(0, 1)
        return self.o_proj(out.transpose(1, 2).reshape(R, T, -1))  # [R,T,H*D] -> [R,T,C]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA for q [B,H,T,D] over k, v [B,Hkv,S,D] (query head h reads kv head h // (H/Hkv)), routed
    so that each case keeps a fused kernel:
    - no mask, S == T: causal; flash attention takes GQA directly (enable_gqa, nothing repeated);
    - one query token (decode): the H/Hkv query heads sharing a kv head are folded into the query
      axis, q -> [B,Hkv,G,D], so each kv head is read once with a plain masked SDPA (CPU bf16:
      1.31 -> 0.20 ms per call measured; fp32 unchanged);
    - a mask, or prefix slots in front (causal aligned bottom-right): the kernels that take a mask do
      not all take GQA, so the kv heads are repeated for this call rather than fall back to math."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if mask is None and S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if T == 1 and mask is not None:
        out = F.scaled_dot_product_attention(q.view(B, Hkv, H // Hkv, D), k, v, attn_mask=mask)  # mask [B,1,1,S]
        return out.view(B, H, 1, D)
    if Hkv != H:
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)  # [B,H,S,D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S) if mask is None else mask)


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
    def __init__(self, cfg: LLMConfig, branches: int = 1, prefix_len: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, branches, prefix_len)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, input_pos, branch=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos, branch)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """`language_model.model`: embeddings, blocks, final norm, and the rotary tables."""

    def __init__(self, cfg: LLMConfig, branches: int = 1, prefix_len: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, branches, prefix_len) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.init_rope()

    def init_rope(self, device=None) -> None:
        """(Re)build the rotary tables, e.g. after a model built on the meta device is materialised.
        InternVL3 configs may carry dynamic-NTK rope_scaling; it only acts past max_position_embeddings,
        which no sequence here reaches (the tables end there), so plain RoPE is exact."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_position_embeddings, self.cfg.rope_theta, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_pos,D] fp32
        self.register_buffer("rope_sin", sin, persistent=False)


class LLM(nn.Module):
    """`language_model`: a Qwen3ForCausalLM (or Qwen2), optionally with P prefix-conditioned branches.
    `forward` folds the branches into the batch and returns every active branch's final-normed
    hidden states, branch-major; the caller fuses them (aggregate.py) and applies lm_head."""

    def __init__(self, cfg: LLMConfig, branches: int = 1, prefix_len: int = 0):
        super().__init__()
        self.cfg = cfg
        self.branches = branches
        self.prefix_len = prefix_len if branches > 1 else 0
        self.model = Decoder(cfg, branches, prefix_len)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def cache(self) -> KVCache | None:
        return self.model.layers[0].self_attn.kv_cache

    def setup_cache(self, batch: int, max_len: int, branch: int | None = None, shared: bool = False,
                    dtype=None, device=None) -> None:
        """Allocate one static KV cache per layer for `batch` samples and `max_len` tokens, with the
        active branches' prefixes seeded in front (see KVCache for the two layouts)."""
        w = self.model.embed_tokens.weight
        cfg, Lp = self.cfg, self.prefix_len
        P = self.branches if branch is None else 1
        rows, offset = (batch, P * Lp) if shared else (P * batch, Lp)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.kv_cache = KVCache(rows, cfg.num_kv_heads, offset + max_len, cfg.head_dim, dtype or w.dtype,
                                    device or w.device, P, offset, shared, branch)
        self.seed_prefixes()

    @torch.no_grad()
    def seed_prefixes(self) -> None:
        """Copy the (current) learned prefixes into the first cache slots."""
        for layer in self.model.layers:
            attn, c = layer.self_attn, layer.self_attn.kv_cache
            if c is None or attn.prefix_k is None:
                continue
            if c.shared:  # every sample: slots p*Lp.. hold branch p's prefix
                pk, pv = (t if c.branch is None else t[c.branch : c.branch + 1] for t in (attn.prefix_k, attn.prefix_v))
                c.k[:, :, : c.offset] = pk.transpose(0, 1).flatten(1, 2).unsqueeze(0).to(c.k.dtype)  # [1,Hkv,P*Lp,D]
                c.v[:, :, : c.offset] = pv.transpose(0, 1).flatten(1, 2).unsqueeze(0).to(c.v.dtype)
            else:
                pk, pv = attn.prefixes(c.branch, c.k.shape[0], c.k.dtype)
                c.k[:, :, : c.offset], c.v[:, :, : c.offset] = pk, pv

    def forward(
        self,
        x: torch.Tensor,  # [B,T,C] input embeddings
        positions: torch.Tensor,  # [B,T] rotary positions (start at 0 per sample)
        mask: torch.Tensor | None = None,  # [B,1,T,S] bool over token slots; None = causal, no padding
        input_pos: torch.Tensor | None = None,  # [T] token slots in the cache; None = no cache
        branch: int | None = None,  # run only this branch (None: all P)
    ) -> torch.Tensor:  # [P*B,T,C] final-normed hidden states, branch-major ([B,T,C] for one branch)
        dec, Lp = self.model, self.prefix_len
        P = self.branches if branch is None else 1
        B, T, _ = x.shape
        cache = self.cache if input_pos is not None else None
        if cache is not None:
            assert cache.branch == branch, f"cache was set up for branch {cache.branch}, forward got {branch}"
            input_pos = input_pos + cache.offset
        cos = dec.rope_cos[positions].to(x.dtype)  # [B,T,D], cast like the reference does
        sin = dec.rope_sin[positions].to(x.dtype)
        if P > 1:  # fold the branches into the batch, branch-major
            x, cos, sin = x.repeat(P, 1, 1), cos.repeat(P, 1, 1), sin.repeat(P, 1, 1)  # [P*B,T,...]
        if cache is not None and cache.shared:
            mask = shared_kv_mask(mask, B, T, P, Lp, x.device)
        elif mask is not None:
            if Lp > 0:  # the prefix slots are visible to every token
                mask = torch.cat([mask.new_ones(B, 1, T, Lp), mask], dim=-1)  # [B,1,T,Lp+S]
            if P > 1:
                mask = mask.repeat(P, 1, 1, 1)  # [P*B,1,T,Lp+S]
        for layer in dec.layers:
            x = layer(x, cos, sin, mask, input_pos, branch)
        return dec.norm(x)


def shared_kv_mask(mask: torch.Tensor | None, B: int, T: int, P: int, Lp: int, device) -> torch.Tensor:
    """Mask [B,1,P*T,P*Lp+S] for shared-KV attention: query row p*T + t (branch p, token t) sees only
    branch p's prefix block and the token slots its token-level mask [B,1,T,S] allows."""
    if mask is None:  # prefill from token 0 without padding: plain causal over the T tokens
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None].expand(B, 1, T, T)
    own = torch.eye(P, dtype=torch.bool, device=device).repeat_interleave(T, 0).repeat_interleave(Lp, 1)  # [P*T,P*Lp]
    return torch.cat([own.expand(B, 1, P * T, P * Lp), mask.repeat(1, 1, P, 1)], dim=-1)
