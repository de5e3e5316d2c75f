"""The study's flags (StudyConfig: the paper's settings by default, every problem found at --plan) and the
vocabulary of its plan: a Piece (one command line, what it reads and writes) and a Model (a checkpoint the
study evaluates)."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from data.subsample import PAPER_MIXTURE, parse_mixture
from evaluation.flops import ARCHS
from evaluation.judge import JUDGE_READS, KEY_ENV, PAPER_JUDGE, judge_flags_problem
from evaluation.scoring import BENCHMARKS, COLUMNS, GROUPS
from shell.flags import flag

ALLOCATIONS = ["1:1", "1:2", "1:4", "2:1", "2:2", "2:4", "4:1", "4:2", "4:4"]  # Table 2 / S4


# Figure 3: vision prefix lengths beside the base's 96, LoRA ranks (the paper names rank 16 the best of its LoRA
# variants, not the ranks it tried: 8 and 32 bracket it); Table S8: mean aggregation
ABLATIONS = ["prefix72", "prefix128", "lora8", "lora16", "lora32", "mean"]


ABLATION = re.compile(r"(prefix|lora)([1-9][0-9]{0,4})|mean")


# the --X-flags strings, split with shlex
EXTRA = ("train", "eval", "label", "router", "profile", "slurm")


# what a study writes in --out (the layout above): a meta JSON or the TSVs kept beside them are not its outputs
OUT_FOLDERS = (
    "data",
    "runs",
    "pred",
    "score",
    "router",
    "profile",
    "tables",
    "report",
    "paper",
    "made",
    "replaced",
)


@dataclass
class StudyConfig:
    model: str = flag(
        "",
        "the starting checkpoint (the paper's: InternVL3.5 *pretrained*)",
        required=True,
        reads=True,
    )
    data: str = flag(
        "",
        "SFT meta JSON (official InternVL format): the whole collection --data-fraction draws from",
        required=True,
        reads=True,
    )
    tsv: str = flag(
        "",
        "folder of the benchmarks' VLMEvalKit TSVs, named BENCHMARK.tsv",
        required=True,
        reads=True,
    )
    out: str = flag(
        "study",
        "the study's folder (on a shared file system with --launcher slurm)",
        writes=OUT_FOLDERS,
    )
    data_fraction: float = flag(
        0.05,
        "fraction of --data the runs train on, a plain seeded draw as the paper's (the study's first "
        "piece; its composition reported as Table S1); 0: --data as given",
        range="[0, 1]",
        shown="0.05, the paper's 1/20",
    )
    mixture: list[str] = flag(
        help="a stratified subsample instead: each domain's share, DOMAIN=SHARE (Table S1's rounded "
        f"estimate: {' '.join(PAPER_MIXTURE)})",
        factory=list,
        shown="none: the paper's plain seeded draw",
    )
    allocations: list[str] = flag(
        help="Pv:Pl allocations trained and evaluated",
        factory=lambda: list(ALLOCATIONS),
        shown="the nine of Table 2",
    )
    benchmarks: list[str] = flag(
        help="benchmarks run for every model", factory=lambda: list(BENCHMARKS), shown="the nine"
    )
    ablations: list[str] = flag(
        help="branch variants of --ablation-base: prefixN (Figure 3's vision prefix length N), "
        "loraR (Figure 3's LoRA vision branches of rank R), mean (Table S8), or none",
        factory=lambda: list(ABLATIONS),
        shown=" ".join(ABLATIONS),
    )
    ablation_base: str = flag("4:1", "the allocation the ablations vary")
    router_allocation: str = flag(
        "4:4", "the allocation of the fixed pairs, the random pair and the router"
    )
    router_step: int = flag(
        7000,
        "the router allocation's training step every table that uses it takes (Tables 1, 2, 3, S5, "
        "S6, S9, Figure 4), kept from --keep-last by train.py --keep-step; a multiple of "
        "--save-every within the run; 0 = the end-of-run export",
        range="[0, inf)",
        shown="7000, the paper's",
    )
    router_data: str = flag(
        "", "meta JSON the router is labelled and trained on", shown="the training data", reads=True
    )
    router_eval_data: str = flag(
        "",
        "held-out meta JSON for `router.py eval` (Table 3 / S9 layout)",
        shown="none",
        reads=True,
    )
    shared_kv_allocation: str = flag(
        "4:4", "the allocation evaluated with shared KV as well (Table S6), or none"
    )
    scale_model: list[list[str]] = flag(
        help="another scale's starting checkpoint, SCALE=DIR (Table 1: "
        "2b=InternVL3_5-2B-Pretrained); repeat the flag per scale",
        nargs="+",
        action="append",
        factory=list,
        metavar="SCALE=DIR",
    )
    scale_allocations: list[str] = flag(
        help="the allocations trained at every --scale-model (Table 1)",
        factory=lambda: ["1:1", "2:2"],
    )
    reference_model: list[list[str]] = flag(
        help="a public model evaluated as a Table 1 reference row, SCALE=DIR "
        "(1b=InternVL3_5-1B-Instruct); each scale's starting checkpoint "
        "is one too",
        nargs="+",
        action="append",
        factory=list,
        metavar="SCALE=DIR",
    )
    lengths: list[str] = flag(
        help="the two allocations of Table S5", nargs=2, factory=lambda: ["1:1", "4:4"]
    )
    tokenizer: str | None = flag(
        None,
        "tokenizer folder Tables S2 and S5 count with (the paper's: Qwen3-VL-2B-"
        "Instruct's Qwen2Tokenizer, use_fast=False)",
        shown="--model's",
        metavar="DIR",
        reads=True,
    )
    cost_column: str = flag(
        "All", "Figure 4's score column (a benchmark, or an aggregate all of whose benchmarks ran)"
    )
    arch: str = flag(
        "1b",
        "backbone preset of --model: Tables 4 / S7's profile, the report's FLOPs, Table 1's scale",
        choices=sorted(ARCHS),
    )
    judge_url: str | None = flag(
        None,
        "OpenAI-compatible base URL of the answer extractor every score piece uses (A.3)",
        shown="none: deterministic extraction only",
    )
    judge_model: str | None = flag(
        None, f"the answer extractor's model name (the paper's: {PAPER_JUDGE})"
    )
    vlmevalkit: str | None = flag(
        None,
        "a VLMEvalKit checkout, whose extraction prompts the answer extractor is sent",
        reads=JUDGE_READS,
    )
    judge_key_env: str = flag(
        KEY_ENV, "environment variable holding the extractor's API key (never a flag)"
    )
    launcher: str = flag(
        "local",
        "local: torchrun on this machine; slurm: sbatch --wait slurm/parvl.sbatch (srun "
        "for one-device pieces)",
        choices=["local", "slurm"],
    )
    nproc_per_node: int = flag(
        8, "--launcher local: processes per multi-process piece; 1 = plain python", range="[1, inf)"
    )
    nodes: int = flag(1, "--launcher slurm: nodes per multi-process piece", range="[1, inf)")
    gpus_per_node: int = flag(
        8,
        "--launcher slurm: GPUs a node of a multi-process piece asks for (one process per "
        "GPU), a one-device piece asks one; 0 on a partition without GPUs",
        range="[0, inf)",
    )
    slurm_flags: str = flag("", "extra sbatch / srun flags (partition, account, time), one string")
    train_flags: str = flag("", "extra train.py flags, one string")
    eval_flags: str = flag("", "extra `evaluate.py run` flags, one string")
    label_flags: str = flag("", "extra `router.py label` flags, one string")
    router_flags: str = flag("", "extra `router.py train` flags, one string")
    profile_flags: str = flag("", "extra `profiling.py latency` flags, one string")
    compiled_profile: bool = flag(
        True,
        "Tables 4 / S7 also with the compiled CUDA-graph decode, this project's regime, beside the "
        "paper's eager one (tables/table4_compiled.md)",
    )
    plan: bool = flag(False, "print every piece, done or to run, and run nothing")
    mfu: float = flag(
        0.4,
        "model FLOPs utilisation --plan prices the pieces at (evaluation/study_cost.py)",
        range="(0, 1]",
    )
    peak_tflops: float = flag(
        989.0,
        "one GPU's dense bf16 peak, TFLOP/s, --plan prices the pieces at",
        range="(0, inf)",
        shown="989, an H100 / H200 SXM",
    )

    def check(self) -> None:
        """Bad flags (exit 2), found by --plan before anything runs (flag_problem)."""
        if why := flag_problem(self):
            raise ValueError(why)


def pairs_of(groups: list[list[str]], name: str) -> list[tuple[str, str]]:
    """SCALE=DIR items of a repeated flag as (scale, dir)."""
    out = []
    for item in (x for g in groups for x in g):
        scale, _, folder = item.partition("=")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", scale) or not folder:
            raise ValueError(f"{name} {item}: write SCALE=DIR, as 2b=InternVL3_5-2B-Pretrained")
        out.append((scale.lower(), folder))
    return out


def is_allocation(a: str) -> bool:
    return len(a.split(":")) == 2 and all(x.isdigit() and int(x) > 0 for x in a.split(":"))


def flag_problem(c: StudyConfig) -> str | None:
    """The first flag that cannot work, as one line naming it, or None."""
    for a in (
        *c.allocations,
        c.ablation_base,
        c.router_allocation,
        *c.lengths,
        *c.scale_allocations,
        *([] if c.shared_kv_allocation == "none" else [c.shared_kv_allocation]),
    ):
        if not is_allocation(a):
            return f"allocation {a!r}: write it Pv:Pl, as 2:4"
    for name, a in (
        ("--router-allocation", c.router_allocation),
        ("--lengths", c.lengths[0]),
        ("--lengths", c.lengths[1]),
        ("--shared-kv-allocation", c.shared_kv_allocation),
        ("--ablation-base", c.ablation_base),
    ):
        if a not in c.allocations and not (a == "none" and name == "--shared-kv-allocation"):
            return f"{name} {a}: not among --allocations {' '.join(c.allocations)}"
    if c.shared_kv_allocation != "none" and c.shared_kv_allocation.endswith(":1"):
        return f"--shared-kv-allocation {c.shared_kv_allocation}: shared KV shares one cache over Pl > 1 branches"
    if unknown := [a for a in c.ablations if not ABLATION.fullmatch(a) and a != "none"]:
        return f"--ablations {' '.join(unknown)}: write prefixN, loraR or mean (as {' '.join(ABLATIONS)}), or none"
    if c.ablation_base.startswith("1:") and any(a.startswith("lora") for a in c.ablations):
        return f"--ablations lora at --ablation-base {c.ablation_base}: LoRA vision branches need Pv 2 or more"
    if unknown := [b for b in c.benchmarks if b not in BENCHMARKS]:
        return f"--benchmarks {' '.join(unknown)}: choose from {' '.join(BENCHMARKS)}"
    if why := cost_column_problem(c):
        return why
    for kind in EXTRA:
        try:
            shlex.split(getattr(c, f"{kind}_flags"))
        except ValueError as e:
            return f"--{kind}-flags {getattr(c, f'{kind}_flags')!r}: {e} (one string of flags, quoted as a shell does)"
    try:
        if c.mixture:
            parse_mixture(c.mixture)
        scales = pairs_of(c.scale_model, "--scale-model")
        refs = pairs_of(c.reference_model, "--reference-model")
    except ValueError as e:
        return str(e)
    if c.arch in dict(scales) or len(dict(scales)) < len(scales):
        return f"--scale-model: each scale once, and not --arch {c.arch} (--model's)"
    if unknown := [s for s, _ in refs if s != c.arch and s not in dict(scales)]:
        return f"--reference-model {unknown[0]}=...: no such scale (--arch {c.arch}, or a --scale-model's)"
    if twice := next((f"{s}={d}" for k, (s, d) in enumerate(refs) if (s, d) in refs[:k]), None):
        return (
            f"--reference-model {twice}: given twice (each reference model is one row of Table 1)"
        )
    return (
        router_step_problem(c)
        or judge_flags_problem(c.judge_url, c.judge_model, c.vlmevalkit, c.judge_key_env)
        or plan_problem(c)
    )


# train.py's --save-every and --global-batch defaults (a test holds them equal; the study reads no command)
SAVE_EVERY, GLOBAL_BATCH = 500, 512


def train_flag(c: StudyConfig, name: str) -> str | None:
    """The value --train-flags gives train.py's flag `name` (the last one wins, as in argparse), or None."""
    args, value = extra(c, "train"), None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def router_step_problem(c: StudyConfig) -> str | None:
    """--router-step must be a step the run saves: a multiple of --save-every (train.py saves at those and at
    its last step, which --max-steps may fix), and not past --max-steps; found at --plan, not at the export
    after the training."""
    if not c.router_step:
        return None
    try:
        every = int(train_flag(c, "--save-every") or SAVE_EVERY)
        last = int(train_flag(c, "--max-steps") or 0)
        int(train_flag(c, "--global-batch") or GLOBAL_BATCH)
    except ValueError:
        return "--train-flags: --save-every, --max-steps and --global-batch take whole numbers"
    if every < 1:
        return f"--train-flags --save-every {every}: at least 1"
    if last and c.router_step > last:
        return f"--router-step {c.router_step}: past --max-steps {last} of --train-flags"
    if c.router_step % every and c.router_step != last:
        return (
            f"--router-step {c.router_step}: train.py saves every {every} steps (--save-every), so step "
            f"{c.router_step} is never written; choose a multiple of {every}"
        )
    return None


def plan_problem(c: StudyConfig) -> str | None:
    """What --plan can know before the training and no other check says: a router allocation with one pair (nothing
    to route), flags the chosen launcher never reads, and the answer extractor's key variable unset for an endpoint
    off this machine (it would fail at the first score, after all the training)."""
    pv, pl = (int(x) for x in c.router_allocation.split(":"))
    if pv * pl < 2:
        return (
            f"--router-allocation {c.router_allocation}: one branch pair, nothing for a router to choose; "
            f"pick one of Pv x Pl >= 2 (the paper's 4:4)"
        )
    defaults = {f.name: f.default for f in fields(StudyConfig)}
    unread = {"local": ("nodes", "gpus_per_node", "slurm_flags"), "slurm": ("nproc_per_node",)}[
        c.launcher
    ]
    if ignored := [n for n in unread if getattr(c, n) != defaults[n]]:
        flag_ = "--" + ignored[0].replace("_", "-")
        return f"{flag_}: --launcher {c.launcher} never reads it; drop it, or pick the launcher that does"
    host = urlsplit(c.judge_url).hostname if c.judge_url else None
    if (
        host
        and host not in ("localhost", "127.0.0.1", "::1")
        and not os.environ.get(c.judge_key_env)
    ):
        return (
            f"--judge-key-env {c.judge_key_env}: not set, and --judge-url's {host} is not this machine; "
            f"export the key in it before the study (its scores come after the training)"
        )
    return None


def cost_column_problem(c: StudyConfig) -> str | None:
    """Figure 4's column must be a score every run has: a benchmark run, or an aggregate of benchmarks run."""
    needs = {"All": BENCHMARKS, **GROUPS}.get(c.cost_column, (c.cost_column,))
    if c.cost_column not in COLUMNS:
        return f"--cost-column {c.cost_column}: choose a benchmark or General, Math, OCR, All"
    if missing := [b for b in needs if b not in c.benchmarks]:
        return f"--cost-column {c.cost_column}: needs {' '.join(missing)} in --benchmarks"
    return None


@dataclass
class Piece:
    """One command of the study: its command line (SCRIPT.py and flags, the launcher aside), the file it leaves
    once finished, the study flags it is made from (by name) and the files it reads (by the flag or piece they
    come from), what it writes (moved aside when it is made again), and whether a change is refused."""

    name: str
    argv: list[str]
    done: Path
    kind: str = (
        "cpu"  # multi: ranks share it (torchrun / sbatch); gpu: one device; cpu: light, here
    )
    stdout: Path | None = None  # the command's stdout is this file (profiles, tables)
    flags: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)
    resume: Path | None = None  # train.py's run folder: --resume once it has started
    refuse_change: bool = False  # a training run is not retrained in place
    # what one sample costs and how many (study_cost.py): arch, pv, pl, branches, passes, rows; None: no price
    work: dict | None = None

    def __post_init__(self):
        self.outputs = self.outputs or [self.done]


@dataclass
class Model:
    """A model the study evaluates on every benchmark: its run name, folder, `evaluate.py run` flags, scale,
    whether it is a reference row (Table 1's public checkpoints), whether it has a batch-1 profile (Figure 4),
    and what one of its samples costs."""

    name: str
    folder: Path
    flags: list = field(default_factory=list)
    scale: str = ""
    reference: bool = False
    profile: list | None = (
        None  # profiling.py latency's extra flags (--shared-kv), None: not profiled
    )
    # the configuration one sample runs through, for the price (study_cost.py): arch, pv, pl, branches
    work: dict | None = None


def run_name(a: str) -> str:
    return a.replace(":", "x")  # 2:2 -> 2x2, a folder name every tool takes


def ablation_flags(name: str) -> list[str]:
    """train.py's branch flags of an ablation: prefixN, loraR, mean."""
    m = ABLATION.fullmatch(name)
    if name == "mean":
        return ["--aggregation", "mean"]
    return (
        ["--vit-prefix-len", m[2]]
        if m[1] == "prefix"
        else ["--vision-branches", "lora", "--lora-rank", m[2]]
    )


def extra(c: StudyConfig, command: str) -> list[str]:
    """The extra flags --train-flags, --eval-flags, ... give one kind of piece."""
    return shlex.split(getattr(c, f"{command}_flags"))


def checkpoint(c: StudyConfig, run: str) -> Path:
    """The checkpoint every table takes of a trained run: its end-of-run export, or for --router-allocation's
    run with --router-step N, the export of step N (C.1 and Appendix E: Table 1 / 2's 4:4 row, Table 3's
    aggregation row and Table S6's standard row are one checkpoint's numbers, "at training step 7,000")."""
    if c.router_step and run == run_name(c.router_allocation):
        return Path(c.out) / "router" / f"model_step_{c.router_step}"
    return Path(c.out) / "runs" / run / "export"


def training_data(c: StudyConfig) -> Path:
    return Path(c.out) / "data" / "meta.json" if c.data_fraction else Path(c.data)


ROOT = Path(__file__).resolve().parents[1]  # the repository: the commands the pieces run
