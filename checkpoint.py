"""Checkpoint files: the model folder (a local one, or a hub model fetched once into the
huggingface_hub cache), safetensors shards and the official key spellings.

Reads a local checkpoint folder (model.safetensors, or shards listed in model.safetensors.index.json)
shard by shard straight to the target device, and renames every official spelling to this
project's module tree, which is the original InternVL layout:
- original InternVLChatModel keys (`vision_model.*`, `mlp1.*`, `language_model.*`): as they are;
- transformers-native "-HF" keys, new style (`model.vision_tower.*`, `model.multi_modal_projector.*`,
  `model.language_model.*`, `lm_head.*`) or legacy (`vision_tower.*`, `language_model.model.*`, ...),
  with the split q/k/v of the ViT fused back into `attn.qkv` (rows q | k | v);
- ParScale's Qwen2 checkpoints (`model.layers.*.self_attn.prefix_k`, `model.aggregate_layer.*`),
  whose aggregator concatenates branch states hidden-major, (h p), where ParVL writes them
  branch-major, (p h): its first layer's columns are permuted once here.
Only safetensors and JSON are read: nothing is unpickled.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from cli import log


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file or key."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "special_tokens_map.json", "generation_config.json")


LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # how a git-LFS pointer file starts


def check_not_lfs_pointer(path: Path) -> None:
    """A clone without git-lfs leaves ~130-byte pointer files where the weights should be: say so,
    instead of the parser's complaint (safetensors: "header too large")."""
    with open(path, "rb") as f:
        head = f.read(len(LFS_POINTER))
    if head == LFS_POINTER:
        raise CheckpointError(f"{path}: a git-LFS pointer, not the file itself (run `git lfs pull` in "
                              f"{path.parent}, or download the file)")


def check_not_run_folder(folder: Path) -> None:
    """A training run folder (train.py --out) given where a model is expected: name its export."""
    if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
        return
    if (folder / "export" / "config.json").is_file():
        raise CheckpointError(f"{folder}: a training run folder, not a model; its model is {folder / 'export'}")
    if (folder / "checkpoints").is_dir():
        raise CheckpointError(f"{folder}: a training run folder with no export yet (the run has not finished; "
                              f"its checkpoints resume training with train.py --resume, they are not a model)")


def read_json(path: Path) -> dict:
    if path.name == "config.json":  # a run folder has one too (train.py's): catch it before it is parsed
        check_not_run_folder(path.parent)
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (is {path.parent} a checkpoint folder?)")
    check_not_lfs_pointer(path)
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):  # every JSON file of a checkpoint, router or labels folder is one object
        raise CheckpointError(f"{path}: a JSON {type(value).__name__}, not the object of names and values it must be")
    return value


# -- the model folder: local, or the huggingface_hub cache ---------------------------------------

DEFAULT_MODEL = "OpenGVLab/InternVL3_5-1B"  # the original layout, which parvl.py reads natively
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name, as the hub spells repo ids
HUB_FILES = ["*.json", "*.safetensors", "*.txt"]  # config, weights, tokenizer: not the remote code or example media


def resolve_model(name: str | None = None, revision: str | None = None) -> Path:
    """The checkpoint folder for --model: a local folder, else a hub repo id, fetched once into
    huggingface_hub's cache (HF_HUB_CACHE / HF_HOME) and read from there on later runs, offline too.
    No name: $PARVL_MODEL, else DEFAULT_MODEL. revision (a branch, tag or commit) pins a hub model."""
    name = name or os.environ.get("PARVL_MODEL") or DEFAULT_MODEL
    if Path(name).is_dir():
        if revision:
            raise ValueError(f"--revision {revision}: {name} is a local folder, not a hub model")
        check_not_run_folder(Path(name))  # runs/22 instead of runs/22/export: say so before anything fails
        return Path(name)
    if Path(name).exists() or not HUB_ID.fullmatch(name) or name.startswith("."):
        raise CheckpointError(f"{name}: not a checkpoint folder (nor a hub model id such as {DEFAULT_MODEL})")
    return hub_snapshot(name, revision)


def hub_snapshot(repo: str, revision: str | None) -> Path:
    """The cached snapshot of a hub model, downloaded (with huggingface_hub's progress bars) only if the
    cache lacks it or holds an incomplete copy. Every failure is one line naming the way out."""
    pin = f" --revision {revision}" if revision else ""
    local = repo.split("/")[-1]
    elsewhere = (f"download it where the hub is reachable (hf download {repo}{pin} --local-dir {local}) and pass "
                 f"--model {local}")
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                           RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:
        raise CheckpointError(f"{repo}: not a local folder, and huggingface_hub is not installed to fetch it "
                              f"(pip install huggingface_hub); or {elsewhere}") from None
    check_hub_cache(Path(constants.HF_HUB_CACHE), repo)
    kw = dict(revision=revision, allow_patterns=HUB_FILES)
    try:  # the cache first: no network round trip, and it works offline
        cached = Path(snapshot_download(repo, local_files_only=True, **kw))
    except LocalEntryNotFoundError:
        cached = None
    if cached is not None and weights_complete(cached):
        return cached
    if constants.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE=1: no download to attempt
        state = "incomplete in" if cached is not None else "not in"
        raise CheckpointError(f"{repo}{pin}: {state} the hub cache, and HF_HUB_OFFLINE is set; {elsewhere}")
    try:
        log(f"downloading {repo}{pin} into {constants.HF_HUB_CACHE} (once; later runs read it there)")
        folder = Path(snapshot_download(repo, **kw))
    except GatedRepoError:
        raise CheckpointError(f"{repo}: a gated model; accept its terms on the hub and log in "
                              f"(hf auth login)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo}: not a local folder, and no hub model of that name "
                              f"(a private one needs hf auth login)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo}: the hub has no revision {revision!r}") from None
    except LocalEntryNotFoundError:  # not cached, and offline (HF_HUB_OFFLINE) or the hub is unreachable
        raise CheckpointError(f"{repo}{pin}: not in the hub cache and the hub cannot be reached; {elsewhere}") from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{repo}: download failed ({type(e).__name__}: {e}); {elsewhere}") from None
    if not weights_complete(folder):
        raise CheckpointError(f"{folder}: the cached {repo} is incomplete (no config.json or weights); {elsewhere}")
    return folder


def check_hub_cache(cache: Path, repo: str) -> None:
    """The hub cache must be a folder or be makeable as one: a file on its path (HOME or HF_HOME set to a
    file) is named with the variable it comes from, not reported as a failed download."""
    above = next(p for p in (cache, *cache.parents) if p.exists())
    if above.is_dir():
        return
    var = next((v for v in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HOME")
                if os.environ.get(v) and cache.is_relative_to(os.environ[v])), None)
    source = f" (from {var}={os.environ[var]})" if var else ""
    fix = f"point {var} at a folder" if var and var.startswith(("HF_", "HUGGINGFACE")) else "set HF_HOME to a folder"
    raise CheckpointError(f"{repo}: the hub cache {cache}{source} cannot be a folder: {above} is a file; {fix}, "
                          f"or pass --model a local checkpoint folder")


def weights_complete(folder: Path) -> bool:
    """config.json and every weight file there (an interrupted download leaves a partial snapshot)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return (folder / "config.json").is_file() and all((folder / s).is_file() for s in shards)
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


# -- safetensors: shards, key spellings ---------------------------------------------------------

# -HF key -> original key (after stripping a leading "model."); q/k/v are fused separately below.
HF_RENAMES = [
    (r"^vision_tower\.embeddings\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^vision_tower\.embeddings\.patch_embeddings\.projection\.", "vision_model.embeddings.patch_embedding."),
    (r"^vision_tower\.embeddings\.position_embeddings$", "vision_model.embeddings.position_embedding"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.projection_layer\.",
     r"vision_model.encoder.layers.\1.attn.proj."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qk])_norm\.",
     r"vision_model.encoder.layers.\1.attn.\2_norm."),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.([qkv])_proj\.",
     r"vision_model.encoder.layers.\1.attn.qkv.\2."),
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
        check_not_lfs_pointer(folder / name)
    return [folder / name for name in names]


def parscale_key(key: str) -> str:
    """ParScale (Qwen2 with prefixes) -> this tree's language-only keys."""
    if key.startswith("model.aggregate_layer."):
        return "language_aggregator.mlp." + key.removeprefix("model.aggregate_layer.")
    if key.startswith("lm_head."):
        return "language_model." + key
    return "language_model." + key  # model.embed_tokens / model.layers.* / model.norm


# safetensors dtype names -> torch dtypes (the format: an 8-byte little-endian header length, a JSON
# header of {name: {dtype, shape, data_offsets}}, then the raw little-endian bytes)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


class CheckpointReader:
    """A checkpoint's tensors under canonical keys, read one at a time, or rows a:b of one, straight
    from the safetensors files with plain reads (no memory map): only the bytes asked for are read
    and held. -HF q/k/v rows are fused back into qkv (rows q | k | v); a ParScale aggregator's
    columns are permuted to branch-major. parscale_branches > 0 reads a ParScale checkpoint."""

    def __init__(self, folder: Path, device="cpu", parscale_branches: int = 0):
        rename = parscale_key if parscale_branches else canonical_key
        self.folder, self.device, self.parscale = folder, device, parscale_branches
        self.parts: dict[str, list[tuple]] = {}  # canonical key -> [(file, dtype, shape, byte offset)]
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

    def keys(self) -> set[str]:
        return set(self.parts)

    def rows(self, key: str, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows start:stop (dim 0) of one tensor, on the reader's device; only those bytes are read."""
        shape = self.shapes[key]
        stop = (shape[0] if shape else 1) if stop is None else stop
        pieces, first = [], 0
        for file, part_dtype, shape, offset in self.parts[key]:
            n = shape[0] if shape else 1
            a, b = max(start - first, 0), min(stop - first, n)  # this part's rows of start:stop
            first += n
            if a >= b and shape:
                continue
            row = part_dtype.itemsize * (int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)
            data = bytearray((b - a) * row if shape else row)
            with open(file, "rb") as f:
                f.seek(offset + a * row)
                if f.readinto(data) != len(data):
                    raise CheckpointError(f"{file}: truncated safetensors file (tensor {key} is cut short)")
            t = torch.frombuffer(data, dtype=part_dtype).reshape((b - a, *shape[1:]) if shape else ())
            pieces.append(t)
        t = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if self.parscale and key == "language_aggregator.mlp.0.weight":  # [C, C*P], column h*P + p -> p*C + h
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
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable safetensors file ({type(e).__name__}: {e})") from None


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (labels, a router), its header checked first: a file
    that is truncated or not one is refused in one line naming it, not safetensors' own error."""
    safetensors_header(file)
    return load_file(str(file))


def check_keys(expected: set[str], found: set[str], folder: Path) -> None:
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        what = []
        if missing:
            what.append(f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])})")
        if unexpected:
            what.append(f"unexpected {len(unexpected)} keys (e.g. {', '.join(unexpected[:3])})")
        raise CheckpointError(f"{folder}: checkpoint does not match the config: {'; '.join(what)}")


def is_branch_tensor(key: str) -> bool:
    """The ParVL tensors on top of InternVL: per-layer prefixes (or LoRA updates) and the two aggregators."""
    return key.endswith((".prefix_k", ".prefix_v", ".lora_A", ".lora_B")) or key.startswith(
        ("vision_aggregator.", "language_aggregator."))
