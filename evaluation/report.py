"""`evaluate.py report`: the score files of every configuration (score_files.py) into the paper's tables
(tables.py), printed and written as report.json and report.md with the paper's numbering (paper_tables.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from evaluation import paper_tables as paper
from evaluation.flops import ARCHS
from evaluation.score_files import (
    config_label,
    read_scores,
    shared_answer_extractor,
    shared_weight_format,
)
from evaluation.scoring import aggregates
from evaluation.tables import (
    allocation_grids,
    best_configs,
    figure_3,
    fixed_pairs,
    gflops,
    table_1,
    table_3,
    table_s6,
    table_s8,
)
from shell.files import write_text
from shell.flags import flag
from shell.outputs import check_folder


@dataclass
class ReportConfig:
    """`evaluate.py report`'s flags."""

    runs: list[str] = flag(
        None,
        "score JSON files written by `evaluate.py score --out` (or its stdout), of the "
        "study's scale (--arch)",
        positional=True,
        nargs="+",
        reads=True,
    )
    reference: list[str] = flag(
        help="score files of reference models (Table 1's public checkpoints, such as "
        "InternVL3.5-Instruct): rows of their own, outside the grids and the best choice",
        nargs="+",
        factory=list,
        metavar="JSON",
        reads=True,
    )
    scale: list[list[str]] = flag(
        help="another model scale's same-recipe runs for Table 1 (its rows only): the "
        "scale's name (2b), then its score files; once per scale",
        nargs="+",
        action="append",
        factory=list,
        metavar=("SCALE", "JSON"),
        reads=True,
    )
    scale_reference: list[list[str]] = flag(
        help="another scale's reference models for Table 1: the scale's name, "
        "then their score files",
        nargs="+",
        action="append",
        factory=list,
        metavar=("SCALE", "JSON"),
        reads=True,
    )
    out: str = flag(
        "report",
        "output folder for report.md, report.json and the heatmaps",
        writes=("report.md", "report.json", "table2.png", "table_s4.png", "figure3_*.png"),
    )
    arch: str = flag(
        "1b",
        "backbone of the positional files: the FLOPs tie-break (flops.py), Table 1's scale",
        choices=sorted(ARCHS),
    )
    tie_decimals: int = flag(
        1,
        "scores equal at this many decimals tie; score files hold 4 (evaluate.py score)",
        range="[0, 4]",
        shown="1, the paper's",
    )
    best_with_shared_kv: bool = flag(False, "let shared-KV runs compete for the best configuration")

    def check(self) -> None:
        """--scale and --scale-reference: a scale's name, then its files; the study's own scale is --arch."""
        for name, groups in (("--scale", self.scale), ("--scale-reference", self.scale_reference)):
            for g in groups:
                if len(g) < 2 or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", g[0]):
                    raise ValueError(
                        f"{name} {' '.join(g)}: give the scale's name (as 2b), then its score files"
                    )
                if g[0].lower() == self.arch:
                    raise ValueError(
                        f"{name} {g[0]}: the positional files are --arch {self.arch}'s"
                    )
        if len({g[0] for g in self.scale}) < len(self.scale):
            raise ValueError("--scale: one scale twice; give each scale's files once")


def report(cfg: ReportConfig) -> int:
    """`evaluate.py report`: the tables of the score files, written into cfg.out and printed."""
    check_folder(Path(cfg.out), "--out")  # a file in the way is named before any work
    main = read_scores(cfg.runs, cfg.reference)
    refs = {g[0]: g[1:] for g in cfg.scale_reference}
    scales = [(cfg.arch, main)] + [
        (g[0], read_scores(g[1:], refs.pop(g[0], []))) for g in cfg.scale
    ]
    scales += [(name, read_scores([], files)) for name, files in refs.items()]
    judge, quant = shared_answer_extractor(scales), shared_weight_format(scales)
    configs = sorted(
        main.runs,
        key=lambda c: (
            len(c) == 7,
            c[4],
            c[2] is not None or c[3] is not None,
            c[5],
            c[0],
            c[1],
            c[2] or 0,
            c[3] or 0,
            c[6:],
        ),
    )
    # the reference models' rows stay out of every other table
    study = [c for c in configs if len(c) == 6]
    table = {c: main.runs[c] | aggregates(main.runs[c]) for c in configs}
    flops = gflops(configs, cfg.arch)
    pvs, pls, grids = allocation_grids(table, study)
    data = {
        "arch": cfg.arch,
        "judge": judge,
        "quant": quant,
        "configs": [
            {
                "label": config_label(c),
                "pv": c[0],
                "pl": c[1],
                "vision_branch": c[2],
                "language_branch": c[3],
                "shared_kv": c[4],
                "branches": dict(c[5]),
                "model": main.models[c],
                "model_step": main.steps.get(main.models[c]),
                "reference": len(c) == 7,
                "gflops": flops[c],
                "scores": table[c],
            }
            for c in configs
        ],
        "table1": table_1(scales),
        "best": {
            k: config_label(c)
            for k, c in best_configs(
                table, study, flops, cfg.tie_decimals, cfg.best_with_shared_kv
            ).items()
        },
        "grid_pv": pvs,
        "grid_pl": pls,
        "grids": grids,
        "pairs": fixed_pairs(table, study, main.models),
        "table3": table_3(main),
        "figure3": figure_3(table, study),
        "table_s6": table_s6(table, study, main.models),
        "table_s8": table_s8(table, study),
    }
    md = paper.markdown(data, cfg.tie_decimals)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "report.md", "\n".join(md) + "\n")
    write_text(out / "report.json", json.dumps(data, indent=1) + "\n")
    print("\n".join(md))
    paper.heatmaps(grids, pvs, pls, out)
    paper.plot_figure_3(data["figure3"], out)
    print(
        json.dumps(
            {"report": str(out / "report.md"), "configs": len(configs), "best": data["best"]}
        )
    )
    return 0
