"""The paper's study as a plan of commands (`study.py` runs it; docs/evaluation.md, "The study as one script"
says which sentence of the paper each piece follows): its pieces, in order (its flags: study_config.py). Each
piece is one command with the file it leaves when it has finished, the study flags it is made from and the
files it reads; study_run.py records them and decides what runs.

    subsample      study.py subsample: the 1/20 subsample of --data in Table S1's mixture (Setup, A.1)
    train          train.py: the allocations (Table 2 / S4), the ablations of --ablation-base (Figure 3's prefix
                   lengths and LoRA ranks, Table S8's mean aggregation), each other scale's (Table 1)
    run, score     evaluate.py: every benchmark of every model: the trained runs, Table 1's references (each
                   scale's starting checkpoint and --reference-model), Table 3's checkpoint (--router-step's
                   export, its dense model), every fixed pair (Table S9), the random pair, the router, shared KV
                   (Table S6); every score with the answer extractor (A.3)
    router         router.py label, train (and eval on --router-eval-data): Appendix E
    profile        profiling.py latency: each run's batch-1 profile (Figure 4), Tables 4 / S7
    tables         evaluate.py report (Tables 1, 2, 3, S2's best, S4, S6, S8, S9, Figure 3), lengths (Table S5),
                   descriptors (Table S2), cost (Figure 4)
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
    extra,
    pairs_of,
    run_name,
    training_data,
)
from evaluation.study_outputs import analysis_pieces, profile_pieces, report_piece
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
                "--mixture",
                *c.mixture,
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


def train_piece(c: StudyConfig, name: str, start: str, alloc: str, branches: list[str]) -> Piece:
    pv, pl = alloc.split(":")
    run, data = Path(c.out) / "runs" / name, training_data(c)
    start_flag = "--model" if start == c.model else "--scale-model"
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
            *extra(c, "train"),
        ],
        run / "export" / "model.safetensors",
        "multi",
        flags={start_flag: start, "--train-flags": c.train_flags},
        inputs={start_flag: Path(start), "--data": data},
        outputs=[run],
        resume=run,
        refuse_change=True,
    )


def scale_models(c: StudyConfig) -> list[tuple[str, str]]:
    """(scale, starting checkpoint) of every scale, --model's (--arch) first."""
    return [(c.arch, c.model)] + pairs_of(c.scale_model, "--scale-model")


def evaluated(c: StudyConfig) -> list[Model]:
    """Every model evaluated before the router's: the trained runs (each profiled at batch 1 at the study's
    scale, Figure 4), then Table 1's references: each scale's starting checkpoint and its --reference-model."""
    out = Path(c.out)
    models = [
        Model(
            name,
            out / "runs" / name / "export",
            scale=scale,
            profile=[] if scale == c.arch else None,
        )
        for name, scale, *_ in trained_runs(c)
    ]
    refs = [(s, folder) for s, folder in scale_models(c)] + pairs_of(
        c.reference_model, "--reference-model"
    )
    for scale, folder in refs:
        base = f"ref_{scale}_{re.sub(r'[^A-Za-z0-9._-]', '_', Path(folder).name) or 'model'}"
        # unique
        name = base + "".join(f"_{k}" for k in [sum(m.name.startswith(base) for m in models)] if k)
        models.append(Model(name, Path(folder), scale=scale, reference=True))
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
                    *extra(c, "eval"),
                ],
                pred,
                "multi",
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


def router_models(c: StudyConfig) -> tuple[list[Piece], list[Model], list[Model]]:
    """Table 3 and S9's checkpoint, the router allocation's end-of-run export or --router-step's export (then its
    dense model is evaluated too: every row of Table 3 is that checkpoint's), its fixed pairs and random pair; and
    the routed model, evaluated once the router is trained."""
    out, ra = Path(c.out), run_name(c.router_allocation)
    model, todo, models = out / "runs" / ra / "export", [], []
    if c.router_step:
        model = out / "router" / f"model_step_{c.router_step}"
        todo.append(
            Piece(
                f"export {ra} step {c.router_step}",
                [
                    "train.py",
                    "export",
                    str(out / "runs" / ra),
                    "--step",
                    str(c.router_step),
                    "--out",
                    str(model),
                ],
                model / "model.safetensors",
                "gpu",
                flags={"--router-step": c.router_step},
                inputs={"run": out / "runs" / ra / "export"},
                outputs=[model],
            )
        )
        models.append(Model(f"{ra}_step{c.router_step}", model))
    pv, pl = map(int, c.router_allocation.split(":"))
    models += [
        Model(f"{ra}_pair{v}{lb}", model, ["--vision-branch", str(v), "--language-branch", str(lb)])
        for v in range(pv)
        for lb in range(pl)
    ]
    models.append(Model(f"{ra}_random", model, ["--random-pair", "--seed", str(SEED)]))
    return todo, models, [Model(f"{ra}_router", model, ["--router", str(out / "router" / "gates")])]


def router_pieces(c: StudyConfig, model: Path) -> list[Piece]:
    """Appendix E: the router labelled on --router-data, trained (and evaluated on held-out labels)."""
    out, data = Path(c.out) / "router", Path(c.router_data) if c.router_data else training_data(c)
    labels, gates = out / "labels", out / "gates"
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
    out, trained = Path(c.out), trained_runs(c)
    models = evaluated(c)
    todo = subsample_piece(c) + [
        train_piece(c, name, start, a, b) for name, _, start, a, b in trained
    ]
    todo += [p for m in models for p in benchmark_pieces(c, m)]
    export, table3, routed = router_models(c)
    todo += export + [p for m in table3 for p in benchmark_pieces(c, m)]
    todo += router_pieces(c, table3[-1].folder) + [
        p for m in routed for p in benchmark_pieces(c, m)
    ]
    models += table3 + routed
    if c.shared_kv_allocation != "none":
        sk = Model(
            f"{run_name(c.shared_kv_allocation)}_sharedkv",
            out / "runs" / run_name(c.shared_kv_allocation) / "export",
            ["--shared-kv"],
            profile=["--shared-kv"],
        )
        todo += benchmark_pieces(c, sk)
        models.append(sk)
    return todo + profile_pieces(c, models) + [report_piece(c, models)] + analysis_pieces(c, models)
