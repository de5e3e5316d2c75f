"""The paper's study as a plan of commands (`study.py` runs it; docs/evaluation.md, "The study as one script"
says which sentence of the paper each piece follows): its pieces, in order (its flags: study_config.py). Each
piece is one command with the file it leaves when it has finished, the study flags it is made from and the
files it reads; study_run.py records them and decides what runs.

    subsample      study.py subsample: the seeded 1/20 subsample of --data, its composition Table S1 (Setup, A.1)
    train          train.py: the allocations (Table 2 / S4), the ablations of --ablation-base (Figure 3's prefix
                   lengths and LoRA ranks, Table S8's mean aggregation), each other scale's (Table 1)
    export         train.py export: --router-step's checkpoint of the router allocation, every table's (C.1)
    run, score     evaluate.py: every benchmark of every model: the trained runs, Table 1's references (each
                   scale's starting checkpoint and --reference-model), every fixed pair (Table S9), the random
                   pair, the router, shared KV (Table S6); every score with the answer extractor (A.3)
    router         router.py label, train (and eval on --router-eval-data): Appendix E
    profile        profiling.py latency: each run's batch-1 profile (Figure 4), Tables 4 / S7
    tables         evaluate.py report (Tables 1, 2, 3, S2's best, S4, S6, S8, S9, Figure 3), lengths (Table S5),
                   descriptors (Table S2), cost (Figure 4)
    document       study.py report: every table and figure in one document, in the paper's order
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from evaluation.judge import prompt_file
from evaluation.study_config import (
    Model,
    Piece,
    StudyConfig,
    ablation_flags,
    checkpoint,
    extra,
    pairs_of,
    run_name,
    training_data,
)
from evaluation.study_cost import TRAIN_PASSES, branch_dict
from evaluation.study_outputs import analysis_pieces, document_piece, profile_pieces, report_piece
from shell.cli import SEED

# -- the pieces ------------------------------------------------------------------------------------------


def trained_runs(c: StudyConfig) -> list[tuple[str, str, str, str, list[str]]]:
    """(run name, scale, starting checkpoint, Pv:Pl, branch flags) of every run trained: Table 2 / S4's
    allocations, Figure 3's and Table S8's variants of --ablation-base, then each other scale's allocations."""
    runs = [(run_name(a), c.arch, c.model, a, []) for a in c.allocations]
    runs += [
        (f"{run_name(c.ablation_base)}_{a}", c.arch, c.model, c.ablation_base, ablation_flags(a))
        for a in c.ablations
        if a != "none"
    ]
    return runs + [
        (f"{s}_{run_name(a)}", s, folder, a, [])
        for s, folder in pairs_of(c.scale_model, "--scale-model")
        for a in c.scale_allocations
    ]


def subsample_piece(c: StudyConfig) -> list[Piece]:
    if not c.data_fraction:
        return []
    out = Path(c.out) / "data"
    return [
        Piece(
            "subsample the data",
            [
                "study.py",
                "subsample",
                "--data",
                c.data,
                "--fraction",
                str(c.data_fraction),
                *(["--mixture", *c.mixture] if c.mixture else []),
                "--seed",
                str(SEED),
                "--out",
                str(out),
            ],
            out / "meta.json",
            flags={"--data-fraction": c.data_fraction, "--mixture": c.mixture},
            inputs={"--data": Path(c.data), **annotations(Path(c.data))},
            outputs=[out],
        )
    ]


def annotations(meta: Path) -> dict:
    """The annotation files a meta JSON names, as inputs labelled by it (none when it cannot be read yet)."""
    try:
        entries = json.loads(meta.read_text())
        return {
            f"--data's {k}": meta.resolve().parent / v["annotation"] for k, v in entries.items()
        }
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def work(arch: str, alloc: str, branches: list[str] = (), **more) -> dict:
    """What one sample of a piece runs through (study_cost.py): arch, Pv:Pl, branch flags, and more (passes,
    rows)."""
    pv, pl = map(int, alloc.split(":"))
    return {"arch": arch, "pv": pv, "pl": pl, "branches": branch_dict(list(branches))} | more


def train_piece(
    c: StudyConfig, name: str, scale: str, start: str, alloc: str, branches: list[str]
) -> Piece:
    pv, pl = alloc.split(":")
    run, data = Path(c.out) / "runs" / name, training_data(c)
    start_flag = "--model" if start == c.model else "--scale-model"
    # the step every table takes of this run, kept whatever --keep-last is
    keep = ["--keep-step", str(c.router_step)] if checkpoint(c, name).name != "export" else []
    return Piece(
        f"train {name}",
        [
            "train.py",
            "--pv",
            pv,
            "--pl",
            pl,
            *branches,
            "--model",
            start,
            "--data",
            str(data),
            "--out",
            str(run),
            *keep,
            *extra(c, "train"),
        ],
        run / "export" / "model.safetensors",
        "multi",
        flags={start_flag: start, "--train-flags": c.train_flags},
        inputs={start_flag: Path(start), "--data": data},
        outputs=[run],
        resume=run,
        refuse_change=True,
        work=work(scale, alloc, branches, passes=TRAIN_PASSES, rows=("training", None)),
    )


def scale_models(c: StudyConfig) -> list[tuple[str, str]]:
    """(scale, starting checkpoint) of every scale, --model's (--arch) first."""
    return [(c.arch, c.model)] + pairs_of(c.scale_model, "--scale-model")


def evaluated(c: StudyConfig) -> list[Model]:
    """Every model evaluated before the router's: the trained runs (each profiled at batch 1 at the study's
    scale, Figure 4), then Table 1's references: each scale's starting checkpoint and its --reference-model."""
    models = [
        Model(
            name,
            checkpoint(c, name),
            scale=scale,
            profile=[] if scale == c.arch else None,
            work=work(scale, alloc, branches),
        )
        for name, scale, _, alloc, branches in trained_runs(c)
    ]
    refs = [(s, folder) for s, folder in scale_models(c)] + pairs_of(
        c.reference_model, "--reference-model"
    )
    for scale, folder in refs:
        base = f"ref_{scale}_{re.sub(r'[^A-Za-z0-9._-]', '_', Path(folder).name) or 'model'}"
        # unique
        name = base + "".join(f"_{k}" for k in [sum(m.name.startswith(base) for m in models)] if k)
        models.append(
            Model(name, Path(folder), scale=scale, reference=True, work=work(scale, "1:1"))
        )
    return models


def benchmark_pieces(c: StudyConfig, m: Model) -> list[Piece]:
    """Every benchmark of one model: its predictions (`evaluate.py run`), then its score, with the answer
    extractor where --judge-url gives one (A.3)."""
    out, tsv, todo = Path(c.out), Path(c.tsv), []
    judge = (
        [
            "--judge-url",
            c.judge_url,
            "--judge-model",
            c.judge_model,
            "--vlmevalkit",
            c.vlmevalkit,
            "--judge-key-env",
            c.judge_key_env,
        ]
        if c.judge_url
        else []
    )
    for b in c.benchmarks:
        pred, score, data = (
            out / "pred" / m.name / f"{b}.jsonl",
            out / "score" / m.name / f"{b}.json",
            tsv / f"{b}.tsv",
        )
        prompt = prompt_file(Path(c.vlmevalkit), b) if c.vlmevalkit else None
        todo.append(
            Piece(
                f"run {m.name} {b}",
                [
                    "evaluate.py",
                    "run",
                    "--benchmark",
                    b,
                    "--data",
                    str(data),
                    "--model",
                    str(m.folder),
                    *m.flags,
                    "--out",
                    str(pred),
                    # one prompt per generate call, as VLMEvalKit runs InternVL: its greedy answers, not
                    # a padded batch's (docs/evaluation.md); --eval-flags "--batch-size 8" trades that away
                    "--batch-size",
                    "1",
                    *extra(c, "eval"),
                ],
                pred,
                "multi",
                work=m.work and m.work | {"rows": ("tsv", data)},
                flags={"--eval-flags": c.eval_flags},
                inputs={"--tsv": data, "--reference-model" if m.reference else "--model": m.folder},
            )
        )
        todo.append(
            Piece(
                f"score {m.name} {b}",
                [
                    "evaluate.py",
                    "score",
                    "--benchmark",
                    b,
                    "--data",
                    str(data),
                    "--predictions",
                    str(pred),
                    "--out",
                    str(score),
                    *judge,
                ],
                score,
                flags={
                    "--judge-url": c.judge_url,
                    "--judge-model": c.judge_model,
                    "--vlmevalkit": c.vlmevalkit,
                    "--judge-key-env": c.judge_key_env,
                },
                # the prompts the answer extractor is sent: a changed prompt file makes the score again
                inputs={"--tsv": data, "predictions": pred}
                | ({"--vlmevalkit's prompts": prompt} if c.judge_url and prompt else {}),
            )
        )
    return todo


def step_export(c: StudyConfig) -> list[Piece]:
    """With --router-step N, `train.py export` of step N of the router allocation's run, right after the
    training: the checkpoint every table takes of that run (study_config.checkpoint)."""
    ra = run_name(c.router_allocation)
    if not c.router_step:
        return []
    model = checkpoint(c, ra)
    return [
        Piece(
            f"export {ra} step {c.router_step}",
            [
                "train.py",
                "export",
                str(Path(c.out) / "runs" / ra),
                "--step",
                str(c.router_step),
                "--out",
                str(model),
            ],
            model / "model.safetensors",
            "gpu",
            flags={"--router-step": c.router_step},
            inputs={"run": Path(c.out) / "runs" / ra / "export"},
            outputs=[model],
        )
    ]


def router_models(c: StudyConfig) -> tuple[list[Model], list[Model]]:
    """Table 3 and S9's fixed pairs and random pair of the router allocation's checkpoint (the one its dense
    row, Tables 1, 2 and S6 take), and the routed model, evaluated once the router is trained."""
    ra = run_name(c.router_allocation)
    model, pv, pl = checkpoint(c, ra), *map(int, c.router_allocation.split(":"))
    one = work(c.arch, "1:1")  # one branch pair per sample
    models = [
        Model(
            f"{ra}_pair{v}{lb}",
            model,
            ["--vision-branch", str(v), "--language-branch", str(lb)],
            work=one,
        )
        for v in range(pv)
        for lb in range(pl)
    ]
    models.append(Model(f"{ra}_random", model, ["--random-pair", "--seed", str(SEED)], work=one))
    gates = str(Path(c.out) / "router" / "gates")
    return models, [Model(f"{ra}_router", model, ["--router", gates], work=one)]


def router_pieces(c: StudyConfig, model: Path) -> list[Piece]:
    """Appendix E: the router labelled on --router-data, trained (and evaluated on held-out labels)."""
    out, data = Path(c.out) / "router", Path(c.router_data) if c.router_data else training_data(c)
    labels, gates = out / "labels", out / "gates"
    # Appendix E: every pair's NLL of every row, one 1:1 pass each
    rows, (pv, pl) = (
        ("meta", data) if c.router_data else ("training", None),
        map(int, c.router_allocation.split(":")),
    )
    todo = [
        Piece(
            "label router data",
            [
                "router.py",
                "label",
                "--model",
                str(model),
                "--data",
                str(data),
                "--out",
                str(labels),
                *extra(c, "label"),
            ],
            labels / "labels.json",
            "multi",
            flags={"--label-flags": c.label_flags},
            inputs={"model": model, "--router-data": data},
            outputs=[labels],
            work=work(c.arch, "1:1", passes=pv * pl, rows=rows),
        ),
        Piece(
            "train router",
            [
                "router.py",
                "train",
                "--model",
                str(model),
                "--labels",
                str(labels),
                "--out",
                str(gates),
                "--overwrite",
                *extra(c, "router"),
            ],
            gates / "router.safetensors",
            "gpu",
            work=work(c.arch, "1:1", rows=rows),
            flags={"--router-flags": c.router_flags},
            inputs={"model": model, "labels": labels},
            outputs=[gates],
        ),
    ]
    if c.router_eval_data:
        held = out / "heldout"
        todo.append(
            Piece(
                "label held-out data",
                [
                    "router.py",
                    "label",
                    "--model",
                    str(model),
                    "--data",
                    c.router_eval_data,
                    "--out",
                    str(held),
                    *extra(c, "label"),
                ],
                held / "labels.json",
                "multi",
                work=work(c.arch, "1:1", passes=pv * pl, rows=("meta", Path(c.router_eval_data))),
                flags={"--label-flags": c.label_flags},
                inputs={"model": model, "--router-eval-data": Path(c.router_eval_data)},
                outputs=[held],
            )
        )
        todo.append(
            Piece(
                "eval router",
                [
                    "router.py",
                    "eval",
                    "--model",
                    str(model),
                    "--router",
                    str(gates),
                    "--labels",
                    str(held),
                ],
                gates / "eval.json",
                "gpu",
                inputs={"model": model, "gates": gates, "labels": held},
            )
        )
    return todo


def pieces(c: StudyConfig) -> list[Piece]:
    """The study, in order: the data, every run trained, every benchmark of every model (runs, references, Table
    3's checkpoint and its pairs, the router once trained, shared KV), the profiles, then the tables."""
    trained = trained_runs(c)
    models = evaluated(c)
    todo = subsample_piece(c) + [train_piece(c, *run) for run in trained]
    todo += step_export(c) + [p for m in models for p in benchmark_pieces(c, m)]
    table3, routed = router_models(c)
    todo += [p for m in table3 for p in benchmark_pieces(c, m)]
    todo += router_pieces(c, table3[-1].folder) + [
        p for m in routed for p in benchmark_pieces(c, m)
    ]
    models += table3 + routed
    if c.shared_kv_allocation != "none":
        sk = Model(
            f"{run_name(c.shared_kv_allocation)}_sharedkv",
            checkpoint(c, run_name(c.shared_kv_allocation)),
            ["--shared-kv"],
            profile=["--shared-kv"],
            work=work(c.arch, c.shared_kv_allocation),
        )
        todo += benchmark_pieces(c, sk)
        models.append(sk)
    todo += profile_pieces(c, models) + [report_piece(c, models)] + analysis_pieces(c, models)
    return todo + [document_piece(c)]
