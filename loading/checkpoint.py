"""A checkpoint folder as the official code writes it, read before any weight: config.json in the
spellings this code reads and writes, each value checked as it is read and the sizes checked against the
tensors (their safetensors headers: names and shapes, nothing loaded), and the tokenizer checked to
belong to it. The tensors themselves are weights.py's; the hub download is hub.py's.

    cfg, tok = open_checkpoint(Path("InternVL3_5-1B"))   # the config and tokenizer, checked together
    raw = config_to_json(cfg)                            # the original layout, with this project's "parvl" block

config.json: the original InternVLChatConfig (`llm_config`, `vision_config`, plus this project's
"parvl" block when saved here), the transformers-native -HF InternVLConfig (`text_config`), and
ParScale's Qwen2 config (`parscale_n`, language-only). The decoder is chosen as InternVL's own code
chooses it, by llm_config.architectures (DECODERS). A bad value is one line naming config.json and the
field, never the TypeError or ZeroDivisionError it would cause once a module is built from it. Only
JSON is read here: nothing is unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path

from config import ParVLConfig


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file or key."""


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "generation_config.json",
)


LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # how a git-LFS pointer file starts


def check_not_lfs_pointer(path: Path) -> None:
    """A clone without git-lfs leaves ~130-byte pointer files where the weights should be: say so,
    instead of the parser's complaint (safetensors: "header too large")."""
    with open(path, "rb") as f:
        head = f.read(len(LFS_POINTER))
    if head == LFS_POINTER:
        raise CheckpointError(
            f"{path}: a git-LFS pointer, not the file itself (run `git lfs pull` in "
            f"{path.parent}, or download the file)"
        )


def check_not_run_folder(folder: Path) -> None:
    """A training run folder (train.py --out) given where a model is expected: name its export."""
    if (folder / "model.safetensors").exists() or (
        folder / "model.safetensors.index.json"
    ).exists():
        return
    if (folder / "export" / "config.json").is_file():
        raise CheckpointError(
            f"{folder}: a training run folder, not a model; its model is {folder / 'export'}"
        )
    if (folder / "checkpoints").is_dir():
        raise CheckpointError(
            f"{folder}: a training run folder with no export yet (the run has not finished; "
            f"its checkpoints resume training with train.py --resume, they are not a model)"
        )


def read_json(path: Path) -> dict:
    # a run folder has one too (train.py's): catch it before it is parsed
    if path.name == "config.json":
        check_not_run_folder(path.parent)
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (is {path.parent} a checkpoint folder?)")
    check_not_lfs_pointer(path)
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # Python's JSON reader recurses once per level
        raise CheckpointError(
            f"{path}: not usable JSON (nested deeper than Python's JSON reader goes)"
        ) from None
    # every JSON file of a checkpoint, router or labels folder is one object
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{path}: a JSON {type(value).__name__}, not the object of names and values it must be"
        )
    return value


def check_keys(expected: set[str], found: set[str], folder: Path) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        what = []
        if missing:
            what.append(f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            what.append(f"unexpected {len(unexpected)} keys (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"{folder}: checkpoint does not match the config: {'; '.join(what)}")


# -- config.json: original (InternVLChatConfig), -HF (InternVLConfig) and ParScale spellings ---------


# -- config.json against the checkpoint's tensors (safetensors headers: names and shapes, nothing loaded) ---


def check_layer_counts(cfg: ParVLConfig, keys, folder: Path) -> None:
    """The layer counts config.json gives against the layers the checkpoint's tensor names hold, before any
    module is built (a num_hidden_layers of 10**6 would build a million blocks before the keys disagree)."""
    towers = [("language model", "language_model.model.layers.", cfg.llm.num_layers)]
    if cfg.vit is not None:
        towers.append(("vision model", "vision_model.encoder.layers.", cfg.vit.num_layers))
    for tower, prefix, layers in towers:
        held = {k[len(prefix) :].split(".")[0] for k in keys if k.startswith(prefix)}
        if len(held) != layers:
            raise CheckpointError(
                f"config.json: the {tower}'s num_hidden_layers is {layers}, but the tensors in "
                f"{folder} hold {len(held)} {tower} layers"
            )


def check_sizes(cfg: ParVLConfig, shapes: dict[str, tuple[int, ...]], folder: Path) -> None:
    """The sizes config.json gives against the shapes of the tensors they size, one line naming the field:
    the embeddings, the first layer's projections and MLP, the patch and position embeddings."""
    t, L = cfg.llm, "language_model.model."
    sized = {  # key: ((dimension, the config's size, the fields that give it), ...)
        L + "embed_tokens.weight": (
            (0, t.vocab_size, "vocab_size"),
            (1, t.hidden_size, "hidden_size"),
        ),
        L + "layers.0.self_attn.q_proj.weight": (
            (0, t.num_heads * t.head_dim, "num_attention_heads x head_dim"),
        ),
        L + "layers.0.self_attn.k_proj.weight": (
            (0, t.num_kv_heads * t.head_dim, "num_key_value_heads x head_dim"),
        ),
    }
    layers = range(t.num_layers)
    if dense := [i for i in layers if not t.is_sparse(i)]:
        sized[L + f"layers.{dense[0]}.mlp.gate_proj.weight"] = (
            (0, t.intermediate_size, "intermediate_size"),
        )
    if sparse := [i for i in layers if t.is_sparse(i)]:  # Qwen3-MoE: the experts stacked at read
        M = L + f"layers.{sparse[0]}.mlp."
        sized[M + "gate.weight"] = ((0, t.num_experts, "num_experts"),)
        sized[M + "experts.gate_up_proj"] = (
            (0, t.num_experts, "num_experts"),
            (1, 2 * t.moe_intermediate_size, "2 x moe_intermediate_size"),
        )
    tower = {k: "language model" for k in sized}
    if cfg.vit is not None:
        v, V = cfg.vit, "vision_model."
        vit = {
            V + "embeddings.patch_embedding.weight": (
                (0, v.hidden_size, "hidden_size"),
                (2, v.patch_size, "patch_size"),
            ),
            V + "embeddings.position_embedding": (
                (1, v.grid**2 + 1, "(image_size / patch_size)^2 + 1"),
            ),
            V + "encoder.layers.0.mlp.fc1.weight": ((0, v.intermediate_size, "intermediate_size"),),
        }
        sized |= vit
        tower |= {k: "vision model" for k in vit}
    for key, dims in sized.items():
        shape = shapes.get(key)
        for dim, size, names in dims if shape is not None else ():
            if len(shape) <= dim or shape[dim] != size:
                raise CheckpointError(
                    f"config.json: the {tower[key]}'s {names} is {size}, but in {folder} {key} "
                    f"has shape {list(shape)}"
                )
