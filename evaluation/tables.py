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
from pathlib import Path

from config import ParConfig
from evaluation import paper_tables as paper
from evaluation.flops import profile_params
from evaluation.score_files import Scores, config_label, dense, is_dense
from evaluation.scoring import COLUMNS, aggregates
from evaluation.tsv import DataError

__all__ = ["COLUMNS"]  # analysis.py reads it from here
# Table 1's ParVL rows in the paper's order; others follow
TABLE1_ORDER = ("4:1", "1:4", "4:4", "2:2")


# -- reading the score files ----------------------------------------------------------------------


# -- the tables -------------------------------------------------------------------------------------


def gflops(configs: list, arch: str) -> dict:
    """The Table S3 workload's GFLOPs of each configuration on arch; a fixed branch runs alone: one vision
    or language branch's cost."""
    return {
        c: total_gflops(
            arch, 1 if c[2] is not None else c[0], 1 if c[3] is not None else c[1], c[5]
        )
        for c in configs
    }


@functools.cache
def total_gflops(arch: str, pv: int, pl: int, variant: tuple) -> float:
    """flops.profile_params' total (a meta model built per call: once per cost, not per configuration)."""
    return profile_params(arch, pv, pl, **dict(variant))["total_gflops"]


def best_configs(
    table: dict, configs: list, flops: dict, decimals: int, with_shared_kv: bool
) -> dict:
    """Table S2: per column the best configuration among full (dense) runs, ties at the reported
    precision going to fewer FLOPs. Fixed-pair runs are diagnostics (Table S9) and variants another
    parameterisation (Table S8): neither competes; shared-KV runs are another decoder (Table 4) and
    compete only with_shared_kv."""
    best = {}
    for col in COLUMNS:
        cands = [
            c
            for c in configs
            if c[2] is None
            and c[3] is None
            and not c[5]
            and table[c].get(col) is not None
            and (with_shared_kv or not c[4])
        ]
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
            rows.append(
                {
                    "scale": name,
                    "kind": "reference",
                    # the paper's spelling of a hub folder's name: InternVL3_5-1B-Instruct -> InternVL3.5-...
                    "label": Path(c[6]).name.replace("InternVL3_5", "InternVL3.5"),
                    "config": f"{c[0]}:{c[1]}",
                    "checkpoint": s.models[c],
                    "scores": s.runs[c] | aggregates(s.runs[c]),
                }
            )
        mine = [c for c in s.runs if len(c) == 6 and is_dense(c)]
        order = {a: k for k, a in enumerate(TABLE1_ORDER)}
        for c in sorted(
            mine,
            key=lambda c: (
                c != dense(1, 1),
                order.get(f"{c[0]}:{c[1]}", len(order)),
                c[0] + c[1],
                -c[0],
            ),
        ):
            label = (
                "Baseline (Pv=1, Pl=1)"
                if c == dense(1, 1)
                else f"ParVL-{name} (Pv={c[0]}, Pl={c[1]})"
            )
            rows.append(
                {
                    "scale": name,
                    "kind": "baseline" if c == dense(1, 1) else "parvl",
                    "label": label,
                    "config": f"{c[0]}:{c[1]}",
                    "checkpoint": s.models[c],
                    "scores": s.runs[c] | aggregates(s.runs[c]),
                }
            )
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
            raise DataError(
                f"Table S9 at {pv}:{pl}: fixed pairs of checkpoints {', '.join(map(str, sorted(ckpts)))}; "
                f"its pairs come from one checkpoint"
            )
        vs, ls, cols = list(range(pv)), list(range(pl)), {}
        for col in COLUMNS:
            got = {(c[2], c[3]): table[c][col] for c in mine if table[c].get(col) is not None}
            if not got:
                continue
            grid = [[got.get((v, l)) for l in ls] for v in vs]
            mean = lambda xs: sum(xs) / len(xs) if None not in xs else None  # noqa: E731
            top = max(got.values())
            cols[col] = {
                "grid": grid,
                "vision_mean": [mean(row) for row in grid],
                "language_mean": [mean([row[j] for row in grid]) for j in range(len(ls))],
                "best": [list(k) for k, x in sorted(got.items()) if x == top],
                "best_score": top,
            }
        out[f"{pv}:{pl}"] = {"v": vs, "l": ls, "checkpoint": models[mine[0]], "columns": cols}
    return out


def table_3(s: Scores) -> list[dict]:
    """Table 3 per Pv:Pl with routed or random-pair runs, in the paper's row order (random pair, learned
    router, aggregation), every row from one checkpoint: the dense row is that checkpoint's (its --router-step
    export's when the grid's is the end of the run); a dense score of another checkpoint only is refused."""
    rows = []
    for pv, pl in sorted({k[:2] for k in s.policies if len(k) == 3}):
        # random pair, then routers
        keys = sorted(k for k in s.policies if len(k) == 3 and k[:2] == (pv, pl))
        ckpt, routers = s.models[keys[0]], sum(k[2].startswith("router") for k in keys)
        mine = [(policy_label(k[2], routers > 1), "1:1", s.policies[k], k[2]) for k in keys]
        scores = s.table3_dense.get((pv, pl))
        if scores is None and dense(pv, pl) in s.runs:
            if s.models[dense(pv, pl)] != ckpt:
                raise DataError(
                    f"Table 3 at {pv}:{pl}: its random-pair and router rows are checkpoint {ckpt} (step "
                    f"{s.steps.get(ckpt)}), the dense {pv}:{pl} scores checkpoint "
                    f"{s.models[dense(pv, pl)]} (step {s.steps.get(s.models[dense(pv, pl)])}): every row "
                    f"of Table 3 is one checkpoint's; score that checkpoint's dense model too"
                )
            scores = s.runs[dense(pv, pl)]
        mine += [("Aggregation", f"{pv}:{pl}", scores, None)] if scores is not None else []
        rows += [
            {
                "trained": f"{pv}:{pl}",
                "active": active,
                "policy": policy,
                "pv": pv,
                "pl": pl,
                "run": run,
                "checkpoint": ckpt,
                "step": s.steps.get(ckpt),
                "scores": sc | aggregates(sc),
            }
            for policy, active, sc, run in mine
        ]
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
            series, x = (
                "prefix",
                ("vit_prefix_len", v.get("vit_prefix_len", default.vit_prefix_len)),
            )
        elif v.get("vision_branches") == "lora" and set(v) <= {"vision_branches", "lora_rank"}:
            series, x = "lora", ("lora_rank", v.get("lora_rank", default.lora_rank))
        else:
            continue
        scores = {d: table[c].get(d) for d in paper.FIGURE3_DOMAINS}
        out.setdefault(f"{pv}:{pl}", {"prefix": [], "lora": []})[series].append(
            {x[0]: x[1], "scores": scores}
        )
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
                raise DataError(
                    f"Table S6 at {label}: its standard run is checkpoint {models[std]}, its shared-KV "
                    f"run {models[c]}: both rows use one checkpoint"
                )
            out[label] = {
                "standard": table[std],
                "shared": table[c],
                "checkpoint": models[c],
                "delta": {
                    k: (
                        None
                        if table[c].get(k) is None or table[std].get(k) is None
                        else table[c][k] - table[std][k]
                    )
                    for k in COLUMNS
                },
            }
    return out


def table_s8(table: dict, configs: list) -> dict:
    """Table S8 per Pv:Pl with a mean-aggregation variant beside its dense (MLP) run: {"Pv:Pl": {"mean",
    "mlp"}}, each a row of scores with Eq. A3's aggregates."""
    return {
        f"{c[0]}:{c[1]}": {"mean": table[c], "mlp": table[dense(c[0], c[1])]}
        for c in configs
        if len(c) == 6
        and dict(c[5]) == {"aggregation": "mean"}
        and c[2] is None
        and c[3] is None
        and not c[4]
        and dense(c[0], c[1]) in table
    }
