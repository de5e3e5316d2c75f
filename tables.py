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
from flags import flag
from scoring import BENCHMARKS, aggregates
from tsv import DataError

COLUMNS = list(BENCHMARKS) + ["General", "Math", "OCR", "All"]


@dataclass
class ReportConfig:
    """`evaluate.py report`'s flags."""
    runs: list[str] = flag(None, "score JSON files written by `evaluate.py score --out` (or its stdout)",
                           positional=True, nargs="+")
    out: str = flag("report", "output folder for report.md, report.json and the heatmaps")
    arch: str = flag("1b", "backbone for the FLOPs tie-break (flops.py)")
    tie_decimals: int = flag(1, "scores equal at this many decimals tie", range="[0, inf)", shown="1, the paper's")
    best_with_shared_kv: bool = flag(False, "let shared-KV runs compete for the best configuration")


def dense(pv: int, pl: int) -> tuple:
    """The configuration of all branches in the paper's parameterisation."""
    return pv, pl, None, None, False, ()


def config_label(c: tuple) -> str:
    if len(c) == 3:  # Table 3's (pv, pl, policy)
        return f"{c[0]}:{c[1]} {c[2]}"
    pv, pl, vb, lb, shared, variant = c
    label = f"{pv}:{pl}" + "".join(f" {k}={v}" for k, v in variant)
    if vb is not None or lb is not None:
        label += f" pair ({'*' if vb is None else vb},{'*' if lb is None else lb})"
    return label + (" sharedKV" if shared else "")


def read_scores(files: list[str]) -> tuple[dict, dict]:
    """The score files as {configuration: {benchmark: score}} and, apart, Table 3's routed and
    random-pair runs as {(pv, pl, policy): {benchmark: score}}; a second score of one benchmark for
    one configuration is refused."""
    runs: dict[tuple, dict[str, float]] = {}
    policies: dict[tuple, dict[str, float]] = {}  # (pv, pl, "random pair (seed S)" or "router R") -> scores
    for name in files:
        try:
            text = Path(name).read_text().strip()
            s = json.loads(text.splitlines()[-1])
            bench, value = s["benchmark"], s["score"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
                raise ValueError(f"score must be a number in [0, 100], got {value!r}")  # NaN is none
            value = float(value)
            key = (int(s["pv"]), int(s["pl"]), s.get("vision_branch"), s.get("language_branch"),
                   bool(s.get("shared_kv")), tuple(sorted((s.get("branches") or {}).items())))  # Table S8 apart
        except (OSError, IndexError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
            raise DataError(f"{name}: not a score file with benchmark, score, pv, pl ({why})") from None
        if bench not in BENCHMARKS:
            raise DataError(f"{name}: unknown benchmark {bench!r}")
        into = runs  # a routed or random-pair run goes to Table 3 alone, beside its dense configuration
        if s.get("router") or s.get("random_pair") is not None:
            policy = f"router {s['router']}" if s.get("router") else f"random pair (seed {s['random_pair']})"
            key, into = (key[0], key[1], policy), policies
        if bench in into.setdefault(key, {}):
            raise DataError(f"{name}: a second {bench} score for configuration {config_label(key)}")
        into[key][bench] = value
    return runs, policies


def gflops(configs: list, arch: str) -> dict:
    """The Table S3 workload's GFLOPs of each configuration on arch; a fixed branch runs alone: one vision
    or language branch's cost."""
    from flops import profile_params

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
        fig.savefig(out / f"heatmap_{col}.png", dpi=100)
        plt.close(fig)


def report(cfg: ReportConfig) -> int:
    """`evaluate.py report`: the tables of the score files cfg.runs, written into cfg.out and printed."""
    check_folder(Path(cfg.out), "--out")  # a file in the way is named before any work
    runs, policies = read_scores(cfg.runs)
    configs = sorted(runs, key=lambda c: (c[4], c[2] is not None or c[3] is not None, c[5], c[0], c[1], c[2] or 0,
                                          c[3] or 0))
    table = {c: runs[c] | aggregates(runs[c]) for c in configs}
    flops = gflops(configs, cfg.arch)
    best = best_configs(table, configs, flops, cfg.tie_decimals, cfg.best_with_shared_kv)
    pvs, pls, grids = allocation_grids(table, configs)
    pairs = fixed_pairs(table, configs, COLUMNS)
    table3 = table_3(runs, policies)
    md = markdown(table, configs, flops, best, pvs, pls, grids, pairs, table3, cfg.tie_decimals)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(md) + "\n")
    data = {"configs": [{"label": config_label(c), "pv": c[0], "pl": c[1], "vision_branch": c[2],
                         "language_branch": c[3], "shared_kv": c[4], "branches": dict(c[5]), "gflops": flops[c],
                         "scores": table[c]}
                        for c in configs],
            "best": {k: config_label(c) for k, c in best.items()}, "grid_pv": pvs, "grid_pl": pls, "grids": grids,
            "pairs": pairs, "table3": table3}
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    print("\n".join(md))
    heatmaps(grids, pvs, pls, out)
    print(json.dumps({"report": str(out / "report.md"), "configs": len(configs), "best": data["best"]}))
    return 0
