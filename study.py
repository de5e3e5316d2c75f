"""The paper's whole study as one resumable script (docs/evaluation.md, "The study as one script", says which
sentence of the paper each piece follows): the data subsample, the nine allocations, the Figure 3 and Table S8
ablations, Table 1's other scales and references, every benchmark of every model with the answer extractor,
Table 3's checkpoint with its fixed pairs, random pair and router (Appendix E), shared KV (Table S6), the
latency profiles, then the report (Tables 1, 2, 3, S2's best, S4, S6, S8, S9, Figure 3), Table S5, Table S2 and
Figure 4.

    python study.py --model InternVL3_5-1B-Pretrained --data internvl35_sft.json --tsv ~/LMUData --out study --plan
    python study.py --model InternVL3_5-1B-Pretrained --data internvl35_sft.json --tsv ~/LMUData --out study \\
        --scale-model 2b=InternVL3_5-2B-Pretrained --reference-model 1b=InternVL3_5-1B-Instruct \\
        --judge-url https://api.openai.com/v1 --judge-model gpt-4o-2024-11-20 --vlmevalkit VLMEvalKit
    python study.py ... --launcher slurm --nodes 4 --slurm-flags "--partition gpu --time 24:00:00"
    python study.py subsample --data internvl35_sft.json --out sub/        # the first piece alone (data/subsample.py)
    python study.py report --out study      # study/paper/report.md: every table and figure, the paper's order

It runs the commands, one after the other, as a user would: study.py subsample, train.py, evaluate.py,
router.py, profiling.py, under torchrun on this machine or through slurm/parvl.sbatch on a Slurm cluster. It
is no workflow engine: each piece is one command with the file it leaves when it has finished
(evaluation/study_plan.py), and records what it was made from; a piece done and made from the same is skipped,
one made from something else is made again (a trained run: refused in one line), and every command resumes by
itself (train.py --resume, `evaluate.py run` and `router.py label` keep their finished parts), so after an
interrupt, a failure or a change of flags the same command goes on where it must (evaluation/study_run.py).
--plan prints what would run and what is done, and runs nothing.

    OUT/data/              the subsample (meta.json)              OUT/runs/2x2/     train.py's run (export/ the model)
    OUT/pred/RUN/B.jsonl   predictions     OUT/score/RUN/B.json   scores            OUT/router/       labels, gates
    OUT/profile/RUN.json   latency         OUT/report/            report.md, .json  OUT/tables/       S5, S2, Fig. 4
    OUT/made/              what each piece was made from          OUT/replaced/N/   what a piece made before
"""

from __future__ import annotations

import shell.early  # noqa: F401  first: a Ctrl-C during the imports below is one line, exit 130

# isort: split

import shlex
import sys
from pathlib import Path

from data.subsample import SubsampleConfig, subsample
from evaluation.judge import prompt_file
from evaluation.study_config import GLOBAL_BATCH, Piece, StudyConfig, pairs_of, train_flag
from evaluation.study_cost import gpu_hours, piece_flops, samples
from evaluation.study_plan import pieces
from evaluation.study_report import StudyReportConfig, study_report
from evaluation.study_run import Plan, execute, launch
from shell.cli import command, log
from shell.flags import Command, dispatch


def check_inputs(c: StudyConfig) -> None:
    """The folders and files the flags name, before anything runs (exit 1): --model, --tsv, each scale's and
    reference's checkpoint, --tokenizer, --vlmevalkit; --data, --router-data, --router-eval-data and every
    benchmark's TSV (a missing one found now, not after the training)."""
    folders = (
        [(c.model, "--model"), (c.tsv, "--tsv")]
        + [(d, f"--scale-model {s}=") for s, d in pairs_of(c.scale_model, "--scale-model")]
        + [
            (d, f"--reference-model {s}=")
            for s, d in pairs_of(c.reference_model, "--reference-model")
        ]
        + [(x, f) for x, f in ((c.tokenizer, "--tokenizer"), (c.vlmevalkit, "--vlmevalkit")) if x]
    )
    for path, what in folders:
        if not Path(path).is_dir():
            raise ValueError(f"{what}{'' if what.endswith('=') else ' '}{path}: not a folder")
    files = [
        (c.data, "--data"),
        (c.router_data, "--router-data"),
        (c.router_eval_data, "--router-eval-data"),
    ]
    for path, what in files:
        if path and not Path(path).is_file():
            raise ValueError(f"{what} {path}: no such file (a meta JSON)")
    check_vlmevalkit(c)
    if missing := [b for b in c.benchmarks if not (Path(c.tsv) / f"{b}.tsv").is_file()]:
        raise ValueError(
            f"--tsv {c.tsv}: no {', '.join(f'{b}.tsv' for b in missing)} there (VLMEvalKit's TSV of "
            f"each of --benchmarks)"
        )


def check_vlmevalkit(c: StudyConfig) -> None:
    """--vlmevalkit must be a VLMEvalKit checkout: the file each judged benchmark's prompts come from is there
    (checked at --plan too, where the folder exists: found after the training, it failed the first score)."""
    if not c.judge_url or not c.vlmevalkit:
        return
    files = {prompt_file(Path(c.vlmevalkit), b) for b in c.benchmarks} - {None}
    if missing := sorted(str(f) for f in files if not f.is_file()):
        raise ValueError(
            f"--vlmevalkit {c.vlmevalkit}: not a VLMEvalKit checkout (no {', '.join(missing)}); give the "
            f"folder of git clone https://github.com/open-compass/VLMEvalKit"
        )


def scores_outside_plan(c: StudyConfig, report: Piece) -> list[Path]:
    """Score files under OUT/score that this plan did not make (an earlier plan's, another --router-allocation's):
    the report leaves them out, and study.py names them."""
    planned = {str(p) for p in report.inputs.values()}
    return [p for p in sorted((Path(c.out) / "score").glob("*/*.json")) if str(p) not in planned]


def run_piece(c: StudyConfig, plan: Plan, p: Piece, head: str) -> None:
    """One piece, decided now (what came before it in this call has run): skipped, recorded, or run (what it made
    before moved aside first when it is made again), then recorded."""
    status, why = plan.status(p)
    if status == "done":
        log(f"{head}: done ({p.done})", sys.stdout)
        return
    if status == "redo":
        log(
            f"{head}: made again ({why}); what it made before is kept in {plan.move_aside(p)}",
            sys.stdout,
        )
    if p.name == "report" and (others := scores_outside_plan(c, p)):
        log(
            f"{head}: leaves out {len(others)} score file(s) this plan did not make: {' '.join(map(str, others))}",
            sys.stdout,
        )
    for o in p.outputs:  # the folders a command writes its files into (score --out needs it)
        o.parent.mkdir(parents=True, exist_ok=True)
    cmd = launch(c, p)
    log(
        f"{head}: {shlex.join(cmd)}" + (f" > {shlex.quote(str(p.stdout))}" if p.stdout else ""),
        sys.stdout,
    )
    if (code := execute(cmd, p.stdout)) != 0:
        raise ValueError(
            f"{p.name} failed (exit {code}; its own line above); the same study.py command resumes from "
            f"this piece"
        )
    if not p.done.exists():
        raise ValueError(f"{p.name} ended without writing {p.done}")
    plan.save(p)


def training(c: StudyConfig) -> tuple[str, float]:
    """Where the training rows are counted: the subsample once drawn, else --data and --data-fraction."""
    drawn = Path(c.out) / "data" / "meta.json"
    return (str(drawn), 0.0) if c.data_fraction and drawn.is_file() else (c.data, c.data_fraction)


def check_router_step(c: StudyConfig) -> None:
    """--router-step past the last step of the router allocation's run (one epoch of the training rows in
    --global-batch steps, or --max-steps) is never saved: refused before the training, at --plan too (exit 1),
    wherever the rows can be counted."""
    rows = samples({"rows": ("training", None)}, training(c)) if c.router_step else None
    if rows is None:
        return
    batch = int(train_flag(c, "--global-batch") or GLOBAL_BATCH)
    steps = int(train_flag(c, "--max-steps") or 0) or rows // batch
    if c.router_step > steps:
        raise ValueError(
            f"--router-step {c.router_step}: the {c.router_allocation} run has {steps} steps ({rows:,} "
            f"training rows in steps of {batch}, or --max-steps); give --router-step 0 (its end) or a saved "
            f"step up to {steps}"
        )


def prices(c: StudyConfig, todo: list[Piece]) -> list[float | None]:
    """Each piece's FLOPs (evaluation/study_cost.py), the training data counted from the subsample once drawn."""
    return [piece_flops(p.work, training(c)) for p in todo]


def price_lines(c: StudyConfig, todo: list[Piece], flops: list[float | None]) -> list[str]:
    """The total, by kind of piece, in GPU-hours at --mfu of --peak-tflops; the pieces of unknown size named."""
    h = lambda f: hours(gpu_hours(f, c.mfu, c.peak_tflops))  # noqa: E731
    names = {"train": "training", "run": "benchmark runs", "label": "router labels"}
    kinds: dict[str, float] = dict.fromkeys([*names, "the rest"], 0.0)
    for p, f in zip(todo, flops):
        first = p.name.split()[0] if p.name != "train router" else ""
        kinds[names.get(first) and first or "the rest"] += f or 0.0
    lines = [
        f"estimated compute: {sum(kinds.values()) / 1e18:,.1f} EFLOP, {h(sum(kinds.values()))} GPU-hours at "
        f"MFU {c.mfu} of {c.peak_tflops:g} TFLOP/s ("
        + ", ".join(f"{names.get(k, k)} {h(v)}" for k, v in kinds.items())
        + "); every sample priced at Table S3's workload (evaluation/study_cost.py)"
    ]
    if unknown := [p.name for p, f in zip(todo, flops) if f is None]:
        lines.append(
            f"not priced, their samples not countable yet (--data, a TSV or --router-data missing): "
            f"{len(unknown)} pieces ({unknown[0]}, ...)"
        )
    return lines


def hours(h: float) -> str:
    """GPU-hours as --plan prints them: one decimal, or one significant digit below 0.1 (a profile)."""
    return f"{h:,.1f}" if h >= 0.1 else f"{h:.1g}"


def print_plan(c: StudyConfig, todo: list[Piece], statuses: list[tuple[str, str | None]]) -> None:
    flops = prices(c, todo)
    for k, (p, (status, why), f) in enumerate(zip(todo, statuses, flops), 1):
        # quoted as every path of the command line is: a target with spaces is one word
        head = f"[{k}/{len(todo)}] {p.name}"
        redirect = f" > {shlex.quote(str(p.stdout))}" if p.stdout else ""
        line = {
            "done": f"done ({p.done})",
            "after": f"done; made again if what {why} leaves changes",
            "run": f"would run {shlex.join(launch(c, p))}{redirect}",
            "redo": f"would be made again ({why}): {shlex.join(launch(c, p))}{redirect}",
        }[status]
        # priced pieces only: those of unknown size are named in the total's line
        cost = f" [{hours(gpu_hours(f, c.mfu, c.peak_tflops))} GPU-h]" if f else ""
        log(f"{head}: {line}{cost}", sys.stdout)
    if others := scores_outside_plan(c, next(p for p in todo if p.name == "report")):
        log(
            f"the report would leave out {len(others)} score file(s) this plan did not make: "
            f"{' '.join(map(str, others))}",
            sys.stdout,
        )
    for line in price_lines(c, todo, flops):
        log(line, sys.stdout)


def study(c: StudyConfig) -> int:
    if not c.plan:
        check_inputs(c)
    check_router_step(c)
    if c.plan and c.vlmevalkit and Path(c.vlmevalkit).exists():
        check_vlmevalkit(c)  # a plan checks no missing input, but a wrong one
    todo = pieces(c)
    plan = Plan(c, todo)
    # a refused change: before anything runs
    statuses = [plan.status(p, planning=True) for p in todo]
    if c.plan:
        print_plan(c, todo, statuses)
        return 0
    for k, p in enumerate(todo, 1):
        run_piece(c, plan, p, f"[{k}/{len(todo)}] {p.name}")
    log(f"the study is complete: {Path(c.out) / 'paper' / 'report.md'}", sys.stdout)
    return 0


DESCRIPTION = __doc__.split("\n\n")[0]
PROG = "study.py"
COMMANDS = {
    None: Command(
        StudyConfig,
        study,
        # one study per OUT, held for the whole call (a second is refused before its first piece); --plan writes none
        writes=lambda c: None if c.plan else Path(c.out),
        interrupted=lambda c: "the finished pieces stay; the same command resumes",
    ),
    "subsample": Command(
        SubsampleConfig,
        subsample,
        "the study's first piece: a seeded subsample of an SFT collection, its composition "
        "printed as Table S1 (--mixture: stratified)",
        writes=lambda c: Path(c.out),
        interrupted=lambda c: "meta.json is written last: the same command draws again",
    ),
    "report": Command(
        StudyReportConfig,
        study_report,
        "one document of every table and figure of the study, in the paper's order",
        writes=lambda c: Path(c.doc) if c.doc else Path(c.out) / "paper",
    ),
}


def main(argv=None) -> int:
    return dispatch(DESCRIPTION, COMMANDS, argv, PROG)


if __name__ == "__main__":
    command(main)
