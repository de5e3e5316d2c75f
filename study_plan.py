"""The paper's study as a plan of commands (`study.py` runs it; docs/evaluation.md, "The study as one script"
says which sentence of the paper each piece follows): its flags (StudyConfig) and its pieces, in order. Each
piece is one command with the file it leaves when it has finished, the study flags it is made from and the
files it reads; study_run.py records them and decides what runs.

    subsample      study.py subsample: the 1/20 subsample of --data in Table S1's mixture (Setup, A.1)
    train          train.py: the allocations (Table 2 / S4), the ablations of --ablation-base (Figure 3's prefix
                   lengths and LoRA ranks, Table S8's mean aggregation), each other scale's (Table 1)
    run, score     evaluate.py: every benchmark of every model: the trained runs, Table 1's references (each
                   scale's starting checkpoint and --reference-model), Table 3's checkpoint (--router-step's
                   export, its dense model), every fixed pair (Table S9), the random pair, the router, shared KV
                   (Table S6); every score with the answer extractor (A.3)
    router         router.py label, train (and eval on --router-eval-data): Appendix E
    profile        profiling.py latency: each run's batch-1 profile (Figure 4), Tables 4 / S7
    tables         evaluate.py report (Tables 1, 2, 3, S2's best, S4, S6, S8, S9, Figure 3), lengths (Table S5),
                   descriptors (Table S2), cost (Figure 4)
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from cli import SEED
from evaluation.judge import KEY_ENV, PAPER_JUDGE, judge_flags_problem
from evaluation.scoring import BENCHMARKS, COLUMNS, GROUPS
from flags import flag
from flops import ARCHS
from mixture import PAPER_MIXTURE, parse_mixture

ROOT = Path(__file__).resolve().parent
ALLOCATIONS = ["1:1", "1:2", "1:4", "2:1", "2:2", "2:4", "4:1", "4:2", "4:4"]  # Table 2 / S4
# Figure 3: vision prefix lengths beside the base's 96, LoRA ranks (the paper names rank 16 the best of its LoRA
# variants, not the ranks it tried: 8 and 32 bracket it); Table S8: mean aggregation
ABLATIONS = ["prefix72", "prefix128", "lora8", "lora16", "lora32", "mean"]
ABLATION = re.compile(r"(prefix|lora)([1-9][0-9]{0,4})|mean")
EXTRA = ("train", "eval", "label", "router", "profile", "slurm")  # the --X-flags strings, split with shlex

# what a study writes in --out (the layout above): a meta JSON or the TSVs kept beside them are not its outputs
OUT_FOLDERS = ("data", "runs", "pred", "score", "router", "profile", "tables", "report", "made", "replaced")


@dataclass
class StudyConfig:
    model: str = flag("", "the starting checkpoint (the paper's: InternVL3.5 *pretrained*)", required=True,
                      reads=True)
    data: str = flag("", "SFT meta JSON (official InternVL format): the whole collection --data-fraction draws "
                         "from", required=True, reads=True)
    tsv: str = flag("", "folder of the benchmarks' VLMEvalKit TSVs, named BENCHMARK.tsv", required=True, reads=True)
    out: str = flag("study", "the study's folder (on a shared file system with --launcher slurm)",
                    writes=OUT_FOLDERS)
    data_fraction: float = flag(0.05, "fraction of --data the runs train on, drawn in --mixture's shares (the "
                                "study's first piece); 0: --data as given", range="[0, 1]",
                                shown="0.05, the paper's 1/20")
    mixture: list[str] = flag(help="domain shares of the subsample, DOMAIN=SHARE (Table S1)",
                              factory=lambda: list(PAPER_MIXTURE), shown=" ".join(PAPER_MIXTURE))
    allocations: list[str] = flag(help="Pv:Pl allocations trained and evaluated", factory=lambda: list(ALLOCATIONS),
                                  shown="the nine of Table 2")
    benchmarks: list[str] = flag(help="benchmarks run for every model", factory=lambda: list(BENCHMARKS),
                                 shown="the nine")
    ablations: list[str] = flag(help="branch variants of --ablation-base: prefixN (Figure 3's vision prefix length N), "
                                     "loraR (Figure 3's LoRA vision branches of rank R), mean (Table S8), or none",
                                factory=lambda: list(ABLATIONS), shown=" ".join(ABLATIONS))
    ablation_base: str = flag("4:1", "the allocation the ablations vary")
    router_allocation: str = flag("4:4", "the allocation of the fixed pairs, the random pair and the router")
    router_step: int = flag(0, "its training step Table 3 (every row) and S9 use (the paper: 7000; keep it with "
                            "--train-flags \"--keep-last K\", docs/training.md), 0 = the end-of-run export",
                            range="[0, inf)")
    router_data: str = flag("", "meta JSON the router is labelled and trained on", shown="the training data",
                             reads=True)
    router_eval_data: str = flag("", "held-out meta JSON for `router.py eval` (Table 3 / S9 layout)", shown="none",
                                 reads=True)
    shared_kv_allocation: str = flag("4:4", "the allocation evaluated with shared KV as well (Table S6), or none")
    scale_model: list[list[str]] = flag(help="another scale's starting checkpoint, SCALE=DIR (Table 1: "
                                             "2b=InternVL3_5-2B-Pretrained); repeat the flag per scale", nargs="+",
                                        action="append", factory=list, metavar="SCALE=DIR")
    scale_allocations: list[str] = flag(help="the allocations trained at every --scale-model (Table 1)",
                                        factory=lambda: ["1:1", "2:2"])
    reference_model: list[list[str]] = flag(help="a public model evaluated as a Table 1 reference row, SCALE=DIR "
                                                 "(1b=InternVL3_5-1B-Instruct); each scale's starting checkpoint "
                                                 "is one too", nargs="+", action="append", factory=list,
                                            metavar="SCALE=DIR")
    lengths: list[str] = flag(help="the two allocations of Table S5", nargs=2, factory=lambda: ["1:1", "4:4"])
    tokenizer: str | None = flag(None, "tokenizer folder Tables S2 and S5 count with (the paper's: Qwen3-VL-2B-"
                                       "Instruct's Qwen2Tokenizer, use_fast=False)", shown="--model's", metavar="DIR",
                                 reads=True)
    cost_column: str = flag("All", "Figure 4's score column (a benchmark, or an aggregate all of whose benchmarks ran)")
    arch: str = flag("1b", "backbone preset of --model: Tables 4 / S7's profile, the report's FLOPs, Table 1's scale",
                     choices=sorted(ARCHS))
    judge_url: str | None = flag(None, "OpenAI-compatible base URL of the answer extractor every score piece uses "
                                       "(A.3)", shown="none: deterministic extraction only")
    judge_model: str | None = flag(None, f"the answer extractor's model name (the paper's: {PAPER_JUDGE})")
    vlmevalkit: str | None = flag(None, "a VLMEvalKit checkout, whose extraction prompts the answer extractor is sent",
                                  reads=True)
    judge_key_env: str = flag(KEY_ENV, "environment variable holding the extractor's API key (never a flag)")
    launcher: str = flag("local", "local: torchrun on this machine; slurm: sbatch --wait slurm/parvl.sbatch (srun "
                         "for one-device pieces)", choices=["local", "slurm"])
    nproc_per_node: int = flag(8, "--launcher local: processes per multi-process piece; 1 = plain python",
                               range="[1, inf)")
    nodes: int = flag(1, "--launcher slurm: nodes per multi-process piece", range="[1, inf)")
    gpus_per_node: int = flag(8, "--launcher slurm: GPUs a node of a multi-process piece asks for (one process per "
                              "GPU), a one-device piece asks one; 0 on a partition without GPUs", range="[0, inf)")
    slurm_flags: str = flag("", "extra sbatch / srun flags (partition, account, time), one string")
    train_flags: str = flag("", "extra train.py flags, one string")
    eval_flags: str = flag("", "extra `evaluate.py run` flags, one string")
    label_flags: str = flag("", "extra `router.py label` flags, one string")
    router_flags: str = flag("", "extra `router.py train` flags, one string")
    profile_flags: str = flag("", "extra `profiling.py latency` flags, one string")
    plan: bool = flag(False, "print every piece, done or to run, and run nothing")

    def check(self) -> None:
        """Bad flags (exit 2), found by --plan before anything runs (study_plan.flag_problem)."""
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
    for a in (*c.allocations, c.ablation_base, c.router_allocation, *c.lengths, *c.scale_allocations,
              *([] if c.shared_kv_allocation == "none" else [c.shared_kv_allocation])):
        if not is_allocation(a):
            return f"allocation {a!r}: write it Pv:Pl, as 2:4"
    for name, a in (("--router-allocation", c.router_allocation), ("--lengths", c.lengths[0]),
                    ("--lengths", c.lengths[1]), ("--shared-kv-allocation", c.shared_kv_allocation),
                    ("--ablation-base", c.ablation_base)):
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
        parse_mixture(c.mixture)
        scales = pairs_of(c.scale_model, "--scale-model")
        refs = pairs_of(c.reference_model, "--reference-model")
    except ValueError as e:
        return str(e)
    if c.arch in dict(scales) or len(dict(scales)) < len(scales):
        return f"--scale-model: each scale once, and not --arch {c.arch} (--model's)"
    if unknown := [s for s, _ in refs if s != c.arch and s not in dict(scales)]:
        return f"--reference-model {unknown[0]}=...: no such scale (--arch {c.arch}, or a --scale-model's)"
    return judge_flags_problem(c.judge_url, c.judge_model, c.vlmevalkit, c.judge_key_env)


def cost_column_problem(c: StudyConfig) -> str | None:
    """Figure 4's column must be a score every run has: a benchmark run, or an aggregate of benchmarks run."""
    needs = {"All": BENCHMARKS, **GROUPS}.get(c.cost_column, (c.cost_column,))
    if c.cost_column not in COLUMNS:
        return f"--cost-column {c.cost_column}: choose a benchmark or General, Math, OCR, All"
    if missing := [b for b in needs if b not in c.benchmarks]:
        return f"--cost-column {c.cost_column}: needs {' '.join(missing)} in --benchmarks"
    return None


# -- the pieces ------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """One command of the study: its command line (SCRIPT.py and flags, the launcher aside), the file it leaves
    once finished, the study flags it is made from (by name) and the files it reads (by the flag or piece they
    come from), what it writes (moved aside when it is made again), and whether a change is refused."""
    name: str
    argv: list[str]
    done: Path
    kind: str = "cpu"  # multi: ranks share it (torchrun / sbatch); gpu: one device; cpu: light, here
    stdout: Path | None = None  # the command's stdout is this file (profiles, tables)
    flags: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)
    resume: Path | None = None  # train.py's run folder: --resume once it has started
    refuse_change: bool = False  # a training run is not retrained in place

    def __post_init__(self):
        self.outputs = self.outputs or [self.done]


@dataclass
class Model:
    """A model the study evaluates on every benchmark: its run name, folder, `evaluate.py run` flags, scale, and
    whether it is a reference row (Table 1's public checkpoints) and has a batch-1 profile (Figure 4)."""
    name: str
    folder: Path
    flags: list = field(default_factory=list)
    scale: str = ""
    reference: bool = False
    profile: list | None = None  # profiling.py latency's extra flags (--shared-kv), None: not profiled


def run_name(a: str) -> str:
    return a.replace(":", "x")  # 2:2 -> 2x2, a folder name every tool takes


def ablation_flags(name: str) -> list[str]:
    """train.py's branch flags of an ablation: prefixN, loraR, mean."""
    m = ABLATION.fullmatch(name)
    if name == "mean":
        return ["--aggregation", "mean"]
    return ["--vit-prefix-len", m[2]] if m[1] == "prefix" else ["--vision-branches", "lora", "--lora-rank", m[2]]


def extra(c: StudyConfig, command: str) -> list[str]:
    """The extra flags --train-flags, --eval-flags, ... give one kind of piece."""
    return shlex.split(getattr(c, f"{command}_flags"))


def training_data(c: StudyConfig) -> Path:
    return Path(c.out) / "data" / "meta.json" if c.data_fraction else Path(c.data)


def trained_runs(c: StudyConfig) -> list[tuple[str, str, str, str, list[str]]]:
    """(run name, scale, starting checkpoint, Pv:Pl, branch flags) of every run trained: Table 2 / S4's
    allocations, Figure 3's and Table S8's variants of --ablation-base, then each other scale's allocations."""
    runs = [(run_name(a), c.arch, c.model, a, []) for a in c.allocations]
    runs += [(f"{run_name(c.ablation_base)}_{a}", c.arch, c.model, c.ablation_base, ablation_flags(a))
             for a in c.ablations if a != "none"]
    return runs + [(f"{s}_{run_name(a)}", s, folder, a, []) for s, folder in pairs_of(c.scale_model, "--scale-model")
                   for a in c.scale_allocations]


def subsample_piece(c: StudyConfig) -> list[Piece]:
    if not c.data_fraction:
        return []
    out = Path(c.out) / "data"
    return [Piece("subsample the data", ["study.py", "subsample", "--data", c.data, "--fraction", str(c.data_fraction),
                                         "--mixture", *c.mixture, "--seed", str(SEED), "--out", str(out)],
                  out / "meta.json", flags={"--data-fraction": c.data_fraction, "--mixture": c.mixture},
                  inputs={"--data": Path(c.data), **annotations(Path(c.data))}, outputs=[out])]


def annotations(meta: Path) -> dict:
    """The annotation files a meta JSON names, as inputs labelled by it (none when it cannot be read yet)."""
    try:
        entries = json.loads(meta.read_text())
        return {f"--data's {k}": meta.resolve().parent / v["annotation"] for k, v in entries.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def train_piece(c: StudyConfig, name: str, start: str, alloc: str, branches: list[str]) -> Piece:
    pv, pl = alloc.split(":")
    run, data = Path(c.out) / "runs" / name, training_data(c)
    start_flag = "--model" if start == c.model else "--scale-model"
    return Piece(f"train {name}", ["train.py", "--pv", pv, "--pl", pl, *branches, "--model", start, "--data",
                                   str(data), "--out", str(run), *extra(c, "train")],
                 run / "export" / "model.safetensors", "multi",
                 flags={start_flag: start, "--train-flags": c.train_flags},
                 inputs={start_flag: Path(start), "--data": data}, outputs=[run], resume=run, refuse_change=True)


def scale_models(c: StudyConfig) -> list[tuple[str, str]]:
    """(scale, starting checkpoint) of every scale, --model's (--arch) first."""
    return [(c.arch, c.model)] + pairs_of(c.scale_model, "--scale-model")


def evaluated(c: StudyConfig) -> list[Model]:
    """Every model evaluated before the router's: the trained runs (each profiled at batch 1 at the study's
    scale, Figure 4), then Table 1's references: each scale's starting checkpoint and its --reference-model."""
    out = Path(c.out)
    models = [Model(name, out / "runs" / name / "export", scale=scale, profile=[] if scale == c.arch else None)
              for name, scale, *_ in trained_runs(c)]
    refs = [(s, folder) for s, folder in scale_models(c)] + pairs_of(c.reference_model, "--reference-model")
    for scale, folder in refs:
        base = f"ref_{scale}_{re.sub(r'[^A-Za-z0-9._-]', '_', Path(folder).name) or 'model'}"
        name = base + "".join(f"_{k}" for k in [sum(m.name.startswith(base) for m in models)] if k)  # unique
        models.append(Model(name, Path(folder), scale=scale, reference=True))
    return models


def benchmark_pieces(c: StudyConfig, m: Model) -> list[Piece]:
    """Every benchmark of one model: its predictions (`evaluate.py run`), then its score, with the answer
    extractor where --judge-url gives one (A.3)."""
    out, tsv, todo = Path(c.out), Path(c.tsv), []
    judge = ["--judge-url", c.judge_url, "--judge-model", c.judge_model, "--vlmevalkit", c.vlmevalkit,
             "--judge-key-env", c.judge_key_env] if c.judge_url else []
    for b in c.benchmarks:
        pred, score, data = out / "pred" / m.name / f"{b}.jsonl", out / "score" / m.name / f"{b}.json", tsv / f"{b}.tsv"
        todo.append(Piece(f"run {m.name} {b}", ["evaluate.py", "run", "--benchmark", b, "--data", str(data),
                                                "--model", str(m.folder), *m.flags, "--out", str(pred),
                                                *extra(c, "eval")],
                          pred, "multi", flags={"--eval-flags": c.eval_flags},
                          inputs={"--tsv": data, "--reference-model" if m.reference else "--model": m.folder}))
        todo.append(Piece(f"score {m.name} {b}", ["evaluate.py", "score", "--benchmark", b, "--data", str(data),
                                                  "--predictions", str(pred), "--out", str(score), *judge],
                          score, flags={"--judge-url": c.judge_url, "--judge-model": c.judge_model,
                                        "--vlmevalkit": c.vlmevalkit, "--judge-key-env": c.judge_key_env},
                          inputs={"--tsv": data, "predictions": pred}))
    return todo


def router_models(c: StudyConfig) -> tuple[list[Piece], list[Model], list[Model]]:
    """Table 3 and S9's checkpoint, the router allocation's end-of-run export or --router-step's export (then its
    dense model is evaluated too: every row of Table 3 is that checkpoint's), its fixed pairs and random pair; and
    the routed model, evaluated once the router is trained."""
    out, ra = Path(c.out), run_name(c.router_allocation)
    model, todo, models = out / "runs" / ra / "export", [], []
    if c.router_step:
        model = out / "router" / f"model_step_{c.router_step}"
        todo.append(Piece(f"export {ra} step {c.router_step}", ["train.py", "export", str(out / "runs" / ra),
                                                                  "--step", str(c.router_step), "--out", str(model)],
                          model / "model.safetensors", "gpu", flags={"--router-step": c.router_step},
                          inputs={"run": out / "runs" / ra / "export"}, outputs=[model]))
        models.append(Model(f"{ra}_step{c.router_step}", model))
    pv, pl = map(int, c.router_allocation.split(":"))
    models += [Model(f"{ra}_pair{v}{lb}", model, ["--vision-branch", str(v), "--language-branch", str(lb)])
               for v in range(pv) for lb in range(pl)]
    models.append(Model(f"{ra}_random", model, ["--random-pair", "--seed", str(SEED)]))
    return todo, models, [Model(f"{ra}_router", model, ["--router", str(out / "router" / "gates")])]


def router_pieces(c: StudyConfig, model: Path) -> list[Piece]:
    """Appendix E: the router labelled on --router-data, trained (and evaluated on held-out labels)."""
    out, data = Path(c.out) / "router", Path(c.router_data) if c.router_data else training_data(c)
    labels, gates = out / "labels", out / "gates"
    todo = [Piece("label router data", ["router.py", "label", "--model", str(model), "--data", str(data), "--out",
                                        str(labels), *extra(c, "label")], labels / "labels.json", "multi",
                  flags={"--label-flags": c.label_flags}, inputs={"model": model, "--router-data": data},
                  outputs=[labels]),
            Piece("train router", ["router.py", "train", "--model", str(model), "--labels", str(labels), "--out",
                                   str(gates), "--overwrite", *extra(c, "router")], gates / "router.safetensors",
                  "gpu", flags={"--router-flags": c.router_flags}, inputs={"model": model, "labels": labels},
                  outputs=[gates])]
    if c.router_eval_data:
        held = out / "heldout"
        todo.append(Piece("label held-out data", ["router.py", "label", "--model", str(model), "--data",
                                                  c.router_eval_data, "--out", str(held), *extra(c, "label")],
                          held / "labels.json", "multi", flags={"--label-flags": c.label_flags},
                          inputs={"model": model, "--router-eval-data": Path(c.router_eval_data)}, outputs=[held]))
        todo.append(Piece("eval router", ["router.py", "eval", "--model", str(model), "--router", str(gates),
                                          "--labels", str(held)], gates / "eval.json", "gpu",
                          inputs={"model": model, "gates": gates, "labels": held}))
    return todo


def profile_pieces(c: StudyConfig, models: list[Model]) -> list[Piece]:
    """Figure 4: each profiled model's own batch-1 latency and memory (its config, random weights); Tables 4 / S7:
    the router allocation against 1:1, standard and shared KV (--arch)."""
    out, todo = Path(c.out), []
    for m in (m for m in models if m.profile is not None):
        profile = out / "profile" / f"{m.name}.json"
        todo.append(Piece(f"profile {m.name}", ["profiling.py", "latency", "--model", str(m.folder), "--batch", "1",
                                                "--json", *m.profile, *extra(c, "profile")], profile, "gpu",
                          stdout=profile, flags={"--profile-flags": c.profile_flags}, inputs={"model": m.folder}))
    pv, pl = c.router_allocation.split(":")
    table4 = out / "tables" / "table4.md"
    return todo + [Piece("Tables 4 / S7", ["profiling.py", "latency", "--arch", c.arch, "--pv", pv, "--pl", pl,
                                           "--baseline", "--compare-shared", *extra(c, "profile")], table4, "gpu",
                         stdout=table4, flags={"--arch": c.arch, "--profile-flags": c.profile_flags})]


def files(c: StudyConfig, models: list[Model], kind: str) -> list[Path]:
    """The score files (kind "score") or predictions ("pred") of models, every benchmark."""
    ext = "json" if kind == "score" else "jsonl"
    return [Path(c.out) / kind / m.name / f"{b}.{ext}" for m in models for b in c.benchmarks]


def report_piece(c: StudyConfig, models: list[Model]) -> Piece:
    """`evaluate.py report` of this plan's score files only (a score left from another plan is named and left
    out, study.py): the study's scale positional, its references apart, every other scale for Table 1."""
    report, mine = Path(c.out) / "report", [m for m in models if m.scale in ("", c.arch)]
    argv = [*map(str, files(c, [m for m in mine if not m.reference], "score"))]
    argv += ["--reference", *map(str, files(c, [m for m in mine if m.reference], "score"))]
    for scale in dict.fromkeys(s for s, _ in pairs_of(c.scale_model, "--scale-model")):
        for flag_, ref in (("--scale", False), ("--scale-reference", True)):
            argv += [flag_, scale, *map(str, files(c, [m for m in models if m.scale == scale and m.reference == ref],
                                                   "score"))]
    return Piece("report", ["evaluate.py", "report", *argv, "--arch", c.arch, "--out", str(report)],
                 report / "report.json", flags={"--arch": c.arch},
                 inputs={str(f): f for f in files(c, models, "score")}, outputs=[report])


def analysis_pieces(c: StudyConfig, models: list[Model]) -> list[Piece]:
    """Table S5 (the two --lengths runs), Table S2 (the TSVs, the report's best, the trained runs' answers) and
    Figure 4 (each trained run's profile), counted with --tokenizer where given."""
    out, tables, report = Path(c.out), Path(c.out) / "tables", Path(c.out) / "report" / "report.json"
    by_run, count = {m.name: m for m in models}, ["--tokenizer", c.tokenizer] if c.tokenizer else []
    a, b = (by_run[run_name(x)] for x in c.lengths)
    profiled = [m for m in models if m.profile is not None]
    trained = [m for m in profiled if not m.flags]  # Table S2's responses: the trained runs' own
    profiles = [out / "profile" / f"{m.name}.json" for m in profiled]
    return [
        Piece("Table S5", ["evaluate.py", "lengths", "--model", c.model, *count,
                           "--a", *map(str, files(c, [a], "pred")), "--b", *map(str, files(c, [b], "pred")),
                           "--names", *c.lengths, "--out", str(tables / "S5.json")],
              tables / "S5.json", stdout=tables / "S5.md", flags={"--lengths": c.lengths, "--tokenizer": c.tokenizer},
              inputs={str(f): f for f in files(c, [a, b], "pred")}, outputs=[tables / "S5.json", tables / "S5.md"]),
        Piece("Table S2", ["evaluate.py", "descriptors", *(str(Path(c.tsv) / f"{x}.tsv") for x in c.benchmarks),
                           "--model", c.model, *count, "--report", str(report), "--predictions",
                           *map(str, files(c, trained, "pred")), "--out", str(tables / "S2.json")],
              tables / "S2.json", stdout=tables / "S2.md", flags={"--tokenizer": c.tokenizer},
              inputs={"report": report, **{str(f): f for f in files(c, trained, "pred")}},
              outputs=[tables / "S2.json", tables / "S2.md"]),
        Piece("Figure 4", ["evaluate.py", "cost", "--report", str(report), "--latency", *map(str, profiles),
                           "--column", c.cost_column, "--out", str(tables / "figure4")],
              tables / "figure4" / "score_cost.json", stdout=tables / "figure4.md",
              flags={"--cost-column": c.cost_column}, inputs={"report": report, **{str(p): p for p in profiles}},
              outputs=[tables / "figure4", tables / "figure4.md"]),
    ]


def pieces(c: StudyConfig) -> list[Piece]:
    """The study, in order: the data, every run trained, every benchmark of every model (runs, references, Table
    3's checkpoint and its pairs, the router once trained, shared KV), the profiles, then the tables."""
    out, trained = Path(c.out), trained_runs(c)
    models = evaluated(c)
    todo = subsample_piece(c) + [train_piece(c, name, start, a, b) for name, _, start, a, b in trained]
    todo += [p for m in models for p in benchmark_pieces(c, m)]
    export, table3, routed = router_models(c)
    todo += export + [p for m in table3 for p in benchmark_pieces(c, m)]
    todo += router_pieces(c, table3[-1].folder) + [p for m in routed for p in benchmark_pieces(c, m)]
    models += table3 + routed
    if c.shared_kv_allocation != "none":
        sk = Model(f"{run_name(c.shared_kv_allocation)}_sharedkv", out / "runs" / run_name(c.shared_kv_allocation) /
                   "export", ["--shared-kv"], profile=["--shared-kv"])
        todo += benchmark_pieces(c, sk)
        models.append(sk)
    return todo + profile_pieces(c, models) + [report_piece(c, models)] + analysis_pieces(c, models)

