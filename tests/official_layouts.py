"""The official checkpoint layouts as key renamings, for the tests' reference checkpoints (official.py): the
original InternVLChatModel keys (fused `attn.qkv`, `mlp1.*`, `language_model.model.*`), the new-style
transformers keys and the llava-style ones transformers 5 saves, and Qwen3-MoE's experts one key each (as
every file holds them) or stacked (as transformers 5 holds them in memory). Written here from the official
converters' rules, not from this project's loader, so that the loader is checked against them."""

from __future__ import annotations

import torch


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
            k = "mlp1." + k.replace("layer_norm.", "0.").replace("linear_1.", "1.").replace(
                "linear_2.", "3."
            )
        elif k.startswith("model.vision_tower."):
            k = "vision_model." + k.removeprefix("model.vision_tower.")
            k = (
                k.replace("embeddings.cls_token", "embeddings.class_embedding")
                .replace("embeddings.patch_embeddings.projection.", "embeddings.patch_embedding.")
                .replace("embeddings.position_embeddings", "embeddings.position_embedding")
                .replace("encoder.layer.", "encoder.layers.")
                .replace(".attention.projection_layer.", ".attn.proj.")
                .replace(".attention.q_norm.", ".attn.q_norm.")
                .replace(".attention.k_norm.", ".attn.k_norm.")
                .replace(".attention.q_proj.", ".attn.qkv.q.")
                .replace(".attention.k_proj.", ".attn.qkv.k.")
                .replace(".attention.v_proj.", ".attn.qkv.v.")
                .replace(".layernorm_before.", ".norm1.")
                .replace(".layernorm_after.", ".norm2.")
                .replace(".lambda_1", ".ls1")
                .replace(".lambda_2", ".ls2")
            )
        else:
            raise AssertionError(f"unexpected transformers key {key!r}")
        out[k] = t
    for k in [k for k in out if ".attn.qkv.q." in k]:  # fused qkv: rows [q | k | v]
        parts = [out.pop(k.replace(".qkv.q.", f".qkv.{x}.")) for x in "qkv"]
        out[k.replace(".qkv.q.", ".qkv.")] = torch.cat(parts, dim=0)
    return per_expert(out)


def per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's stacked experts (`experts.gate_up_proj` [E,2I,C], gate rows first; `experts.down_proj`
    [E,C,I]) -> one key per expert and projection, as every checkpoint on disk holds them."""
    out = {}
    for k, t in sd.items():
        if k.endswith(".mlp.experts.gate_up_proj"):
            base, width = k.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :width].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, width:].clone()
        elif k.endswith(".mlp.experts.down_proj"):
            base = k.removesuffix("down_proj")
            out |= {f"{base}{e}.down_proj.weight": t[e].clone() for e in range(t.shape[0])}
        else:
            out[k] = t
    return out


def stacked_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of per_expert."""
    out, experts = {}, {}
    for k, t in sd.items():
        base, sep, rest = k.partition(".mlp.experts.")
        if not sep:
            out[k] = t
            continue
        e, proj = rest.split(".")[:2]
        experts.setdefault(base + sep, {}).setdefault(proj, {})[int(e)] = t
    for base, projs in experts.items():
        n = len(projs["down_proj"])
        out[base + "gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)]
        )
        out[base + "down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def original_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """InternVLChatModel keys -> new-style transformers keys (the direction of internvl_custom2hf.py)."""
    out = {}
    for key, t in stacked_experts(sd).items():
        k = key
        if k == "language_model.lm_head.weight":
            k = "lm_head.weight"
        elif k.startswith("language_model.model."):
            k = "model.language_model." + k.removeprefix("language_model.model.")
        elif k.startswith("mlp1."):
            idx, leaf = k.removeprefix("mlp1.").split(".")
            k = (
                "model.multi_modal_projector."
                + {"0": "layer_norm", "1": "linear_1", "3": "linear_2"}[idx]
                + "."
                + leaf
            )
        elif k.startswith("vision_model."):
            k = "model.vision_tower." + k.removeprefix("vision_model.")
            k = (
                k.replace("embeddings.class_embedding", "embeddings.cls_token")
                .replace("embeddings.patch_embedding.", "embeddings.patch_embeddings.projection.")
                .replace("embeddings.position_embedding", "embeddings.position_embeddings")
                .replace("encoder.layers.", "encoder.layer.")
                .replace(".attn.proj.", ".attention.projection_layer.")
                .replace(".attn.q_norm.", ".attention.q_norm.")
                .replace(".attn.k_norm.", ".attention.k_norm.")
                .replace(".norm1.", ".layernorm_before.")
                .replace(".norm2.", ".layernorm_after.")
                .replace(".ls1", ".lambda_1")
                .replace(".ls2", ".lambda_2")
            )
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
