"""The study's pieces that measure and tabulate: the latency profiles (Tables S7 and 4, Figure 4, in the paper's
eager regime; Tables S7 and 4 compiled as well), the report of every table, and the analyses of finished runs
(Tables S5 and S2, Figure 4)."""

from __future__ import annotations

from pathlib import Path

from evaluation.study_config import Model, Piece, StudyConfig, extra, pairs_of, run_name
from evaluation.study_cost import PROFILE_CALLS


def profile_pieces(c: StudyConfig, models: list[Model]) -> list[Piece]:
    """Figure 4: each profiled model's own batch-1 latency and memory (its config, random weights); Tables 4 / S7:
    the router allocation against 1:1, standard and shared KV (--arch). The paper's tables in the paper's regime,
    eager decode (C.1: "using the batched generation path", min_new_tokens = max_new_tokens = 128, where launch
    overhead hides most of the branches' extra compute); Tables 4 / S7 again with the compiled CUDA-graph
    decode beside them, this project's own regime, titled as such (latency.paper_layout)."""
    out, todo = Path(c.out), []
    for m in (m for m in models if m.profile is not None):
        profile = out / "profile" / f"{m.name}.json"
        todo.append(
            Piece(
                f"profile {m.name}",
                [
                    "profiling.py",
                    "latency",
                    "--model",
                    str(m.folder),
                    "--batch",
                    "1",
                    "--json",
                    "--no-compile",
                    *m.profile,
                    *extra(c, "profile"),
                ],
                profile,
                "gpu",
                stdout=profile,
                flags={"--profile-flags": c.profile_flags},
                inputs={"model": m.folder},
                work=m.work and m.work | {"rows": ("fixed", PROFILE_CALLS)},
            )
        )
    pv, pl = c.router_allocation.split(":")
    # batches 1, 2, 4, 8 of 1:1, standard and shared KV: priced as three of the router allocation's (a bound)
    bound = {"arch": c.arch, "pv": int(pv), "pl": int(pl), "passes": 3}
    for name, regime, table in (
        ("Tables 4 / S7", "--no-compile", out / "tables" / "table4.md"),
        ("Tables 4 / S7, compiled", "--compile", out / "tables" / "table4_compiled.md"),
    )[: 2 if c.compiled_profile else 1]:
        argv = ["profiling.py", "latency", "--arch", c.arch, "--pv", pv, "--pl", pl]
        todo.append(
            Piece(
                name,
                [*argv, "--baseline", "--compare-shared", regime, *extra(c, "profile")],
                table,
                "gpu",
                stdout=table,
                flags={"--arch": c.arch, "--profile-flags": c.profile_flags},
                work=bound | {"rows": ("fixed", PROFILE_CALLS * 15)},
            )
        )
    return todo


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
            argv += [
                flag_,
                scale,
                *map(
                    str,
                    files(
                        c, [m for m in models if m.scale == scale and m.reference == ref], "score"
                    ),
                ),
            ]
    return Piece(
        "report",
        ["evaluate.py", "report", *argv, "--arch", c.arch, "--out", str(report)],
        report / "report.json",
        flags={"--arch": c.arch},
        inputs={str(f): f for f in files(c, models, "score")},
        outputs=[report],
    )


def analysis_pieces(c: StudyConfig, models: list[Model]) -> list[Piece]:
    """Table S5 (the two --lengths runs), Table S2 (the TSVs, the report's best, the trained runs' answers) and
    Figure 4 (each trained run's profile), counted with --tokenizer where given."""
    out, tables, report = (
        Path(c.out),
        Path(c.out) / "tables",
        Path(c.out) / "report" / "report.json",
    )
    by_run, count = {m.name: m for m in models}, ["--tokenizer", c.tokenizer] if c.tokenizer else []
    a, b = (by_run[run_name(x)] for x in c.lengths)
    profiled = [m for m in models if m.profile is not None]
    trained = [m for m in profiled if not m.flags]  # Table S2's responses: the trained runs' own
    profiles = [out / "profile" / f"{m.name}.json" for m in profiled]
    return [
        Piece(
            "Table S5",
            [
                "evaluate.py",
                "lengths",
                "--model",
                c.model,
                *count,
                "--a",
                *map(str, files(c, [a], "pred")),
                "--b",
                *map(str, files(c, [b], "pred")),
                "--names",
                *c.lengths,
                "--out",
                str(tables / "S5.json"),
            ],
            tables / "S5.json",
            stdout=tables / "S5.md",
            flags={"--lengths": c.lengths, "--tokenizer": c.tokenizer},
            inputs={str(f): f for f in files(c, [a, b], "pred")},
            outputs=[tables / "S5.json", tables / "S5.md"],
        ),
        Piece(
            "Table S2",
            [
                "evaluate.py",
                "descriptors",
                *(str(Path(c.tsv) / f"{x}.tsv") for x in c.benchmarks),
                "--model",
                c.model,
                *count,
                "--report",
                str(report),
                "--predictions",
                *map(str, files(c, trained, "pred")),
                "--out",
                str(tables / "S2.json"),
            ],
            tables / "S2.json",
            stdout=tables / "S2.md",
            flags={"--tokenizer": c.tokenizer},
            inputs={"report": report, **{str(f): f for f in files(c, trained, "pred")}},
            outputs=[tables / "S2.json", tables / "S2.md"],
        ),
        Piece(
            "Figure 4",
            [
                "evaluate.py",
                "cost",
                "--report",
                str(report),
                "--latency",
                *map(str, profiles),
                "--column",
                c.cost_column,
                "--out",
                str(tables / "figure4"),
            ],
            tables / "figure4" / "score_cost.json",
            stdout=tables / "figure4.md",
            flags={"--cost-column": c.cost_column},
            inputs={"report": report, **{str(p): p for p in profiles}},
            outputs=[tables / "figure4", tables / "figure4.md"],
        ),
    ]


def document_piece(c: StudyConfig) -> Piece:
    """`study.py report`: the one document of every table and figure, in the paper's order (study_report.py),
    made again whenever a table it gathers changes."""
    out = Path(c.out)
    tables = ["S5.md", "S2.md", "figure4.md", "table4.md"]
    tables += ["table4_compiled.md"] if c.compiled_profile else []
    gathered = [out / "report" / "report.md", *(out / "tables" / t for t in tables)]
    gathered += [out / "data" / "subsample.json"] if c.data_fraction else []
    return Piece(
        "the document",
        ["study.py", "report", "--out", str(out)],
        out / "paper" / "report.md",
        inputs={str(p): p for p in gathered},
        outputs=[out / "paper"],
    )
