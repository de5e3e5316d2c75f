"""ParVL: InternVL3.5 assembled from vit.py and llm.py, and its checkpoint loading and saving.

The model is InternViT -> drop CLS -> pixel shuffle (v2, ratio 0.5) -> mlp1 connector
(LayerNorm -> Linear -> GELU -> Linear) -> features written into the <IMG_CONTEXT> positions of
the prompt -> Qwen3 decoder -> lm_head. With Pv = Pl = 1 this is exactly InternVL3.5: the same
state-dict keys and the same outputs as the official implementation.

Usage:
    from parvl import ParVL, load_image
    model = ParVL.from_pretrained("path/to/InternVL3_5-1B", dtype=torch.bfloat16, device="cuda")
    pixel_values = load_image("image.png", max_tiles=12)  # [N,3,448,448] fp32
    logits = model(input_ids, pixel_values)  # [B,T,V]

Checkpoints load directly from a local folder in either official layout: the original
InternVLChatModel keys (`vision_model.*`, `mlp1.*`, `language_model.*`), which is this module
tree's own layout, or the transformers-native "-HF" layout (split q/k/v, `vision_tower.*`,
`multi_modal_projector.*`), renamed and fused once at load. The model is built on the meta
device and the checkpoint tensors are assigned in place, so weights are held in memory once.

Shape legend: B batch, T tokens, N tiles, C ViT width, D LLM width, V vocabulary.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from llm import LLM, LLMConfig, causal_mask
from processor import IMG_CONTEXT, Tokenizer, load_image  # noqa: F401  (load_image is public API)
from vit import ViT, ViTConfig


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file or key."""


@dataclass
class ParVLConfig:
    vit: ViTConfig = field(default_factory=ViTConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    downsample_ratio: float = 0.5  # pixel shuffle: 2x2 neighbouring patches -> one token
    ps_version: str = "v2"  # v1 leaves the token grid transposed (older checkpoints)
    select_layer: int = -1  # which ViT hidden state feeds the connector (-1 = last)
    image_token_id: int = 151671  # <IMG_CONTEXT> of the InternVL3.5 tokenizer
    max_dynamic_patch: int = 12
    use_thumbnail: bool = True
    template: str = "internvl2_5"

    def __post_init__(self):
        r = round(1 / self.downsample_ratio)
        assert r * self.downsample_ratio == 1.0 and self.vit.grid % r == 0, (self.downsample_ratio, self.vit.grid)
        if self.ps_version not in ("v1", "v2"):
            raise ValueError(f"ps_version must be v1 or v2, got {self.ps_version!r}")

    @property
    def tokens_per_tile(self) -> int:  # 256 for 448 px tiles
        return round(self.vit.grid**2 * self.downsample_ratio**2)

    @property
    def vit_layers(self) -> int:
        """How many ViT blocks select_layer needs: hidden_states[k] with hidden_states[0] = embeddings."""
        n = self.vit.num_layers + 1
        assert -n <= self.select_layer < n, self.select_layer
        return self.select_layer % n


# The InternVL3.5 sizes (spec tables) and a tiny preset that runs on CPU in seconds.
VIT_300M = ViTConfig()
PRESETS = {
    "1b": ParVLConfig(VIT_300M, LLMConfig(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16)),
    "2b": ParVLConfig(VIT_300M, LLMConfig(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16)),
    "4b": ParVLConfig(VIT_300M, LLMConfig(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32)),
    "8b": ParVLConfig(VIT_300M, LLMConfig(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32)),
    "tiny": ParVLConfig(
        ViTConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4),
        LLMConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=32, max_position_embeddings=8192),
        image_token_id=300,
    ),
}


def pixel_shuffle(x: torch.Tensor, ratio: float = 0.5, version: str = "v2") -> torch.Tensor:
    """[N,h,w,C] patch grid -> [N,h*w*ratio^2, C/ratio^2] tokens. Each output token concatenates an
    r x r block of patches in row-major order: [(2i,2j), (2i,2j+1), (2i+1,2j), (2i+1,2j+1)] for r=2.
    v2 orders output tokens row-major; v1 (the original bug kept for old checkpoints) column-major."""
    N, h, w, C = x.shape
    r = round(1 / ratio)
    x = x.view(N, h // r, r, w // r, r, C)  # [N,h/r,dr,w/r,dc,C]
    order = (0, 1, 3, 2, 4, 5) if version == "v2" else (0, 3, 1, 2, 4, 5)
    return x.permute(order).reshape(N, (h // r) * (w // r), r * r * C)  # [N,h*w/r^2,r^2*C]


class ParVL(nn.Module):
    def __init__(self, cfg: ParVLConfig):
        super().__init__()
        self.cfg = cfg
        C, D = cfg.vit.hidden_size, cfg.llm.hidden_size
        Cs = C * round(1 / cfg.downsample_ratio) ** 2
        self.vision_model = ViT(cfg.vit)
        # `mlp1` with the checkpoint's Sequential indices (2 is the parameter-free GELU)
        self.mlp1 = nn.Sequential(nn.LayerNorm(Cs), nn.Linear(Cs, D), nn.GELU(), nn.Linear(D, D))
        self.language_model = LLM(cfg.llm)

    # -- forward -------------------------------------------------------------------------------

    def extract_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Connector output for a batch of tiles: [N,3,S,S] -> [N,tokens_per_tile,D]."""
        x = self.vision_model(pixel_values, num_layers=self.cfg.vit_layers)  # [N,1+h*w,C]
        x = x[:, 1:]  # drop CLS
        N, L, C = x.shape
        g = int(L**0.5)
        x = pixel_shuffle(x.reshape(N, g, g, C), self.cfg.downsample_ratio, self.cfg.ps_version)
        return self.mlp1(x)  # [N,256,D]

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings with the image features written, in order, into the <IMG_CONTEXT> slots."""
        x = self.language_model.model.embed_tokens(input_ids)  # [B,T,D]
        is_img = input_ids == self.cfg.image_token_id  # [B,T]
        if pixel_values is None:
            if is_img.any():
                raise ValueError("input_ids hold <IMG_CONTEXT> tokens but no pixel_values were given")
            return x
        feats = self.extract_features(pixel_values)  # [N,256,D]
        n_slots, n_feats = int(is_img.sum()), feats.shape[0] * feats.shape[1]
        if n_slots != n_feats:
            raise ValueError(
                f"prompt has {n_slots} <IMG_CONTEXT> tokens but {feats.shape[0]} tiles give {n_feats} features"
            )
        return x.masked_scatter(is_img[..., None], feats.to(x.dtype))

    def hidden(
        self,
        x: torch.Tensor,  # [B,T,D] input embeddings
        positions: torch.Tensor,  # [B,T] rotary positions
        mask: torch.Tensor | None = None,  # [B,1,T,S] bool, None = causal without padding
        input_pos: torch.Tensor | None = None,  # [T] KV-cache slots, None = no cache
    ) -> torch.Tensor:  # [B,T,D] final-normed hidden states, ready for lm_head
        return self.language_model(x, positions, mask, input_pos)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B,T]
        pixel_values: torch.Tensor | None = None,  # [N,3,448,448], tiles of all samples in order
        attention_mask: torch.Tensor | None = None,  # [B,T], 1 = token, 0 = (left) padding
    ) -> torch.Tensor:  # [B,T,V] logits
        x = self.embed(input_ids, pixel_values)
        B, T = input_ids.shape
        if attention_mask is None:
            positions = torch.arange(T, device=x.device).expand(B, T)
            mask = None  # plain causal: SDPA's fused kernels
        else:
            valid = attention_mask.bool()
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # every prompt starts at position 0
            mask = causal_mask(valid, torch.arange(T, device=x.device))
        return self.language_model.lm_head(self.hidden(x, positions, mask))

    # -- loading and saving ---------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: ParVLConfig, dtype=torch.float32, device="cpu", seed: int = 0) -> ParVL:
        """A randomly initialised model (benchmarks and tests), built directly on `device`."""
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(cfg)
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith(("ls1", "ls2")):
                nn.init.constant_(p, 0.1)
        return model.to(dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, device="cpu") -> ParVL:
        """Load a local InternVL3.5 / InternVL3 checkpoint folder (original or -HF layout, sharded or
        not). dtype None keeps the stored dtype (bf16 checkpoints stay bf16)."""
        folder = Path(path)
        raw = read_json(folder / "config.json")
        state = read_checkpoint(folder, dtype, device)
        cfg = config_from_json(raw, folder, tied="language_model.lm_head.weight" not in state)
        with torch.device("meta"):
            model = cls(cfg)
        expected = set(model.state_dict().keys())
        if cfg.llm.tie_word_embeddings:
            expected.discard("language_model.lm_head.weight")
        check_keys(expected, set(state), folder)
        for key, p in model.state_dict().items():
            if key in state and state[key].shape != p.shape:
                raise CheckpointError(f"{folder}: {key} has shape {list(state[key].shape)}, the config needs {list(p.shape)}")
        model.load_state_dict(state, strict=False, assign=True)
        if cfg.llm.tie_word_embeddings:
            model.language_model.lm_head.weight = model.language_model.model.embed_tokens.weight
        model.language_model.model.init_rope(device)
        model.source_dir = folder
        return model.eval()

    def save(self, path: str | Path) -> None:
        """Write config.json and model.safetensors in the original InternVL layout (plus the tokenizer
        files of the folder the model came from), so InternVL's own code loads the result."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.cfg.llm.tie_word_embeddings:  # safetensors refuses shared storage; the tie is in config
            state.pop("language_model.lm_head.weight")
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config_to_json(self.cfg), indent=2))
        src = getattr(self, "source_dir", None)
        for name in TOKENIZER_FILES:
            if src is not None and (src / name).exists() and src.resolve() != folder.resolve():
                shutil.copy(src / name, folder / name)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "special_tokens_map.json", "generation_config.json")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (is {path.parent} a checkpoint folder?)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


# -- config.json: original (InternVLChatConfig) and -HF (InternVLConfig) spellings ---------------


def config_from_json(raw: dict, folder: Path | None = None, tied: bool | None = None) -> ParVLConfig:
    hf = "text_config" in raw
    t = raw.get("text_config") if hf else raw.get("llm_config")
    v = raw.get("vision_config")
    if t is None or v is None:
        raise CheckpointError("config.json: needs llm_config (or text_config) and vision_config")
    family = (t.get("model_type") or "").lower()
    if family not in ("qwen3", "qwen2"):
        raise CheckpointError(f"config.json: unsupported language model type {family!r} (qwen3, qwen2)")
    rope_theta = t.get("rope_theta", (t.get("rope_parameters") or {}).get("rope_theta", 1e6))
    llm = LLMConfig(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        intermediate_size=t["intermediate_size"],
        num_layers=t["num_hidden_layers"],
        num_heads=t["num_attention_heads"],
        num_kv_heads=t.get("num_key_value_heads", t["num_attention_heads"]),
        head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],  # Qwen2 has none
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        qkv_bias=family == "qwen2" or bool(t.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        # the checkpoint decides: a stored lm_head is used, a missing one means tied embeddings
        tie_word_embeddings=tied if tied is not None else bool(t.get("tie_word_embeddings", False)),
    )
    size = v.get("image_size", 448)
    patch = v.get("patch_size", 14)
    vit = ViTConfig(
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_layers=v["num_hidden_layers"],
        num_heads=v["num_attention_heads"],
        patch_size=patch[0] if isinstance(patch, list) else patch,
        image_size=size[0] if isinstance(size, list) else size,
        qkv_bias=v.get("attention_bias" if hf else "qkv_bias", True),
        qk_norm=v.get("use_qk_norm" if hf else "qk_normalization", False),
        norm_type=v.get("norm_type", "layer_norm"),
        norm_eps=v.get("layer_norm_eps", 1e-6),
        drop_path_rate=v.get("drop_path_rate", 0.0),
    )
    image_token_id = raw.get("image_token_id") or raw.get("img_context_token_id")
    if image_token_id is None:  # the original config leaves it to the tokenizer
        tok = Tokenizer.from_pretrained(folder) if folder is not None else None
        image_token_id = tok.token_to_id(IMG_CONTEXT) if tok is not None else None
        if image_token_id is None:
            raise CheckpointError(f"{folder}: no image_token_id in config.json and no {IMG_CONTEXT} in the tokenizer")
    return ParVLConfig(
        vit=vit,
        llm=llm,
        downsample_ratio=raw.get("downsample_ratio", 0.5),
        ps_version="v2" if hf else raw.get("ps_version", "v1"),  # -HF always uses v2; original class default v1
        select_layer=raw.get("vision_feature_layer" if hf else "select_layer", -1),
        image_token_id=int(image_token_id),
        max_dynamic_patch=raw.get("max_dynamic_patch", 12),
        use_thumbnail=raw.get("use_thumbnail", True),
        template=raw.get("template", "internvl2_5"),
    )


def config_to_json(cfg: ParVLConfig) -> dict:
    """The original InternVLChatConfig layout, which InternVL's own code reads."""
    v, t = cfg.vit, cfg.llm
    family = "qwen3" if t.qk_norm else "qwen2"
    arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    return {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "downsample_ratio": cfg.downsample_ratio,
        "ps_version": cfg.ps_version,
        "select_layer": cfg.select_layer,
        "template": cfg.template,
        "force_image_size": v.image_size,
        "dynamic_image_size": True,
        "min_dynamic_patch": 1,
        "max_dynamic_patch": cfg.max_dynamic_patch,
        "use_thumbnail": cfg.use_thumbnail,
        "image_token_id": cfg.image_token_id,
        "tie_word_embeddings": t.tie_word_embeddings,
        "llm_config": {
            "architectures": [arch], "model_type": family, "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps,
            "rope_theta": t.rope_theta, "max_position_embeddings": t.max_position_embeddings,
            "attention_bias": t.qkv_bias, "hidden_act": "silu", "tie_word_embeddings": t.tie_word_embeddings,
        },
        "vision_config": {
            "architectures": ["InternVisionModel"], "model_type": "intern_vit_6b",
            "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
            "num_hidden_layers": v.num_layers, "num_attention_heads": v.num_heads,
            "patch_size": v.patch_size, "image_size": v.image_size, "num_channels": 3,
            "qkv_bias": v.qkv_bias, "qk_normalization": v.qk_norm, "norm_type": v.norm_type,
            "layer_norm_eps": v.norm_eps, "hidden_act": "gelu", "drop_path_rate": v.drop_path_rate,
        },
        "parvl": {"vit": asdict(v), "llm": asdict(t)},
    }


# -- safetensors: shards, key spellings ---------------------------------------------------------

# -HF key -> original key (after stripping a leading "model."); q/k/v are fused separately below.
HF_RENAMES = [
    (r"^vision_tower\.embeddings\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^vision_tower\.embeddings\.patch_embeddings\.projection\.", "vision_model.embeddings.patch_embedding."),
    (r"^vision_tower\.embeddings\.position_embeddings$", "vision_model.embeddings.position_embedding"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.projection_layer\.", r"vision_model.encoder.layers.\1.attn.proj."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qk])_norm\.", r"vision_model.encoder.layers.\1.attn.\2_norm."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qkv])_proj\.", r"vision_model.encoder.layers.\1.attn.qkv.\2."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_before\.", r"vision_model.encoder.layers.\1.norm1."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_after\.", r"vision_model.encoder.layers.\1.norm2."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.lambda_1$", r"vision_model.encoder.layers.\1.ls1"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.lambda_2$", r"vision_model.encoder.layers.\1.ls2"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.mlp\.", r"vision_model.encoder.layers.\1.mlp."),
    (r"^multi_modal_projector\.layer_norm\.", "mlp1.0."),
    (r"^multi_modal_projector\.linear_1\.", "mlp1.1."),
    (r"^multi_modal_projector\.linear_2\.", "mlp1.3."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^language_model\.(?!model\.|lm_head\.)", "language_model.model."),  # new-style -HF spelling
]


def canonical_key(key: str) -> str:
    """Any official spelling -> this module tree's (= the original InternVL) key."""
    if key.startswith(("vision_model.", "mlp1.", "language_model.model.", "language_model.lm_head.")):
        return key  # already the original layout
    key = key.removeprefix("model.")
    for pattern, repl in HF_RENAMES:
        key, n = re.subn(pattern, repl, key)
        if n:
            break
    return key


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not names:
            raise CheckpointError(f"{index}: empty weight_map")
    elif (folder / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    for name in names:
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name}: checkpoint shard is missing")
    return [folder / name for name in names]


def read_checkpoint(folder: Path, dtype: torch.dtype | None, device) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint under canonical keys, read shard by shard straight to `device`
    (one copy in memory), cast to `dtype` if given; -HF q/k/v rows fused back into qkv."""
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(folder):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    t = f.get_tensor(key)
                    state[canonical_key(key)] = t if dtype is None else t.to(dtype)
        except Exception as e:  # a truncated or non-safetensors file: name it, keep one line
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{file}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    for key in [k for k in state if ".attn.qkv.q." in k]:
        parts = [state.pop(key.replace(".qkv.q.", f".qkv.{x}.")) for x in "qkv"]
        state[key.replace(".qkv.q.", ".qkv.")] = torch.cat(parts, dim=0)  # rows [q | k | v]
    return state


def check_keys(expected: set[str], found: set[str], folder: Path) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        what = []
        if missing:
            what.append(f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            what.append(f"unexpected {len(unexpected)} keys (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"{folder}: checkpoint does not match the config: {'; '.join(what)}")
