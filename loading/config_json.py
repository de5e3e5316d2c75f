"""config.json in the spellings this code reads and writes: the original InternVLChatConfig (`llm_config`,
`vision_config`, plus this project's "parvl" block when saved here), the transformers-native -HF
InternVLConfig (`text_config`), and ParScale's Qwen2 config (`parscale_n`, language-only); and what every
command reads of a checkpoint folder before its weights (open_checkpoint: the config and the tokenizer,
checked to belong together).

    cfg, tok = open_checkpoint(Path("InternVL3_5-1B"))   # the config and tokenizer, checked together
    raw = config_to_json(cfg)                            # the original layout, with this project's "parvl" block

The decoder is chosen as InternVL's own code chooses it, by llm_config.architectures (DECODERS). A bad
value is one line naming config.json and the field, never the TypeError or ZeroDivisionError it would
cause once a module is built from it. Only JSON is read here: nothing is unpickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from config import LLMConfig, ParConfig, ParVLConfig, ViTConfig
from data.processor import IM_END, IM_START, IMG_CONTEXT, IMG_END, IMG_START, MAX_TILES, Tokenizer
from loading.checkpoint import CheckpointError, read_json

# The decoders this code implements, by the llm_config.architectures name InternVL's own code
# dispatches on (InternVLChatConfig.__init__), and the family each one is. Anything else (Llama,
# InternLM2, Phi-3, GPT-OSS) is refused rather than run as a Qwen decoder.
DECODERS = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def open_checkpoint(folder: Path) -> tuple[ParVLConfig, Tokenizer]:
    """What every command reads of a checkpoint folder before its weights: the config and the
    tokenizer, checked to belong together (check_tokenizer)."""
    cfg = config_from_json(read_json(folder / "config.json"), folder)
    tok = Tokenizer.from_pretrained(folder)
    check_tokenizer(tok, cfg, folder)
    return cfg, tok


def check_tokenizer(tok: Tokenizer, cfg: ParVLConfig, folder: Path) -> None:
    """Refuse a tokenizer that does not belong to the checkpoint, at load (open_checkpoint):
    its <IMG_CONTEXT> must be config.json's image_token_id, its vocabulary must fit the embedding
    rows, and it must have the chat template's tokens."""
    source = f"the tokenizer in {tok.folder}"
    needed = (
        (IM_START, IM_END)
        if cfg.vit is None
        else (IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT)
    )
    missing = [t for t in needed if tok.token_to_id(t) is None]
    if missing:
        raise CheckpointError(
            f"{source} has no {', '.join(missing)} token: not an InternVL3.5 tokenizer"
        )
    if cfg.vit is not None and tok.token_to_id(IMG_CONTEXT) != cfg.image_token_id:
        raise CheckpointError(
            f"{source} has {IMG_CONTEXT} = {tok.token_to_id(IMG_CONTEXT)}, but "
            f"{folder / 'config.json'} says image_token_id = {cfg.image_token_id}: the tokenizer "
            f"is not this checkpoint's"
        )
    if tok.vocab_size > cfg.llm.vocab_size:
        raise CheckpointError(
            f"{source} has {tok.vocab_size} tokens, but the checkpoint in {folder} embeds only "
            f"{cfg.llm.vocab_size}: the tokenizer is not this checkpoint's"
        )


class Fields:
    """The values of one block of config.json (llm_config, vision_config, or the top level), each checked
    as it is read: a value missing, of the wrong type or out of range is one line naming config.json and
    the field ("config.json: llm_config.num_attention_heads must be a positive integer, got -2"), never the
    TypeError or ZeroDivisionError it would cause once a module is built from it."""

    def __init__(self, block, where: str):
        if not isinstance(block, dict):
            raise CheckpointError(
                f"config.json: {where.rstrip('.') or 'the file'} must be a JSON object, got "
                f"{type(block).__name__}"
            )
        self.block, self.where = block, where

    def bad(self, key: str, what: str, value) -> CheckpointError:
        return CheckpointError(f"config.json: {self.where}{key} must be {what}, got {value!r}")

    def int(self, key: str, default=None, low: int = 1) -> int:
        value = self.block.get(key, default)
        # [448, 448]: a square size
        if isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.bad(key, "a positive integer" if low == 1 else f"an integer >= {low}", value)
        return value

    def number(self, key: str, default=None) -> float:
        value = self.block.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value < float("inf")
        ):
            raise self.bad(key, "a positive number", value)
        return float(value)

    def divides(self, small: str, large: str) -> None:
        if self.block.get(large, 0) % self.block.get(small, 1):
            raise CheckpointError(
                f"config.json: {self.where}{large} {self.block[large]} is not a multiple of "
                f"{self.where}{small} {self.block[small]}"
            )


def llm_config_from_json(
    t: dict, family: str, tied: bool | None, default_theta: float = 1e6, where: str = ""
) -> LLMConfig:
    """A Qwen3 / Qwen2 config dict (InternVL's llm_config, -HF text_config, or ParScale's) -> LLMConfig;
    `where` is its place in config.json ("llm_config.") for the line a bad value gets (Fields)."""
    f = Fields(t, where)
    rope_theta = t.get(
        "rope_theta", (t.get("rope_parameters") or {}).get("rope_theta", default_theta)
    )
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    f.divides("num_key_value_heads", "num_attention_heads")
    if t.get("head_dim") is None:  # Qwen2 has none: the width split over the heads
        f.int("hidden_size")
        f.divides("num_attention_heads", "hidden_size")
    head_dim = f.int("head_dim") if t.get("head_dim") is not None else t["hidden_size"] // heads
    if head_dim % 2:  # rotary embeddings pair the channels
        raise f.bad("head_dim", "even (rotary embeddings pair its channels)", head_dim)
    return LLMConfig(
        vocab_size=f.int("vocab_size"),
        hidden_size=f.int("hidden_size"),
        intermediate_size=f.int("intermediate_size"),
        num_layers=f.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=Fields({"rope_theta": rope_theta}, where).number("rope_theta"),
        max_position_embeddings=f.int("max_position_embeddings", 32768),
        qkv_bias=family == "qwen2" or bool(t.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        # the checkpoint decides: a stored lm_head is used, a missing one means tied embeddings
        tie_word_embeddings=tied if tied is not None else bool(t.get("tie_word_embeddings", False)),
        **(moe_fields(f) if family == "qwen3_moe" else {}),
    )


def moe_fields(f: Fields) -> dict:
    """Qwen3-MoE's fields of llm_config, each checked as read; a missing one takes Qwen3MoeConfig's
    default (norm_topk_prob False, as the class has it: the released configs all state true). The expert
    count is num_experts, or num_local_experts where transformers 5 saved the config."""
    count = (
        "num_local_experts"
        if "num_experts" not in f.block and "num_local_experts" in f.block
        else "num_experts"
    )
    experts, top_k = f.int(count), f.int("num_experts_per_tok")
    if top_k > experts:
        raise CheckpointError(
            f"config.json: {f.where}num_experts_per_tok {top_k} is more than "
            f"{f.where}{count} {experts}"
        )
    dense = f.block.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(type(i) is not int or i < 0 for i in dense):
        raise f.bad("mlp_only_layers", "a list of layer indices", dense)
    renormalise = f.block.get("norm_topk_prob", False)
    if not isinstance(renormalise, bool):
        raise f.bad("norm_topk_prob", "true or false", renormalise)
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.int("moe_intermediate_size"),
        norm_topk_prob=renormalise,
        decoder_sparse_step=f.int("decoder_sparse_step", 1),
        mlp_only_layers=tuple(dense),
    )


def trained_step(folder: Path) -> int | None:
    """The training step an export of train.py records (config.json's parvl.step, runs.export), None for a
    checkpoint that records none (a hub model, an older export)."""
    raw = read_json(Path(folder) / "config.json")
    step = raw.get("parvl", {}).get("step") if isinstance(raw.get("parvl"), dict) else None
    return step if type(step) is int and step >= 0 else None


def record_step(folder: Path, step: int | None) -> None:
    """config.json's "parvl" block gets the training step of the weights beside it (written whole, then renamed;
    None: nothing), which trained_step reads: Table 3 and Appendix E name "training step 7,000"."""
    if step is None:
        return
    raw = json.loads((folder / "config.json").read_text())
    raw.setdefault("parvl", {})["step"] = step
    tmp = folder / "config.json.tmp"
    tmp.write_text(json.dumps(raw, indent=2))
    tmp.replace(folder / "config.json")


def par_from_json(block, folder: Path | None) -> ParConfig:
    """The "parvl": {"par": ...} block this project writes into config.json: a bad value is one line naming
    the file and the field, as a flag's would be."""
    where = f"{folder / 'config.json' if folder is not None else 'config.json'}: parvl.par"
    names = [f.name for f in fields(ParConfig)]
    if not isinstance(block, dict):
        raise CheckpointError(f"{where} must be an object of branch fields, got {block!r:.40}")
    if unknown := sorted(set(block) - set(names)):
        raise CheckpointError(
            f"{where} has no field {unknown[0]!r} (its fields: {', '.join(names)})"
        )
    try:
        return ParConfig(**block)
    except ValueError as e:
        raise CheckpointError(f"{where}.{e}") from None


def config_from_json(
    raw: dict, folder: Path | None = None, tied: bool | None = None
) -> ParVLConfig:
    """config.json in any supported spelling -> ParVLConfig: original InternVLChatConfig (with this
    project's "parvl" block when saved here), -HF InternVLConfig, or ParScale's Qwen2 config. tied: whether
    the tensors lack a stored lm_head (None: config.json's tie_word_embeddings says)."""
    if "parscale_n" in raw:
        return parscale_config(raw, tied)
    hf = "text_config" in raw
    t = raw.get("text_config") if hf else raw.get("llm_config")
    extra = raw.get("parvl", {})
    where = folder / "config.json" if folder is not None else "config.json"
    if not isinstance(extra, dict):  # this project's block: {"par": {...}, "language_only": bool}
        raise CheckpointError(
            f"{where}: parvl must be an object of par and language_only, got {extra!r:.40}"
        )
    language_only = bool(extra.get("language_only", False))
    if t is None or (raw.get("vision_config") is None and not language_only):
        raise CheckpointError("config.json: needs llm_config (or text_config) and vision_config")
    llm = decoder_config(t, "text_config" if hf else "llm_config", tied)
    par = par_from_json(extra.get("par", {}), folder)
    if language_only:
        if par.pv != 1:
            raise CheckpointError(
                f"{where}: parvl.language_only is true, but parvl.par.pv is {par.pv}: a "
                f"language-only model has no vision branches"
            )
        return ParVLConfig(vit=None, llm=llm, par=par, image_token_id=-1)
    vit = vision_config(raw["vision_config"], hf)
    return ParVLConfig(vit=vit, llm=llm, par=par, **multimodal_fields(raw, vit, hf, folder))


def parscale_config(raw: dict, tied: bool | None) -> ParVLConfig:
    """ParScale's Qwen2 config: a language-only model with parscale_n language branches."""
    top = Fields(raw, "")
    smooth = raw.get("parscale_attn_smooth", 0.01)
    if isinstance(smooth, bool) or not isinstance(smooth, (int, float)) or not 0 <= smooth <= 1:
        raise top.bad("parscale_attn_smooth", "a number in [0, 1]", smooth)
    par = ParConfig(
        pl=top.int("parscale_n"),
        llm_prefix_len=top.int("parscale_n_tokens", 48, low=0),
        lambda_l=float(smooth),
    )
    # Qwen2ParScaleConfig's own default rope_theta is 1e4 (the released configs all state it)
    return ParVLConfig(
        vit=None, llm=llm_config_from_json(raw, "qwen2", tied, 1e4), par=par, image_token_id=-1
    )


def decoder_config(t, field: str, tied: bool | None) -> LLMConfig:
    """The language model's block (llm_config, or -HF text_config): its decoder family by architectures, as
    InternVL's code dispatches (DECODERS), agreeing with model_type; anything else is refused."""
    Fields(t, field + ".")  # a block that is not an object is named before anything is read from it
    arch = (t.get("architectures") or [None])[0]
    if arch is not None and arch not in DECODERS:
        raise CheckpointError(
            f"config.json: {field}.architectures {arch!r} is not a supported decoder "
            f"(supported: {', '.join(DECODERS)})"
        )
    family = (t.get("model_type") or DECODERS.get(arch) or "").lower()
    if family not in DECODERS.values():
        raise CheckpointError(
            f"config.json: {field}.model_type {family!r} is not a supported decoder "
            f"(supported: {', '.join(DECODERS.values())})"
        )
    if arch is not None and DECODERS[arch] != family:
        raise CheckpointError(
            f"config.json: {field}.model_type {family!r} does not match architectures {arch!r}"
        )
    return llm_config_from_json(t, family, tied, where=field + ".")


def vision_config(v, hf: bool) -> ViTConfig:
    """The vision_config block (original or -HF spelling of the same InternViT fields)."""
    f = Fields(v, "vision_config.")
    size, patch = f.int("image_size", 448), f.int("patch_size", 14)
    if size % patch:
        raise CheckpointError(
            f"config.json: vision_config.image_size {size} is not a multiple of "
            f"vision_config.patch_size {patch}"
        )
    hidden, heads, layers = (
        f.int("hidden_size"),
        f.int("num_attention_heads"),
        f.int("num_hidden_layers"),
    )
    f.divides("num_attention_heads", "hidden_size")
    return ViTConfig(
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        patch_size=patch,
        image_size=size,
        qkv_bias=v.get("attention_bias" if hf else "qkv_bias", True),
        qk_norm=v.get("use_qk_norm" if hf else "qk_normalization", False),
        norm_type=v.get("norm_type", "layer_norm"),
        norm_eps=v.get("layer_norm_eps", 1e-6),
        drop_path_rate=v.get("drop_path_rate", 0.0),
    )


def multimodal_fields(raw: dict, vit: ViTConfig, hf: bool, folder: Path | None) -> dict:
    """The top-level fields that join the towers (ParVLConfig's own): the image token, pixel shuffle, the
    ViT layer the connector reads, tiling and the chat template."""
    top = Fields(raw, "")
    image_token_id = raw.get("image_token_id") or raw.get("img_context_token_id")
    if image_token_id is None:  # the original config leaves it to the tokenizer
        tok = Tokenizer.from_pretrained(folder) if folder is not None else None
        image_token_id = tok.token_to_id(IMG_CONTEXT) if tok is not None else None
        if image_token_id is None:
            raise CheckpointError(
                f"{folder}: no image_token_id in config.json and no {IMG_CONTEXT} in the tokenizer"
            )
    elif isinstance(image_token_id, bool) or not isinstance(image_token_id, int):
        raise top.bad("image_token_id", "an integer (a token id)", image_token_id)
    # pixel shuffle merges (1/ratio)^2 patches: 1/ratio divides the grid
    ratio = raw.get("downsample_ratio", 0.5)
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, (int, float))
        or not 0 < ratio <= 1
        or round(1 / ratio) * ratio != 1
        or vit.grid % round(1 / ratio)
    ):
        raise top.bad(
            "downsample_ratio", f"1/k for a k that divides the {vit.grid}-patch grid", ratio
        )
    layers, select_key = vit.num_layers, "vision_feature_layer" if hf else "select_layer"
    select = raw.get(select_key, -1)
    if (
        isinstance(select, bool)
        or not isinstance(select, int)
        or not -layers - 1 <= select <= layers
    ):
        raise top.bad(select_key, f"an integer in [{-layers - 1}, {layers}]", select)
    if top.int("max_dynamic_patch", 12) > MAX_TILES:  # the default tile budget of every command
        raise top.bad(
            "max_dynamic_patch",
            f"in [1, {MAX_TILES}] (the most tiles InternVL's pipelines give)",
            raw["max_dynamic_patch"],
        )
    template = raw.get("template", "internvl2_5")
    # the one chat template data/processor.py implements (InternVL3 and 3.5 use it)
    if template != "internvl2_5":
        raise CheckpointError(
            f"config.json: chat template {template!r} is not supported (internvl2_5)"
        )
    return dict(
        downsample_ratio=float(ratio),
        ps_version="v2"
        if hf
        else raw.get("ps_version", "v1"),  # -HF always v2; the original class default v1
        select_layer=select,
        image_token_id=int(image_token_id),
        max_dynamic_patch=top.int("max_dynamic_patch", 12),
        use_thumbnail=raw.get("use_thumbnail", True),
        template=template,
    )


def config_to_json(cfg: ParVLConfig) -> dict:
    """The original InternVLChatConfig layout, which InternVL's own code reads, plus a "parvl" block
    with the branch configuration (ignored by InternVL, read back by config_from_json)."""
    v, t = cfg.vit, cfg.llm
    family = "qwen3_moe" if t.num_experts else "qwen3" if t.qk_norm else "qwen2"
    arch = {v: k for k, v in DECODERS.items()}[family]
    moe = dict(
        num_experts=t.num_experts,
        num_experts_per_tok=t.num_experts_per_tok,
        moe_intermediate_size=t.moe_intermediate_size,
        norm_topk_prob=t.norm_topk_prob,
        decoder_sparse_step=t.decoder_sparse_step,
        mlp_only_layers=list(t.mlp_only_layers),
    )
    out = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "tie_word_embeddings": t.tie_word_embeddings,
        "llm_config": {
            "architectures": [arch],
            "model_type": family,
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads,
            "head_dim": t.head_dim,
            "rms_norm_eps": t.rms_norm_eps,
            "rope_theta": t.rope_theta,
            "max_position_embeddings": t.max_position_embeddings,
            "attention_bias": t.qkv_bias,
            "hidden_act": "silu",
            "tie_word_embeddings": t.tie_word_embeddings,
        }
        | (moe if t.num_experts else {}),
        "parvl": {"par": asdict(cfg.par), "language_only": v is None},
    }
    if v is None:
        return out
    return out | {
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
        "vision_config": {
            "architectures": ["InternVisionModel"],
            "model_type": "intern_vit_6b",
            "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size,
            "num_hidden_layers": v.num_layers,
            "num_attention_heads": v.num_heads,
            "patch_size": v.patch_size,
            "image_size": v.image_size,
            "num_channels": 3,
            "qkv_bias": v.qkv_bias,
            "qk_normalization": v.qk_norm,
            "norm_type": v.norm_type,
            "layer_norm_eps": v.norm_eps,
            "hidden_act": "gelu",
            "drop_path_rate": v.drop_path_rate,
        },
    }
