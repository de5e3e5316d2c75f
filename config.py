"""The configuration of ParVL: the branches (ParConfig), the assembled model (ParVLConfig), the named
presets, and config.json in the spellings this code reads and writes.

    cfg = PRESETS["tiny"]                                    # runs on CPU in seconds
    cfg, tok = open_checkpoint(Path("InternVL3_5-1B"))       # a folder's config and tokenizer, checked together
    par = ParConfig(pv=2, pl=2)                              # Pv:Pl = 2:2 (paper, "Method"; Figure 2)

ParConfig's fields are also the command line's branch flags: each carries its help, range and choices
once (flags.flag's metadata), the range check in __post_init__ reads them, and a command that takes a
branch flag whose default is the checkpoint's declares it with `branch_flag(name)`.

config.json: the original InternVLChatConfig (`llm_config`, `vision_config`, plus this project's
"parvl" block when saved here), the transformers-native -HF InternVLConfig (`text_config`), and
ParScale's Qwen2 config (`parscale_n`, language-only). The decoder is chosen as InternVL's own code
chooses it, by llm_config.architectures (DECODERS). This module sits below the model: parvl.py
builds from it, the commands read checkpoints' configs through it before any weight loads.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from checkpoint import CheckpointError, read_json
from cli import UsageError
from flags import flag, out_of_range
from llm import LLMConfig
from processor import IM_END, IM_START, IMG_CONTEXT, IMG_END, IMG_START, Tokenizer
from vit import ViTConfig


@dataclass
class ParConfig:
    """The ParVL branches. Pv = Pl = 1 adds nothing: the model is exactly InternVL3.5. Every field is
    a flag (flags.flag): help, range and choices are written here once, for every command."""

    pv: int = flag(1, "vision branches Pv (the paper studies 1, 2, 4)", range="[1, inf)")
    pl: int = flag(1, "language branches Pl (the paper studies 1, 2, 4)", range="[1, inf)")
    vit_prefix_len: int = flag(96, "key/value prefix tokens per ViT layer and vision branch (the paper: 96; "
                                   "Figure 3 sweeps 72, 96, 128)", range="[0, inf)")
    llm_prefix_len: int = flag(48, "key/value prefix tokens per LLM layer and language branch (the paper: 48)",
                               range="[0, inf)")
    lambda_v: float = flag(0.0, "smoothing of the vision branch weights toward uniform (the paper: 0)",
                           range="[0, 1]")
    lambda_l: float = flag(0.1, "smoothing of the language branch weights toward uniform (the paper: 0.1)",
                           range="[0, 1]")
    aggregation: str = flag("mlp", "how branches fuse: mlp (Eq. 2, the paper's) or mean (Table S8's ablation)",
                            choices=["mlp", "mean"])
    vision_branches: str = flag("prefix", "prefix (Eq. 1, the paper's) or lora: a low-rank update of the ViT's "
                                          "qkv, proj, fc1, fc2 per vision branch (Figure 3; B starts at zero, "
                                          "alpha = 2 x rank)", choices=["prefix", "lora"])
    lora_rank: int = flag(16, "rank of lora vision branches (the paper's best)", range="[1, inf)")

    def __post_init__(self):
        """The ranges and choices of the fields' metadata, checked in field order: "lora_rank must be
        >= 1, got 0" (flags.out_of_range's line, with the field's name for the flag's)."""
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            kind = type(f.default)  # int, float or str: what a flag's value (or a config.json's) must be
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
                raise ValueError(f"{f.name} must be {'a string' if kind is str else 'a number'}"
                                 f"{' (an integer)' if kind is int else ''}, got {value!r}")
            if "range" in meta and (why := out_of_range(self, {f.name: meta["range"]})):
                raise ValueError(f"{f.name} {why.partition(' ')[2]}")
            if "choices" in meta and value not in meta["choices"]:
                raise ValueError(f"{f.name} must be {' or '.join(map(repr, meta['choices']))}, got {value!r}")


def branch_flag(name: str, shown: str = "the checkpoint's", own_default: bool = False):
    """A command's flag for ParConfig field `name`: the field's help, range and choices, declared once in
    ParConfig. Its default is None, "the checkpoint's" (shown as `shown`), or with own_default
    ParConfig's own default (a command that builds a model from a preset, profiling.py).

        vit_prefix_len: int | None = branch_flag("vit_prefix_len")      # in train.py's TrainConfig
    """
    f = next(f for f in fields(ParConfig) if f.name == name)
    if own_default:
        return field(default=f.default, metadata=f.metadata)
    return field(default=None, metadata={**f.metadata, "shown": shown})


def branch_variant(par: ParConfig) -> dict:
    """A configuration's branch parameterisation where it is not the paper's (Figure 3, Table S8): the
    ParConfig fields other than the counts that differ from their defaults ({} for the paper's). What
    evaluate.py run records of a checkpoint and profiling.py latency of the model it profiles."""
    unused, paper = "lora_rank" if par.vision_branches == "prefix" else "vit_prefix_len", ParConfig()
    return {k: v for k, v in asdict(par).items() if k not in ("pv", "pl", unused) and v != getattr(paper, k)}


def branch_conflict(values: dict, vit_width: int | None = None, origin: dict | None = None) -> str | None:
    """Branch flags that cannot mean anything together, as one line naming them, or None. values: ParConfig
    field names -> values, None (or missing) where not known yet (train.py's flags before the checkpoint
    is read); vit_width: the ViT width C, where known; origin: a note for a value the user did not give
    ("the checkpoint's"). What makes two branches of a tower differ is its own prefixes (Eq. 1), or for
    vision branches, with --vision-branches lora, their own low-rank updates instead; the aggregator
    only weighs the branch states, so branches that start and stay identical fuse to one."""
    v, origin = {k: x for k, x in values.items() if x is not None}, origin or {}

    def say(name: str) -> str:
        return f"--{name.replace('_', '-')} {v[name]}" + (f" ({origin[name]})" if name in origin else "")

    lora = v.get("vision_branches") == "lora"
    if lora and v.get("pv") == 1:
        return (f"{say('vision_branches')} needs --pv 2 or more: LoRA vision branches are one low-rank update of the "
                f"ViT per branch, and at {say('pv')} there is no branch to create one for")
    if v.get("pv", 1) > 1 and v.get("vision_branches") == "prefix" and v.get("vit_prefix_len") == 0:
        return (f"{say('vit_prefix_len')} at {say('pv')}: with no prefix tokens every vision branch computes the same "
                f"states; give --vit-prefix-len 1 or more, or --vision-branches lora")
    if v.get("pl", 1) > 1 and v.get("llm_prefix_len") == 0:
        return (f"{say('llm_prefix_len')} at {say('pl')}: with no prefix tokens every language branch computes the "
                f"same states; give --llm-prefix-len 1 or more")
    if lora and vit_width is not None and v.get("lora_rank", 0) > vit_width:
        return (f"{say('lora_rank')} is more than the ViT's width {vit_width}: a low-rank update of a {vit_width}-wide "
                f"linear has rank at most {vit_width}")
    return None


def resolve_branch_flags(given: dict, par: ParConfig, vit_width: int, model: str, run: dict | None = None,
                         run_name: str = "") -> dict:
    """A command's branch flags (ParConfig field names -> the value given, None for branch_flag's "the
    checkpoint's") resolved: as given, else the run's own where a run is continued (`run`, the config it
    recorded, named `run_name`; None there means it took the checkpoint's), else the checkpoint's `par`
    (of --model `model`). The branch parameterisation fixes a run as Pv:Pl does: a given value other
    than the run's is refused in one line. Values that cannot mean anything together (branch_conflict)
    are a UsageError (exit 2), naming where each value not given came from."""
    values, origin = {}, {}
    for name, value in given.items():
        was = getattr(par, name) if run is None or run.get(name) is None else run[name]
        if run is not None and value is not None and value != was:
            raise ValueError(f"{run_name} was trained with --{name.replace('_', '-')} {was}, this run asks for "
                             f"{value}; resume without the flag (or with the run's value), or start a new run in "
                             f"another --out")
        values[name] = was if value is None else value
        if value is None:
            origin[name] = "the run's" if run is not None else f"{model}'s"
    if why := branch_conflict(values, vit_width, origin):
        raise UsageError(why)
    ParConfig(**values)  # the ranges, as the flags' own
    return values


def check_branch_choice(par: ParConfig, vision_branch: int | None, language_branch: int | None) -> None:
    """--vision-branch and --language-branch (generate.py, evaluate.py run) against the checkpoint's
    branch counts: one line naming the flag."""
    for name, value, count in (("--vision-branch", vision_branch, par.pv),
                               ("--language-branch", language_branch, par.pl)):
        if value is not None and not 0 <= value < count:
            raise ValueError(f"{name} {value} out of range: the checkpoint has {count} branches")


@dataclass
class ParVLConfig:
    vit: ViTConfig | None = field(default_factory=ViTConfig)  # None: language-only (ParScale)
    llm: LLMConfig = field(default_factory=LLMConfig)
    par: ParConfig = field(default_factory=ParConfig)
    downsample_ratio: float = 0.5  # pixel shuffle: 2x2 neighbouring patches -> one token
    ps_version: str = "v2"  # v1 leaves the token grid transposed (older checkpoints)
    select_layer: int = -1  # which ViT hidden state feeds the connector (-1 = last)
    image_token_id: int = 151671  # <IMG_CONTEXT> of the InternVL3.5 tokenizer
    max_dynamic_patch: int = 12
    use_thumbnail: bool = True
    template: str = "internvl2_5"

    def __post_init__(self):
        r = round(1 / self.downsample_ratio)
        assert self.vit is None or (r * self.downsample_ratio == 1.0 and self.vit.grid % r == 0), self.downsample_ratio
        if self.vit is None and self.par.pv != 1:
            raise ValueError("a language-only model has no vision branches: pv must be 1")
        if self.ps_version not in ("v1", "v2"):
            raise ValueError(f"ps_version must be v1 or v2, got {self.ps_version!r}")

    @property
    def tokens_per_tile(self) -> int:  # 256 for 448 px tiles; 0 for a language-only model
        return round(self.vit.grid**2 * self.downsample_ratio**2) if self.vit is not None else 0

    @property
    def vit_layers(self) -> int:
        """How many ViT blocks select_layer needs: hidden_states[k] with hidden_states[0] = embeddings."""
        n = self.vit.num_layers + 1
        assert -n <= self.select_layer < n, self.select_layer
        return self.select_layer % n


# The InternVL3.5 sizes (the released configs) and a tiny preset that runs on CPU in seconds.
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


# The decoders this code implements, by the llm_config.architectures name InternVL's own code
# dispatches on (InternVLChatModel.__init__), and the family each one is. Anything else (Llama,
# InternLM2, Phi-3, Qwen3-MoE, GPT-OSS) is refused rather than run as a Qwen decoder.
DECODERS = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2"}


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
    needed = (IM_START, IM_END) if cfg.vit is None else (IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT)
    missing = [t for t in needed if tok.token_to_id(t) is None]
    if missing:
        raise CheckpointError(f"{source} has no {', '.join(missing)} token: not an InternVL3.5 tokenizer")
    if cfg.vit is not None and tok.token_to_id(IMG_CONTEXT) != cfg.image_token_id:
        raise CheckpointError(f"{source} has {IMG_CONTEXT} = {tok.token_to_id(IMG_CONTEXT)}, but "
                              f"{folder / 'config.json'} says image_token_id = {cfg.image_token_id}: the tokenizer "
                              f"is not this checkpoint's")
    if tok.vocab_size > cfg.llm.vocab_size:
        raise CheckpointError(f"{source} has {tok.vocab_size} tokens, but the checkpoint in {folder} embeds only "
                              f"{cfg.llm.vocab_size}: the tokenizer is not this checkpoint's")


# -- config.json: original (InternVLChatConfig) and -HF (InternVLConfig) spellings ---------------


class Fields:
    """The values of one block of config.json (llm_config, vision_config, or the top level), each checked
    as it is read: a value missing, of the wrong type or out of range is one line naming config.json and
    the field ("config.json: llm_config.num_attention_heads must be a positive integer, got -2"), never the
    TypeError or ZeroDivisionError it would cause once a module is built from it."""

    def __init__(self, block, where: str):
        if not isinstance(block, dict):
            raise CheckpointError(f"config.json: {where.rstrip('.') or 'the file'} must be a JSON object, got "
                                  f"{type(block).__name__}")
        self.block, self.where = block, where

    def bad(self, key: str, what: str, value) -> CheckpointError:
        return CheckpointError(f"config.json: {self.where}{key} must be {what}, got {value!r}")

    def int(self, key: str, default=None, low: int = 1) -> int:
        value = self.block.get(key, default)
        if isinstance(value, list) and len(value) == 2 and value[0] == value[1]:  # [448, 448]: a square size
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.bad(key, "a positive integer" if low == 1 else f"an integer >= {low}", value)
        return value

    def number(self, key: str, default=None) -> float:
        value = self.block.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise self.bad(key, "a positive number", value)
        return float(value)

    def divides(self, small: str, large: str) -> None:
        if self.block.get(large, 0) % self.block.get(small, 1):
            raise CheckpointError(f"config.json: {self.where}{large} {self.block[large]} is not a multiple of "
                                  f"{self.where}{small} {self.block[small]}")


def llm_config_from_json(t: dict, family: str, tied: bool | None, default_theta: float = 1e6,
                         where: str = "") -> LLMConfig:
    """A Qwen3 / Qwen2 config dict (InternVL's llm_config, -HF text_config, or ParScale's) -> LLMConfig;
    `where` is its place in config.json ("llm_config.") for the line a bad value gets (Fields)."""
    f = Fields(t, where)
    rope_theta = t.get("rope_theta", (t.get("rope_parameters") or {}).get("rope_theta", default_theta))
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
        qk_norm=family == "qwen3",
        # the checkpoint decides: a stored lm_head is used, a missing one means tied embeddings
        tie_word_embeddings=tied if tied is not None else bool(t.get("tie_word_embeddings", False)),
    )


def par_from_json(block, folder: Path | None) -> ParConfig:
    """The "parvl": {"par": ...} block this project writes into config.json: a bad value is one line naming
    the file and the field, as a flag's would be."""
    where = f"{folder / 'config.json' if folder is not None else 'config.json'}: parvl.par"
    names = [f.name for f in fields(ParConfig)]
    if not isinstance(block, dict):
        raise CheckpointError(f"{where} must be an object of branch fields, got {block!r:.40}")
    if unknown := sorted(set(block) - set(names)):
        raise CheckpointError(f"{where} has no field {unknown[0]!r} (its fields: {', '.join(names)})")
    try:
        return ParConfig(**block)
    except ValueError as e:
        raise CheckpointError(f"{where}.{e}") from None


def config_from_json(raw: dict, folder: Path | None = None, tied: bool | None = None) -> ParVLConfig:
    """config.json in any supported spelling -> ParVLConfig: original InternVLChatConfig (with this
    project's "parvl" block when saved here), -HF InternVLConfig, or ParScale's Qwen2 config."""
    top = Fields(raw, "")
    if "parscale_n" in raw:  # ParScale: a language-only model with Pl branches
        smooth = raw.get("parscale_attn_smooth", 0.01)
        if isinstance(smooth, bool) or not isinstance(smooth, (int, float)) or not 0 <= smooth <= 1:
            raise top.bad("parscale_attn_smooth", "a number in [0, 1]", smooth)
        par = ParConfig(pl=top.int("parscale_n"), llm_prefix_len=top.int("parscale_n_tokens", 48, low=0),
                        lambda_l=float(smooth))
        # Qwen2ParScaleConfig's own default rope_theta is 1e4 (the released configs all state it)
        return ParVLConfig(vit=None, llm=llm_config_from_json(raw, "qwen2", tied, 1e4), par=par, image_token_id=-1)
    hf = "text_config" in raw
    t = raw.get("text_config") if hf else raw.get("llm_config")
    v = raw.get("vision_config")
    extra = raw.get("parvl", {})
    language_only = bool(extra.get("language_only", False))
    if t is None or (v is None and not language_only):
        raise CheckpointError("config.json: needs llm_config (or text_config) and vision_config")
    field = "text_config" if hf else "llm_config"
    Fields(t, field + ".")  # a block that is not an object is named before anything is read from it
    arch = (t.get("architectures") or [None])[0]
    if arch is not None and arch not in DECODERS:
        raise CheckpointError(f"config.json: {field}.architectures {arch!r} is not a supported decoder "
                              f"(supported: {', '.join(DECODERS)})")
    family = (t.get("model_type") or DECODERS.get(arch) or "").lower()
    if family not in DECODERS.values():
        raise CheckpointError(f"config.json: {field}.model_type {family!r} is not a supported decoder "
                              f"(supported: {', '.join(DECODERS.values())})")
    if arch is not None and DECODERS[arch] != family:
        raise CheckpointError(f"config.json: {field}.model_type {family!r} does not match architectures {arch!r}")
    llm = llm_config_from_json(t, family, tied, where=field + ".")
    par = par_from_json(extra.get("par", {}), folder)
    if language_only:
        return ParVLConfig(vit=None, llm=llm, par=par, image_token_id=-1)
    f = Fields(v, "vision_config.")
    size, patch = f.int("image_size", 448), f.int("patch_size", 14)
    if size % patch:
        raise CheckpointError(f"config.json: vision_config.image_size {size} is not a multiple of "
                              f"vision_config.patch_size {patch}")
    hidden, heads, layers = f.int("hidden_size"), f.int("num_attention_heads"), f.int("num_hidden_layers")
    f.divides("num_attention_heads", "hidden_size")
    vit = ViTConfig(
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
    image_token_id = raw.get("image_token_id") or raw.get("img_context_token_id")
    if image_token_id is None:  # the original config leaves it to the tokenizer
        tok = Tokenizer.from_pretrained(folder) if folder is not None else None
        image_token_id = tok.token_to_id(IMG_CONTEXT) if tok is not None else None
        if image_token_id is None:
            raise CheckpointError(f"{folder}: no image_token_id in config.json and no {IMG_CONTEXT} in the tokenizer")
    elif isinstance(image_token_id, bool) or not isinstance(image_token_id, int):
        raise top.bad("image_token_id", "an integer (a token id)", image_token_id)
    ratio = raw.get("downsample_ratio", 0.5)  # pixel shuffle merges (1/ratio)^2 patches: 1/ratio divides the grid
    if (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1
            or round(1 / ratio) * ratio != 1 or vit.grid % round(1 / ratio)):
        raise top.bad("downsample_ratio", f"1/k for a k that divides the {vit.grid}-patch grid", ratio)
    select = raw.get("vision_feature_layer" if hf else "select_layer", -1)
    if isinstance(select, bool) or not isinstance(select, int) or not -layers - 1 <= select <= layers:
        raise top.bad("vision_feature_layer" if hf else "select_layer", f"an integer in [{-layers - 1}, {layers}]",
                      select)
    template = raw.get("template", "internvl2_5")
    if template != "internvl2_5":  # the one chat template processor.py implements (InternVL3 and 3.5 use it)
        raise CheckpointError(f"config.json: chat template {template!r} is not supported (internvl2_5)")
    return ParVLConfig(
        vit=vit,
        llm=llm,
        par=par,
        downsample_ratio=float(ratio),
        ps_version="v2" if hf else raw.get("ps_version", "v1"),  # -HF always uses v2; original class default v1
        select_layer=select,
        image_token_id=int(image_token_id),
        max_dynamic_patch=top.int("max_dynamic_patch", 12),
        use_thumbnail=raw.get("use_thumbnail", True),
        template=template,
    )


# -- config.json against the checkpoint's tensors (safetensors headers: names and shapes, nothing loaded) ---


def check_layer_counts(cfg: ParVLConfig, keys, folder: Path) -> None:
    """The layer counts config.json gives against the layers the checkpoint's tensor names hold, before any
    module is built (a num_hidden_layers of 10**6 would build a million blocks before the keys disagree)."""
    towers = [("language model", "language_model.model.layers.", cfg.llm.num_layers)]
    if cfg.vit is not None:
        towers.append(("vision model", "vision_model.encoder.layers.", cfg.vit.num_layers))
    for tower, prefix, layers in towers:
        held = {k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)}
        if len(held) != layers:
            raise CheckpointError(f"config.json: the {tower}'s num_hidden_layers is {layers}, but the tensors in "
                                  f"{folder} hold {len(held)} {tower} layers")


def check_sizes(cfg: ParVLConfig, shapes: dict[str, tuple[int, ...]], folder: Path) -> None:
    """The sizes config.json gives against the shapes of the tensors they size, one line naming the field:
    the embeddings, the first layer's projections and MLP, the patch and position embeddings."""
    t, L = cfg.llm, "language_model.model."
    sized = {  # key: ((dimension, the config's size, the fields that give it), ...)
        L + "embed_tokens.weight": ((0, t.vocab_size, "vocab_size"), (1, t.hidden_size, "hidden_size")),
        L + "layers.0.self_attn.q_proj.weight": ((0, t.num_heads * t.head_dim, "num_attention_heads x head_dim"),),
        L + "layers.0.self_attn.k_proj.weight": ((0, t.num_kv_heads * t.head_dim, "num_key_value_heads x head_dim"),),
        L + "layers.0.mlp.gate_proj.weight": ((0, t.intermediate_size, "intermediate_size"),),
    }
    tower = {k: "language model" for k in sized}
    if cfg.vit is not None:
        v, V = cfg.vit, "vision_model."
        vit = {V + "embeddings.patch_embedding.weight": ((0, v.hidden_size, "hidden_size"),
                                                         (2, v.patch_size, "patch_size")),
               V + "embeddings.position_embedding": ((1, v.grid**2 + 1, "(image_size / patch_size)^2 + 1"),),
               V + "encoder.layers.0.mlp.fc1.weight": ((0, v.intermediate_size, "intermediate_size"),)}
        sized |= vit
        tower |= {k: "vision model" for k in vit}
    for key, dims in sized.items():
        shape = shapes.get(key)
        for dim, size, names in dims if shape is not None else ():
            if len(shape) <= dim or shape[dim] != size:
                raise CheckpointError(f"config.json: the {tower[key]}'s {names} is {size}, but in {folder} {key} "
                                      f"has shape {list(shape)}")


def config_to_json(cfg: ParVLConfig) -> dict:
    """The original InternVLChatConfig layout, which InternVL's own code reads, plus a "parvl" block
    with the branch configuration (ignored by InternVL, read back by config_from_json)."""
    v, t = cfg.vit, cfg.llm
    family = "qwen3" if t.qk_norm else "qwen2"
    arch = {v: k for k, v in DECODERS.items()}[family]
    out = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "tie_word_embeddings": t.tie_word_embeddings,
        "llm_config": {
            "architectures": [arch], "model_type": family, "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_layers, "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps,
            "rope_theta": t.rope_theta, "max_position_embeddings": t.max_position_embeddings,
            "attention_bias": t.qkv_bias, "hidden_act": "silu", "tie_word_embeddings": t.tie_word_embeddings,
        },
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
            "architectures": ["InternVisionModel"], "model_type": "intern_vit_6b",
            "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
            "num_hidden_layers": v.num_layers, "num_attention_heads": v.num_heads,
            "patch_size": v.patch_size, "image_size": v.image_size, "num_channels": 3,
            "qkv_bias": v.qkv_bias, "qk_normalization": v.qk_norm, "norm_type": v.norm_type,
            "layer_norm_eps": v.norm_eps, "hidden_act": "gelu", "drop_path_rate": v.drop_path_rate,
        },
    }
