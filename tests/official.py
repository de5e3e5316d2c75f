"""The official implementation as the tests' reference, and tiny random checkpoints in its layouts.

The reference is transformers' `InternVLForConditionalGeneration` (test-only dependency), built
from a tiny config that keeps the real model's quirks: 448 px tiles with 14 px
patches (1025 ViT tokens, 256 image tokens per tile), Qwen3 heads·head_dim != hidden, GQA, an
untied lm_head and a vocabulary a little larger than the tokenizer. Every tensor is random
(norm weights and biases, layer scales, q/k norms, class token and position embedding included),
so a swapped, skipped or mis-scaled tensor shows up in the logits.

Five kinds of model: "qwen3" (InternVL3.5 1B-14B), "qwen2" (InternVL3), "qwen3_moe" (Qwen3-MoE, as in
30B-A3B: 8 experts, top 2, renormalised, layer 1 listed dense in mlp_only_layers), "qwen3+vit6b" (an
InternViT-6B-style encoder: RMSNorm, q/k norm over the width, no qkv bias, as in 38B) and
"qwen3_moe+vit6b" (both, as in 241B-A28B). The reference runs Qwen3-MoE's experts with transformers'
"eager" loop over experts (the official model's arithmetic), not its grouped kernel.

One set of weights is written in three layouts (Qwen3-MoE experts one key per expert and projection,
`mlp.experts.{e}.gate_proj.weight`, in all three, as InternVL's code and transformers 5 both save them):
  "original"   InternVLChatModel keys (`vision_model.*`, fused `attn.qkv`, `mlp1.*`,
               `language_model.model.*`) with the original config.json (`internvl_chat`),
  "hf"         new-style transformers keys (`model.vision_tower.*`, ..., `lm_head.weight`),
  "hf_legacy"  llava-style keys (`vision_tower.*`, `language_model.model.*`,
               `language_model.lm_head.weight`); transformers 5 `save_pretrained` writes these,
both -HF layouts with the transformers config.json (`internvl`). Optionally sharded with a
`model.safetensors.index.json`, optionally stored in bf16. Each folder also gets a tiny tokenizer
(`tiny_tokenizer.py`); the image token id is that tokenizer's `<IMG_CONTEXT>`.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import parvl`
from official_layouts import (  # noqa: E402, F401  (re-exported: the tests import them from here)
    hf_to_legacy,
    hf_to_original,
    original_to_hf,
    per_expert,
    stacked_experts,
)
from tiny_tokenizer import write_tiny_tokenizer  # noqa: E402  (tests/ is on sys.path under pytest)

IMAGE_SIZE, PATCH_SIZE = 448, 14  # must stay real: tiling and 256 tokens per tile depend on them
ROPE_THETA, RMS_EPS, VIT_LN_EPS, MAX_POS = 1e6, 1e-6, 1e-6, 40960


TOKENS_PER_TILE = 256  # (448 / 14)^2 * 0.5^2


# Tiny InternViT-300M: LayerNorm with bias, qkv bias, no q/k norm, layer scale, no final norm.
TINY_VISION = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)
# What InternViT-6B changes (its config: norm_type rms_norm, qk_normalization, no qkv bias), in -HF and
# original spellings.
VIT6B_HF = dict(attention_bias=False, use_qk_norm=True, norm_type="rms_norm")
VIT6B_ORIGINAL = dict(qkv_bias=False, qk_normalization=True, norm_type="rms_norm")


# Tiny decoders. Qwen3: 4 heads x 32 = 128 != hidden 64, as in the 1B; q/k norm, no biases.
# Qwen2 (InternVL3): q/k/v biases, no q/k norm, head_dim = hidden / heads.
TINY_TEXT = {
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # Qwen3-MoE: layer 0 routed (8 experts of width 32, top 2), layer 1 dense (mlp_only_layers)
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
}


LAYOUTS = ("original", "hf", "hf_legacy")


FAMILIES = ("qwen3", "qwen2", "qwen3_moe", "qwen3+vit6b", "qwen3_moe+vit6b")


def text_family(family: str) -> str:
    """The decoder of a kind: "qwen3_moe+vit6b" -> "qwen3_moe"."""
    return family.split("+")[0]


def is_vit6b(family: str) -> bool:
    return family.endswith("+vit6b")


@functools.cache
def tokenizer_ids(family: str) -> dict:
    """Ids of the tiny tokenizer of `family` (identical for both file layouts)."""
    with tempfile.TemporaryDirectory() as tmp:
        return write_tiny_tokenizer(tmp, layout="json", family=tokenizer_family(family))


def tokenizer_family(family: str) -> str:
    return "qwen2" if family == "qwen2" else "qwen3"  # Qwen3-MoE has Qwen3's tokenizer


def model_vocab_size(family: str) -> int:
    # Real checkpoints pad the embedding to a multiple of 128 (151936 rows vs ~151678 tokens).
    return (tokenizer_ids(family)["vocab_size_tokenizer"] // 128 + 1) * 128


def hf_config(family: str, text_sizes: dict | None = None, vision_sizes: dict | None = None):
    """The transformers `InternVLConfig` of the tiny model (untied everywhere); text_sizes / vision_sizes
    replace TINY_TEXT's / TINY_VISION's (a benchmark's larger model, vocab_size included)."""
    from transformers import (
        InternVLConfig,
        InternVLVisionConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    ids = tokenizer_ids(family)
    vision = InternVLVisionConfig(
        **(vision_sizes or TINY_VISION),
        **(
            VIT6B_HF
            if is_vit6b(family)
            else dict(attention_bias=True, use_qk_norm=False, norm_type="layer_norm")
        ),
        layer_norm_eps=VIT_LN_EPS,
        hidden_act="gelu",
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        use_mean_pooling=True,
    )
    text_cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}
    text = text_cls[text_family(family)](
        **{
            "vocab_size": model_vocab_size(family),
            **(text_sizes or TINY_TEXT[text_family(family)]),
        },
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        max_position_embeddings=MAX_POS,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=ids["endoftext_id"],
        eos_token_id=ids["im_end_id"],
    )
    text.experts_implementation = (
        "eager"  # Qwen3-MoE: the loop over experts, the official arithmetic
    )
    # InternVLConfig defaults to tie_word_embeddings=True in transformers 5: switch it off, or the
    # reference would silently reuse embed_tokens as the output head.
    return InternVLConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=ids["img_context_id"],
        image_seq_length=TOKENS_PER_TILE,
        downsample_ratio=0.5,
        projector_hidden_act="gelu",
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


def original_config(family: str, dtype: torch.dtype) -> dict:
    """The config.json of an original (remote-code) InternVL checkpoint."""
    ids, t = tokenizer_ids(family), TINY_TEXT[text_family(family)]
    dtype_name = str(dtype).removeprefix("torch.")
    llm = {
        "architectures": [ARCHITECTURES[text_family(family)]],
        "model_type": text_family(family),
        "attention_dropout": 0.0,
        "bos_token_id": ids["endoftext_id"],
        "eos_token_id": ids["im_end_id"],
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": t["intermediate_size"],
        "max_position_embeddings": MAX_POS,
        "max_window_layers": t["num_hidden_layers"],
        "num_attention_heads": t["num_attention_heads"],
        "num_hidden_layers": t["num_hidden_layers"],
        "num_key_value_heads": t["num_key_value_heads"],
        "rms_norm_eps": RMS_EPS,
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "torch_dtype": dtype_name,
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": model_vocab_size(family),
    }
    if family.startswith("qwen3"):
        # InternVL3.5 llm_config: explicit head_dim, attention_bias false, no tie_word_embeddings key.
        llm.update(head_dim=t["head_dim"], attention_bias=False)
    if text_family(family) == "qwen3_moe":  # Qwen3-30B-A3B's MoE keys (SFT adds no router loss)
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
        llm.update({k: t[k] for k in moe + ("decoder_sparse_step", "mlp_only_layers")})
        llm.update(output_router_logits=False, router_aux_loss_coef=0.001)
    else:
        # InternVL3's config class forces an untied head; Qwen2 has no head_dim key (= hidden/heads).
        llm.update(tie_word_embeddings=False)
    vision = {
        "architectures": ["InternVisionModel"],
        "model_type": "intern_vit_6b",
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "drop_path_rate": 0.0,
        "hidden_act": "gelu",
        "hidden_size": TINY_VISION["hidden_size"],
        "image_size": IMAGE_SIZE,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "intermediate_size": TINY_VISION["intermediate_size"],
        "layer_norm_eps": VIT_LN_EPS,
        "norm_type": "layer_norm",
        "num_attention_heads": TINY_VISION["num_attention_heads"],
        "num_channels": 3,
        "num_hidden_layers": TINY_VISION["num_hidden_layers"],
        "patch_size": PATCH_SIZE,
        "qk_normalization": False,
        "qkv_bias": True,
        "torch_dtype": dtype_name,
        "use_flash_attn": True,
    } | (VIT6B_ORIGINAL if is_vit6b(family) else {})
    return {
        "architectures": ["InternVLChatModel"],
        "auto_map": {
            "AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
            "AutoModel": "modeling_internvl_chat.InternVLChatModel",
            "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel",
        },
        "model_type": "internvl_chat",
        "downsample_ratio": 0.5,
        "dynamic_image_size": True,
        "eos_token_id": ids["im_end_id"],
        "force_image_size": IMAGE_SIZE,
        "llm_config": llm,
        "max_dynamic_patch": 12,
        "min_dynamic_patch": 1,
        "pad2square": False,
        "pad_token_id": ids["endoftext_id"],
        "ps_version": "v2",
        "select_layer": -1,
        "template": "internvl2_5",
        "torch_dtype": dtype_name,
        "use_backbone_lora": 0,
        "use_llm_lora": 0,
        "use_thumbnail": True,
        "vision_config": vision,
    }


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every tensor with random values of a sensible scale (nothing left at 0 or 1).

    Matrices get std fan_in^-0.5 so activations stay O(1) through the layers and logits are O(1);
    norm weights 1 + 0.3·N(0,1); biases, layer scales and position embeddings their own random draws.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        randn = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("lambda_1", "lambda_2"):  # layer scale: positive, around 0.7
            value = 0.7 + 0.3 * randn
        # LayerNorm/RMSNorm/q_norm/k_norm weight or bias
        elif "norm" in name or "layernorm" in name:
            value = (1.0 + 0.3 * randn) if leaf == "weight" else 0.3 * randn
        elif leaf == "bias":
            value = 0.3 * randn
        elif leaf in ("cls_token", "position_embeddings"):
            value = 0.5 * randn
        elif "embed_tokens" in name:
            value = randn
        elif leaf in ("gate_up_proj", "down_proj") and p.ndim == 3:  # stacked experts [E,out,in]
            value = randn * p.shape[-1] ** -0.5
        else:  # Linear / Conv2d weight: fan_in = everything but the output dim
            value = randn * p[0].numel() ** -0.5
        p.copy_(value)


ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@functools.cache
def build_reference(family: str = "qwen3", seed: int = 0):
    """The transformers reference of the tests, eval mode, fp32, with this (family, seed)'s random weights;
    built once per session."""
    return reference_model(family, seed)


def reference_model(
    family: str, seed: int, text_sizes: dict | None = None, vision_sizes: dict | None = None
):
    """A transformers reference with random weights drawn from `seed` (sizes: see hf_config); not cached."""
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(hf_config(family, text_sizes, vision_sizes)).eval()
    randomize_(model, seed)
    lm_head, embed = model.lm_head.weight, model.model.language_model.embed_tokens.weight
    assert lm_head.data_ptr() != embed.data_ptr() and not torch.equal(lm_head, embed), (
        "reference is tied"
    )
    return model


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def write_safetensors(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """`model.safetensors`, or `shards` files plus the standard `model.safetensors.index.json`."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = list(tensors)
    assert len(keys) >= shards, (len(keys), shards)
    bounds = [round(i * len(keys) / shards) for i in range(shards + 1)]
    weight_map = {}
    for s in range(shards):
        chunk = {k: tensors[k] for k in keys[bounds[s] : bounds[s + 1]]}
        save_file(chunk, str(folder / shard_name(s + 1, shards)), metadata={"format": "pt"})
        weight_map.update({k: shard_name(s + 1, shards) for k in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (sharded or not), as stored."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def make_checkpoint(
    tmp_root: Path,
    family: str = "qwen3",
    layout: str = "original",
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Path:
    """Write the reference's weights for (family, seed) as a checkpoint folder; return its path."""
    assert family in FAMILIES and layout in LAYOUTS, (family, layout)
    name = f"{family}-{layout}-s{shards}-{str(dtype).removeprefix('torch.')}-seed{seed}"
    folder = Path(tmp_root) / name
    folder.mkdir(parents=True, exist_ok=False)
    ref = build_reference(family, seed)
    sd = {k: v.detach().to(dtype).clone() for k, v in ref.state_dict().items()}
    if layout == "original":
        tensors = hf_to_original(sd)
        (folder / "config.json").write_text(
            json.dumps(original_config(family, dtype), indent=2) + "\n"
        )
    else:
        tensors = per_expert(sd if layout == "hf" else hf_to_legacy(sd))
        cfg = hf_config(family)
        cfg.dtype = dtype
        cfg.architectures = ["InternVLForConditionalGeneration"]
        cfg.save_pretrained(str(folder))
    write_safetensors(folder, tensors, shards)
    # The original repos ship vocab.json + merges.txt, the -HF ones tokenizer.json.
    ids = write_tiny_tokenizer(
        folder, layout="vocab" if layout == "original" else "json", family=tokenizer_family(family)
    )
    assert ids["img_context_id"] == tokenizer_ids(family)["img_context_id"], "tokenizer ids drifted"
    return folder


def hf_greedy(ref, ids: list[int], pixel_values, n: int) -> list[int]:
    """transformers' greedy generate, forced to n tokens (no eos) so both sides run every step."""
    # None trips transformers 5.24
    images = {} if pixel_values is None else {"pixel_values": pixel_values}
    out = ref.generate(
        input_ids=torch.tensor([ids]),
        **images,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )
    return out[0, len(ids) :].tolist()
