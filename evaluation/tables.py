"""The allocation study's tables from the score files of several configurations (`evaluate.py report`), each
titled and laid out as the paper numbers it (evaluation/paper_tables.py): Table 1 (every scale's references,
same-recipe baseline and ParVL rows), Table 2 and S4 (the Pl x Pv grids, drawn as heatmaps too), Table 3 (the
routed and random-pair runs beside the dense one, all of one checkpoint), Figure 3 (prefix lengths and LoRA
ranks), Table S2's best configuration per benchmark (ties to fewer FLOPs), Table S6 (shared KV), Table S8 (mean
aggregation), Table S9 (fixed pairs), and every configuration with its FLOPs and Eq. A3's aggregates.

    python evaluate.py report score/*/*.json --reference ref/*.json --scale 2b score_2b/*/*.json --out report/

A configuration is (pv, pl, vision branch, language branch, shared KV, branch variant): a fixed pair names
its branches, a variant (Figure 3, Table S8) its ParConfig fields that are not the paper's. Each belongs to one
checkpoint (its model fingerprint). Writes OUT/report.md (also printed), OUT/report.json and, with matplotlib,
OUT/table2.png, OUT/table_s4.png (the heatmaps) and OUT/figure3_PVxPL.png.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from cli import check_folder
from config import ParConfig
from evaluation import paper_tables as paper
from evaluation.judge import JUDGED
from evaluation.scoring import BENCHMARKS, COLUMNS, aggregates
from evaluation.tsv import DataError
from files import regular_file, write_text
from flags import flag
from flops import ARCHS, profile_params

__all__ = ["COLUMNS", "ReportConfig", "config_label", "report"]  # COLUMNS: analysis.py reads it from here
TABLE1_ORDER = ("4:1", "1:4", "4:4", "2:2")  # Table 1's ParVL rows in the paper's order; others follow


@dataclass
class ReportConfig:
    """`evaluate.py report`'s flags."""
    runs: list[str] = flag(None, "score JSON files written by `evaluate.py score --out` (or its stdout), of the "
                                 "study's scale (--arch)", positional=True, nargs="+", reads=True)
    reference: list[str] = flag(help="score files of reference models (Table 1's public checkpoints, such as "
                                     "InternVL3.5-Instruct): rows of their own, outside the grids and the best choice",
                                nargs="+", factory=list, metavar="JSON", reads=True)
    scale: list[list[str]] = flag(help="another model scale's same-recipe runs for Table 1 (its rows only): the "
                                       "scale's name (2b), then its score files; once per scale",
                                  nargs="+", action="append", factory=list, metavar=("SCALE", "JSON"), reads=True)
    scale_reference: list[list[str]] = flag(help="another scale's reference models for Table 1: the scale's name, "
                                                 "then their score files", nargs="+", action="append",
                                            factory=list, metavar=("SCALE", "JSON"), reads=True)
    out: str = flag("report", "output folder for report.md, report.json and the heatmaps",
                    writes=("report.md", "report.json", "table2.png", "table_s4.png", "figure3_*.png"))
    arch: str = flag("1b", "backbone of the positional files: the FLOPs tie-break (flops.py), Table 1's scale",
                     choices=sorted(ARCHS))
    tie_decimals: int = flag(1, "scores equal at this many decimals tie; score files hold 4 (evaluate.py score)",
                             range="[0, 4]", shown="1, the paper's")
    best_with_shared_kv: bool = flag(False, "let shared-KV runs compete for the best configuration")

    def check(self) -> None:
        """--scale and --scale-reference: a scale's name, then its files; the study's own scale is --arch."""
        for name, groups in (("--scale", self.scale), ("--scale-reference", self.scale_reference)):
            for g in groups:
                if len(g) < 2 or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", g[0]):
                    raise ValueError(f"{name} {' '.join(g)}: give the scale's name (as 2b), then its score files")
                if g[0].lower() == self.arch:
                    raise ValueError(f"{name} {g[0]}: the positional files are --arch {self.arch}'s")
        if len({g[0] for g in self.scale}) < len(self.scale):
            raise ValueError("--scale: one scale twice; give each scale's files once")


def dense(pv: int, pl: int) -> tuple:
    """The configuration of all branches in the paper's parameterisation."""
    return pv, pl, None, None, False, ()


def is_dense(c: tuple) -> bool:
    return len(c) >= 6 and c[2] is None and c[3] is None and not c[4] and not c[5]


def config_label(c: tuple) -> str:
    """"2:4", "4:1 vit_prefix_len=72", "4:4 pair (0,1)", "4:4 sharedKV", "4:4 router R"; a reference
    model's configuration (a 7th element, the model) ends in " [its folder]"."""
    model = f" [{c[-1]}]" if len(c) in (4, 7) else ""
    if len(c) in (3, 4):  # Table 3's (pv, pl, policy)
        return f"{c[0]}:{c[1]} {c[2]}{model}"
    pv, pl, vb, lb, shared, variant = c[:6]
    label = f"{pv}:{pl}" + "".join(f" {k}={v}" for k, v in variant)
    if vb is not None or lb is not None:
        label += f" pair ({'*' if vb is None else vb},{'*' if lb is None else lb})"
    return label + (" sharedKV" if shared else "") + model


def model_of(s: dict) -> str | None:
    """A score file's checkpoint: its model fingerprint (copied from the predictions' record), else its
    model folder; None for a file of neither."""
    return s.get("model_fingerprint") or s.get("model")


# -- reading the score files ----------------------------------------------------------------------


@dataclass
class Scores:
    """One scale's score files: {configuration: {benchmark: score}} (a reference model's configuration carries
    the model as a 7th element), Table 3's routed and random-pair runs apart as {(pv, pl, policy): scores}, the
    dense scores of Table 3's checkpoint where the grid's configuration is another checkpoint's (a --router-step
    export beside the end of the run), each key's checkpoint, each checkpoint's training step, and per answer
    extractor (None: none) the first file of A.3's five benchmarks scored with it."""
    runs: dict = field(default_factory=dict)
    policies: dict = field(default_factory=dict)
    table3_dense: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    judges: dict = field(default_factory=dict)
    quants: dict = field(default_factory=dict)


def read_record(name: str, is_reference: bool) -> dict:
    """One score file: its benchmark, score, configuration key, checkpoint, step, Table 3 policy and extractor."""
    try:
        text = regular_file(name).read_text().strip()  # a FIFO would block the read
        s = json.loads(text.splitlines()[-1])
        bench, value = s["benchmark"], s["score"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
            raise ValueError(f"score must be a number in [0, 100], got {value!r}")  # NaN is none
        key = (int(s["pv"]), int(s["pl"]), s.get("vision_branch"), s.get("language_branch"),
               bool(s.get("shared_kv")), tuple(sorted((s.get("branches") or {}).items())))  # Table S8 apart
    except (OSError, IndexError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError,
            RecursionError) as e:
        raise DataError(f"{name}: not a score file with benchmark, score, pv, pl ({type(e).__name__}: {e})") from None
    if bench not in BENCHMARKS:
        raise DataError(f"{name}: unknown benchmark {bench!r}")
    policy = None  # a routed or random-pair run goes to Table 3 alone, beside its dense configuration
    if s.get("router") or s.get("random_pair") is not None:
        policy = f"router {s['router']}" if s.get("router") else f"random pair (seed {s['random_pair']})"
        key = (key[0], key[1], policy)
    if is_reference:
        key = key + (str(s.get("model") or model_of(s) or name),)  # a reference model: a row of its own
    return {"file": name, "bench": bench, "value": float(value), "key": key, "checkpoint": model_of(s),
            "step": s.get("model_step"), "policy": policy, "judge": s.get("judge_model"), "reference": is_reference,
            "quant": s.get("quant")}


def table_3_checkpoints(records: list[dict]) -> dict[tuple, str]:
    """{(pv, pl): the checkpoint of Table 3's policy rows}; rows of two checkpoints are refused (Table 3: "All
    rows use the same checkpoint"), never averaged together."""
    out: dict[tuple, tuple] = {}
    for r in records:
        if r["policy"] and not r["reference"]:
            at = r["key"][:2]
            if at in out and out[at][0] != r["checkpoint"]:
                raise DataError(f"{r['file']}: Table 3 at {at[0]}:{at[1]} holds rows of checkpoint {r['checkpoint']} "
                                f"and of {out[at][0]} ({out[at][1]}): all its rows use one checkpoint")
            out.setdefault(at, (r["checkpoint"], r["file"]))
    return {k: v[0] for k, v in out.items()}


def read_scores(files: list[str], reference: list[str] = ()) -> Scores:
    """The score files of one scale (read_record), refused where two checkpoints would share a row: a second
    score of one benchmark for one configuration, or the scores of two checkpoints for one configuration (a
    1:1 run and InternVL3.5-Instruct would land in one row). One exception, Table 3's own: the dense scores of
    its policies' checkpoint, when the configuration's grid row is another checkpoint (the end of the run
    beside --router-step's export), are kept apart as Table 3's dense row."""
    records = [read_record(f, False) for f in files] + [read_record(f, True) for f in reference]
    table3 = table_3_checkpoints(records)
    grid: dict[tuple, set] = {}  # dense configuration -> the checkpoints scored for it
    for r in records:
        if is_dense(r["key"]) and not r["reference"]:
            grid.setdefault(r["key"], set()).add(r["checkpoint"])
    for r in records:
        r["into"], r["row"] = ("policies" if r["policy"] else "runs"), r["key"]
        if r["key"] in grid and len(grid[r["key"]]) > 1 and table3.get(r["key"][:2]) == r["checkpoint"]:
            r["into"], r["row"] = "table3_dense", r["key"][:2]
    check_one_checkpoint(records)
    s = Scores()
    for r in records:
        s.steps.setdefault(r["checkpoint"], r["step"])
        if r["bench"] in JUDGED:
            s.judges.setdefault(r["judge"], r["file"])
        s.quants.setdefault(r["quant"], r["file"])
        into, key = getattr(s, r["into"]), r["row"]
        s.models[key] = r["checkpoint"]
        if r["bench"] in into.setdefault(key, {}):
            raise DataError(f"{r['file']}: a second {r['bench']} score for configuration {config_label(r['key'])}")
        into[key][r["bench"]] = r["value"]
    return s


def one_judge(scales: list[tuple[str, Scores]]) -> str | None:
    """The answer extractor of every score of A.3's five benchmarks (None: none); a report mixing scores with
    and without one, or of two, is refused (Table S6: "Both variants use the same gpt-4o-2024-11-20 answer
    extractor wherever API extraction is required")."""
    judges = {j: f for _, s in scales for j, f in s.judges.items()}
    if len(judges) > 1:
        (a, fa), (b, fb) = list(judges.items())[:2]
        say = lambda j: f"with answer extractor {j}" if j else "without an answer extractor"  # noqa: E731
        raise DataError(f"{fb} was scored {say(b)}, {fa} {say(a)}: one report, one extractor (A.3); score them "
                        f"again alike (evaluate.py score --judge-url ... --judge-model ...)")
    return next(iter(judges), None)


def one_quant(scales: list[tuple[str, Scores]]) -> str | None:
    """The weights' format of every score (--quant of evaluate.py run; None: the checkpoint's own weights); a
    report mixing formats is refused, as one mixing answer extractors: a row of quantized weights beside
    full-precision ones would put the quantization's error into the comparison of configurations."""
    quants = {q: f for _, s in scales for q, f in s.quants.items()}
    if len(quants) > 1:
        (a, fa), (b, fb) = list(quants.items())[:2]
        say = lambda q: f"with --quant {q}" if q else "without --quant"  # noqa: E731
        raise DataError(f"{fb} was predicted {say(b)}, {fa} {say(a)}: one report, one weight format; run them "
                        f"again alike (evaluate.py run --quant ...)")
    return next(iter(quants), None)


# -- the tables -------------------------------------------------------------------------------------


def check_one_checkpoint(records: list[dict]) -> None:
    """One checkpoint per row (a 1:1 run and InternVL3.5-Instruct would land in one row): where the files of one
    row hold several checkpoints, the few that disagree with most of them are named as the foreign ones, whatever
    the order they came in (the file read second was blamed before, often the genuine one); a tie names both."""
    held: dict[tuple, dict] = {}  # (table, row) -> checkpoint -> its files
    for r in records:
        held.setdefault((r["into"], r["row"]), {}).setdefault(r["checkpoint"], []).append(str(r["file"]))
    for (_, row), by_model in held.items():
        if len(by_model) < 2:
            continue
        fix = ("one checkpoint per configuration (pass a reference model with --reference; other model sizes with "
               "--scale)")
        label = config_label(row) if len(row) > 2 else f"{row[0]}:{row[1]}"
        ranked = sorted(by_model.items(), key=lambda m: -len(m[1]))
        (most, theirs), others = ranked[0], ranked[1:]
        if len(theirs) > len(others[0][1]):
            foreign = [f for _, fs in others for f in fs]
            raise DataError(f"{', '.join(foreign)}: score(s) of checkpoint {', '.join(str(m) for m, _ in others)} for "
                            f"configuration {label}, whose other {len(theirs)} score files ({theirs[0]}, ...) are "
                            f"checkpoint {most}'s: {fix}")
        sides = "; ".join(f"checkpoint {m} ({', '.join(fs)})" for m, fs in ranked)
        raise DataError(f"configuration {label} holds scores of {len(ranked)} checkpoints: {sides}: {fix}")


def gflops(configs: list, arch: str) -> dict:
    """The Table S3 workload's GFLOPs of each configuration on arch; a fixed branch runs alone: one vision
    or language branch's cost."""
    return {c: total_gflops(arch, 1 if c[2] is not None else c[0], 1 if c[3] is not None else c[1], c[5])
            for c in configs}


@functools.cache
def total_gflops(arch: str, pv: int, pl: int, variant: tuple) -> float:
    """flops.profile_params' total (a meta model built per call: once per cost, not per configuration)."""
    return profile_params(arch, pv, pl, **dict(variant))["total_gflops"]


def best_configs(table: dict, configs: list, flops: dict, decimals: int, with_shared_kv: bool) -> dict:
    """Table S2: per column the best configuration among full (dense) runs, ties at the reported
    precision going to fewer FLOPs. Fixed-pair runs are diagnostics (Table S9) and variants another
    parameterisation (Table S8): neither competes; shared-KV runs are another decoder (Table 4) and
    compete only with_shared_kv."""
    best = {}
    for col in COLUMNS:
        cands = [c for c in configs if c[2] is None and c[3] is None and not c[5] and table[c].get(col) is not None
                 and (with_shared_kv or not c[4])]
        if cands:
            top = max(round(table[c][col], decimals) for c in cands)
            tied = [c for c in cands if round(table[c][col], decimals) == top]
            best[col] = min(tied, key=lambda c: flops[c])
    return best


def allocation_grids(table: dict, configs: list) -> tuple[list, list, dict]:
    """Table 2 / S4 as the paper prints them, dense runs only: (Pv values, Pl values, {column: Pl rows x
    Pv columns}) for every column some run scored."""
    runs = [c for c in configs if is_dense(c)]
    pvs, pls = sorted({c[0] for c in runs}), sorted({c[1] for c in runs})
    out = {}
    for col in COLUMNS:
        grid = [[table.get(dense(pv, pl), {}).get(col) for pv in pvs] for pl in pls]
        if any(v is not None for row in grid for v in row):
            out[col] = grid
    return pvs, pls, out


def table_1(scales: list[tuple[str, Scores]]) -> list[dict]:
    """Table 1 per scale, in the paper's row order: the reference models (in the order given), the
    same-recipe single-branch baseline 1:1, then the ParVL configurations (TABLE1_ORDER first); dense
    standard runs only (pairs, variants and shared KV are other tables'). Each row with Eq. A3's aggregates."""
    rows = []
    for scale, s in scales:
        name = scale.upper()
        for c in (c for c in s.runs if len(c) == 7):
            rows.append({"scale": name, "kind": "reference", "label": Path(c[6]).name, "config": f"{c[0]}:{c[1]}",
                         "checkpoint": s.models[c], "scores": s.runs[c] | aggregates(s.runs[c])})
        mine = [c for c in s.runs if len(c) == 6 and is_dense(c)]
        order = {a: k for k, a in enumerate(TABLE1_ORDER)}
        for c in sorted(mine, key=lambda c: (c != dense(1, 1), order.get(f"{c[0]}:{c[1]}", len(order)),
                                             c[0] + c[1], -c[0])):
            label = "Baseline (Pv=1, Pl=1)" if c == dense(1, 1) else f"ParVL-{name} (Pv={c[0]}, Pl={c[1]})"
            rows.append({"scale": name, "kind": "baseline" if c == dense(1, 1) else "parvl", "label": label,
                         "config": f"{c[0]}:{c[1]}", "checkpoint": s.models[c],
                         "scores": s.runs[c] | aggregates(s.runs[c])})
    return rows


def fixed_pairs(table: dict, configs: list, models: dict) -> dict:
    """Table S9 per Pv:Pl from its fixed-pair runs (both branches set), all of one checkpoint (refused
    otherwise): per column the vision x language matrix, each branch's mean over its partners (only where all
    partners were run: the upper block) and the post-hoc best pairs with their score (the lower block)."""
    runs = [c for c in configs if c[2] is not None and c[3] is not None]
    out = {}
    for pv, pl in sorted({c[:2] for c in runs}):
        mine = [c for c in runs if c[:2] == (pv, pl)]
        if len(ckpts := {models[c] for c in mine}) > 1:
            raise DataError(f"Table S9 at {pv}:{pl}: fixed pairs of checkpoints {', '.join(map(str, sorted(ckpts)))}; "
                            f"its pairs come from one checkpoint")
        vs, ls, cols = list(range(pv)), list(range(pl)), {}
        for col in COLUMNS:
            got = {(c[2], c[3]): table[c][col] for c in mine if table[c].get(col) is not None}
            if not got:
                continue
            grid = [[got.get((v, l)) for l in ls] for v in vs]
            mean = lambda xs: sum(xs) / len(xs) if None not in xs else None  # noqa: E731
            top = max(got.values())
            cols[col] = {"grid": grid, "vision_mean": [mean(row) for row in grid],
                         "language_mean": [mean([row[j] for row in grid]) for j in range(len(ls))],
                         "best": [list(k) for k, x in sorted(got.items()) if x == top], "best_score": top}
        out[f"{pv}:{pl}"] = {"v": vs, "l": ls, "checkpoint": models[mine[0]], "columns": cols}
    return out


def table_3(s: Scores) -> list[dict]:
    """Table 3 per Pv:Pl with routed or random-pair runs, in the paper's row order (random pair, learned
    router, aggregation), every row from one checkpoint: the dense row is that checkpoint's (its --router-step
    export's when the grid's is the end of the run); a dense score of another checkpoint only is refused."""
    rows = []
    for pv, pl in sorted({k[:2] for k in s.policies if len(k) == 3}):
        keys = sorted(k for k in s.policies if len(k) == 3 and k[:2] == (pv, pl))  # random pair, then routers
        ckpt, routers = s.models[keys[0]], sum(k[2].startswith("router") for k in keys)
        mine = [(policy_label(k[2], routers > 1), "1:1", s.policies[k], k[2]) for k in keys]
        scores = s.table3_dense.get((pv, pl))
        if scores is None and dense(pv, pl) in s.runs:
            if s.models[dense(pv, pl)] != ckpt:
                raise DataError(f"Table 3 at {pv}:{pl}: its random-pair and router rows are checkpoint {ckpt} (step "
                                f"{s.steps.get(ckpt)}), the dense {pv}:{pl} scores checkpoint "
                                f"{s.models[dense(pv, pl)]} (step {s.steps.get(s.models[dense(pv, pl)])}): every row "
                                f"of Table 3 is one checkpoint's; score that checkpoint's dense model too")
            scores = s.runs[dense(pv, pl)]
        mine += [("Aggregation", f"{pv}:{pl}", scores, None)] if scores is not None else []
        rows += [{"trained": f"{pv}:{pl}", "active": active, "policy": policy, "pv": pv, "pl": pl, "run": run,
                  "checkpoint": ckpt, "step": s.steps.get(ckpt), "scores": sc | aggregates(sc)}
                 for policy, active, sc, run in mine]
    return rows


def policy_label(policy: str, name_router: bool) -> str:
    """Table 3's name of a policy ("random pair (seed 42)", "router R"): the paper's, the router named when
    more than one was scored."""
    if policy.startswith("random pair"):
        return "Random pair" + policy.removeprefix("random pair")
    return "Learned router" + (f" ({policy.removeprefix('router ')})" if name_router else "")


def figure_3(table: dict, configs: list) -> dict:
    """Figure 3 per Pv:Pl that has a prefix-length or LoRA variant (the paper: 4:1): the domain scores
    against the vision prefix length (the dense run at the paper's 96 among them) and, beside, against
    the LoRA rank of LoRA vision branches. {"Pv:Pl": {"prefix": [{"vit_prefix_len", "scores"}], "lora":
    [{"lora_rank", "scores"}]}}, each series sorted by its x."""
    default = ParConfig()
    out: dict[str, dict] = {}
    for c in configs:
        pv, pl, vb, lb, shared, variant = c
        v = dict(variant)
        if vb is not None or lb is not None or shared:
            continue
        if set(v) <= {"vit_prefix_len"}:
            series, x = "prefix", ("vit_prefix_len", v.get("vit_prefix_len", default.vit_prefix_len))
        elif v.get("vision_branches") == "lora" and set(v) <= {"vision_branches", "lora_rank"}:
            series, x = "lora", ("lora_rank", v.get("lora_rank", default.lora_rank))
        else:
            continue
        scores = {d: table[c].get(d) for d in paper.FIGURE3_DOMAINS}
        out.setdefault(f"{pv}:{pl}", {"prefix": [], "lora": []})[series].append({x[0]: x[1], "scores": scores})
    for key in list(out):
        f = out[key]
        if len(f["prefix"]) < 2 and not f["lora"]:
            del out[key]  # a lone dense run is no sweep
            continue
        f["prefix"].sort(key=lambda p: p["vit_prefix_len"])
        f["lora"].sort(key=lambda p: p["lora_rank"])
    return out


def table_s6(table: dict, configs: list, models: dict) -> dict:
    """Table S6 per Pv:Pl with both a standard and a shared-KV dense run of one checkpoint ("Both rows use the
    same checkpoint": two are refused): the two rows and their difference Δ (shared − standard) per column."""
    out = {}
    for c in configs:
        std = c[:4] + (False,) + c[5:]
        if c[4] and c[2] is None and c[3] is None and std in table:
            label = config_label(std)
            if models[std] != models[c]:
                raise DataError(f"Table S6 at {label}: its standard run is checkpoint {models[std]}, its shared-KV "
                                f"run {models[c]}: both rows use one checkpoint")
            out[label] = {"standard": table[std], "shared": table[c], "checkpoint": models[c],
                          "delta": {k: (None if table[c].get(k) is None or table[std].get(k) is None
                                        else table[c][k] - table[std][k]) for k in COLUMNS}}
    return out


def table_s8(table: dict, configs: list) -> dict:
    """Table S8 per Pv:Pl with a mean-aggregation variant beside its dense (MLP) run: {"Pv:Pl": {"mean",
    "mlp"}}, each a row of scores with Eq. A3's aggregates."""
    return {f"{c[0]}:{c[1]}": {"mean": table[c], "mlp": table[dense(c[0], c[1])]} for c in configs
            if len(c) == 6 and dict(c[5]) == {"aggregation": "mean"} and c[2] is None and c[3] is None and not c[4]
            and dense(c[0], c[1]) in table}


def report(cfg: ReportConfig) -> int:
    """`evaluate.py report`: the tables of the score files, written into cfg.out and printed."""
    check_folder(Path(cfg.out), "--out")  # a file in the way is named before any work
    main = read_scores(cfg.runs, cfg.reference)
    refs = {g[0]: g[1:] for g in cfg.scale_reference}
    scales = [(cfg.arch, main)] + [(g[0], read_scores(g[1:], refs.pop(g[0], []))) for g in cfg.scale]
    scales += [(name, read_scores([], files)) for name, files in refs.items()]
    judge, quant = one_judge(scales), one_quant(scales)
    configs = sorted(main.runs, key=lambda c: (len(c) == 7, c[4], c[2] is not None or c[3] is not None, c[5],
                                               c[0], c[1], c[2] or 0, c[3] or 0, c[6:]))
    study = [c for c in configs if len(c) == 6]  # the reference models' rows stay out of every other table
    table = {c: main.runs[c] | aggregates(main.runs[c]) for c in configs}
    flops = gflops(configs, cfg.arch)
    pvs, pls, grids = allocation_grids(table, study)
    data = {"arch": cfg.arch, "judge": judge, "quant": quant,
            "configs": [{"label": config_label(c), "pv": c[0], "pl": c[1], "vision_branch": c[2],
                         "language_branch": c[3], "shared_kv": c[4], "branches": dict(c[5]), "model": main.models[c],
                         "model_step": main.steps.get(main.models[c]), "reference": len(c) == 7,
                         "gflops": flops[c], "scores": table[c]} for c in configs],
            "table1": table_1(scales),
            "best": {k: config_label(c) for k, c in best_configs(table, study, flops, cfg.tie_decimals,
                                                                 cfg.best_with_shared_kv).items()},
            "grid_pv": pvs, "grid_pl": pls, "grids": grids, "pairs": fixed_pairs(table, study, main.models),
            "table3": table_3(main), "figure3": figure_3(table, study), "table_s6": table_s6(table, study, main.models),
            "table_s8": table_s8(table, study)}
    md = paper.markdown(data, cfg.tie_decimals)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "report.md", "\n".join(md) + "\n")
    write_text(out / "report.json", json.dumps(data, indent=1) + "\n")
    print("\n".join(md))
    paper.heatmaps(grids, pvs, pls, out)
    paper.plot_figure_3(data["figure3"], out)
    print(json.dumps({"report": str(out / "report.md"), "configs": len(configs), "best": data["best"]}))
    return 0
