"""Token-wise fusion of P parallel branches (ParVL paper, "Vision and Language Branch Aggregation",
Eq. 2; ParScale's dynamic weighted sum).

For every token the P branch states are concatenated branch-major, c = [z_1; ...; z_P] (P*C), a
two-layer SiLU MLP maps c to P logits, a softmax over branches (in fp32) gives the weights, which
are smoothed toward uniform, a' = (1 - lambda) a + lambda / P, and the fused state is sum_k a'_k z_k.
Mean aggregation (a' = 1/P) is the ablation of Appendix D.1. The vision branches are fused before
CLS removal and pixel shuffle, the language branches after the final norm, before the lm_head.

Branches arrive folded into the batch dimension, branch-major: row p*B + b is branch p of sample b.
This is the one place they are unfolded. Shape legend: P branches, B batch, T tokens, C width.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class Aggregator(nn.Module):
    def __init__(self, branches: int, width: int, smoothing: float = 0.0, kind: str = "mlp"):
        super().__init__()
        if kind not in ("mlp", "mean"):
            raise ValueError(f"aggregation must be 'mlp' or 'mean', got {kind!r}")
        if not 0.0 <= smoothing <= 1.0:
            raise ValueError(f"aggregation smoothing lambda must be in [0, 1], got {smoothing}")
        self.branches, self.smoothing, self.kind = branches, smoothing, kind
        if kind == "mlp":  # ParScale's aggregate_layer: P*C -> C -> P
            self.mlp = nn.Sequential(nn.Linear(branches * width, width), nn.SiLU(), nn.Linear(width, branches))

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

    def reset_parameters(self) -> None:
        """Start from uniform weights: the last layer is zero, so the MLP emits equal logits and the
        fused state is the plain mean of the branches until training moves it (see parvl.init_branches)."""
        if self.kind == "mlp":
            nn.init.normal_(self.mlp[0].weight, std=0.02)
            nn.init.zeros_(self.mlp[0].bias)
            nn.init.zeros_(self.mlp[2].weight)
            nn.init.zeros_(self.mlp[2].bias)


def entropy(w_BTP: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of branch weights [..., P]; log P means uniform, 0 means collapse."""
    return -(w_BTP * w_BTP.clamp_min(1e-12).log()).sum(-1).mean()


def mean_branches(z: torch.Tensor, branches: int) -> torch.Tensor:
    """[P*B,...] branch-major -> [B,...] mean over branches in fp32, cast back (shared-KV reduction)."""
    return z.view(branches, -1, *z.shape[1:]).float().mean(0).to(z.dtype)

