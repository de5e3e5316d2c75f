"""The configuration of ParVL, one small dataclass per part: the two towers (ViTConfig, LLMConfig), the
branches (ParConfig, paper "Method"), composed into ParVLConfig; and the named presets (PRESETS), the
released InternVL3.5 sizes and a tiny one that runs on CPU in seconds.

    cfg = PRESETS["1b"]                                            # InternVL3.5-1B: Pv = Pl = 1
    cfg = dataclasses.replace(PRESETS["tiny"], par=ParConfig(pv=2, pl=2))

Nothing here reads a file or parses a flag: config.json's spellings are loading/checkpoint.py's, the
command line's inference/flags.py's. ParConfig's fields document themselves once for both (field
metadata: "help", "range" as an interval such as "[1, inf)", "choices"); inference/flags.py makes a
command's branch flags of them, loading/checkpoint.py reads config.json's "parvl" block against them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class ViTConfig:
    """InternViT-300M-448px-V2_5 by default; InternViT-6B is norm_type "rms_norm", qk_norm, no qkv bias."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 24
    num_heads: int = 16
    patch_size: int = 14
    image_size: int = 448  # the size the position embedding was trained at
    qkv_bias: bool = True
    qk_norm: bool = False  # InternViT-6B: RMSNorm over the full width of q and k
    norm_type: str = "layer_norm"  # or "rms_norm" (InternViT-6B)
    norm_eps: float = 1e-6
    drop_path_rate: float = 0.0  # stochastic depth, linearly increasing per layer, training only

    def __post_init__(self):
        assert self.hidden_size % self.num_heads == 0, (self.hidden_size, self.num_heads)
        assert self.image_size % self.patch_size == 0, (self.image_size, self.patch_size)
        if self.norm_type not in ("layer_norm", "rms_norm"):
            raise ValueError(
                f"vision norm_type must be layer_norm or rms_norm, got {self.norm_type!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid(self) -> int:  # patches per side: 32 for 448 px tiles of 14 px
        return self.image_size // self.patch_size


@dataclass
class LLMConfig:
    """Qwen3 (InternVL3.5) by default; Qwen2/2.5 (InternVL3) is qkv_bias, no qk_norm."""

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
    # Qwen3-MoE (InternVL3.5-30B-A3B, 241B-A28B): num_experts > 0 makes the MLP of every sparse layer a
    # routed mixture (moe.py); 0 is a dense decoder and the fields below are unused.
    num_experts: int = 0  # experts per sparse layer (Qwen3-30B-A3B, 235B-A22B: 128)
    num_experts_per_tok: int = 8  # top-k experts each token runs
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (30B-A3B: 768, 235B-A22B: 1536)
    norm_topk_prob: bool = (
        True  # renormalise the k routing weights to sum to 1 (both released: true)
    )
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (these stay dense)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert self.head_dim % 2 == 0, self.head_dim
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.num_experts:
            assert 1 <= self.num_experts_per_tok <= self.num_experts, (
                self.num_experts_per_tok,
                self.num_experts,
            )
            assert self.moe_intermediate_size > 0 and self.decoder_sparse_step > 0, self

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) routes its tokens through experts, as Qwen3-MoE decides it
        (Qwen3MoeDecoderLayer): experts exist, the layer is on the sparse step and not listed as dense."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def range_error(value: float, interval: str) -> str | None:
    """What is wrong with a value outside its interval ("[1, inf)", "(0, 1]", ...), as "must be >= 1, got 0",
    or None inside it. (The shell's flags word a flag out of range alike, shell/flags.py's out_of_range; the
    model's files import nothing of the shell.)"""
    low, high = (float(x) for x in interval[1:-1].split(","))
    if (low < value or interval[0] == "[" and value == low) and (
        value < high or interval[-1] == "]" and value == high
    ):
        return None
    low = int(low) if low.is_integer() else low
    bound = (
        (f">= {low}" if interval[0] == "[" else f"> {low}")
        if high == float("inf")
        else f"in {interval}"
    )
    return f"must be {bound}, got {value}"


@dataclass
class ParConfig:
    """The ParVL branches. Pv = Pl = 1 adds nothing: the model is exactly InternVL3.5. A value out of its
    range or choices is a ValueError naming the field ("lora_rank must be >= 1, got 0")."""

    pv: int = field(
        default=1,
        metadata={"help": "vision branches Pv (the paper studies 1, 2, 4)", "range": "[1, inf)"},
    )
    pl: int = field(
        default=1,
        metadata={"help": "language branches Pl (the paper studies 1, 2, 4)", "range": "[1, inf)"},
    )
    vit_prefix_len: int = field(
        default=96,
        metadata={
            "help": "key/value prefix tokens per ViT layer and vision branch (the paper: 96; Figure 3 sweeps 72, 96, "
            "128)",
            "range": "[0, inf)",
        },
    )
    llm_prefix_len: int = field(
        default=48,
        metadata={
            "help": "key/value prefix tokens per LLM layer and language branch (the paper: 48)",
            "range": "[0, inf)",
        },
    )
    lambda_v: float = field(
        default=0.0,
        metadata={
            "help": "smoothing of the vision branch weights toward uniform (the paper: 0)",
            "range": "[0, 1]",
        },
    )
    lambda_l: float = field(
        default=0.1,
        metadata={
            "help": "smoothing of the language branch weights toward uniform (the paper: 0.1)",
            "range": "[0, 1]",
        },
    )
    aggregation: str = field(
        default="mlp",
        metadata={
            "help": "how branches fuse: mlp (Eq. 2, the paper's) or mean (Table S8's ablation)",
            "choices": ["mlp", "mean"],
        },
    )
    vision_branches: str = field(
        default="prefix",
        metadata={
            "help": "prefix (Eq. 1, the paper's) or lora: a low-rank update of the ViT's qkv, proj, fc1, "
            "fc2 per vision branch (Figure 3; B starts at zero, alpha = 2 x rank)",
            "choices": ["prefix", "lora"],
        },
    )
    lora_rank: int = field(
        default=16,
        metadata={"help": "rank of lora vision branches (the paper's best)", "range": "[1, inf)"},
    )

    def __post_init__(self):
        """Each field's type, range and choices, in field order (a config.json's "parvl" block is one too)."""
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            kind = type(f.default)  # int, float or str: what a value must be
            if isinstance(value, bool) or not isinstance(
                value, (int, float) if kind is float else kind
            ):
                raise ValueError(
                    f"{f.name} must be {'a string' if kind is str else 'a number'}"
                    f"{' (an integer)' if kind is int else ''}, got {value!r}"
                )
            if "range" in meta and (why := range_error(value, meta["range"])):
                raise ValueError(f"{f.name} {why}")
            if "choices" in meta and value not in meta["choices"]:
                raise ValueError(
                    f"{f.name} must be {' or '.join(map(repr, meta['choices']))}, got {value!r}"
                )


@dataclass
class ParVLConfig:
    vit: ViTConfig | None = field(default_factory=ViTConfig)  # None: language-only (ParScale)
    llm: LLMConfig = field(default_factory=LLMConfig)
    par: ParConfig = field(default_factory=ParConfig)
    downsample_ratio: float = 0.5  # pixel shuffle: 2x2 neighbouring patches -> one token
    ps_version: str = "v2"  # v1 leaves the token grid transposed (older checkpoints)
    select_layer: int = -1  # which ViT hidden state feeds the connector (-1 = last)
    image_token_id: int = 151671  # <IMG_CONTEXT> of the InternVL3.5 tokenizer
    max_dynamic_patch: int = 12
    use_thumbnail: bool = True
    template: str = "internvl2_5"

    def __post_init__(self):
        r = round(1 / self.downsample_ratio)
        assert self.vit is None or (r * self.downsample_ratio == 1.0 and self.vit.grid % r == 0), (
            self.downsample_ratio
        )
        if self.vit is None and self.par.pv != 1:
            raise ValueError("a language-only model has no vision branches: pv must be 1")
        if self.ps_version not in ("v1", "v2"):
            raise ValueError(f"ps_version must be v1 or v2, got {self.ps_version!r}")

    @property
    def tokens_per_tile(self) -> int:  # 256 for 448 px tiles; 0 for a language-only model
        return round(self.vit.grid**2 * self.downsample_ratio**2) if self.vit is not None else 0

    @property
    def vit_layers(self) -> int:
        """How many ViT blocks select_layer needs: hidden_states[k] with hidden_states[0] = embeddings."""
        n = self.vit.num_layers + 1
        assert -n <= self.select_layer < n, self.select_layer
        return self.select_layer % n


# The InternVL3.5 sizes (the released configs) and a tiny preset that runs on CPU in seconds. 1B-30B-A3B
# read images with InternViT-300M-448px-V2_5, 38B and 241B-A28B with InternViT-6B-448px-V2_5 (45 layers of
# width 3200, 25 heads, RMSNorm, q/k norm, no qkv bias: its connector reads 4 x 3200 = 12800 channels).
# 30B-A3B and 241B-A28B decode with Qwen3-30B-A3B and Qwen3-235B-A22B: 128 experts, 8 a token,
# renormalised, every layer sparse (decoder_sparse_step 1, no mlp_only_layers).
VIT_300M = ViTConfig()
VIT_6B = ViTConfig(
    hidden_size=3200,
    intermediate_size=12800,
    num_layers=45,
    num_heads=25,
    qkv_bias=False,
    qk_norm=True,
    norm_type="rms_norm",
)
PRESETS = {
    "1b": ParVLConfig(
        VIT_300M, LLMConfig(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16)
    ),
    "2b": ParVLConfig(
        VIT_300M, LLMConfig(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16)
    ),
    "4b": ParVLConfig(
        VIT_300M, LLMConfig(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32)
    ),
    "8b": ParVLConfig(
        VIT_300M, LLMConfig(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32)
    ),
    "14b": ParVLConfig(
        VIT_300M, LLMConfig(hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40)
    ),
    "38b": ParVLConfig(
        VIT_6B, LLMConfig(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64)
    ),
    "30b-a3b": ParVLConfig(
        VIT_300M,
        LLMConfig(
            hidden_size=2048,
            intermediate_size=6144,
            num_layers=48,
            num_heads=32,
            num_kv_heads=4,
            num_experts=128,
            moe_intermediate_size=768,
        ),
    ),
    "241b-a28b": ParVLConfig(
        VIT_6B,
        LLMConfig(
            hidden_size=4096,
            intermediate_size=12288,
            num_layers=94,
            num_heads=64,
            num_kv_heads=4,
            num_experts=128,
            moe_intermediate_size=1536,
        ),
    ),
    "tiny": ParVLConfig(
        ViTConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4),
        LLMConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=96,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            max_position_embeddings=8192,
        ),
        image_token_id=300,
    ),
}


def branch_variant(par: ParConfig) -> dict:
    """A configuration's branch parameterisation where it is not the paper's (Figure 3, Table S8): the
    ParConfig fields other than the counts that differ from their defaults ({} for the paper's). What
    evaluate.py run records of a checkpoint and profiling.py latency of the model it profiles."""
    unused, paper = (
        "lora_rank" if par.vision_branches == "prefix" else "vit_prefix_len",
        ParConfig(),
    )
    return {
        k: v
        for k, v in asdict(par).items()
        if k not in ("pv", "pl", unused) and v != getattr(paper, k)
    }
