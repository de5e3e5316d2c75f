"""The score files `evaluate.py score` writes, read back for the report: each file's record (its configuration,
checkpoint, step, answer extractor, weight format), the configurations they hold, and the rules that keep one
report honest (one checkpoint per Table 3, one answer extractor, one weight format)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from evaluation.judge import JUDGED
from evaluation.scoring import BENCHMARKS
from evaluation.tsv import DataError
from shell.files import regular_file


def dense(pv: int, pl: int) -> tuple:
    """The configuration of all branches in the paper's parameterisation."""
    return pv, pl, None, None, False, ()


def is_dense(c: tuple) -> bool:
    return len(c) >= 6 and c[2] is None and c[3] is None and not c[4] and not c[5]


def config_label(c: tuple) -> str:
    """ "2:4", "4:1 vit_prefix_len=72", "4:4 pair (0,1)", "4:4 sharedKV", "4:4 router R"; a reference
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


@dataclass
class Scores:
    """One scale's score files: {configuration: {benchmark: score}} (a reference model's configuration carries
    the model as a 7th element), Table 3's routed and random-pair runs apart as {(pv, pl, policy): scores}, the
    dense scores of Table 3's checkpoint where the grid's configuration is another checkpoint's (a --router-step
    export beside the end of the run), each key's checkpoint, each checkpoint's training step, and per answer
    extractor (None: none) the first file of A.3's five benchmarks scored with it."""

    runs: dict = field(default_factory=dict)
    policies: dict = field(default_factory=dict)
    table3_dense: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    judges: dict = field(default_factory=dict)
    quants: dict = field(default_factory=dict)
    dtypes: dict = field(default_factory=dict)


def read_record(name: str, is_reference: bool) -> dict:
    """One score file: its benchmark, score, configuration key, checkpoint, step, Table 3 policy and extractor."""
    try:
        text = regular_file(name).read_text().strip()  # a FIFO would block the read
        s = json.loads(text.splitlines()[-1])
        bench, value = s["benchmark"], s["score"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
            raise ValueError(f"score must be a number in [0, 100], got {value!r}")  # NaN is none
        # Table S8 apart
        key = (
            int(s["pv"]),
            int(s["pl"]),
            s.get("vision_branch"),
            s.get("language_branch"),
            bool(s.get("shared_kv")),
            tuple(sorted((s.get("branches") or {}).items())),
        )
    except (
        OSError,
        IndexError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        RecursionError,
    ) as e:
        raise DataError(
            f"{name}: not a score file with benchmark, score, pv, pl ({type(e).__name__}: {e})"
        ) from None
    if bench not in BENCHMARKS:
        raise DataError(f"{name}: unknown benchmark {bench!r}")
    policy = (
        None  # a routed or random-pair run goes to Table 3 alone, beside its dense configuration
    )
    if s.get("router") or s.get("random_pair") is not None:
        policy = (
            f"router {s['router']}" if s.get("router") else f"random pair (seed {s['random_pair']})"
        )
        key = (key[0], key[1], policy)
    if is_reference:
        # a reference model: a row of its own
        key = key + (str(s.get("model") or model_of(s) or name),)
    return {
        "file": name,
        "bench": bench,
        "value": float(value),
        "key": key,
        "checkpoint": model_of(s),
        "step": s.get("model_step"),
        "policy": policy,
        "judge": s.get("judge_model"),
        "reference": is_reference,
        "quant": s.get("quant"),
        "dtype": s.get("dtype"),
    }


def table_3_checkpoints(records: list[dict]) -> dict[tuple, str]:
    """{(pv, pl): the checkpoint of Table 3's policy rows}; rows of two checkpoints are refused (Table 3: "All
    rows use the same checkpoint"), never averaged together."""
    out: dict[tuple, tuple] = {}
    for r in records:
        if r["policy"] and not r["reference"]:
            at = r["key"][:2]
            if at in out and out[at][0] != r["checkpoint"]:
                raise DataError(
                    f"{r['file']}: Table 3 at {at[0]}:{at[1]} holds rows of checkpoint {r['checkpoint']} "
                    f"and of {out[at][0]} ({out[at][1]}): all its rows use one checkpoint"
                )
            out.setdefault(at, (r["checkpoint"], r["file"]))
    return {k: v[0] for k, v in out.items()}


def read_scores(files: list[str], reference: list[str] = ()) -> Scores:
    """The score files of one scale (read_record), refused where two checkpoints would share a row: a second
    score of one benchmark for one configuration, or the scores of two checkpoints for one configuration (a
    1:1 run and InternVL3.5-Instruct would land in one row). One exception, Table 3's own: the dense scores of
    its policies' checkpoint, when the configuration's grid row is another checkpoint (the end of the run
    beside --router-step's export), are kept apart as Table 3's dense row."""
    records = [read_record(f, False) for f in files] + [read_record(f, True) for f in reference]
    table3 = table_3_checkpoints(records)
    grid: dict[tuple, set] = {}  # dense configuration -> the checkpoints scored for it
    for r in records:
        if is_dense(r["key"]) and not r["reference"]:
            grid.setdefault(r["key"], set()).add(r["checkpoint"])
    for r in records:
        r["into"], r["row"] = ("policies" if r["policy"] else "runs"), r["key"]
        if (
            r["key"] in grid
            and len(grid[r["key"]]) > 1
            and table3.get(r["key"][:2]) == r["checkpoint"]
        ):
            r["into"], r["row"] = "table3_dense", r["key"][:2]
    check_one_checkpoint(records)
    s = Scores()
    for r in records:
        s.steps.setdefault(r["checkpoint"], r["step"])
        if r["bench"] in JUDGED:
            s.judges.setdefault(r["judge"], r["file"])
        s.quants.setdefault(r["quant"], r["file"])
        if r["dtype"] is not None:  # a score file from before the predictions recorded it: unknown
            s.dtypes.setdefault(r["dtype"], r["file"])
        into, key = getattr(s, r["into"]), r["row"]
        s.models[key] = r["checkpoint"]
        if r["bench"] in into.setdefault(key, {}):
            raise DataError(
                f"{r['file']}: a second {r['bench']} score for configuration {config_label(r['key'])}"
            )
        into[key][r["bench"]] = r["value"]
    return s


def shared_answer_extractor(scales: list[tuple[str, Scores]]) -> str | None:
    """The answer extractor of every score of A.3's five benchmarks (None: none); a report mixing scores with
    and without one, or of two, is refused (Table S6: "Both variants use the same gpt-4o-2024-11-20 answer
    extractor wherever API extraction is required")."""
    judges = {j: f for _, s in scales for j, f in s.judges.items()}
    if len(judges) > 1:
        (a, fa), (b, fb) = list(judges.items())[:2]
        say = lambda j: f"with answer extractor {j}" if j else "without an answer extractor"  # noqa: E731
        raise DataError(
            f"{fb} was scored {say(b)}, {fa} {say(a)}: one report, one extractor (A.3); score them "
            f"again alike (evaluate.py score --judge-url ... --judge-model ...)"
        )
    return next(iter(judges), None)


def shared_weight_format(scales: list[tuple[str, Scores]]) -> str | None:
    """The weights' format of every score (--quant of evaluate.py run; None: the checkpoint's own weights); a
    report mixing formats is refused, as one mixing answer extractors: a row of quantized weights beside
    full-precision ones would put the quantization's error into the comparison of configurations. So is one
    mixing dtypes (--dtype: fp32 beside bf16), which no row of the tables shows."""
    dtypes = {d: f for _, s in scales for d, f in s.dtypes.items()}
    # fp32 beside bf16 is a precision's difference too, as quantized beside full
    if len(dtypes) > 1:
        (a, fa), (b, fb) = list(dtypes.items())[:2]
        raise DataError(
            f"{fb} was predicted in {b}, {fa} in {a}: one report, one precision; run them again alike "
            f"(evaluate.py run --dtype ...)"
        )
    quants = {q: f for _, s in scales for q, f in s.quants.items()}
    if len(quants) > 1:
        (a, fa), (b, fb) = list(quants.items())[:2]
        say = lambda q: f"with --quant {q}" if q else "without --quant"  # noqa: E731
        raise DataError(
            f"{fb} was predicted {say(b)}, {fa} {say(a)}: one report, one weight format; run them "
            f"again alike (evaluate.py run --quant ...)"
        )
    return next(iter(quants), None)


def check_one_checkpoint(records: list[dict]) -> None:
    """One checkpoint per row (a 1:1 run and InternVL3.5-Instruct would land in one row): where the files of one
    row hold several checkpoints, the few that disagree with most of them are named as the foreign ones, whatever
    the order they came in (the file read second was blamed before, often the genuine one); a tie names both."""
    held: dict[tuple, dict] = {}  # (table, row) -> checkpoint -> its files
    for r in records:
        held.setdefault((r["into"], r["row"]), {}).setdefault(r["checkpoint"], []).append(
            str(r["file"])
        )
    for (_, row), by_model in held.items():
        if len(by_model) < 2:
            continue
        fix = (
            "one checkpoint per configuration (pass a reference model with --reference; other model sizes with "
            "--scale)"
        )
        label = config_label(row) if len(row) > 2 else f"{row[0]}:{row[1]}"
        ranked = sorted(by_model.items(), key=lambda m: -len(m[1]))
        (most, theirs), others = ranked[0], ranked[1:]
        if len(theirs) > len(others[0][1]):
            foreign = [f for _, fs in others for f in fs]
            raise DataError(
                f"{', '.join(foreign)}: score(s) of checkpoint {', '.join(str(m) for m, _ in others)} for "
                f"configuration {label}, whose other {len(theirs)} score files ({theirs[0]}, ...) are "
                f"checkpoint {most}'s: {fix}"
            )
        sides = "; ".join(f"checkpoint {m} ({', '.join(fs)})" for m, fs in ranked)
        raise DataError(
            f"configuration {label} holds scores of {len(ranked)} checkpoints: {sides}: {fix}"
        )
