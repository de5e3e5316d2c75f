"""A checkpoint's weights: its safetensors files (model.safetensors, or the shards listed in
model.safetensors.index.json), read a tensor, or rows of one, at a time straight to the target device, with
every official key spelling renamed to this project's module tree, which is the original InternVL layout:
- original InternVLChatModel keys (`vision_model.*`, `mlp1.*`, `language_model.*`): as they are;
- transformers-native "-HF" keys, new style (`model.vision_tower.*`, `model.multi_modal_projector.*`,
  `model.language_model.*`, `lm_head.*`) or legacy (`vision_tower.*`, `language_model.model.*`, ...),
  with the split q/k/v of the ViT fused back into `attn.qkv` (rows q | k | v);
- ParScale's Qwen2 checkpoints (`model.layers.*.self_attn.prefix_k`, `model.aggregate_layer.*`),
  whose aggregator concatenates branch states hidden-major, (h p), where ParVL writes them
  branch-major, (p h): its first layer's columns are permuted once here.
Only safetensors and JSON are read: nothing is unpickled. The folder's config.json is checkpoint.py's.

    reader = CheckpointReader(Path("InternVL3_5-1B"))   # headers only: names, dtypes, shapes
    w = reader.rows("language_model.lm_head.weight")    # one tensor; rows(key, a, b) reads rows a:b alone
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from loading.checkpoint import CheckpointError, check_not_lfs_pointer, read_json

# -HF key -> original key (after stripping a leading "model."); q/k/v are fused separately below.
HF_RENAMES = [
    (r"^vision_tower\.embeddings\.cls_token$", "vision_model.embeddings.class_embedding"),
    (
        r"^vision_tower\.embeddings\.patch_embeddings\.projection\.",
        "vision_model.embeddings.patch_embedding.",
    ),
    (
        r"^vision_tower\.embeddings\.position_embeddings$",
        "vision_model.embeddings.position_embedding",
    ),
    (
        r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.projection_layer\.",
        r"vision_model.encoder.layers.\1.attn.proj.",
    ),
    (
        r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qk])_norm\.",
        r"vision_model.encoder.layers.\1.attn.\2_norm.",
    ),
    (
        r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qkv])_proj\.",
        r"vision_model.encoder.layers.\1.attn.qkv.\2.",
    ),
    (
        r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_before\.",
        r"vision_model.encoder.layers.\1.norm1.",
    ),
    (
        r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_after\.",
        r"vision_model.encoder.layers.\1.norm2.",
    ),
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
    if key.startswith(
        ("vision_model.", "mlp1.", "language_model.model.", "language_model.lm_head.")
    ):
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
        check_not_lfs_pointer(folder / name)
    return [folder / name for name in names]


def parscale_key(key: str) -> str:
    """ParScale (Qwen2 with prefixes) -> this tree's language-only keys."""
    if key.startswith("model.aggregate_layer."):
        return "language_aggregator.mlp." + key.removeprefix("model.aggregate_layer.")
    if key.startswith("lm_head."):
        return "language_model." + key
    return "language_model." + key  # model.embed_tokens / model.layers.* / model.norm


# a Qwen3-MoE expert's weight as every official layout stores it: (prefix, expert, projection)
EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def unstack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """moe.py's stacked experts -> the per-expert keys every official layout stores (the inverse of
    CheckpointReader.stack_experts), so a saved Qwen3-MoE loads in InternVL's own code; the rest as it is."""
    out = {}
    for key, t in state.items():
        prefix, _, name = key.rpartition(".")
        if not prefix.endswith(".mlp.experts") or name not in ("gate_up_proj", "down_proj"):
            out[key] = t
            continue
        for e, w in enumerate(t):
            parts = (
                zip(("gate_proj", "up_proj"), w.chunk(2)) if name == "gate_up_proj" else [(name, w)]
            )
            out |= {f"{prefix}.{e}.{p}.weight": part.contiguous() for p, part in parts}
    return out


# safetensors dtype names -> torch dtypes (the format: an 8-byte little-endian header length, a JSON
# header of {name: {dtype, shape, data_offsets}}, then the raw little-endian bytes)
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointReader:
    """A checkpoint's tensors under canonical keys, read one at a time, or rows a:b of one, straight
    from the safetensors files with plain reads (no memory map): only the bytes asked for are read
    and held. -HF q/k/v rows are fused back into qkv (rows q | k | v); a ParScale aggregator's
    columns are permuted to branch-major. parscale_branches > 0 reads a ParScale checkpoint."""

    def __init__(self, folder: Path, device="cpu", parscale_branches: int = 0):
        rename = parscale_key if parscale_branches else canonical_key
        self.folder, self.device, self.parscale = folder, device, parscale_branches
        # canonical key -> [(file, dtype, shape, byte offset)]
        self.parts: dict[str, list[tuple]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in checkpoint_files(folder):
            for key, (dtype, shape, offset) in safetensors_header(file).items():
                self.parts[rename(key)] = [(file, dtype, shape, offset)]
                self.shapes[rename(key)] = shape
        for key in [k for k in self.parts if ".attn.qkv.q." in k]:  # -HF: q, k, v -> one qkv
            names = [key.replace(".qkv.q.", f".qkv.{x}.") for x in "qkv"]
            fused = key.replace(".qkv.q.", ".qkv.")
            self.parts[fused] = [part for name in names for part in self.parts.pop(name)]
            shapes = [self.shapes.pop(name) for name in names]
            self.shapes[fused] = (sum(shape[0] for shape in shapes), *shapes[0][1:])
        self.stack_experts()

    def stack_experts(self) -> None:
        """Qwen3-MoE: the per-expert keys `mlp.experts.{e}.{gate,up,down}_proj.weight` (every official layout,
        transformers 5's save included) -> moe.py's stacked `mlp.experts.gate_up_proj` [E,2I,C] (expert e's
        gate rows, then its up rows) and `mlp.experts.down_proj` [E,C,I]; nothing is read, the parts are
        listed in stacking order. Experts numbered with a gap are refused, naming the first one missing."""
        found: dict[str, dict[int, dict[str, str]]] = {}
        for key in self.parts:
            if m := EXPERT_KEY.match(key):
                found.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = key
        for prefix, experts in found.items():
            if missing := sorted(set(range(len(experts))) - set(experts)):
                raise CheckpointError(
                    f"{self.folder}: {prefix}.{missing[0]} is missing (the checkpoint holds "
                    f"{len(experts)} experts, numbered up to {max(experts)})"
                )
            for name, projections in (
                ("gate_up_proj", ("gate_proj", "up_proj")),
                ("down_proj", ("down_proj",)),
            ):
                keys = [experts[e].get(p) for e in range(len(experts)) for p in projections]
                if None in keys:
                    raise CheckpointError(
                        f"{self.folder}: an expert of {prefix} has no {'/'.join(projections)} weight"
                    )
                rows, rest = self.shapes[keys[0]][0] * len(projections), self.shapes[keys[0]][1:]
                self.parts[f"{prefix}.{name}"] = [part for k in keys for part in self.parts.pop(k)]
                self.shapes[f"{prefix}.{name}"] = (len(experts), rows, *rest)
                for k in keys:
                    self.shapes.pop(k)

    def keys(self) -> set[str]:
        return set(self.parts)

    def rows(
        self, key: str, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Rows start:stop (dim 0) of one tensor, on the reader's device; only those bytes are read. A tensor
        stacked of 2-D parts (experts [E,2I,C]) reads its rows as the parts' rows they are made of."""
        whole = self.shapes[key]
        stop = (whole[0] if whole else 1) if stop is None else stop
        rows_out, stacked = stop - start, len(whole) > len(self.parts[key][0][2])
        if stacked:  # expert e's rows are the parts' rows e*per:(e+1)*per
            per = whole[1]
            start, stop = start * per, stop * per
        pieces, first = [], 0
        for file, part_dtype, shape, offset in self.parts[key]:
            n = shape[0] if shape else 1
            a, b = max(start - first, 0), min(stop - first, n)  # this part's rows of start:stop
            first += n
            if a >= b and shape:
                continue
            row = part_dtype.itemsize * (
                int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1
            )
            data = bytearray((b - a) * row if shape else row)
            with open(file, "rb") as f:
                f.seek(offset + a * row)
                if f.readinto(data) != len(data):
                    raise CheckpointError(
                        f"{file}: truncated safetensors file (tensor {key} is cut short)"
                    )
            t = torch.frombuffer(data, dtype=part_dtype).reshape(
                (b - a, *shape[1:]) if shape else ()
            )
            pieces.append(t)
        t = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if stacked:
            t = t.reshape(rows_out, *whole[1:])
        # [C, C*P], column h*P + p -> p*C + h
        if self.parscale and key == "language_aggregator.mlp.0.weight":
            t = t.reshape(t.shape[0], -1, self.parscale).transpose(1, 2).reshape(t.shape[0], -1)
        return t.to(device=self.device, dtype=dtype or t.dtype)


def safetensors_header(file: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """{name: (dtype, shape, absolute byte offset)} of one safetensors file; a file that is not one
    (truncated, another format) is refused in one line naming it."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size <= 0 or size > 100_000_000:
                raise ValueError(f"header length {size}")
            header = json.loads(f.read(size))
            end = f.seek(0, 2)
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            if 8 + size + b > end:
                raise ValueError(f"tensor {name} ends at byte {8 + size + b}, the file has {end}")
            out[name] = (SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + a)
        return out
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(
            f"{file}: unreadable safetensors file ({type(e).__name__}: {e})"
        ) from None


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (labels, a router), its header checked first: a file
    that is truncated or not one is refused in one line naming it, not safetensors' own error."""
    safetensors_header(file)
    return load_file(str(file))
