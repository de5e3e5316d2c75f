"""The report's tables and figures as the paper numbers and lays them out (`evaluate.py report`, tables.py
computes them): each titled with the paper's number and caption, its rows and columns in the paper's order,
so that the two can be laid side by side. report.md holds, in the paper's order: Table 1, Table 2, Figure 3,
Table 3, Table S2's last column (the best Pv:Pl), Table S4, Table S6, Table S8, Table S9, and every configuration
scored with its Table S3 GFLOPs. Figures: the Table S4 heatmaps and Figure 3, with matplotlib (optional).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from evaluation.judge import PAPER_JUDGE
from evaluation.scoring import BENCHMARKS, COLUMNS
from shell.cli import log, pyplot
from shell.files import writing

# the paper's names of the benchmarks and domains, for the subtables' titles
PAPER_NAMES = {
    "MMMU_DEV_VAL": "MMMU dev-val",
    "MathVista_MINI": "MathVista mini",
    "MathVision_MINI": "MathVision mini",
    "LogicVista": "LogicVista",
    "WeMath": "WeMath",
    "ChartQA_TEST": "ChartQA test",
    "TextVQA_VAL": "TextVQA val",
    "DocVQA_VAL": "DocVQA val",
    "OCRBench": "OCRBench",
    "General": "General",
    "Math": "Avg. Math",
    "OCR": "Avg. OCR",
    "All": "All",
}
# Table 2's subtables (a)-(i), in the paper's order; Table S4's are the nine benchmarks in BENCHMARKS' order
TABLE2 = (
    "MathVista_MINI",
    "LogicVista",
    "WeMath",
    "ChartQA_TEST",
    "TextVQA_VAL",
    "OCRBench",
    "General",
    "Math",
    "OCR",
)
FIGURE3_DOMAINS = ("General", "Math", "OCR", "All")
# Table 3 prints the domains and All only (report.json has all)
TABLE3_COLUMNS = ("General", "Math", "OCR", "All")


def cells(fmt, scores: dict, columns=COLUMNS) -> str:
    return " | ".join(fmt(scores.get(k)) for k in columns) + " |"


# a column's name in a table's head: the paper's (Table 1's "MMMU dev-val"), not VLMEvalKit's file name; the
# domain averages keep Table 1's plain names
HEAD_NAMES = PAPER_NAMES | {"Math": "Math", "OCR": "OCR"}


def head(first: list[str], columns=COLUMNS) -> list[str]:
    return [
        "| " + " | ".join([*first, *(HEAD_NAMES.get(c, c) for c in columns)]) + " |",
        "|" + " --- |" * (len(first) + len(columns)),
    ]


def judge_line(judge: str | None) -> list[str]:
    """Which answer extractor the scores of A.3's five benchmarks were made with."""
    if judge:
        return [
            f"Answer extractor: {judge} (Appendix A.3: MMMU, MathVista, MathVision and WeMath rows deterministic "
            f"extraction leaves unresolved, and every LogicVista row)."
        ]
    return [
        f"Answer extractor: none. Unresolved MMMU, MathVista, MathVision and WeMath rows count as wrong and "
        f"LogicVista counts bare capital letters only: not the paper's protocol (A.3: {PAPER_JUDGE})."
    ]


def checkpoint_line(configs: list[dict]) -> list[str]:
    """The training step every trained configuration's numbers come from, one checkpoint per model in every
    table (C.1: Table 1 / 2's 4:4 row, Table 3's aggregation row and Table S6's standard row are one
    checkpoint's, "at training step 7,000")."""
    steps: dict = {}
    for c in configs:
        if not c["reference"]:
            steps.setdefault(c["model_step"], []).append(c["label"])
    parts = [
        f"step {'not recorded' if s is None else s}: {', '.join(labels)}"
        for s, labels in steps.items()
    ]
    return ["", "Checkpoints (the training step each number comes from): " + "; ".join(parts) + "."]


def table_1(rows: list[dict], fmt) -> list[str]:
    md = [
        "",
        "Table 1: Comparison of multimodal general, mathematical, and OCR performance. Within each model "
        "scale, the ParVL variants against the single-branch baseline trained with the same recipe; public "
        "models for reference.",
        "",
    ] + head(["Model"])
    for scale in dict.fromkeys(r["scale"] for r in rows):
        md.append(f"| ~{scale} Models |" + " |" * len(COLUMNS))
        md += [f"| {r['label']} | " + cells(fmt, r["scores"]) for r in rows if r["scale"] == scale]
    return md


def grids(
    title: str, columns, pvs: list, pls: list, grids_: dict, fmt, first: int = 0
) -> list[str]:
    """Table 2 or S4: a Pl x Pv subtable per column the runs scored, in `columns`' order, lettered as the paper
    letters it ((b) LogicVista in Table 2 whether or not MathVista ran); `first`: the letter of columns[0] (an
    extra grid after Table 2's nine goes on at (j), no letter of the paper's used twice)."""
    md = ["", title]
    for col in (c for c in columns if c in grids_):
        md += [
            "",
            f"({'abcdefghijklm'[first + columns.index(col)]}) {PAPER_NAMES[col]}",
            "",
            "| Pl \\ Pv | " + " | ".join(map(str, pvs)) + " |",
            "|" + " --- |" * (len(pvs) + 1),
        ]
        md += [
            f"| {pl} | " + " | ".join(fmt(v) for v in row) + " |"
            for pl, row in zip(pls, grids_[col])
        ]
    return md


def figure_3(fig3: dict, fmt) -> list[str]:
    md = []
    for key, f in fig3.items():
        for series, x, title in (
            ("prefix", "vit_prefix_len", "vision prefix length"),
            ("lora", "lora_rank", "LoRA rank"),
        ):
            if f[series]:
                md += [
                    "",
                    f"Figure 3 ({key}): prefix vs. LoRA vision branches, domain scores against the {title}",
                    "",
                ] + head([title], FIGURE3_DOMAINS)
                md += [f"| {p[x]} | " + cells(fmt, p["scores"], FIGURE3_DOMAINS) for p in f[series]]
    return md


def table_3(rows: list[dict], fmt) -> list[str]:
    md = []
    for trained in dict.fromkeys(r["trained"] for r in rows):
        mine = [r for r in rows if r["trained"] == trained]
        step = "its step not recorded" if mine[0]["step"] is None else f"step {mine[0]['step']}"
        md += [
            "",
            f"Table 3: Exploration on sparse router module. All rows use the same checkpoint trained under "
            f"{trained}: {mine[0]['checkpoint']} ({step}). Random pair and the learned router activate one "
            f"branch pair per sample, Aggregation all branches.",
            "",
        ]
        md += head(["Trained Pv:Pl", "Active Pv:Pl", "Policy"], TABLE3_COLUMNS)
        md += [
            f"| {r['trained']} | {r['active']} | {r['policy']} | "
            + cells(fmt, r["scores"], TABLE3_COLUMNS)
            for r in mine
        ]
    return md


def best(best_: dict, decimals: int) -> list[str]:
    return [
        "",
        f"Table S2, last column: the empirically best Pv:Pl per benchmark, selected from Table S4; ties (at "
        f"{decimals} decimals) favor the lower-FLOP configuration.",
        "",
        "| " + " | ".join(HEAD_NAMES.get(b, b) for b in best_) + " |",
        "|" + " --- |" * len(best_),
        "| " + " | ".join(best_.values()) + " |",
    ]


def table_s6(s6: dict, decimals: int) -> list[str]:
    def fmt(v, sign=""):
        text = "-" if v is None else f"{v:{sign}.{decimals}f}"
        # Table S6's "0.0"
        return "0." + "0" * decimals if text.lstrip("+-") == "0." + "0" * decimals else text

    md = []
    for label, t in s6.items():
        md += [
            "",
            f"Table S6: Per-benchmark accuracy with Shared KV. Both rows use the same checkpoint trained with "
            f"{label} ({t['checkpoint']}); only the inference-time KV cache changes.",
            "",
        ] + head(["KV Cache"])
        md += [
            "| Standard | " + cells(fmt, t["standard"]),
            "| Shared | " + cells(fmt, t["shared"]),
            "| Δ (Shared − Standard) | " + cells(lambda v: fmt(v, "+"), t["delta"]),
        ]
    return md


def table_s8(s8: dict, fmt) -> list[str]:
    md = []
    for key, t in s8.items():
        md += [
            "",
            f"Table S8: Per-benchmark comparison of mean and MLP aggregation, trained separately under {key}, "
            f"all branches active at inference.",
            "",
        ] + head(["Aggregation"])
        md += ["| Mean | " + cells(fmt, t["mean"]), "| MLP | " + cells(fmt, t["mlp"])]
    return md


def table_s9(pairs: dict, fmt) -> list[str]:
    """The upper block (each branch's mean over its partners), then the lower (the post-hoc best pairs)."""
    md = []
    for key, p in pairs.items():
        cols = p["columns"]
        md += [
            "",
            f"Table S9: Fixed-branch performance from a jointly trained {key} ParVL checkpoint "
            f"({p['checkpoint']}). The upper block averages each branch over its possible partners; the lower "
            f"reports post-hoc best pairs as oracle diagnostics.",
            "",
        ] + head(["Component", "Branch ID"])
        for name, axis, branches in (
            ("ViT", "vision_mean", p["v"]),
            ("LLM", "language_mean", p["l"]),
        ):
            md += [
                f"| {name} | {b} | "
                + " | ".join(fmt(cols[c][axis][b]) if c in cols else "-" for c in COLUMNS)
                + " |"
                for b in branches
            ]
        md += [""] + head(["Selection"])
        md.append(
            "| ViT–LLM pair | "
            + " | ".join(
                ", ".join(f"({v},{lb})" for v, lb in cols[c]["best"]) if c in cols else "-"
                for c in COLUMNS
            )
            + " |"
        )
        md.append(
            "| Score | "
            + " | ".join(fmt(cols[c]["best_score"]) if c in cols else "-" for c in COLUMNS)
            + " |"
        )
    return md


def every_config(configs: list[dict], arch: str, fmt) -> list[str]:
    md = [
        "",
        f"Every configuration scored, with its Table S3 GFLOPs ({arch}; a fixed pair costs one branch pair) "
        f"and Eq. A3's aggregates",
        "",
    ] + head(["Pv:Pl", "GFLOPs"])
    return md + [
        f"| {c['label']} | {c['gflops']:.2f} | " + cells(fmt, c["scores"]) for c in configs
    ]


def markdown(data: dict, decimals: int) -> list[str]:
    """report.md's lines: the answer extractor, then every table in the paper's order."""
    fmt = lambda v: "-" if v is None else f"{v:.{decimals}f}"  # noqa: E731
    md = judge_line(data["judge"]) + checkpoint_line(data["configs"]) + table_1(data["table1"], fmt)
    md += grids(
        "Table 2: Ablation on branch-count configurations between vision branches (Pv, columns) and "
        "language branches (Pl, rows).",
        TABLE2,
        data["grid_pv"],
        data["grid_pl"],
        data["grids"],
        fmt,
    )
    # not a subtable of the paper's: the nine-benchmark average its text cites
    if "All" in data["grids"]:
        md += grids(
            "Table 2's nine-benchmark average (All), which the paper's text cites.",
            ["All"],
            data["grid_pv"],
            data["grid_pl"],
            data["grids"],
            fmt,
            first=len(TABLE2),
        )
    md += (
        figure_3(data["figure3"], fmt) + table_3(data["table3"], fmt) + best(data["best"], decimals)
    )
    md += grids(
        "Table S4: Full benchmark-level compute allocation heatmaps (rows Pl, columns Pv).",
        BENCHMARKS,
        data["grid_pv"],
        data["grid_pl"],
        data["grids"],
        fmt,
    )
    md += (
        table_s6(data["table_s6"], decimals)
        + table_s8(data["table_s8"], fmt)
        + table_s9(data["pairs"], fmt)
    )
    return md + every_config(data["configs"], data["arch"], fmt)


# -- the figures (matplotlib is optional: without it one line, the tables still written) --------------


def plot_figure_3(fig3: dict, out: Path) -> None:
    """figure3_PVxPL.png: the domain scores against the vision prefix length, the LoRA ranks beside."""
    try:
        plt = pyplot()
    except ValueError:
        log("matplotlib is not installed: Figure 3 skipped (its table is written)")
        return
    for key, f in fig3.items():
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
        for ax, series, x, name in (
            (axes[0], "prefix", "vit_prefix_len", "vision prefix length (tokens)"),
            (axes[1], "lora", "lora_rank", "LoRA rank"),
        ):
            for d in FIGURE3_DOMAINS:
                pts = [(p[x], p["scores"][d]) for p in f[series] if p["scores"][d] is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=d)
            (
                ax.set_xlabel(name),
                ax.set_title(f"{key}, {'prefix' if series == 'prefix' else 'LoRA'}"),
            )
        axes[0].set_ylabel("score"), axes[0].legend(fontsize=8)
        fig.suptitle(f"Figure 3 ({key}): prefix vs. LoRA vision branches", fontsize=10)
        fig.tight_layout()
        with writing(out / f"figure3_{key.replace(':', 'x')}.png"):
            fig.savefig(out / f"figure3_{key.replace(':', 'x')}.png", dpi=100)
        plt.close(fig)


def heatmaps(grids_: dict, pvs: list, pls: list, out: Path) -> None:
    """Table 2's and Table S4's heatmaps, one PNG each (table2.png, table_s4.png), a panel per subtable in the
    paper's order, darker cells higher within each, as the paper draws them."""
    try:
        plt = pyplot()
    except ValueError:  # matplotlib is optional
        log("matplotlib is not installed: heatmaps skipped (the tables are written)")
        return
    for name, title, columns in (
        ("table2", "Table 2", TABLE2),
        ("table_s4", "Table S4", BENCHMARKS),
    ):
        panels = [c for c in columns if c in grids_]
        if not panels:
            continue
        rows = math.ceil(len(panels) / 3)
        fig, axes = plt.subplots(rows, 3, figsize=(9, 2.6 * rows), squeeze=False)
        for k, ax in enumerate(axes.flat):
            if k >= len(panels):
                ax.axis("off")
                continue
            col = panels[k]
            letter = "abcdefghi"[columns.index(col)]  # the paper's letter, whichever subtables ran
            vals = [[math.nan if v is None else v for v in row] for row in grids_[col]]
            ax.imshow(vals, cmap="Blues")
            ax.set_xticks(range(len(pvs)), pvs), ax.set_yticks(range(len(pls)), pls)
            (
                ax.set_xlabel("Pv"),
                ax.set_ylabel("Pl"),
                ax.set_title(f"({letter}) {PAPER_NAMES[col]}", fontsize=9),
            )
            for i, j in itertools.product(range(len(pls)), range(len(pvs))):
                if not math.isnan(vals[i][j]):
                    ax.text(j, i, f"{vals[i][j]:.1f}", ha="center", va="center", fontsize=8)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        with writing(out / f"{name}.png"):
            fig.savefig(out / f"{name}.png", dpi=80)
        plt.close(fig)
