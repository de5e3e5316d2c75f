"""The allocation study's tables from the score files of several configurations (`evaluate.py report`):
every configuration's scores with the domain aggregates (Eq. A3, scoring.aggregates) beside its FLOPs
(Tables 1 and S4), the best configuration per column with ties going to fewer FLOPs (Table S2's best
Pv:Pl), the Pl x Pv grids of the dense runs (Table 2 / S4, drawn as heatmaps too), the fixed-pair
matrix (Table S9) and the routed and random-pair runs beside their dense one (Table 3).

    python evaluate.py report runs/*/score_*.json --out report/

A configuration is (pv, pl, vision branch, language branch, shared KV, branch variant): a fixed pair
names its branches, a variant (Figure 3, Table S8) its ParConfig fields that are not the paper's.
Writes OUT/report.md (also printed), OUT/report.json and, with matplotlib, OUT/heatmap_COLUMN.png.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from cli import check_folder, log, pyplot
from config import ParConfig
from evaluation.scoring import BENCHMARKS, aggregates
from evaluation.tsv import DataError
from files import regular_file, write_text, writing
from flags import flag
from flops import ARCHS, profile_params

COLUMNS = list(BENCHMARKS) + ["General", "Math", "OCR", "All"]


@dataclass
class ReportConfig:
    """`evaluate.py report`'s flags."""
    runs: list[str] = flag(None, "score JSON files written by `evaluate.py score --out` (or its stdout)",
                           positional=True, nargs="+")
    reference: list[str] = flag(help="score files of reference models (Table 1's public checkpoints, such as "
                                     "InternVL3.5-Instruct): rows of their own, outside the grids and the best choice",
                                nargs="+", factory=list, metavar="JSON")
    out: str = flag("report", "output folder for report.md, report.json and the heatmaps")
    arch: str = flag("1b", "backbone for the FLOPs tie-break (flops.py)", choices=sorted(ARCHS))
    tie_decimals: int = flag(1, "scores equal at this many decimals tie", range="[0, inf)", shown="1, the paper's")
    best_with_shared_kv: bool = flag(False, "let shared-KV runs compete for the best configuration")


def dense(pv: int, pl: int) -> tuple:
    """The configuration of all branches in the paper's parameterisation."""
    return pv, pl, None, None, False, ()


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


def read_scores(files: list[str], reference: list[str] = ()) -> tuple[dict, dict, dict]:
    """The score files as {configuration: {benchmark: score}} and, apart, Table 3's routed and
    random-pair runs as {(pv, pl, policy): {benchmark: score}}; a second score of one benchmark for
    one configuration is refused, and so are the scores of two checkpoints for one configuration (a
    1:1 run and InternVL3.5-Instruct would land in one row). Reference models' files are rows of their
    own: their configuration carries the model (its folder) as a 7th element. Also returns
    {configuration: model fingerprint or folder}."""
    runs: dict[tuple, dict[str, float]] = {}
    policies: dict[tuple, dict[str, float]] = {}  # (pv, pl, "random pair (seed S)" or "router R") -> scores
    models: dict[tuple, str | None] = {}
    read = []  # (file, score file, configuration, its table), every file read before any is judged
    for name, is_reference in [*((f, False) for f in files), *((f, True) for f in reference)]:
        try:
            text = regular_file(name).read_text().strip()  # a FIFO would block the read
            s = json.loads(text.splitlines()[-1])
            bench, value = s["benchmark"], s["score"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
                raise ValueError(f"score must be a number in [0, 100], got {value!r}")  # NaN is none
            key = (int(s["pv"]), int(s["pl"]), s.get("vision_branch"), s.get("language_branch"),
                   bool(s.get("shared_kv")), tuple(sorted((s.get("branches") or {}).items())))  # Table S8 apart
        except (OSError, IndexError, json.JSONDecodeError, KeyError, TypeError, ValueError, RecursionError) as e:
            why = f"{type(e).__name__}: {e}"
            raise DataError(f"{name}: not a score file with benchmark, score, pv, pl ({why})") from None
        if bench not in BENCHMARKS:
            raise DataError(f"{name}: unknown benchmark {bench!r}")
        into = runs  # a routed or random-pair run goes to Table 3 alone, beside its dense configuration
        if s.get("router") or s.get("random_pair") is not None:
            policy = f"router {s['router']}" if s.get("router") else f"random pair (seed {s['random_pair']})"
            key, into = (key[0], key[1], policy), policies
        if is_reference:
            key = key + (str(s.get("model") or model_of(s) or name),)  # a reference model: a row of its own
        read.append((name, s, key, into))
    check_one_checkpoint(read)
    for name, s, key, into in read:
        models[key] = model_of(s)
        if s["benchmark"] in into.setdefault(key, {}):
            raise DataError(f"{name}: a second {s['benchmark']} score for configuration {config_label(key)}")
        into[key][s["benchmark"]] = float(s["score"])
    return runs, policies, models


def check_one_checkpoint(read: list) -> None:
    """One checkpoint per configuration (a 1:1 run and InternVL3.5-Instruct would land in one row): where the
    files of one configuration hold several checkpoints, the few that disagree with most of them are named as
    the foreign ones, whatever the order they came in (the file read second was blamed before, often the
    genuine one); a tie names both sides."""
    held: dict[tuple, dict] = {}  # configuration -> checkpoint -> its files
    for name, s, key, _ in read:
        held.setdefault(key, {}).setdefault(model_of(s), []).append(str(name))
    for key, by_model in held.items():
        if len(by_model) < 2:
            continue
        fix = ("one checkpoint per configuration (pass a reference model with --reference; other model sizes in a "
               "report of their own)")
        ranked = sorted(by_model.items(), key=lambda m: -len(m[1]))
        (most, theirs), others = ranked[0], ranked[1:]
        if len(theirs) > len(others[0][1]):
            foreign = [f for _, fs in others for f in fs]
            raise DataError(f"{', '.join(foreign)}: score(s) of checkpoint {', '.join(str(m) for m, _ in others)} for "
                            f"configuration {config_label(key)}, whose other {len(theirs)} score files ({theirs[0]}, "
                            f"...) are checkpoint {most}'s: {fix}")
        sides = "; ".join(f"checkpoint {m} ({', '.join(fs)})" for m, fs in ranked)
        raise DataError(f"configuration {config_label(key)} holds scores of {len(ranked)} checkpoints: {sides}: {fix}")


def gflops(configs: list, arch: str) -> dict:
    """The Table S3 workload's GFLOPs of each configuration on arch; a fixed branch runs alone: one vision
    or language branch's cost."""
    return {c: profile_params(arch, 1 if c[2] is not None else c[0], 1 if c[3] is not None else c[1],
                              **dict(c[5]))["total_gflops"] for c in configs}


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
    runs = [c for c in configs if c[2] is None and c[3] is None and not c[4] and not c[5]]
    pvs, pls = sorted({c[0] for c in runs}), sorted({c[1] for c in runs})
    out = {}
    for col in COLUMNS:
        grid = [[table.get(dense(pv, pl), {}).get(col) for pv in pvs] for pl in pls]
        if any(v is not None for row in grid for v in row):
            out[col] = grid
    return pvs, pls, out


def fixed_pairs(table: dict, configs: list, columns: list) -> dict:
    """Table S9 from fixed-pair runs (both branches set): per column the vision x language matrix, each
    branch's mean over its partners (only where all partners were run) and the post-hoc best pair."""
    runs = [c for c in configs if c[2] is not None and c[3] is not None]
    out = {}
    for col in columns:
        mine = [c for c in runs if table[c].get(col) is not None]
        if not mine:
            continue
        got = {(c[2], c[3]): table[c][col] for c in mine}
        vs, ls = list(range(max(c[0] for c in mine))), list(range(max(c[1] for c in mine)))  # every branch
        grid = [[got.get((v, l)) for l in ls] for v in vs]
        mean = lambda xs: sum(xs) / len(xs) if None not in xs else None  # noqa: E731
        top = max(got.values())
        out[col] = {"v": vs, "l": ls, "grid": grid, "vision_mean": [mean(row) for row in grid],
                    "language_mean": [mean([row[j] for row in grid]) for j in range(len(ls))],
                    "best": [list(k) for k, x in got.items() if x == top]}
    return out


def table_3(runs: dict, policies: dict) -> list[dict]:
    """Table 3: per Pv:Pl with a routed or random-pair run, its dense row (when run), then each policy's
    row (one branch pair per sample), every row with its aggregates."""
    rows = []
    for pv, pl in sorted({k[:2] for k in policies}):
        mine = [(f"{pv}:{pl} dense", runs[dense(pv, pl)])] if dense(pv, pl) in runs else []
        mine += [(config_label(k), policies[k]) for k in sorted(policies) if k[:2] == (pv, pl)]
        rows += [{"label": label, "pv": pv, "pl": pl, "scores": scores | aggregates(scores)} for label, scores in mine]
    return rows


def markdown(table: dict, configs: list, flops: dict, best: dict, pvs: list, pls: list, grids: dict, pairs: dict,
             table3: list, decimals: int) -> list[str]:
    """report.md's lines: every configuration, the best per column, the grids, the fixed pairs, Table 3."""
    fmt = lambda v: "-" if v is None else f"{v:.{decimals}f}"  # noqa: E731
    md = ["| Pv:Pl | GFLOPs | " + " | ".join(COLUMNS) + " |", "|" + " --- |" * (len(COLUMNS) + 2)]
    md += [f"| {config_label(c)} | {flops[c]:.2f} | " + " | ".join(fmt(table[c].get(k)) for k in COLUMNS) + " |"
           for c in configs]
    md += ["", "Best configuration (ties to fewer FLOPs):", ""]
    md += ["| " + " | ".join(best) + " |", "|" + " --- |" * len(best),
           "| " + " | ".join(config_label(c) for c in best.values()) + " |"]
    for col, g in grids.items():
        md += ["", f"{col}", "", "| Pl \\ Pv | " + " | ".join(map(str, pvs)) + " |", "|" + " --- |" * (len(pvs) + 1)]
        md += [f"| {pl} | " + " | ".join(fmt(v) for v in row) + " |" for pl, row in zip(pls, g)]
    for col, p in pairs.items():
        md += ["", f"{col}: fixed pairs (vision branch rows, language branch columns; marginals; best {p['best']})", "",
               "| v \\ l | " + " | ".join(map(str, p["l"])) + " | mean |", "|" + " --- |" * (len(p["l"]) + 2)]
        md += [f"| {v} | " + " | ".join(fmt(x) for x in row) + f" | {fmt(m)} |"
               for v, row, m in zip(p["v"], p["grid"], p["vision_mean"])]
        md += ["| mean | " + " | ".join(fmt(m) for m in p["language_mean"]) + " | |"]
    for pv, pl in dict.fromkeys((t["pv"], t["pl"]) for t in table3):  # in Table 3's order
        md += ["", f"Table 3, {pv}:{pl}: one branch pair per sample", "", "| policy | " + " | ".join(COLUMNS) + " |",
               "|" + " --- |" * (len(COLUMNS) + 1)]
        md += [f"| {t['label']} | " + " | ".join(fmt(t["scores"].get(k)) for k in COLUMNS) + " |"
               for t in table3 if (t["pv"], t["pl"]) == (pv, pl)]
    return md


FIGURE3_DOMAINS = ("General", "Math", "OCR", "All")


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
        scores = {d: table[c].get(d) for d in FIGURE3_DOMAINS}
        out.setdefault(f"{pv}:{pl}", {"prefix": [], "lora": []})[series].append({x[0]: x[1], "scores": scores})
    for key in list(out):
        f = out[key]
        if len(f["prefix"]) < 2 and not f["lora"]:
            del out[key]  # a lone dense run is no sweep
            continue
        f["prefix"].sort(key=lambda p: p["vit_prefix_len"])
        f["lora"].sort(key=lambda p: p["lora_rank"])
    return out


def figure_3_markdown(fig3: dict, decimals: int) -> list[str]:
    fmt = lambda v: "-" if v is None else f"{v:.{decimals}f}"  # noqa: E731
    md = []
    for key, f in fig3.items():
        for series, x, title in (("prefix", "vit_prefix_len", "vision prefix length"), ("lora", "lora_rank",
                                                                                         "LoRA rank")):
            if f[series]:
                md += ["", f"Figure 3, {key}: domain scores against the {title}", "",
                       f"| {title} | " + " | ".join(FIGURE3_DOMAINS) + " |", "|" + " --- |" * 5]
                md += [f"| {p[x]} | " + " | ".join(fmt(p["scores"][d]) for d in FIGURE3_DOMAINS) + " |"
                       for p in f[series]]
    return md


def plot_figure_3(fig3: dict, out: Path) -> None:
    """figure3_PVxPL.png: the domain scores against the vision prefix length, the LoRA ranks beside
    (matplotlib is optional, as for the heatmaps)."""
    try:
        plt = pyplot()
    except ValueError:
        log("matplotlib is not installed: Figure 3 skipped (its table is written)")
        return
    for key, f in fig3.items():
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
        for ax, series, x, name in ((axes[0], "prefix", "vit_prefix_len", "vision prefix length (tokens)"),
                                    (axes[1], "lora", "lora_rank", "LoRA rank")):
            for d in FIGURE3_DOMAINS:
                pts = [(p[x], p["scores"][d]) for p in f[series] if p["scores"][d] is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=d)
            ax.set_xlabel(name), ax.set_title(f"{key}, {'prefix' if series == 'prefix' else 'LoRA'}")
        axes[0].set_ylabel("score"), axes[0].legend(fontsize=8)
        fig.tight_layout()
        with writing(out / f"figure3_{key.replace(':', 'x')}.png"):
            fig.savefig(out / f"figure3_{key.replace(':', 'x')}.png", dpi=100)
        plt.close(fig)


def table_s6(table: dict, configs: list) -> dict:
    """Table S6 per Pv:Pl with both a standard and a shared-KV dense run: the two rows and their
    difference Δ (shared − standard) in every column."""
    out = {}
    for c in configs:
        std = c[:4] + (False,) + c[5:]
        if c[4] and c[2] is None and c[3] is None and std in table:
            label = config_label(std)
            out[label] = {"standard": table[std], "shared": table[c],
                          "delta": {k: (None if table[c].get(k) is None or table[std].get(k) is None
                                        else table[c][k] - table[std][k]) for k in COLUMNS}}
    return out


def table_s6_markdown(s6: dict, decimals: int) -> list[str]:
    def fmt(v, sign=""):
        text = "-" if v is None else f"{v:{sign}.{decimals}f}"
        return "0." + "0" * decimals if text.lstrip("+-") == "0." + "0" * decimals else text  # Table S6's "0.0"

    md = []
    for label, t in s6.items():
        md += ["", f"Table S6, {label}: shared KV against the standard cache", "",
               "| KV cache | " + " | ".join(COLUMNS) + " |", "|" + " --- |" * (len(COLUMNS) + 1),
               "| Standard | " + " | ".join(fmt(t["standard"].get(k)) for k in COLUMNS) + " |",
               "| Shared | " + " | ".join(fmt(t["shared"].get(k)) for k in COLUMNS) + " |",
               "| Δ (Shared − Standard) | " + " | ".join(fmt(t["delta"][k], "+") for k in COLUMNS) + " |"]
    return md


def heatmaps(grids: dict, pvs: list, pls: list, out: Path) -> None:
    """One PNG per grid (the Table S4 heatmaps); matplotlib is optional."""
    try:
        plt = pyplot()
    except ValueError:  # matplotlib is optional
        log("matplotlib is not installed: heatmaps skipped (the tables are written)")
        return
    for col, grid in grids.items():
        fig, ax = plt.subplots(figsize=(3.2, 2.8))
        vals = [[math.nan if v is None else v for v in row] for row in grid]
        im = ax.imshow(vals, cmap="viridis")
        ax.set_xticks(range(len(pvs)), pvs), ax.set_yticks(range(len(pls)), pls)
        ax.set_xlabel("Pv"), ax.set_ylabel("Pl"), ax.set_title(col)
        for i, j in itertools.product(range(len(pls)), range(len(pvs))):
            if not math.isnan(vals[i][j]):
                ax.text(j, i, f"{vals[i][j]:.1f}", ha="center", va="center", color="w")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        with writing(out / f"heatmap_{col}.png"):
            fig.savefig(out / f"heatmap_{col}.png", dpi=100)
        plt.close(fig)


def report(cfg: ReportConfig) -> int:
    """`evaluate.py report`: the tables of the score files cfg.runs, written into cfg.out and printed."""
    check_folder(Path(cfg.out), "--out")  # a file in the way is named before any work
    runs, policies, models = read_scores(cfg.runs, cfg.reference)
    configs = sorted(runs, key=lambda c: (len(c) == 7, c[4], c[2] is not None or c[3] is not None, c[5], c[0], c[1],
                                          c[2] or 0, c[3] or 0, c[6:]))
    study = [c for c in configs if len(c) == 6]  # the reference models' rows stay out of every other table
    table = {c: runs[c] | aggregates(runs[c]) for c in configs}
    flops = gflops(configs, cfg.arch)
    best = best_configs(table, study, flops, cfg.tie_decimals, cfg.best_with_shared_kv)
    pvs, pls, grids = allocation_grids(table, study)
    pairs = fixed_pairs(table, study, COLUMNS)
    table3 = table_3(runs, {k: v for k, v in policies.items() if len(k) == 3})
    fig3, s6 = figure_3(table, study), table_s6(table, study)
    md = markdown(table, configs, flops, best, pvs, pls, grids, pairs, table3, cfg.tie_decimals)
    md += figure_3_markdown(fig3, cfg.tie_decimals) + table_s6_markdown(s6, cfg.tie_decimals)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "report.md", "\n".join(md) + "\n")
    data = {"arch": cfg.arch,
            "configs": [{"label": config_label(c), "pv": c[0], "pl": c[1], "vision_branch": c[2],
                         "language_branch": c[3], "shared_kv": c[4], "branches": dict(c[5]), "model": models[c],
                         "reference": len(c) == 7, "gflops": flops[c], "scores": table[c]}
                        for c in configs],
            "best": {k: config_label(c) for k, c in best.items()}, "grid_pv": pvs, "grid_pl": pls, "grids": grids,
            "pairs": pairs, "table3": table3, "figure3": fig3, "table_s6": s6}
    write_text(out / "report.json", json.dumps(data, indent=1) + "\n")
    print("\n".join(md))
    heatmaps(grids, pvs, pls, out)
    plot_figure_3(fig3, out)
    print(json.dumps({"report": str(out / "report.md"), "configs": len(configs), "best": data["best"]}))
    return 0
