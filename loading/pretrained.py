"""A ParVL from a checkpoint folder, and back: the model (parvl.py) is architecture only, and this is how
it meets its files.

    from loading.pretrained import load_pretrained, save_pretrained
    model = load_pretrained("path/to/InternVL3_5-1B", dtype=torch.bfloat16, device="cuda")
    save_pretrained(model, "path/to/out")

Checkpoints load directly from a local folder in either official layout: the original
InternVLChatModel keys (`vision_model.*`, `mlp1.*`, `language_model.*`), which is parvl.py's own module
tree, or the transformers-native "-HF" layout (split q/k/v, `vision_tower.*`, `multi_modal_projector.*`),
renamed and fused once at load (weights.py). The model is built on the meta device and the checkpoint
tensors are assigned in place, so the weights are held in memory once. config.json's spellings and
every check of its values against the tensors are checkpoint.py's.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import fields, replace
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from config import ParConfig, ParVLConfig
from loading.checkpoint import (
    TOKENIZER_FILES,
    CheckpointError,
    check_keys,
    check_layer_counts,
    check_sizes,
    read_json,
)
from loading.config_json import config_from_json, config_to_json
from loading.weights import CheckpointReader, unstack_experts
from parvl import ParVL, is_branch_tensor


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device="cpu",
    pv: int | None = None,
    pl: int | None = None,
    par: ParConfig | None = None,
    model_class: type[ParVL] = ParVL,
) -> ParVL:
    """Load a local checkpoint folder: InternVL3.5 / InternVL3 (original or -HF layout, sharded or not), a
    ParVL checkpoint written by `save_pretrained`, or a ParScale checkpoint (language-only). dtype None keeps
    the stored dtype (bf16 stays bf16). pv / pl (or a whole ParConfig) start ParVL branches from a plain
    InternVL checkpoint: the new tensors are set by `ParVL.init_branches`. model_class: ParVL or a subclass
    of it (training's TrainedParVL)."""
    folder = Path(path)
    raw = read_json(folder / "config.json")
    reader = CheckpointReader(folder, device, parscale_branches=int(raw.get("parscale_n", 0)))
    with torch.device("meta"):
        model = model_class(checkpoint_config(folder, raw, reader.keys(), pv, pl, par))
    new = check_checkpoint(model, reader, folder)
    model.load_state_dict(
        {k: reader.rows(k, dtype=dtype) for k in reader.keys()}, strict=False, assign=True
    )
    if model.cfg.llm.tie_word_embeddings:
        model.language_model.lm_head.weight = model.language_model.model.embed_tokens.weight
    if new:
        like = model.language_model.model.embed_tokens.weight
        for name in new:  # materialise the meta tensors the checkpoint does not have
            owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            blank = torch.empty_like(getattr(owner, attr), device=like.device, dtype=like.dtype)
            setattr(owner, attr, nn.Parameter(blank))
        model.init_branches()
    model.language_model.model.init_rope(device)
    model.source_dir = folder  # where save_pretrained takes the tokenizer files from by default
    return model.eval()


def checkpoint_config(
    folder: Path,
    raw: dict,
    keys: set[str],
    pv: int | None = None,
    pl: int | None = None,
    par: ParConfig | None = None,
) -> ParVLConfig:
    """The config of a checkpoint folder (its config.json `raw` and tensor names `keys`), with the branch
    counts asked for; a ParVL checkpoint only loads as the Pv:Pl it was saved with."""
    cfg = config_from_json(raw, folder, tied="language_model.lm_head.weight" not in keys)
    check_layer_counts(cfg, keys, folder)  # before a module is built from it
    saved = cfg.par
    if par is not None or pv is not None or pl is not None:
        par = replace(par or saved, **{k: v for k, v in (("pv", pv), ("pl", pl)) if v is not None})
        # its branch tensors are what they are; the smoothing may change
        if (saved.pv, saved.pl) != (1, 1):
            for name in (
                f.name for f in fields(ParConfig) if f.name not in ("lambda_v", "lambda_l")
            ):
                if getattr(saved, name) != getattr(par, name):
                    raise CheckpointError(
                        f"{folder}: holds Pv:Pl = {saved.pv}:{saved.pl} branches with {name} "
                        f"{getattr(saved, name)}, cannot load them as {name} {getattr(par, name)}"
                    )
        cfg = replace(cfg, par=par)
    return cfg


def check_checkpoint(model: ParVL, reader: CheckpointReader, folder: Path) -> set[str]:
    """Refuse a checkpoint whose keys or shapes do not fit `model`; return the branch tensors it lacks,
    which start from branch_init (a plain InternVL checkpoint under Pv, Pl > 1)."""
    # the sizes' fields named, before any key or shape
    check_sizes(model.cfg, reader.shapes, folder)
    expected = set(model.state_dict().keys())
    if model.cfg.llm.tie_word_embeddings:
        expected.discard("language_model.lm_head.weight")
    new = {k for k in expected if is_branch_tensor(k)}
    fresh = not any(is_branch_tensor(k) for k in reader.keys())
    check_keys(expected - new if fresh else expected, reader.keys(), folder)
    for key, p in model.state_dict().items():
        if key in reader.shapes and reader.shapes[key] != tuple(p.shape):
            raise CheckpointError(
                f"{folder}: {key} has shape {list(reader.shapes[key])}, the config needs {list(p.shape)}"
            )
    return new if fresh else set()


def save_pretrained(
    model: ParVL, path: str | Path, tokenizer_from: str | Path | None = None
) -> None:
    """Write config.json and model.safetensors in the original InternVL layout plus the ParVL tensors
    (prefixes, aggregators), and the tokenizer files of `tokenizer_from` (default: the folder the model
    was loaded from). At Pv = Pl = 1 the result is a plain InternVL checkpoint."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    # Qwen3-MoE's experts one key each, as InternVL's code reads them
    state = unstack_experts(
        {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    )
    # safetensors refuses shared storage; the tie is in config
    if model.cfg.llm.tie_word_embeddings:
        state.pop("language_model.lm_head.weight")
    tmp = folder / "model.safetensors.tmp"  # write, then rename: a crash never leaves half a file
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config_to_json(model.cfg), indent=2))
    src = Path(tokenizer_from) if tokenizer_from is not None else getattr(model, "source_dir", None)
    for name in TOKENIZER_FILES:
        if src is not None and (src / name).exists() and src.resolve() != folder.resolve():
            shutil.copy(src / name, folder / name)
