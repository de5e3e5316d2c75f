"""InternViT, the vision encoder of InternVL3.5, in plain PyTorch.

InternViT-300M-448px-V2_5: a 14x14 patch embedding with a class token and learned position
embeddings, 24 pre-norm blocks (fused qkv attention, exact-erf GELU MLP, layer scale on both
branch outputs) and no final norm. The InternViT-6B style (RMSNorm, q/k normalisation over the
whole width, no qkv bias) is a config away. ParVL (paper, "Method") runs Pv branches of this
encoder folded into the batch dimension, each with learned key/value prefixes in every layer.

Parameter names mirror the official `vision_model.*` checkpoint keys, so an InternVL checkpoint
loads with no renaming. Shape legend: aggregate.py's (here B = N tiles,
T = 1 + patches, C the ViT width).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from aggregate import LoRA, PrefixKV, Rows, lora_linear, prefix_attention, to_rows
from config import ViTConfig


class RMSNorm(nn.Module):
    """InternViT-6B's own RMSNorm (InternRMSNorm): normalise in fp32, cast back to the input dtype, then
    scale. The same arithmetic as Qwen's (llm.rms_norm); each tower keeps its own, as the official code does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )


def make_norm(cfg: ViTConfig, dim: int) -> nn.Module:
    return (
        nn.LayerNorm(dim, eps=cfg.norm_eps)
        if cfg.norm_type == "layer_norm"
        else RMSNorm(dim, cfg.norm_eps)
    )


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth: drop the whole residual branch per sample, rescale the survivors."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1.0 - p)
    return x * keep / (1.0 - p)


class Embeddings(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.hidden_size
        # bare parameters, as in the checkpoint: `class_embedding`, `position_embedding` (no .weight)
        self.class_embedding = nn.Parameter(torch.zeros(1, 1, C))
        self.patch_embedding = nn.Conv2d(3, C, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Parameter(torch.zeros(1, 1 + cfg.grid**2, C))

    def position_for(self, h: int, w: int) -> torch.Tensor:
        """Position embedding for an h x w patch grid: [1, 1 + h*w, C]."""
        pos = self.position_embedding
        g = self.cfg.grid
        # bicubic resize to the same grid is the identity (checked: max diff 0)
        if (h, w) == (g, g):
            return pos
        # the official encoder resizes the patch part in fp32, bicubic, align_corners=False
        patch = pos[:, 1:].reshape(1, g, g, -1).permute(0, 3, 1, 2).float()  # [1,C,g,g]
        patch = F.interpolate(patch, size=(h, w), mode="bicubic", align_corners=False)
        patch = patch.flatten(2).transpose(1, 2).to(pos.dtype)  # [1,h*w,C]
        return torch.cat([pos[:, :1], patch], dim=1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [N,C,h,w]
        h, w = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)  # [N,h*w,C], row-major patches
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)  # [N,1,C]
        x = torch.cat([cls, x], dim=1)  # [N,T,C]
        return x + self.position_for(h, w).to(x.dtype)


class Attention(PrefixKV):
    """Bidirectional self-attention with a fused qkv projection (rows ordered q | k | v). With P > 1
    branches each branch has learned key/value prefixes [P,H,Lp,D]; each row attends with its own
    branch's prefix in front of its keys and values (Eq. 1, aggregate.prefix_attention), no mask."""

    def __init__(self, cfg: ViTConfig, branches: int = 1, prefix_len: int = 0, lora_rank: int = 0):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        C = cfg.hidden_size
        self.qkv = nn.Linear(C, 3 * C, bias=cfg.qkv_bias)
        self.proj = nn.Linear(C, C)
        # LoRA vision branches: no prefix, an update of each linear
        lora = branches > 1 and lora_rank > 0
        self.qkv_lora = LoRA(branches, lora_rank, C, 3 * C) if lora else None
        self.proj_lora = LoRA(branches, lora_rank, C, C) if lora else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(C, cfg.norm_eps)
            self.k_norm = RMSNorm(C, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.add_prefixes(branches, cfg.num_heads, prefix_len, cfg.head_dim)

    def forward(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        R, T, C = x.shape
        q, k, v = lora_linear(self.qkv, self.qkv_lora, x, rows).split(C, dim=-1)  # 3 x [R,T,C]
        if self.qk_norm:  # over the whole width, all heads jointly (InternViT-6B)
            q, k = self.q_norm(q), self.k_norm(k)
        # [R,H,T,D]
        q, k, v = (t.view(R, T, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        pk, pv = self.row_prefixes(rows, k.dtype)  # each row's own branch prefix: [R,H,Lp,D]
        out = prefix_attention(q, k, v, pk, pv, causal=False)  # [R,H,T,D]
        return lora_linear(self.proj, self.proj_lora, out.transpose(1, 2).reshape(R, T, C), rows)


class MLP(nn.Module):
    def __init__(self, cfg: ViTConfig, branches: int = 1, lora_rank: int = 0):
        super().__init__()
        C, I = cfg.hidden_size, cfg.intermediate_size
        self.fc1 = nn.Linear(C, I)
        self.fc2 = nn.Linear(I, C)
        lora = branches > 1 and lora_rank > 0
        self.fc1_lora = LoRA(branches, lora_rank, C, I) if lora else None
        self.fc2_lora = LoRA(branches, lora_rank, I, C) if lora else None

    def forward(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        # exact erf GELU, as the checkpoint was trained
        h = F.gelu(lora_linear(self.fc1, self.fc1_lora, x, rows))
        return lora_linear(self.fc2, self.fc2_lora, h, rows)


class Block(nn.Module):
    def __init__(
        self,
        cfg: ViTConfig,
        drop_path_rate: float,
        branches: int = 1,
        prefix_len: int = 0,
        lora_rank: int = 0,
    ):
        super().__init__()
        C = cfg.hidden_size
        self.norm1 = make_norm(cfg, C)
        self.attn = Attention(cfg, branches, prefix_len, lora_rank)
        self.norm2 = make_norm(cfg, C)
        self.mlp = MLP(cfg, branches, lora_rank)
        self.ls1 = nn.Parameter(torch.ones(C))  # layer scale: multiplies the branch output
        self.ls2 = nn.Parameter(torch.ones(C))
        self.drop_path_rate = drop_path_rate

    def forward(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        p = self.drop_path_rate
        x = x + drop_path(self.attn(self.norm1(x).to(x.dtype), rows) * self.ls1, p, self.training)
        x = x + drop_path(self.mlp(self.norm2(x).to(x.dtype), rows) * self.ls2, p, self.training)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: ViTConfig, branches: int = 1, prefix_len: int = 0, lora_rank: int = 0):
        super().__init__()
        n = cfg.num_layers
        rates = [cfg.drop_path_rate * i / max(n - 1, 1) for i in range(n)]  # linspace(0, rate, n)
        self.layers = nn.ModuleList(Block(cfg, r, branches, prefix_len, lora_rank) for r in rates)


class ViT(nn.Module):
    """InternViT, optionally with P branches, each conditioned by its key/value prefixes or (lora_rank
    > 0, Figure 3's alternative) by its low-rank updates of qkv, proj, fc1 and fc2, the linears
    InternVL's own wrap_backbone_lora adapts in the ViT. `forward` returns hidden state number
    `num_layers` (0 = the embeddings; no final norm) of every row: each tile once per branch it runs
    (see aggregate.Rows)."""

    def __init__(self, cfg: ViTConfig, branches: int = 1, prefix_len: int = 0, lora_rank: int = 0):
        super().__init__()
        self.cfg, self.branches = cfg, branches
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg, branches, 0 if lora_rank else prefix_len, lora_rank)

    def forward(
        self,
        pixel_values: torch.Tensor,  # [N,3,px,px]
        rows: Rows | None = None,  # which branch each row runs; None: all P, dense
        num_layers: int | None = None,  # run only the first num_layers blocks (select_layer)
    ) -> torch.Tensor:  # [R,T,C]: [P*N,T,C] dense (branch-major), [N,T,C] with a branch per tile
        if rows is None:
            rows = Rows.choose(None, self.branches, pixel_values.shape[0], pixel_values.device)
        # [R,T,C]: the embedding is computed once per tile
        x = to_rows(self.embeddings(pixel_values), rows)
        layers = self.encoder.layers[: self.cfg.num_layers if num_layers is None else num_layers]
        for layer in layers:
            x = layer(x, rows)
        return x
