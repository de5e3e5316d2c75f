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
    """Static per-layer cache [B,Hkv,S,D], written in place (no torch.cat: CUDA graphs need fixed shapes)."""

    def __init__(self, batch: int, num_kv_heads: int, max_len: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # input_pos [T] cache slots; k, v [B,Hkv,T,D]
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, cfg: LLMConfig):
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
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: torch.Tensor,  # [B,T,C]
        cos: torch.Tensor,  # [B,T,D]
        sin: torch.Tensor,  # [B,T,D]
        mask: torch.Tensor | None,  # [B,1,T,S] bool over cache slots 0..S-1; None = plain causal over these T
        input_pos: torch.Tensor | None,  # [T] cache slots to write, None = no cache
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3: per-head norm over D, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B,H,T,D], [B,Hkv,T,D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if input_pos is not None:
            assert self.kv_cache is not None, "call LLM.setup_cache before decoding with input_pos"
            k_all, v_all = self.kv_cache.update(input_pos, k, v)  # [B,Hkv,S_max,D]
            if mask is not None:  # attend over the cache slots the mask covers
                k, v = k_all[:, :, : mask.shape[-1]], v_all[:, :, : mask.shape[-1]]  # [B,Hkv,S,D]
            # mask None: a prefill from slot 0 with no padding; the fresh k, v are the whole sequence
        # GQA without materialising repeated kv heads: query head h reads kv head h // (H / Hkv)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # [B,T,H*D] -> [B,T,C]


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
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, input_pos) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """`language_model.model`: embeddings, blocks, final norm, and the rotary tables."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
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
    """`language_model`: a Qwen3ForCausalLM (or Qwen2) without the generation machinery."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def setup_cache(self, batch: int, max_len: int, dtype=None, device=None) -> None:
        """Allocate one static KV cache per layer: [batch, Hkv, max_len, D]."""
        w = self.model.embed_tokens.weight
        cfg = self.cfg
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(
                batch, cfg.num_kv_heads, max_len, cfg.head_dim, dtype or w.dtype, device or w.device
            )

    def forward(
        self,
        x: torch.Tensor,  # [B,T,C] input embeddings
        positions: torch.Tensor,  # [B,T] rotary positions (start at 0 per sample)
        mask: torch.Tensor | None = None,  # [B,1,T,S] bool; None = causal, no padding, no cache
        input_pos: torch.Tensor | None = None,  # [T] cache slots; None = no cache
    ) -> torch.Tensor:  # [B,T,C] final-normed hidden states (apply lm_head for logits)
        dec = self.model
        cos = dec.rope_cos[positions].to(x.dtype)  # [B,T,D], cast like the reference does
        sin = dec.rope_sin[positions].to(x.dtype)
        for layer in dec.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return dec.norm(x)
