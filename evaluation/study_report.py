"""`study.py report`: the study's one document, every table and figure of the paper in the paper's order and
under its titles, beside what the paper does not print (this project's own tables, titled as such).

    python study.py report --out study          # study/paper/report.md, the figures as PNGs beside it

The pieces of a finished study each leave their table (study_plan.py): the report's tables (report.md: Tables
1, 2, 3, S2's last column, S4, S6, S8, S9, Figure 3), Table S5, Table S2, Figure 4 (tables/), Tables 4 and S7
(tables/table4.md, the paper's eager regime; table4_compiled.md, the compiled one) and the subsample (Table
S1, data/subsample.json). This file cuts them into sections at their titles, adds Table S3 (flops.py: the
parameters and forward FLOPs of each allocation the report scored), and writes them in the order the paper
prints them: Table 1, Table 2, Figure 3, Table 3, Table 4, Figure 4, Tables S1 to S9. A table the study has not
made yet is named as missing, not left out silently.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from data.subsample import table_s1
from evaluation.flops import ARCHS, profile_params
from shell.files import write_text
from shell.flags import flag
from shell.outputs import check_folder

# the paper's order; a section is the block whose title line starts with the key
PAPER_ORDER = (
    "Table 1:",
    "Table 2:",
    "Figure 3",
    "Table 3:",
    "Table 4:",
    "Figure 4:",
    "Table S1:",
    "Table S2:",
    "Table S2, last column",
    "Table S3:",
    "Table S4:",
    "Table S5:",
    "Table S6:",
    "Table S7:",
    "Table S8:",
    "Table S9:",
)
# this project's own, after the paper's: titled apart, never under a paper's number alone
OURS = (
    "Table 2's nine-benchmark average",
    "Appendix C.2:",
    "Table S7's layout",
    "Table 4's layout",
    "Every configuration scored",
)
# the lines before the first table: which answer extractor, which checkpoint step
PREAMBLE = ("Answer extractor", "Checkpoints")
# the figures each section shows, as (the section, a glob in the study folder)
FIGURES = (
    ("Table 2:", "report/table2.png"),
    ("Figure 3", "report/figure3_*.png"),
    ("Figure 4:", "tables/figure4/score_cost.png"),
    ("Table S4:", "report/table_s4.png"),
)
# where each section is made, for the line naming what is missing
MADE_BY = {
    "Table S1:": "data/subsample.json",
    "Table S2:": "tables/S2.md",
    "Table S5:": "tables/S5.md",
    "Table 4:": "tables/table4.md",
    "Table S7:": "tables/table4.md",
    "Figure 4:": "tables/figure4.md",
}


@dataclass
class StudyReportConfig:
    """`study.py report`'s flags."""

    out: str = flag(
        "study",
        "the study's folder (study.py --out), whose tables the document gathers",
        reads=("report", "tables", "data"),
    )
    doc: str | None = flag(
        None, "folder of the document (report.md) and its figures", shown="OUT/paper", writes=True
    )


def key_of(line: str) -> str | None:
    """The section a title line opens, or None (longest key first: "Table S2, last column" before "Table S2:")."""
    keys = sorted(PAPER_ORDER + OURS + PREAMBLE, key=len, reverse=True)
    return next((k for k in keys if line.startswith(k)), None)


def sections(text: str) -> list[tuple[str, list[str]]]:
    """A Markdown file cut at its title lines into (key, lines); lines before the first title (a command's own
    table) and JSON lines (a command's line for scripts) are dropped."""
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if (k := key_of(line)) is not None:
            out.append((k, [line]))
        elif out and not line.startswith("{"):
            out[-1][1].append(line)
    return [(k, trim(lines)) for k, lines in out]


def trim(lines: list[str]) -> list[str]:
    """lines without the blank ones at either end."""
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    while lines and not lines[0].strip():
        lines = lines[1:]
    return lines


def table_s3(report: dict) -> list[str]:
    """Table S3 of the allocations the report scored at its scale (dense rows: the grid's), from flops.py at the
    paper's workload (768 image tokens, 256 text, 128 response, batch 1), the paper's columns."""
    arch, dense = (
        report["arch"],
        lambda c: c["vision_branch"] is None and c["language_branch"] is None,
    )
    grid = [c for c in report["configs"] if dense(c) and not (c["reference"] or c["shared_kv"])]
    alloc = sorted({(c["pv"], c["pl"]) for c in grid if not c["branches"]})
    if arch not in ARCHS or not alloc:
        return []
    md = [
        "Table S3: Computational Cost and Parameter Analysis. FLOPs are fixed-length forward-pass estimates at "
        "batch size 1 for 768 image-context tokens, 256 text tokens, and 128 response tokens (flops.py: "
        "calflops' convention).",
        "",
        "| Backbone | Config. (Pv:Pl) | ViT FLOPs (G) | ViT Params (M) | LLM FLOPs (G) | LLM Params (M) "
        "| Total FLOPs (G) | Total Params (M) |",
        "|" + " --- |" * 8,
    ]
    for pv, pl in alloc:
        r = profile_params(arch, pv, pl)
        cells = [
            f"{r['vit_gflops']:.2f}",
            f"{r['vit_params'] / 1e6:.2f}",
            f"{r['llm_gflops']:.2f}",
            f"{r['llm_params'] / 1e6:.2f}",
            f"{r['total_gflops']:.2f}",
            f"{r['total_params'] / 1e6:.2f}",
        ]
        md.append(f"| {arch.upper()} | {pv}:{pl} | " + " | ".join(cells) + " |")
    return md


def gather(out: Path) -> list[tuple[str, list[str]]]:
    """Every section the study has made, from its files."""
    found = []
    for name in ("report/report.md", "tables/S2.md", "tables/S5.md", "tables/figure4.md"):
        if (out / name).is_file():
            found += sections((out / name).read_text(encoding="utf-8"))
    for name in ("tables/table4.md", "tables/table4_compiled.md"):
        for k, lines in sections((out / name).read_text("utf-8")) if (out / name).is_file() else ():
            if name.endswith("compiled.md") and k == "Appendix C.2:":  # this project's regime too
                k, lines = "compiled C.2", [f"{lines[0]} (compiled decode)", *lines[1:]]
            found.append((k, lines))
    if (out / "data" / "subsample.json").is_file():
        found.append(("Table S1:", table_s1(json.loads((out / "data/subsample.json").read_text()))))
    if (out / "report" / "report.json").is_file():
        s3 = table_s3(json.loads((out / "report" / "report.json").read_text()))
        found += [("Table S3:", s3)] if s3 else []
    return found


def document(out: Path, doc: Path, found: list[tuple[str, list[str]]]) -> list[str]:
    """The document's lines: the preamble, the paper's sections in its order (figures beside them, copied into
    doc), a line naming each missing one, then this project's own tables."""
    md = [f"# ParVL study report: {out}", ""]
    md += [ln for k, lines in found if k in PREAMBLE for ln in lines + [""]]
    missing = []
    for key in PAPER_ORDER:
        mine = [lines for k, lines in found if k == key]
        if not mine and key != "Table S2, last column":
            missing.append(f"{key.rstrip(':')} ({MADE_BY.get(key, 'report/report.md')})")
        for lines in mine:
            md += [f"## {lines[0]}", "", *trim(lines[1:]), ""]
        figures = [png for k, pattern in FIGURES if k == key and mine for png in out.glob(pattern)]
        for png in sorted(figures):
            shutil.copyfile(png, doc / png.name)  # beside the document, linked by name
            md += [f"![{png.stem}]({png.name})", ""]
    ours = [(k, lines) for k, lines in found if k not in PAPER_ORDER and k not in PREAMBLE]
    if ours:
        md += ["# Beyond the paper: this project's own tables", ""]
        md += [ln for _, lines in ours for ln in [f"## {lines[0]}", "", *trim(lines[1:]), ""]]
    if missing:
        md += ["Not made yet (the study's piece that writes each): " + "; ".join(missing) + "."]
    return md


def study_report(cfg: StudyReportConfig) -> int:
    """`study.py report`: OUT/paper/report.md (or --doc's), every table of the study in the paper's order."""
    out = Path(cfg.out)
    doc = Path(cfg.doc) if cfg.doc else out / "paper"
    if not (out / "report" / "report.md").is_file():
        raise ValueError(f"--out {out}: no report/report.md there; run the study (study.py) first")
    check_folder(doc, "--doc")
    doc.mkdir(parents=True, exist_ok=True)
    md = document(out, doc, gather(out))
    write_text(doc / "report.md", "\n".join(md).rstrip() + "\n")
    print(json.dumps({"report": str(doc / "report.md")}))
    return 0
