"""Test fixtures: tiny random InternVL checkpoints in every official layout, plus their reference.

The reference is transformers' `InternVLForConditionalGeneration` (test-only dependency), built
from a tiny config that keeps the real model's quirks: 448 px tiles with 14 px
patches (1025 ViT tokens, 256 image tokens per tile), Qwen3 heads·head_dim != hidden, GQA, an
untied lm_head and a vocabulary a little larger than the tokenizer. Every tensor is random
(norm weights and biases, layer scales, q/k norms, class token and position embedding included),
so a swapped, skipped or mis-scaled tensor shows up in the logits.

One set of weights is written in three layouts:
  "original"   InternVLChatModel keys (`vision_model.*`, fused `attn.qkv`, `mlp1.*`,
               `language_model.model.*`) with the original config.json (`internvl_chat`),
  "hf"         new-style transformers keys (`model.vision_tower.*`, ..., `lm_head.weight`),
  "hf_legacy"  llava-style keys (`vision_tower.*`, `language_model.model.*`,
               `language_model.lm_head.weight`); transformers 5 `save_pretrained` writes these,
both -HF layouts with the transformers config.json (`internvl`). Optionally sharded with a
`model.safetensors.index.json`, optionally stored in bf16. Each folder also gets a tiny tokenizer
(`tiny_tokenizer.py`); the image token id is that tokenizer's `<IMG_CONTEXT>`.

Fixtures: `checkpoint(...) -> Path`, `reference(family, seed) -> model` and `parvl(family, layout) -> ParVL`,
all session-cached; `model_dir` (the tiny qwen3 checkpoint, original layout) and `meta` (16 SFT rows), both
per module; and, session-cached because several files read them: `png` (a small photo), `input_files` (bad
input for the commands), `bench` / `full_run` (an MMMU-style TSV and its predictions) and `run3` (a 2:2
training run with a kept step and TensorBoard events).
Plain helpers (import with `from conftest import ...`): `make_checkpoint`, `build_reference`,
`hf_to_original`, `original_to_hf`, `prompt_ids`, `left_pad`, `random_pixels`, `read_safetensors`; for the
commands, `parse_flags`, `two_nodes`, `fake_slurm` / `sbatch` / `slurm_log`; for training runs,
`write_dataset`, `train_here`, `run_train`, `metrics`, `COMMON`; for a command run in this process,
`run_main`, `gen_main`, `main_out`; for what a command leaves and says, `tree`, `notes`, `one_line`,
`worker_lines`, `root_cause`, `png_ok`; for benchmark files, `write_tsv`, `png_b64`, `read_preds`,
`write_scores`; for the answer extractor, `fake_vlmevalkit`, `judge_server` (`StubJudge`); for trackers,
`expected_scalars`, `event_scalars`; for generation, `hf_greedy`.
The fixtures are checked on their own by the `test_fixture_*` tests in `test_equivalence.py`.
"""
from __future__ import annotations

import base64
import contextlib
import csv
import functools
import hashlib
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import parvl`
from tiny_tokenizer import write_tiny_tokenizer  # noqa: E402  (tests/ is on sys.path under pytest)

IMAGE_SIZE, PATCH_SIZE = 448, 14  # must stay real: tiling and 256 tokens per tile depend on them
TOKENS_PER_TILE = 256  # (448 / 14)^2 * 0.5^2

# Tiny InternViT-300M: LayerNorm with bias, qkv bias, no q/k norm, layer scale, no final norm.
TINY_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)

# Tiny decoders. Qwen3: 4 heads x 32 = 128 != hidden 64, as in the 1B; q/k norm, no biases.
# Qwen2 (InternVL3): q/k/v biases, no q/k norm, head_dim = hidden / heads.
TINY_TEXT = {
    "qwen3": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32),
    "qwen2": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
}
ROPE_THETA, RMS_EPS, VIT_LN_EPS, MAX_POS = 1e6, 1e-6, 1e-6, 40960
LAYOUTS = ("original", "hf", "hf_legacy")
FAMILIES = ("qwen3", "qwen2")


# ----------------------------------------------------------------------------- tokenizer + config

@functools.cache
def tokenizer_ids(family: str) -> dict:
    """Ids of the tiny tokenizer of `family` (identical for both file layouts)."""
    with tempfile.TemporaryDirectory() as tmp:
        return write_tiny_tokenizer(tmp, layout="json", family=family)


def model_vocab_size(family: str) -> int:
    # Real checkpoints pad the embedding to a multiple of 128 (151936 rows vs ~151678 tokens).
    return (tokenizer_ids(family)["vocab_size_tokenizer"] // 128 + 1) * 128


def hf_config(family: str):
    """The transformers `InternVLConfig` of the tiny model (untied everywhere)."""
    from transformers import InternVLConfig, InternVLVisionConfig, Qwen2Config, Qwen3Config

    ids = tokenizer_ids(family)
    vision = InternVLVisionConfig(**TINY_VISION, attention_bias=True, use_qk_norm=False,
                                  norm_type="layer_norm", layer_norm_eps=VIT_LN_EPS, hidden_act="gelu",
                                  image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, use_mean_pooling=True)
    text_cls = Qwen3Config if family == "qwen3" else Qwen2Config
    text = text_cls(**TINY_TEXT[family], vocab_size=model_vocab_size(family), rms_norm_eps=RMS_EPS,
                    rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                    max_position_embeddings=MAX_POS, hidden_act="silu", tie_word_embeddings=False,
                    bos_token_id=ids["endoftext_id"], eos_token_id=ids["im_end_id"])
    # InternVLConfig defaults to tie_word_embeddings=True in transformers 5: switch it off, or the
    # reference would silently reuse embed_tokens as the output head.
    return InternVLConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                          image_token_id=ids["img_context_id"], image_seq_length=TOKENS_PER_TILE,
                          downsample_ratio=0.5, projector_hidden_act="gelu", vision_feature_layer=-1,
                          vision_feature_select_strategy="default", tie_word_embeddings=False)


def original_config(family: str, dtype: torch.dtype) -> dict:
    """The config.json of an original (remote-code) InternVL checkpoint."""
    ids, t = tokenizer_ids(family), TINY_TEXT[family]
    dtype_name = str(dtype).removeprefix("torch.")
    llm = {
        "architectures": ["Qwen3ForCausalLM" if family == "qwen3" else "Qwen2ForCausalLM"],
        "model_type": family,
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
    if family == "qwen3":
        # InternVL3.5 llm_config: explicit head_dim, attention_bias false, no tie_word_embeddings key.
        llm.update(head_dim=t["head_dim"], attention_bias=False)
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
    }
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


# ----------------------------------------------------------------------------- reference model

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
        elif "norm" in name or "layernorm" in name:  # LayerNorm/RMSNorm/q_norm/k_norm weight or bias
            value = (1.0 + 0.3 * randn) if leaf == "weight" else 0.3 * randn
        elif leaf == "bias":
            value = 0.3 * randn
        elif leaf in ("cls_token", "position_embeddings"):
            value = 0.5 * randn
        elif "embed_tokens" in name:
            value = randn
        else:  # Linear / Conv2d weight: fan_in = everything but the output dim
            value = randn * p[0].numel() ** -0.5
        p.copy_(value)


@functools.cache
def build_reference(family: str = "qwen3", seed: int = 0):
    """The transformers reference, eval mode, fp32, with this (family, seed)'s random weights."""
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(hf_config(family)).eval()
    randomize_(model, seed)
    lm_head, embed = model.lm_head.weight, model.model.language_model.embed_tokens.weight
    assert lm_head.data_ptr() != embed.data_ptr() and not torch.equal(lm_head, embed), "reference is tied"
    return model


# ----------------------------------------------------------------------------- key layouts

def hf_to_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New-style transformers keys -> InternVLChatModel keys (inverse of internvl_custom2hf.py); fuses q|k|v."""
    out = {}
    for key, t in sd.items():
        k = key
        if k == "lm_head.weight":
            k = "language_model.lm_head.weight"
        elif k.startswith("model.language_model."):
            k = "language_model.model." + k.removeprefix("model.language_model.")
        elif k.startswith("model.multi_modal_projector."):
            k = k.removeprefix("model.multi_modal_projector.")
            k = "mlp1." + k.replace("layer_norm.", "0.").replace("linear_1.", "1.").replace("linear_2.", "3.")
        elif k.startswith("model.vision_tower."):
            k = "vision_model." + k.removeprefix("model.vision_tower.")
            k = (k.replace("embeddings.cls_token", "embeddings.class_embedding")
                  .replace("embeddings.patch_embeddings.projection.", "embeddings.patch_embedding.")
                  .replace("embeddings.position_embeddings", "embeddings.position_embedding")
                  .replace("encoder.layer.", "encoder.layers.")
                  .replace(".attention.projection_layer.", ".attn.proj.")
                  .replace(".attention.q_norm.", ".attn.q_norm.").replace(".attention.k_norm.", ".attn.k_norm.")
                  .replace(".attention.q_proj.", ".attn.qkv.q.").replace(".attention.k_proj.", ".attn.qkv.k.")
                  .replace(".attention.v_proj.", ".attn.qkv.v.")
                  .replace(".layernorm_before.", ".norm1.").replace(".layernorm_after.", ".norm2.")
                  .replace(".lambda_1", ".ls1").replace(".lambda_2", ".ls2"))
        else:
            raise AssertionError(f"unexpected transformers key {key!r}")
        out[k] = t
    for k in [k for k in out if ".attn.qkv.q." in k]:  # fused qkv: rows [q | k | v]
        parts = [out.pop(k.replace(".qkv.q.", f".qkv.{x}.")) for x in "qkv"]
        out[k.replace(".qkv.q.", ".qkv.")] = torch.cat(parts, dim=0)
    return out


def original_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """InternVLChatModel keys -> new-style transformers keys (the direction of internvl_custom2hf.py)."""
    out = {}
    for key, t in sd.items():
        k = key
        if k == "language_model.lm_head.weight":
            k = "lm_head.weight"
        elif k.startswith("language_model.model."):
            k = "model.language_model." + k.removeprefix("language_model.model.")
        elif k.startswith("mlp1."):
            idx, leaf = k.removeprefix("mlp1.").split(".")
            k = "model.multi_modal_projector." + {"0": "layer_norm", "1": "linear_1", "3": "linear_2"}[idx] + "." + leaf
        elif k.startswith("vision_model."):
            k = "model.vision_tower." + k.removeprefix("vision_model.")
            k = (k.replace("embeddings.class_embedding", "embeddings.cls_token")
                  .replace("embeddings.patch_embedding.", "embeddings.patch_embeddings.projection.")
                  .replace("embeddings.position_embedding", "embeddings.position_embeddings")
                  .replace("encoder.layers.", "encoder.layer.")
                  .replace(".attn.proj.", ".attention.projection_layer.")
                  .replace(".attn.q_norm.", ".attention.q_norm.").replace(".attn.k_norm.", ".attention.k_norm.")
                  .replace(".norm1.", ".layernorm_before.").replace(".norm2.", ".layernorm_after.")
                  .replace(".ls1", ".lambda_1").replace(".ls2", ".lambda_2"))
            if ".attn.qkv." in k:
                q, kk, v = t.chunk(3, dim=0)
                for name, part in zip("qkv", (q, kk, v)):
                    out[k.replace(".attn.qkv.", f".attention.{name}_proj.")] = part.clone()
                continue
        else:
            raise AssertionError(f"unexpected original key {key!r}")
        out[k] = t
    return out


def hf_to_legacy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """New-style -> llava-style spelling (what transformers 5 `save_pretrained` writes)."""
    out = {}
    for k, t in sd.items():
        if k == "lm_head.weight":
            k = "language_model.lm_head.weight"
        elif k.startswith("model.language_model."):
            k = "language_model.model." + k.removeprefix("model.language_model.")
        else:
            k = k.removeprefix("model.")
        out[k] = t
    return out


# ----------------------------------------------------------------------------- checkpoint files

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
        chunk = {k: tensors[k] for k in keys[bounds[s]:bounds[s + 1]]}
        save_file(chunk, str(folder / shard_name(s + 1, shards)), metadata={"format": "pt"})
        weight_map.update({k: shard_name(s + 1, shards) for k in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (sharded or not), as stored."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    out = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def make_checkpoint(tmp_root: Path, family: str = "qwen3", layout: str = "original", shards: int = 1,
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Write the reference's weights for (family, seed) as a checkpoint folder; return its path."""
    assert family in FAMILIES and layout in LAYOUTS, (family, layout)
    name = f"{family}-{layout}-s{shards}-{str(dtype).removeprefix('torch.')}-seed{seed}"
    folder = Path(tmp_root) / name
    folder.mkdir(parents=True, exist_ok=False)
    ref = build_reference(family, seed)
    sd = {k: v.detach().to(dtype).clone() for k, v in ref.state_dict().items()}
    if layout == "original":
        tensors = hf_to_original(sd)
        (folder / "config.json").write_text(json.dumps(original_config(family, dtype), indent=2) + "\n")
    else:
        tensors = sd if layout == "hf" else hf_to_legacy(sd)
        cfg = hf_config(family)
        cfg.dtype = dtype
        cfg.architectures = ["InternVLForConditionalGeneration"]
        cfg.save_pretrained(str(folder))
    write_safetensors(folder, tensors, shards)
    # The original repos ship vocab.json + merges.txt, the -HF ones tokenizer.json.
    ids = write_tiny_tokenizer(folder, layout="vocab" if layout == "original" else "json", family=family)
    assert ids["img_context_id"] == tokenizer_ids(family)["img_context_id"], "tokenizer ids drifted"
    return folder


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """`checkpoint(family="qwen3", layout="original", shards=1, dtype=torch.float32, seed=0) -> Path`.

    Session-cached: one folder per argument set. Treat it as read-only (copy it to break it).
    """
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[tuple, Path] = {}

    def get(family="qwen3", layout="original", shards=1, dtype=torch.float32, seed=0) -> Path:
        key = (family, layout, shards, dtype, seed)
        if key not in cache:
            cache[key] = make_checkpoint(root, family, layout, shards, dtype, seed)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def reference():
    """`reference(family="qwen3", seed=0) -> InternVLForConditionalGeneration` (eval, fp32)."""
    return build_reference


# ----------------------------------------------------------------------------- inputs

@functools.cache
def _tokenizer(folder: str):
    # Qwen2Tokenizer reads either file layout; AutoTokenizer would stop at the original config's
    # auto_map (remote code) and ask for trust_remote_code.
    from transformers import Qwen2Tokenizer
    return Qwen2Tokenizer.from_pretrained(folder)


def prompt_ids(folder: Path, tiles_per_image: list[int], question: str = "Please describe the image.") -> torch.Tensor:
    """1-D input ids of a chat prompt with one `<img>` + 256·n `<IMG_CONTEXT>` + `</img>` per image.

    Encoded with the checkpoint's own tokenizer files (chat() layout, no system turn).
    """
    images = "".join(f"Image-{i + 1}: <img>" + "<IMG_CONTEXT>" * (TOKENS_PER_TILE * n) + "</img>\n"
                      for i, n in enumerate(tiles_per_image))
    text = f"<|im_start|>user\n{images}{question}<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor(_tokenizer(str(folder))(text)["input_ids"], dtype=torch.long)
    img_context = _tokenizer(str(folder)).convert_tokens_to_ids("<IMG_CONTEXT>")
    assert int((ids == img_context).sum()) == TOKENS_PER_TILE * sum(tiles_per_image), "image tokens miscounted"
    return ids


def left_pad(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors into (input_ids [B,T], attention_mask [B,T]), as batch_chat does."""
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, t - len(s):] = s
        mask[b, t - len(s):] = 1
    return ids, mask


def random_pixels(n: int, seed: int = 0) -> torch.Tensor:
    """[n,3,448,448] fp32 pixel values, roughly ImageNet-normalized scale."""
    return torch.randn((n, 3, IMAGE_SIZE, IMAGE_SIZE), generator=torch.Generator().manual_seed(seed))


def first_decode_step(model, ids: list[int], pv: torch.Tensor, room: int = 4) -> tuple:
    """The inputs of engine.decode_one_token's first step after a prefill of one prompt (ids, its images pv)
    on a fresh cache of len(ids) + room slots: (token, position, positions, mask, rows)."""
    from engine import prefill

    rows, T = model.language_rows(None, 1, "cpu"), len(ids)
    model.language_model.setup_cache(rows, T + room)
    with torch.no_grad():
        logits = prefill(model, torch.tensor([ids]), pv, torch.ones(1, T, dtype=torch.bool), False, None, rows)
    return (logits.argmax(-1, keepdim=True), torch.tensor([T]), torch.tensor([[T]]),
            torch.ones(1, T + room, dtype=torch.bool), rows)


# Under pytest-xdist every worker is one process on a machine of few cores (CI: 2 workers on 2): one
# intra-op thread each, and for the processes they start (torchrun workers, commands), so that no
# OpenMP team waits on a core another worker holds.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


# Compiled graphs are shared across the tests of a session: a model of the same config and shapes
# reuses the decode step compiled for an earlier one (its weights are graph inputs), which is most
# of what the compiled tests cost. The recompile limit per code object is raised to cover the
# suite's distinct configs, and reaching it is an error rather than a silent fall back to eager
# (which would make every compiled-equals-eager test vacuous).
for name, value in (("recompile_limit", 256), ("accumulated_recompile_limit", 4096),
                    ("automatic_dynamic_shapes",
                     False),  # a new shape compiles a static graph, as a fresh process would
                    ("fail_on_recompile_limit_hit", True)):
    if hasattr(torch._dynamo.config, name):  # the names of torch 2.11 and newer
        setattr(torch._dynamo.config, name, value)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    """The tiny Qwen3 checkpoint in the original layout: the model of the training, command and
    robustness tests."""
    return checkpoint("qwen3", "original")


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    """16 SFT rows in the official InternVL format (write_dataset), made once per module."""
    return write_dataset(tmp_path_factory.mktemp("data"), rows=16)


def parse_flags(command, argv: list):
    """The config a command module's flags give (flags.parse_command over its COMMANDS), without running it."""
    from flags import parse_command
    return parse_command(command.DESCRIPTION, command.COMMANDS, argv, getattr(command, "PROG", None))[1]


def two_nodes(args: list, node_args: tuple[list, list] = ([], []), timeout: int = 300) -> tuple[list[int], str]:
    """A command (script and flags) as 2 nodes x 1 process: two torchrun launchers on 127.0.0.1, the
    multi-node invocation of docs/training.md, "More than one machine" (--nnodes 2 --node-rank 0 / 1,
    rendezvous at --master-addr and --master-port), as two machines sharing a file system. node_args: flags
    only one node gets.
    Returns both launchers' exit codes and their stderr, node 0's first."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               *map(str, args), *map(str, node_args[k])], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [p.returncode for p in procs], "".join(err for _, err in outs)


# A faked Slurm for slurm/parvl.sbatch: `scontrol show hostnames` lists the comma-separated nodes of
# SLURM_JOB_NODELIST, `scontrol requeue` is written down; `srun --nodes=N ...` writes down its arguments
# (and its whole environment into FAKE_SRUN_ENV, when set) and starts its command once per node with that
# node's SLURM_NODEID (as N machines would), or with FAKE_SRUN_SLEEP only sleeps that long. Both append one
# JSON line per call to FAKE_SLURM_LOG. `squeue -h -j JOBID -o %l` (the one query the script makes; any other
# is refused) prints FAKE_TIME_LIMIT, the job's time limit as squeue writes it, and is not logged.
FAKE_SRUN = '''import json, os, subprocess, sys, time
args = sys.argv[1:]
opts = [a for a in args[:next(i for i, a in enumerate(args) if not a.startswith("--"))]]
cmd = args[len(opts):]
nodes = int(next(a for a in opts if a.startswith("--nodes=")).split("=")[1])
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps(["srun", *args]) + "\\n")
if "FAKE_SRUN_ENV" in os.environ:
    with open(os.environ["FAKE_SRUN_ENV"], "w") as f:
        json.dump(dict(os.environ), f)
if "FAKE_SRUN_SLEEP" in os.environ:
    time.sleep(float(os.environ["FAKE_SRUN_SLEEP"]))
    sys.exit(0)
procs = [subprocess.Popen(cmd, env=dict(os.environ, SLURM_NODEID=str(k), SLURM_PROCID=str(k))) for k in range(nodes)]
sys.exit(max(p.wait() for p in procs))
'''
FAKE_SCONTROL = '''import json, os, sys
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps(["scontrol", *sys.argv[1:]]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(sys.argv[3].split(",")))
'''
FAKE_SQUEUE = '''import os, sys
if sys.argv[1:] != ["-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%l"]:
    sys.exit(f"fake squeue: unexpected arguments {sys.argv[1:]}")
print(os.environ["FAKE_TIME_LIMIT"])
'''


def fake_slurm(folder: Path, nodes: int = 2, job_id: int = 4242, **env) -> dict:
    """The environment of a Slurm batch job of `nodes` nodes on 127.0.0.1 (one process each, one task and all
    of this machine's CPUs per node, an hour's time limit), with fake srun, scontrol and squeue first on PATH;
    `env` adds or overrides variables. Its log: folder / "slurm.log"."""
    bin_ = folder / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    for name, code in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("squeue", FAKE_SQUEUE)):
        (bin_ / name).write_text(f"#!{sys.executable}\n{code}")
        (bin_ / name).chmod(0o755)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the job's own Slurm variables only: none of a Slurm job these tests may themselves run in
    outer = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    return {**outer, **dict(PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
                            FAKE_SLURM_LOG=str(folder / "slurm.log"), SLURM_JOB_ID=str(job_id),
                            SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_NODELIST=",".join(["127.0.0.1"] * nodes),
                            NPROC_PER_NODE="1", RDZV_PORT=str(port), SLURM_NTASKS_PER_NODE="1",
                            SLURM_JOB_CPUS_PER_NODE=f"{os.cpu_count()}(x{nodes})", FAKE_TIME_LIMIT="1:00:00",
                            PYTHON=sys.executable), **{k: str(v) for k, v in env.items()}}


def slurm_log(env: dict) -> list[list[str]]:
    path = Path(env["FAKE_SLURM_LOG"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def sbatch(args: list, env: dict, timeout: int = 300, **popen) -> subprocess.CompletedProcess:
    """slurm/parvl.sbatch with these arguments, as Slurm runs a batch script (bash, in the submit folder)."""
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(["bash", str(root / "slurm" / "parvl.sbatch"), *map(str, args)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout, **popen)


# ----------------------------------------------------------------------------- training runs

ROOT = Path(__file__).resolve().parents[1]


QA = [("What colour dominates?", "Mostly red with some blue."), ("Describe it.", "A noisy square."),
      ("Is it bright?", "Fairly bright."), ("Count the shapes.", "There are none, only noise.")]


def write_dataset(folder: Path, rows: int = 8, bad: int = 0, repeat: float = 1.0) -> Path:
    """A meta JSON + JSONL in the official format: images (1 or 2 per row), text-only rows, and
    `bad` rows whose image is missing."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for k in range(3):
        Image.fromarray(rng.integers(0, 255, (60 + 40 * k, 90, 3), dtype=np.uint8)).save(folder / f"img{k}.png")
    lines = []
    for i in range(rows):
        q, a = QA[i % len(QA)]
        if i % 4 == 3:
            lines.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
        elif i % 4 == 2:
            lines.append({"image": ["img0.png", "img1.png"], "conversations": [
                {"from": "human", "value": f"<image>\n<image>\n{q}"}, {"from": "gpt", "value": a},
                {"from": "human", "value": "And then?"}, {"from": "gpt", "value": "Nothing more."}]})
        else:
            lines.append({"image": f"img{i % 3}.png", "conversations": [
                {"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]})
    for i in range(bad):
        lines.insert(1 + 3 * i, {"image": "missing.png", "conversations": [
            {"from": "human", "value": "<image>\nHi"}, {"from": "gpt", "value": "Hello."}]})
    (folder / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    meta = {"tiny": {"root": str(folder), "annotation": str(folder / "train.jsonl"), "repeat_time": repeat,
                     "length": len(lines), "data_augment": False}}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / "meta.json"


def run_train(*args, nproc: int = 1, check: bool = True, fault: str | None = None):
    """train.py with these flags (under torchrun with nproc > 1); fault: one of tests/faults.py's."""
    script = [str(ROOT / "tests" / "faults.py"), fault] if fault else [str(ROOT / "train.py")]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"] if nproc > 1
           else [sys.executable]) + [*script,
                                     *map(str, args)]  # --standalone: a free port, so runs side by side never clash
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if check:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def train_here(*args, check: bool = True) -> subprocess.CompletedProcess:
    """train.py's main in this process, for the runs of one process with no fault: what run_train
    gives, less the 3.6 s of imports a new interpreter spends. One intra-op thread, as run_train's
    OMP_NUM_THREADS=1; stdout and stderr captured; a flag error's SystemExit is its exit code."""
    import train

    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = train.main([str(a) for a in args])
            except SystemExit as e:
                code = e.code
    finally:
        torch.set_num_threads(threads)
    res = subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
    if check:
        assert code == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


COMMON = ["--dtype", "fp32", "--global-batch", "4", "--num-workers", "0", "--max-tiles", "2", "--log-every", "1",
          "--no-activation-checkpointing"]


# ----------------------------------------------------------------------------- what a command says

def tree(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under folder: "intact" means this does not change."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


PROGRESS = re.compile(r"step \d+/\d+ \| ")  # train.py's human line per log step (stderr), not a note


def notes(text: str) -> list[str]:
    """The lines of stderr that are not training progress lines."""
    return [x for x in text.strip().splitlines() if not PROGRESS.match(x)]


def one_line(text: str) -> str:
    lines = notes(text)
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    return lines[0]


def worker_lines(stderr: str) -> list[str]:
    """What the workers printed under torchrun: the launcher appends its own failure report (an
    "E... failed (exitcode: 1)" log line and a ChildFailedError traceback) that no worker controls."""
    lines = notes(stderr)
    cut = next((i for i, x in enumerate(lines) if "torch/distributed/elastic" in x or x.startswith("Traceback")),
               len(lines))
    return lines[:cut]


def root_cause(stderr: str) -> str:
    """The traceback field of the root cause in torchrun's failure report (the worker's error file)."""
    section = stderr.split("Root Cause (first observed failure):", 1)[1]
    return next(x for x in section.splitlines() if x.strip().startswith("traceback :")).split(":", 1)[1].strip()


# ----------------------------------------------------------------------------- benchmark files

def write_tsv(path: Path, rows: list[dict]) -> Path:
    """A TSV the way VLMEvalKit writes one (pandas to_csv(sep='\\t'): csv quoting, minimal)."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(cols)
        for r in rows:
            w.writerow([r.get(c, "") for c in cols])
    return path


def png_b64(w: int, h: int, seed: int) -> str:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


# ----------------------------------------------------------------------------- the answer extractor

FAKE_VLMEVALKIT = {
    "multiple_choice.py": '''
def build_prompt(question, options, prediction):
    tmpl = 'MCQ-EXTRACT Q:{} O:{} A:{} ->'
    return tmpl.format(question, options, prediction)
def build_prompt_cn(question, options, prediction):
    tmpl = 'CN {} {} {}'
    return tmpl
def build_prompt_wemath(question, options, prediction):
    tmpl = 'MCQ-EXTRACT WEMATH Q:{} O:{} A:{}'
    question = question.replace('FORMAT-RULE', '')
    return tmpl
''',
    "logicvista.py": '''
def build_prompt_logicvista(line):
    tmpl = 'LOGIC Q:{} A:{}'
    return tmpl
''',
    "wemath.py": "",
    "mathv.py": '''
def get_gpt4_ICE():
    example_1 = "V1"
    return [example_1]
def build_mathv_gpt4_prompt(line):
    task_description = "MATHV "
    return task_description
''',
    "mathvista.py": '''
def get_gpt4_ICE():
    example_1 = "EX1"
    example_2 = "EX2"
    return [example_1, example_2]
def build_mathvista_gpt4_prompt(line):
    task_description = "MATH-EXTRACT "
    return task_description
''',
}


class StubJudge(BaseHTTPRequestHandler):
    """Answers chat completions on the loopback address: option B for option prompts, 14 for maths; with a
    `key` set, only requests that carry it as a bearer token (401 otherwise)."""
    requests: list = []
    key: str | None = None

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if StubJudge.key is not None and self.headers.get("Authorization") != f"Bearer {StubJudge.key}":
            self.send_error(401, "Unauthorized")
            return
        StubJudge.requests.append(body)
        prompt = body["messages"][0]["content"]
        if prompt.startswith("LOGIC"):  # first try not letters only: the extractor must retry
            reply = "AC" if body["temperature"] > 0 else "A and C"
        elif prompt.startswith("MATHV"):
            reply = "0.6"
        else:
            reply = "B" if prompt.startswith("MCQ-EXTRACT") else "14"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def fake_vlmevalkit(folder: Path) -> Path:
    """A VLMEvalKit checkout holding only the extraction prompts judge.py reads (FAKE_VLMEVALKIT)."""
    kit = folder / "vlmeval" / "dataset" / "utils"
    kit.mkdir(parents=True, exist_ok=True)
    for name, text in FAKE_VLMEVALKIT.items():
        (kit / name).write_text(text)
    return folder


@contextlib.contextmanager
def judge_server(key: str | None = None, max_requests: int = 500, seconds: float = 300):
    """A small OpenAI-compatible server (StubJudge) on 127.0.0.1 for the answer extractor, its base URL yielded:
    it answers at most `max_requests` requests and stops by itself after `seconds`, or when the block ends; with
    `key`, only requests carrying it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubJudge)
    server.timeout = 0.2  # handle_request returns to the loop that checks the bounds
    stop, start, StubJudge.key = threading.Event(), time.monotonic(), key
    count = len(StubJudge.requests)

    def serve():
        while (not stop.is_set() and time.monotonic() - start < seconds
               and len(StubJudge.requests) - count < max_requests):
            server.handle_request()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        stop.set()
        thread.join()
        server.server_close()
        StubJudge.key = None


# ----------------------------------------------------------------------------- trackers

def expected_scalars(lines: list[dict], dtype=np.float32) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as a tracker should hold it: each number at its line's step, a nested one under
    outer/inner, nulls absent; float32, as TensorBoard's event files store scalars."""
    want = {}
    for line in lines:
        for key, value in line.items():
            items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list)
                     else [(None, value)])
            for sub, x in items:
                if key != "step" and x is not None:
                    want.setdefault(key if sub is None else f"{key}/{sub}", []).append(
                        (line["step"], float(dtype(x))))
    return want


def event_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard run folder (or one event file), read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})  # 0: keep every event, no sampling
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ----------------------------------------------------------------------------- the model, loaded

@pytest.fixture(scope="session")
def parvl(checkpoint):
    """`parvl(family, layout) -> ParVL` loaded in fp32 from that checkpoint folder (session-cached; don't modify)."""
    from parvl import ParVL

    models: dict[tuple[str, str], ParVL] = {}

    def get(family: str = "qwen3", layout: str = "original") -> ParVL:
        if (family, layout) not in models:
            models[family, layout] = ParVL.from_pretrained(checkpoint(family, layout), dtype=torch.float32,
                                                           device="cpu")
        return models[family, layout]
    return get


def hf_greedy(ref, ids: list[int], pixel_values, n: int) -> list[int]:
    """transformers' greedy generate, forced to n tokens (no eos) so both sides run every step."""
    images = {} if pixel_values is None else {"pixel_values": pixel_values}  # None trips transformers 5.24
    out = ref.generate(input_ids=torch.tensor([ids]), **images, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


# ----------------------------------------------------------------------------- commands in this process

def run_main(capsys, main, argv) -> tuple[int, list[str]]:
    """A command's main in this process: its exit code (a flag error's too) and its stderr lines."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def gen_main(capsys, *args) -> tuple[int, str, str]:
    """generate.py's main in this process: its exit code, stdout and stderr."""
    import generate

    code = generate.main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def main_out(capsys, *argv) -> tuple[int, str, str]:
    """evaluate.py's main in this process: its exit code, stdout and stderr."""
    import evaluate

    rc = evaluate.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


NOT_UTF8 = "character {k} is a lone surrogate U+DCFF (the byte 0xff of text that is not UTF-8?)"


@pytest.fixture(scope="session")
def png(tmp_path_factory):
    """A 90 x 60 random photo.png: the image of the command tests."""
    path = tmp_path_factory.mktemp("img") / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8)).save(path)
    return path


def png_ok(path, size) -> None:
    img = Image.open(path)
    assert img.format == "PNG" and img.size == size
    assert np.asarray(img.convert("L")).std() > 5  # something is drawn


@pytest.fixture(scope="session")
def input_files(tmp_path_factory):
    """Small files of bad (or odd) input the commands are handed: a TSV with a header and no rows, one
    with a short row, predictions, score files (a NaN, a string), law CSVs (six equal points, a byte order
    mark, 200,004 rows), a file where a folder goes, an empty folder, a run with foreign metrics lines."""
    d = tmp_path_factory.mktemp("inputs")
    img = png_b64(16, 16, 5)
    f = {"header_tsv": write_tsv(d / "header_tsv", [{"index": "0", "question": "q", "answer": "a", "image": img}]),
         "short_tsv": d / "short_tsv", "preds": d / "preds.jsonl", "score": d / "score.json",
         "nan": d / "nan.json", "text": d / "text.json", "six_csv": d / "six_csv", "bom_csv": d / "bom_csv",
         "big_csv": d / "big_csv", "a file": d / "a file", "folder": d / "folder", "run": d / "run"}
    f["header_tsv"].write_text(f["header_tsv"].read_text().splitlines()[0] + "\n")
    f["short_tsv"].write_text("index\tquestion\tanswer\n0\tWhat?\n1\tWhat?\tyes\n")  # row 0 has no answer cell
    f["preds"].write_text('{"index": "0", "prediction": "yes"}\n{"index": "1", "prediction": "yes"}\n')
    f["score"].write_text('{"benchmark": "OCRBench", "score": 50.0, "pv": 1, "pl": 1}\n')
    f["nan"].write_text('{"benchmark": "OCRBench", "score": NaN, "pv": 1, "pl": 1}\n')
    f["text"].write_text('{"benchmark": "OCRBench", "score": "high", "pv": 1, "pl": 1}\n')
    f["six_csv"].write_text("params,p,loss\n" + "1000000,2,2.5\n" * 6)
    rows = [(n, p, 1.5 + (3e8 / (n * (0.4 * math.log(p) + 1))) ** 0.3) for n in (1e8, 1e9) for p in (1, 2, 4)]
    f["bom_csv"].write_text("\ufeffparams,p,loss\n" + "".join(f"{n},{p},{loss}\n" for n, p, loss in rows),
                            encoding="utf-8")
    f["big_csv"].write_text("params,p,loss\n" + "".join(f"{n},{p},{loss}\n" for n, p, loss in rows) * 33334)
    f["a file"].write_text("x")
    f["folder"].mkdir()
    f["run"].mkdir()
    (f["run"] / "metrics.jsonl").write_text(
        '{"step": 1, "loss": null, "grad_norm": 1.0, "lr": {"pretrained": 0.001}}\n{"loss": 3}\nnull\n[1, 2]\n'
        '{"step": 2, "loss": 2.0, "grad_norm": null, "lr": null}\n"text"\n'
        '{"step": 3, "loss": 1.5, "grad_norm": 0.5, "lr": {"pretrained": 0.002, "branches": 0.01}}\n')
    return f


# ----------------------------------------------------------------------------- a benchmark and its predictions

BENCH_NEW = 6  # new tokens of the bench runs: enough for a short answer, cheap on CPU


@pytest.fixture(scope="session")
def bench(checkpoint, tmp_path_factory):
    """An MMMU-style TSV: options, a hint, an open question, two images, a shared image, a 2:1 image
    (two tiles + thumbnail) and one corrupt image."""
    folder = checkpoint("qwen3", "original")
    d = tmp_path_factory.mktemp("bench")
    imgs = [png_b64(24, 24, 1), png_b64(20, 20, 2), png_b64(64, 32, 3)]
    rows = [
        {"index": "10", "question": "What is shown?", "A": "cat", "B": "dog", "answer": "A", "split": "validation",
         "image": imgs[0]},
        {"index": "11", "question": "Compare <image 1> and <image 2>.", "A": "same", "B": "different", "answer": "B",
         "split": "validation", "image": str([imgs[1], imgs[0]])},
        {"index": "12", "question": "How many?", "hint": "Count them.", "answer": "3", "split": "dev", "image": "10"},
        {"index": "13", "question": "Broken", "A": "x", "B": "y", "answer": "A", "split": "dev",
         "image": "!!notbase64" * 10},
        {"index": "14", "question": "Wide picture?", "A": "yes", "B": "no", "answer": "A", "split": "validation",
         "image": imgs[2]},
    ]
    return folder, write_tsv(d / "MMMU_DEV_VAL.tsv", rows), rows, imgs


def read_preds(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session")
def full_run(bench, tmp_path_factory):
    """`evaluate.py run` of the bench TSV on its checkpoint, in batches of 3: the predictions every
    score, lengths and descriptors test reads."""
    import evaluate

    folder, tsv, rows, _ = bench
    out = tmp_path_factory.mktemp("run") / "pred.jsonl"
    rc = evaluate.main(["run", "--benchmark", "MMMU_DEV_VAL", "--data", str(tsv), "--model", str(folder),
                        "--out", str(out), "--batch-size", "3", "--max-new-tokens", str(BENCH_NEW)])
    assert rc == 0
    return out


def write_scores(folder: Path, name: str, values: list, **record) -> list[Path]:
    """One score file per benchmark, as `evaluate.py score --out` writes them (its config fields); name
    is the checkpoint's."""
    from evaluation import scoring as S

    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for bench, v in zip(S.BENCHMARKS, values):
        files.append(folder / f"{name}{'_kv' if record.get('shared_kv') else ''}_{bench}.json")
        files[-1].write_text(json.dumps({"benchmark": bench, "score": v, "n": 10, "unresolved": 0, "missing": 0,
                                         "model": f"runs/{name}/export", "model_fingerprint": f"fp-{name}",
                                         "pv": 1, "pl": 1, "vision_branch": None, "language_branch": None,
                                         "shared_kv": False, "router": None, "random_pair": None, "branches": {}}
                                        | record) + "\n")
    return files


# ----------------------------------------------------------------------------- a training run several files read

@pytest.fixture(scope="session")
def run3(checkpoint, tmp_path_factory):
    """A 2:2 run of 3 steps saving every step and keeping the last 2, logged to TensorBoard; the model it
    held in memory after step 2 is exported by the run itself (the end-of-run export's function, through a
    patched save) into a folder beside it. On the tiny checkpoint and 16 rows written as `meta` writes them.
    Returns the run folder, that export and the meta file."""
    import runs
    import train

    model_dir = checkpoint("qwen3", "original")
    root = tmp_path_factory.mktemp("run3")
    meta = write_dataset(root / "data", rows=16)
    out, at_two = root / "run", root / "in_memory_step_2"
    save = train.save_checkpoint

    def save_and_export(model, optim, sched, step, *args):
        save(model, optim, sched, step, *args)
        if step == 2:
            runs.export(model, at_two, Path(model_dir), step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "save_checkpoint", save_and_export)
        train_here("--model", model_dir, "--data", meta, "--pv", "2", "--pl", "2", "--max-steps", "3", "--save-every",
                   "1", "--keep-last", "2", "--tracker", "tensorboard", "--out", out, *COMMON)
    return out, at_two, meta
