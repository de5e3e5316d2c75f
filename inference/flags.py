"""From flags to a running engine: the inference flags that generate.py, `evaluate.py run` and `profiling.py
latency` share, declared once, and the one path from them to an Engine.

    flags = InferenceFlags(model="InternVL3_5-1B", dtype="bf16")   # a command's config inherits the fields
    folder, cfg, tok = open_model(flags)          # the folder, its config and tokenizer; branch choice checked
    engine = load_engine(flags, folder, device)   # weights, router, --quant, Engine (compiled on CUDA by default)

The steps are in two parts so that a command can refuse its own bad input (a prompt past the context, an
unreadable image) after reading config.json and the tokenizer but before the weights load. A flag that
contradicts another is found at parsing (InferenceFlags.check, exit 2); one that contradicts the checkpoint
(a branch it does not have) as soon as config.json is read (a UsageError, exit 2), before any weight loads.

ParConfig's fields are flags too (branch_flags), so every command that takes a branch flag (train.py,
profiling.py) shares its help and range; the rules that tie them together (branch_conflict,
resolve_branch_flags) are here, beside them. The flag machinery itself is the shell's (shell/flags.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import Field, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Callable

import torch

from config import ParConfig, ParVLConfig
from data.processor import MAX_TILES, Tokenizer
from inference.engine import Engine
from inference.quant import GROUP_SIZES, MODES, quantize
from loading.config_json import open_checkpoint
from loading.hub import DEFAULT_MODEL, resolve_model
from loading.pretrained import load_pretrained
from loading.router import ROUTER_SAVED, load_router
from shell.cli import UsageError, allocation, log, start_processes
from shell.devices import resolve_device, resolve_dtype
from shell.flags import flag

DEFAULT_GROUP = 128  # --group-size when --quant int4 gives none: gpt-fast's and torchao's default


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class DeviceFlags:
    """Where and in what precision a model runs (every command that runs one)."""

    device: str = flag(
        help="torch device: cpu, cuda or cuda:N; under torchrun each rank takes its LOCAL_RANK's "
        "GPU",
        factory=default_device,
        shown="cuda if available, else cpu",
    )
    dtype: str | None = flag(
        None,
        "weights and activations",
        choices=["bf16", "fp16", "fp32"],
        shown="bf16 on CUDA, fp32 on CPU",
    )

    def check(self) -> None:
        """A --device that names no device is a bad flag (exit 2); one this machine lacks is found when the
        command starts (devices.resolve_device, exit 1)."""
        try:
            kind = torch.device(self.device).type
        except (RuntimeError, ValueError):
            kind = None
        if kind not in ("cpu", "cuda", "mps"):
            raise ValueError(f"--device {self.device!r}: not a device; use cpu, cuda or cuda:N")


@dataclass
class InferenceFlags(DeviceFlags):
    """The flags of every command that generates with a checkpoint: the model and how its engine runs."""

    model: str | None = flag(
        None,
        "checkpoint folder or hub repo id",
        reads=True,
        shown=f"$PARVL_MODEL, else {DEFAULT_MODEL}, downloaded once into the huggingface_hub cache",
    )
    revision: str | None = flag(None, "hub branch, tag or commit of --model", shown="main")
    compile: bool | None = flag(
        None, "torch.compile the decode step (CUDA graphs on GPU)", shown="on for CUDA, off for CPU"
    )
    max_tiles: int | None = flag(
        None,
        "448 px tiles per image, thumbnail excluded",
        range=f"[1, {MAX_TILES}]",
        shown="the checkpoint's max_dynamic_patch, 12 for InternVL3.5; evaluate.py run: "
        "VLMEvalKit's budget for the benchmark",
    )
    shared_kv: bool = flag(
        False,
        "ParVL: one mean-reduced token KV cache per sample instead of one per language "
        "branch (less memory, an approximation; paper Appendix C.2)",
    )
    vision_branch: int | None = flag(
        None,
        "ParVL: run only vision branch 0..Pv-1 (Table S9)",
        shown="all, fused",
        range="[0, inf)",
    )
    language_branch: int | None = flag(
        None, "ParVL: run only language branch 0..Pl-1", shown="all, fused", range="[0, inf)"
    )
    router: str | None = flag(
        None,
        "ParVL: a router folder (router.py train); runs one (vision, language) branch "
        "pair per prompt, chosen by the router (Table 3)",
        shown="none",
        reads=ROUTER_SAVED,
    )
    quant: str | None = flag(
        None,
        "weight-only quantization of the language model's linears and LM head as the "
        "weights load: int8 per output channel, int4 in groups of --group-size inputs; the ViT, "
        "connector, embedding, norms, branch prefixes, aggregators and router keep --dtype "
        '(docs/performance.md, "Weight-only quantization")',
        choices=list(MODES),
        shown="none",
    )
    group_size: int | None = flag(
        None,
        f"--quant int4: inputs per scale and zero point, one of {', '.join(map(str, GROUP_SIZES))}",
        range=f"[{GROUP_SIZES[0]}, {GROUP_SIZES[-1]}]",
        shown=str(DEFAULT_GROUP),
    )

    def check(self) -> None:
        """Flags that exclude each other (exit 2)."""
        super().check()
        check_quant(self.quant, self.group_size)
        for name, used in (
            ("--vision-branch", self.vision_branch is not None),
            ("--language-branch", self.language_branch is not None),
            ("--shared-kv", self.shared_kv),
        ):
            if self.router and used:
                raise ValueError(
                    f"--router picks the branches per prompt; it cannot be combined with {name}"
                )


def check_quant(quant: str | None, group_size: int | None) -> None:
    """--quant and --group-size together (exit 2): a group size goes with int4 only, and is one the kernels take."""
    if group_size is not None and quant != "int4":
        raise ValueError(
            f"--group-size sets int4's groups; it goes with --quant int4, not {quant or 'no --quant'}"
        )
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(
            f"--group-size {group_size}: int4's kernels take groups of {', '.join(map(str, GROUP_SIZES))}"
        )


def quant_spec(flags) -> tuple[str | None, int]:
    """(mode, int4 group size) of --quant and --group-size, for quant.quantize."""
    return flags.quant, flags.group_size or DEFAULT_GROUP


def process_device(flags: DeviceFlags) -> torch.device:
    """The device of a command that may run under torchrun (evaluate.py run): --device, or under torchrun
    each rank's LOCAL_RANK GPU, with the process group torchrun asks for (cli.start_processes). An index
    (cuda:1) there would be ignored, so it is refused, as is a device the process group cannot serve."""
    device = resolve_device(flags.device)
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {flags.device}: this command runs on cpu or cuda")
    if "RANK" in os.environ and device.index is not None:
        raise UsageError(
            f"--device {flags.device}: under torchrun each rank takes its LOCAL_RANK's GPU; pass "
            f"--device cuda"
        )
    return start_processes(device.type == "cuda")


def open_model(flags: InferenceFlags) -> tuple[Path, ParVLConfig, Tokenizer]:
    """The checkpoint folder --model names (a local folder or the hub cache), its config and tokenizer
    (checked to belong together), and the branch choice checked against its branches; no weight is read."""
    folder = resolve_model(flags.model, flags.revision)
    cfg, tok = open_checkpoint(folder)
    check_branch_choice(cfg.par, flags.vision_branch, flags.language_branch)
    return folder, cfg, tok


def check_branch_choice(
    par: ParConfig, vision_branch: int | None, language_branch: int | None
) -> None:
    """--vision-branch and --language-branch against the checkpoint's branch counts: one line naming the
    flag, exit 2 (a flag that turns out bad once config.json is read)."""
    for tower, value, count in (
        ("vision", vision_branch, par.pv),
        ("language", language_branch, par.pl),
    ):
        if value is not None and not 0 <= value < count:
            raise UsageError(
                f"--{tower}-branch {value} out of range: the checkpoint has {count} {tower} "
                f"branch{'' if count == 1 else 'es'} (0 to {count - 1})"
            )


def check_new_tokens(max_new_tokens: int, cfg: ParVLConfig) -> None:
    """--max-new-tokens against the model's context (config.json's max_position_embeddings), once it is read: a
    budget that leaves no room for any prompt is a flag that contradicts the checkpoint (UsageError, exit 2),
    said before the weights load, not found row by row (evaluate.py run skipped every row and exited 0)."""
    context = cfg.llm.max_position_embeddings
    if max_new_tokens >= context:
        raise UsageError(
            f"--max-new-tokens {max_new_tokens}: the model's context is {context} tokens, the prompt's "
            f"included (config.json max_position_embeddings); give at most {context - 1}"
        )


def load_engine(flags: InferenceFlags, folder: Path, device: torch.device) -> Engine:
    """The weights of `folder` (open_model's) in --dtype on `device`, the --router checked against them, and
    the Engine that runs them with the branch flags."""
    dtype = resolve_dtype(flags.dtype, device)
    t0 = time.perf_counter()
    with allocation(
        f"loading {folder} ({str(dtype).removeprefix('torch.')} on {device})",
        "the precision (--dtype bf16), or use a device with more free memory",
    ):
        model = load_pretrained(folder, dtype=dtype, device=device)
    router = None
    if flags.router:  # checked against the checkpoint as it was saved, before --quant
        router = load_router(flags.router, model)
        log(f"router {flags.router}: one branch pair per prompt")
    try:  # --quant: the language model's linears, as they load (quant.py)
        quantize(model, *quant_spec(flags))
    except ValueError as e:  # int4 groups that do not divide this checkpoint's widths
        raise UsageError(str(e)) from None
    par, quant = model.cfg.par, f", {model.quant}" if model.quant else ""
    log(
        f"loaded {folder} in {time.perf_counter() - t0:.2f} s ({dtype}{quant}, {device}, Pv:Pl = {par.pv}:{par.pl})"
    )
    return Engine(
        model,
        compile=flags.compile,
        shared_kv=flags.shared_kv,
        vision_branch=flags.vision_branch,
        language_branch=flags.language_branch,
        router=router,
    )


# -- the branch flags: ParConfig's fields ------------------------------------------------------


def branch_flags(name: str, shown: Callable[[Field], str]) -> type:
    """A dataclass of every ParConfig field as a flag whose default is None (not given), for a command's config
    to inherit: each flag's help, range and choices are the field's own (config.py), and `shown(field)` says
    what None stands for, from the field's default, so that no default is written twice.

        class TrainConfig(branch_flags("TrainBranches", lambda f: f"the checkpoint's, else {f.default}")): ...
    """
    return make_dataclass(
        name,
        [
            (
                f.name,
                f"{f.type} | None",
                field(default=None, metadata={**f.metadata, "shown": shown(f)}),
            )
            for f in fields(ParConfig)
        ],
    )


def branch_conflict(
    values: dict, vit_width: int | None = None, origin: dict | None = None
) -> str | None:
    """Branch flags that cannot mean anything together, as one line naming them, or None. values: ParConfig
    field names -> values, None (or missing) where not known yet (train.py's flags before the checkpoint
    is read); vit_width: the ViT width C, where known; origin: a note for a value the user did not give
    ("the checkpoint's"). What makes two branches of a tower differ is its own prefixes (Eq. 1), or for
    vision branches, with --vision-branches lora, their own low-rank updates instead; the aggregator
    only weighs the branch states, so branches that start and stay identical fuse to one."""
    v, origin = {k: x for k, x in values.items() if x is not None}, origin or {}

    def say(name: str) -> str:
        return f"--{name.replace('_', '-')} {v[name]}" + (
            f" ({origin[name]})" if name in origin else ""
        )

    lora = v.get("vision_branches") == "lora"
    if lora and v.get("pv") == 1:
        return (
            f"{say('vision_branches')} needs --pv 2 or more: LoRA vision branches are one low-rank update of the "
            f"ViT per branch, and at {say('pv')} there is no branch to create one for"
        )
    if v.get("pv", 1) > 1 and v.get("vision_branches") == "prefix" and v.get("vit_prefix_len") == 0:
        return (
            f"{say('vit_prefix_len')} at {say('pv')}: with no prefix tokens every vision branch computes the same "
            f"states; give --vit-prefix-len 1 or more, or --vision-branches lora"
        )
    if v.get("pl", 1) > 1 and v.get("llm_prefix_len") == 0:
        return (
            f"{say('llm_prefix_len')} at {say('pl')}: with no prefix tokens every language branch computes the "
            f"same states; give --llm-prefix-len 1 or more"
        )
    if lora and vit_width is not None and v.get("lora_rank", 0) > vit_width:
        return (
            f"{say('lora_rank')} is more than the ViT's width {vit_width}: a low-rank update of a {vit_width}-wide "
            f"linear has rank at most {vit_width}"
        )
    return None


def resolve_branch_flags(
    given: dict,
    par: ParConfig,
    vit_width: int,
    model: str,
    run: dict | None = None,
    run_name: str = "",
) -> dict:
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
            raise ValueError(
                f"{run_name} was trained with --{name.replace('_', '-')} {was}, this run asks for "
                f"{value}; resume without the flag (or with the run's value), or start a new run in "
                f"another --out"
            )
        values[name] = was if value is None else value
        if value is None:
            origin[name] = "the run's" if run is not None else f"{model}'s"
    if why := branch_conflict(values, vit_width, origin):
        raise UsageError(why)
    ParConfig(**values)  # the ranges, as the flags' own
    return values
