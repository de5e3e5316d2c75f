"""Parameter and FLOP accounting of ParVL (paper, Appendix B.2, Table S3), from the config alone:
profiling.py prints it (`python profiling.py params --all`), evaluate.py's report breaks ties by it.

    profile_params("1b", pv=2, pl=4)    # {"vit_params": ..., "llm_gflops": ..., "total_gflops": ...}

Parameters are counted from the real module tree built on the meta device, so no weight is
allocated: vit = vision_model.* + vision_aggregator.*, connector = mlp1.*, llm = language_model.*
+ language_aggregator.* (a tied lm_head is counted once). FLOPs are analytic, from the config, for
the paper's fixed workload at batch size 1: 3 tiles (768 image tokens), 256 text tokens, 128
response tokens, the LLM evaluated at 768 + 256 + 128 = 1152 tokens in one forward pass.

Counting convention: the paper used calflops, which patches torch.nn.functional and counts what
passes through it, so this file counts the same things:
  - Linear: 2 x multiply-accumulates (2 * tokens * fan_in * fan_out); biases are free.
    Conv2d: 2 x MACs plus one add per output element for its bias.
  - LayerNorm (affine): 5 FLOPs per element. nn.GELU and SiLU: 1 per element. Softmax: 1 per element.
  - Not counted, because calflops never sees them: attention score and value products
    (F.scaled_dot_product_attention / flash-attn), Qwen's RMSNorm and RoPE (tensor methods and
    operators), residual adds and layer scale, embedding lookups, and InternViT's GELU (its
    GELUActivation binds F.gelu at construction, before calflops patches it). So the learned
    prefixes add parameters but, under this convention, no FLOPs.
  - Branches: the ViT patch embedding runs once; the Pv ViT branches each run every block over
    all 1025 tokens of every tile; the vision aggregator runs once per token (CLS included, it is
    dropped after aggregation); pixel shuffle and the connector run once; the Pl LLM branches each
    run the decoder blocks over all 1152 tokens; the language aggregator and lm_head run once per
    token, after aggregation. A Qwen3-MoE layer counts its router (linear and softmax) and the K experts
    each token runs (their linears and SiLU), not the E - K it skips; `*_active_params` count only those
    K too (idle_expert_params). An aggregator (P*C -> C, SiLU, C -> P, softmax) exists only for P > 1.
  - LoRA vision branches (Figure 3): each branch's update of qkv, proj, fc1 and fc2 is two linears
    (fan_in -> r -> fan_out) over that branch's tokens, counted as linears; no prefix.
This reproduces Table S3 (tests/test_profiling.py): every parameter entry to 0.01 M, the LLM and
connector FLOPs to the table's rounding, the ViT and total FLOPs within 1e-5 relative. The
paper's ViT entries sit a constant 0.016 GFLOPs above this count at every Pv: the size of one
more affine LayerNorm over the 3 x 1025 x 1024 ViT outputs, once per forward (or of the
connector's LayerNorm counted a second time). Our ViT has no final norm, so it is not added here.
"""

from __future__ import annotations

import dataclasses

import torch

from config import PRESETS, LLMConfig, ParVLConfig, ViTConfig
from parvl import ParVL

# Which top-level modules each Table S3 column sums; aggregators belong to their modality.
GROUPS = {
    "vit": ("vision_model.", "vision_aggregator."),
    "connector": ("mlp1.",),
    "llm": ("language_model.", "language_aggregator."),
}
BRANCHES = (1, 2, 4)  # the paper's grid: Pv, Pl in {1, 2, 4}
# "mid": branch scaling timed on a CPU (a 4:4 forward of 1 tile + 128 text tokens: ~1.3 s on one core).
# Real tiles (448 px, 1025 ViT tokens) and prefix lengths (96 / 48); smaller widths, depths, vocabulary.
MID = ParVLConfig(
    ViTConfig(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4),
    LLMConfig(
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
    ),
    image_token_id=32000,
)
ARCHS = PRESETS | {"mid": MID}


@dataclasses.dataclass(frozen=True)
class Workload:
    """The fixed forward pass of Table S3 and the latency profile (batch size 1)."""

    tiles: int = 3  # 448 px tiles, 256 image tokens each after pixel shuffle
    text_tokens: int = 256
    response_tokens: int = 128

    def image_tokens(self, cfg: ParVLConfig) -> int:  # 768 for the defaults
        return 0 if cfg.vit is None else self.tiles * cfg.tokens_per_tile

    def llm_tokens(
        self, cfg: ParVLConfig
    ) -> int:  # 1152 for the defaults: the whole prompt + response
        return self.image_tokens(cfg) + self.text_tokens + self.response_tokens


def build_config(arch: str, pv: int, pl: int, **branches) -> ParVLConfig:
    """The preset with these branch counts; branches: other ParConfig fields (vision_branches="lora",
    lora_rank=16), else the preset's prefix lengths and aggregation."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}, choose from {sorted(ARCHS)}")
    base = ARCHS[arch]
    return dataclasses.replace(base, par=dataclasses.replace(base.par, pv=pv, pl=pl, **branches))


def meta_model(cfg: ParVLConfig) -> ParVL:
    """The full module tree with every tensor on the meta device: shapes only, no storage."""
    with torch.device("meta"):
        return ParVL(cfg)


def count_params(model: ParVL) -> dict[str, int]:
    counts = dict.fromkeys(GROUPS, 0)
    for name, p in model.named_parameters():  # shared (tied) tensors are yielded once
        group = [g for g, prefixes in GROUPS.items() if name.startswith(prefixes)]
        assert len(group) == 1, f"parameter {name} belongs to no Table S3 group: {group}"
        counts[group[0]] += p.numel()
    return counts


def idle_expert_params(m: LLMConfig) -> int:
    """The parameters a token does not run in a Qwen3-MoE decoder: per sparse layer, the E - K experts it
    is not routed to (each 3 x C x I: gate, up, down); 0 for a dense one. Total minus this is the
    "active" count of a name like 30B-A3B."""
    sparse = sum(m.is_sparse(i) for i in range(m.num_layers))
    return (
        sparse
        * (m.num_experts - m.num_experts_per_tok)
        * 3
        * m.hidden_size
        * m.moe_intermediate_size
    )


# -- FLOPs, one function per part (calflops convention, see the module docstring) ----------------


def linear(tokens: int, fan_in: int, fan_out: int) -> int:
    return 2 * tokens * fan_in * fan_out


def aggregator_flops(cfg: ParVLConfig, tokens: int, width: int, p: int) -> int:
    """Eq. 2's MLP g_m over the concatenated branch states: P*C -> C, SiLU, C -> P, softmax."""
    if p == 1 or cfg.par.aggregation == "mean":
        return 0  # no MLP: one branch passes through, mean fusion has no weights to predict
    return linear(tokens, p * width, width) + tokens * width + linear(tokens, width, p) + tokens * p


def vit_flops(cfg: ParVLConfig, tiles: int) -> int:
    v, pv = cfg.vit, cfg.par.pv
    if v is None:
        return 0
    C, I, patches = v.hidden_size, v.intermediate_size, v.grid**2
    tokens = tiles * (1 + patches)  # CLS + patches per tile
    # conv + bias
    patch_embed = linear(tiles * patches, 3 * v.patch_size**2, C) + tiles * patches * C
    block = (
        linear(tokens, C, 3 * C)
        + linear(tokens, C, C)
        + linear(tokens, C, I)
        + linear(tokens, I, C)
    )
    # each branch's low-rank updates of the four linears
    if pv > 1 and cfg.par.vision_branches == "lora":
        r = cfg.par.lora_rank
        block += sum(
            linear(tokens, a, r) + linear(tokens, r, b)
            for a, b in ((C, 3 * C), (C, C), (C, I), (I, C))
        )
    if v.norm_type == "layer_norm":  # norm1, norm2; InternViT-6B's RMSNorm is invisible to calflops
        block += 2 * 5 * tokens * C
    return patch_embed + pv * cfg.vit_layers * block + aggregator_flops(cfg, tokens, C, pv)


def connector_flops(cfg: ParVLConfig, tiles: int) -> int:
    if cfg.vit is None:
        return 0
    tokens = tiles * cfg.tokens_per_tile
    Cs, D = cfg.vit.hidden_size * round(1 / cfg.downsample_ratio) ** 2, cfg.llm.hidden_size
    # LN, fc, GELU, fc
    return 5 * tokens * Cs + linear(tokens, Cs, D) + tokens * D + linear(tokens, D, D)


def llm_flops(cfg: ParVLConfig, tokens: int) -> int:
    m, pl = cfg.llm, cfg.par.pl
    C, I, HD, KD = (
        m.hidden_size,
        m.intermediate_size,
        m.num_heads * m.head_dim,
        m.num_kv_heads * m.head_dim,
    )
    attn = linear(tokens, C, HD) + 2 * linear(tokens, C, KD) + linear(tokens, HD, C)  # q, k, v, o
    mlp = 3 * linear(tokens, C, I) + tokens * I  # gate, up, down and the SiLU
    # Qwen3-MoE: the router's linear and softmax, then K experts' SwiGLU per token (top-k is not counted)
    E, K, Im = m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size
    moe = linear(tokens, C, E) + tokens * E + K * (3 * linear(tokens, C, Im) + tokens * Im)
    sparse = sum(m.is_sparse(i) for i in range(m.num_layers))
    layers = (m.num_layers - sparse) * (attn + mlp) + sparse * (attn + moe)
    lm_head = linear(tokens, C, m.vocab_size)
    return pl * layers + aggregator_flops(cfg, tokens, C, pl) + lm_head


def profile_params(arch: str, pv: int, pl: int, work: Workload = Workload(), **branches) -> dict:
    """One Table S3 row: parameter counts (integers) and forward GFLOPs per part; branches: as build_config."""
    cfg = build_config(arch, pv, pl, **branches)
    params = count_params(meta_model(cfg))
    flops = {
        "vit": vit_flops(cfg, work.tiles),
        "connector": connector_flops(cfg, work.tiles),
        "llm": llm_flops(cfg, work.llm_tokens(cfg)),
    }
    row = {"arch": arch, "pv": pv, "pl": pl, "vision_branches": cfg.par.vision_branches}
    row |= {f"{k}_params": n for k, n in params.items()} | {"total_params": sum(params.values())}
    idle = idle_expert_params(cfg.llm)  # a MoE decoder runs K of its E experts per token
    row |= {
        "llm_active_params": params["llm"] - idle,
        "total_active_params": row["total_params"] - idle,
    }
    row |= {f"{k}_gflops": f / 1e9 for k, f in flops.items()} | {
        "total_gflops": sum(flops.values()) / 1e9
    }
    return row
