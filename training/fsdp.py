"""The model as training holds it, the torchtitan way (train.py): built on the meta device, frozen where
the flags say, each ViT and LLM block wrapped (activation checkpointing, torch.compile) and sharded with
FSDP2's fully_shard, then the root; every rank then reads only its own rows of each tensor from the
safetensors files (load_shards), so no rank ever holds the whole model, in any dtype. Its optimizer
groups (two learning rates) and its training FLOPs per token (for MFU) are read off it here too."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from aggregate import LoRA
from loading.checkpoint import read_json
from loading.config_json import config_from_json
from loading.pretrained import check_checkpoint, checkpoint_config
from loading.weights import CheckpointReader
from parvl import ParVL, is_branch_tensor
from shell.cli import rank


class TrainedParVL(ParVL):
    """ParVL as training runs it: `train_states` is the root's FSDP2 forward method (hidden_from_ids). Its
    states h get a tensor of their own where the language Aggregator's fp32 result is a view (einsum's): FSDP2
    warns at a view output of a module it hooks for backward (an in-place op on it would skip the hook). In
    bf16 training the Aggregator's cast already makes a new tensor, so the copy is fp32 training's alone,
    and the decode step, which never comes here, pays nothing."""

    def train_states(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        segment_ids: torch.Tensor | None,
    ):
        h, w_vision, w_language = self.hidden_from_ids(
            input_ids, pixel_values, attention_mask, segment_ids=segment_ids
        )
        return (h.clone() if h._base is not None else h), w_vision, w_language


def has_lora_dropout(model: ParVL, cfg) -> bool:
    """Whether the ViT's blocks draw random masks while training (LoRA vision branches, --lora-dropout > 0)."""
    return any(isinstance(m, LoRA) for m in model.modules()) and cfg.lora_dropout > 0


def build_model(cfg, device, mesh) -> TrainedParVL:
    """cfg: train.py's TrainConfig. Build on the meta device, freeze, wrap blocks with activation
    checkpointing and compile, fully_shard blocks and root, then let every rank materialise its own
    rows only (load_shards): no rank ever holds the whole model, in any dtype."""
    folder = Path(cfg.model)
    raw = read_json(folder / "config.json")
    check_no_router_loss(raw, folder)
    reader = CheckpointReader(folder, parscale_branches=int(raw.get("parscale_n", 0)))
    with torch.device("meta"):
        # into the export's config.json
        given = {k: v for k, v in cfg.branches().items() if v is not None}
        # checkpoint_config refuses to change a ParVL checkpoint's branches
        par = replace(config_from_json(raw, folder).par, **given) if given else None
        model = TrainedParVL(
            checkpoint_config(folder, raw, reader.keys(), cfg.pv, cfg.pl, par)
        ).train()
    new = check_checkpoint(model, reader, folder)
    # every rank draws the same new branch tensors, as load_pretrained does
    torch.manual_seed(cfg.seed)
    fresh = {k: v for k, v in model.branch_init().items() if k in new}
    for name, p in model.named_parameters():
        frozen = (cfg.freeze_backbone and not is_branch_tensor(name)) or (
            not is_branch_tensor(name)
            and (
                (cfg.freeze_vit and name.startswith("vision_model."))
                or (cfg.freeze_connector and name.startswith("mlp1."))
                or (cfg.freeze_llm and name.startswith("language_model."))
            )
        )
        p.requires_grad_(not frozen)
    for m in model.modules():  # LoRA vision branches: InternVL's dropout, a training setting
        if isinstance(m, LoRA):
            m.dropout = cfg.lora_dropout
    # a block that draws dropout masks recomputes them alike only with its RNG state kept
    random = {id(model.vision_model.encoder.layers)} if has_lora_dropout(model, cfg) else set()
    blocks = [model.language_model.model.layers]
    if model.cfg.vit is not None:
        blocks.append(model.vision_model.encoder.layers)
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cfg.dtype == "bf16" else None, reduce_dtype=torch.float32
    )
    for layers in blocks:
        for i, block in enumerate(layers):
            if cfg.activation_checkpointing:
                block = checkpoint_wrapper(block, preserve_rng_state=id(layers) in random)
            if cfg.compile:
                block.compile(fullgraph=True)
            layers[i] = block
            fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # the root all-gathers for this entry point too; as the
    register_fsdp_forward_method(model, "train_states")
    # root it is not resharded after forward, so lm_head's weight is still whole for the chunked loss after it
    model.to_empty(device=device)
    load_shards(model, reader, fresh)
    model.language_model.model.init_rope(device)
    return model


def check_no_router_loss(raw: dict, folder: Path) -> None:
    """The official InternVL3.5 SFT (internvl_chat_gpt_oss/internvl/train/internvl_chat_finetune.py) adds
    the experts' load-balancing loss only where the language model's config has output_router_logits
    true: it sets it for GPT-OSS alone and leaves Qwen3-MoE's as the checkpoint has it, false in every
    released config, so its loss is the language loss alone, and so is train.py's. A checkpoint that asks
    for the loss is refused in one line rather than trained without it."""
    block = raw.get("llm_config") or raw.get("text_config") or {}
    if isinstance(block, dict) and block.get("output_router_logits") is True:
        key = "llm_config" if "llm_config" in raw else "text_config"
        raise ValueError(
            f"{folder / 'config.json'}: {key}.output_router_logits is true: the official fine-tuning "
            f"then adds the experts' load-balancing loss (router_aux_loss_coef "
            f"{block.get('router_aux_loss_coef', 0.001)}), which train.py does not; set it false to "
            f"train on the language loss alone, as the released configs do"
        )


@torch.no_grad()
def load_shards(model: ParVL, reader: CheckpointReader, fresh: dict[str, torch.Tensor]) -> None:
    """Fill each rank's shard of every parameter: FSDP2 splits dim 0 as torch.chunk does (ceil(n /
    world) rows each), so this rank reads rows [r*c, (r+1)*c) of each tensor from the safetensors
    files, cast to fp32 one slice at a time; new branch tensors come from `fresh` (drawn alike on
    every rank). The host holds this rank's shards and one slice in flight, never the checkpoint."""
    world, r = dist.get_world_size(), rank()
    # tied lm_head: the same tensor as embed_tokens, filled once
    for key, t in model.state_dict().items():
        if key not in reader.keys() and key not in fresh:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        n = t.shape[0]
        c = -(-n // world)
        a, b = min(r * c, n), min((r + 1) * c, n)
        assert local.shape[0] == b - a, (key, tuple(local.shape), a, b)  # FSDP2's even-chunk layout
        if b > a:
            src = reader.rows(key, a, b) if key in reader.keys() else fresh[key][a:b]
            local.copy_(src.to(local.dtype))


def param_groups(model: ParVL, cfg) -> list[dict]:
    """New branch tensors at lr_new, pretrained weights at lr_pretrained; weight decay on everything,
    as the official DeepSpeed recipe applies it (one group, biases and norms included)."""
    new = [p for n, p in model.named_parameters() if p.requires_grad and is_branch_tensor(n)]
    old = [p for n, p in model.named_parameters() if p.requires_grad and not is_branch_tensor(n)]
    return [
        g
        for g in (
            {"params": new, "lr": cfg.lr_new, "name": "branches"},
            {"params": old, "lr": cfg.lr_pretrained, "name": "pretrained"},
        )
        if g["params"]
    ]
