"""The sparse MLP of Qwen3-MoE (InternVL3.5-30B-A3B and 241B-A28B), in plain PyTorch: a linear gate scores
every expert for every token, the top k run, their SwiGLU outputs summed with the routing weights.

    moe = SparseMoE(cfg)                 # cfg: an LLMConfig with num_experts > 0
    y = moe(x)                           # [..., C] -> [..., C], every token routed on its own

The routing is the official model's (Qwen3MoeSparseMoeBlock): the gate's softmax in fp32, top-k of the
probabilities, renormalised to sum to 1 where the config says so (norm_topk_prob), cast back to the
activation dtype, and each chosen expert's output scaled by its weight and added in expert order.

The experts are held stacked, one tensor per projection, gate_up_proj [E,2I,C] (gate rows then up rows,
per expert) and down_proj [E,C,I], as transformers 5 holds them: FSDP2 shards them on dim 0, the expert
dimension, as it shards every other weight; the checkpoint's per-expert keys
(`mlp.experts.{e}.gate_proj.weight`, ...) are stacked once at load and unstacked at save (loading/).
One formulation serves prefill, decode and training: the N*K (token, expert) pairs are sorted by expert,
and one grouped matrix product per projection (F.grouped_mm) runs every expert over its contiguous rows
(where grouped_mm cannot run, in a compiled fp32 step or in fp32 on a GPU, each pair's row is multiplied by
its expert's gathered weights: Experts.forward). The shapes are static (always N*K rows), nothing reads a tensor value
on the host and no Python loop runs over the experts, so it compiles into the decode step whole
(docs/performance.md measures it on CPU against a loop over experts, which syncs the host once per
expert, and against running every expert on every token, E/K times the work).

A ParVL branch is a row of its own (aggregate.Rows): its tokens carry their branch's prefix context, so
they are routed on their own states, and two branches of one sample may choose different experts.

Shape legend (aggregate.py's, plus): N tokens (rows x T, flattened), E experts, K experts per token,
I an expert's width.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from config import LLMConfig

# torch.nn.functional.grouped_mm is the public name of torch._grouped_mm in newer torch; the project runs on
# torch 2.11 and newer, where the private name has the same signature
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


def route(
    logits: torch.Tensor, k: int, renormalise: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's top-k routing of gate logits [N,E]: softmax in fp32, the k largest probabilities
    (renormalised to sum to 1 when `renormalise`), cast to `dtype`. Returns weights [N,K], experts [N,K]."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [N,E]
    weights, experts = torch.topk(probs, k, dim=-1)  # [N,K]
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


def grouped_experts(
    x: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over rows sorted by expert: x [N*K,C], expert e's rows ending at offsets[e] (int32,
    [E]); gate_up [E,2I,C], down [E,C,I]. One grouped product per projection: row group e times its own
    expert's matrix (the transposed views, no copy)."""
    h = grouped_mm(x, gate_up.transpose(1, 2), offs=offsets)  # [N*K,2I]
    gate, up = h.chunk(2, dim=-1)  # [N*K,I] each
    return grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)  # [N*K,C]


def gathered_experts(
    x: torch.Tensor, expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The same SwiGLU experts with each row times its own expert's weights, gathered: expert [N*K] the
    expert of each row. K weight copies per token: for the few rows of a decode step."""
    h = torch.bmm(gate_up[expert], x[:, :, None])  # [N*K,2I,C] @ [N*K,C,1]
    gate, up = h.squeeze(-1).chunk(2, dim=-1)  # [N*K,I] each
    return torch.bmm(down[expert], (F.silu(gate) * up)[:, :, None]).squeeze(-1)  # [N*K,C]


class Experts(nn.Module):
    """E SwiGLU experts stacked: `gate_up_proj` [E,2I,C] (rows 0:I gate, I:2I up) and `down_proj` [E,C,I]."""

    def __init__(self, num_experts: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """x [N*K,C] sorted by expert, expert e's rows ending at offsets[e]; expert [N*K] each row's.
        grouped_mm's CUDA kernels and its compile-time shape check take bf16 only, its CPU kernel any
        dtype: so bf16 anywhere and eager CPU run the grouped products, and the rest (a compiled fp32
        decode step, fp32 on a GPU) the gathered weights (docs/performance.md: bench/bench_moe.py)."""
        if x.dtype == torch.bfloat16 or (
            x.device.type == "cpu" and not torch.compiler.is_compiling()
        ):
            return grouped_experts(x, offsets, self.gate_up_proj, self.down_proj)
        return gathered_experts(x, expert, self.gate_up_proj, self.down_proj)


class SparseMoE(nn.Module):
    """`mlp` of a sparse Qwen3-MoE layer: `gate` (Linear C -> E, no bias) and `experts` (Experts)."""

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.num_experts, self.top_k, self.renormalise = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
        )
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, C, K = x.shape, x.shape[-1], self.top_k
        x = x.reshape(-1, C)  # [N,C]
        weights, experts = route(self.gate(x), K, self.renormalise, x.dtype)  # [N,K], [N,K]
        # the N*K (token, expert) pairs sorted by expert (stable: a token's pairs keep their order)
        order = experts.flatten().argsort(stable=True)  # [N*K]
        token = order // K  # [N*K] the token of each sorted pair
        # rows per expert by a scatter, not bincount: a static [E] shape, no host sync
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.index_add_(0, experts.flatten(), torch.ones_like(order, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)  # [E] where each expert's rows end
        out = self.experts(x[token], offsets, experts.flatten()[order])  # [N*K,C]
        out = out * weights.flatten()[order, None]  # each expert's output at its routing weight
        y = torch.zeros_like(x).index_add_(0, token, out)  # [N,C] summed per token
        return y.reshape(shape)
