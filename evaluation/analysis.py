"""The paper's analyses of finished runs beyond the score tables: Table S5 (how long the answers of
two configurations are), Table S2's workload descriptors (what each benchmark asks) and Figure 4
(each configuration's score against its batch-1 latency and peak memory, from `evaluate.py report`'s
report.json and `profiling.py latency --json`).

Table S5. Each answer is re-tokenised (the text `evaluate.py run` kept, not its token count, so every configuration
is measured alike) with --tokenizer, read as the paper's Qwen2Tokenizer (use_fast=False) reads its folder, else with
the checkpoint's tokenizer; no special tokens are added (B.4: add_special_tokens=False). An answer whose
re-tokenised length is at or above the near-cap threshold (Appendix B.4: 4090 of the 4096-token budget) is a
truncated run-on, not a length, and is left out: the clean mean of a configuration is over its answers below the
threshold, the paired difference over the rows below it in both; only rows both configurations
answered, from the same TSV and budgets, pair. Domain and overall columns average their benchmarks
with equal weight (Eq. A3's grouping). The intervals come from one benchmark-balanced paired
bootstrap: each resample draws every benchmark's paired rows with replacement and takes each
benchmark's mean difference; a domain's (and All's) resample averages its benchmarks' with equal
weight; the 2.5th and 97.5th percentiles of 10,000 resamples (seed 42, the paper's) bound each
column's difference (the paper's [-3.1, 13.3] is the Math domain's).

Table S2 (Appendix B.1). Per benchmark TSV: the mean source-image pixels of a row (width x height
summed over its images, before tiling: read from each image's header), the mean question and
reference lengths in tokens (the `question` cell and the reference: MMMU's `explanation`,
LogicVista's `reasoning`, otherwise `answer`, an empty one 0 tokens; before any prompt template),
next to the best Pv:Pl of `evaluate.py report` when its report.json is given.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.processor import ImageError, open_base64
from evaluation.lengths import (
    NEAR_CAP,
    TOKENIZER_HELP,
    counting_tokenizer,
    read_predictions,
    row_lengths,
)
from evaluation.paper_tables import HEAD_NAMES
from evaluation.score_files import config_label
from evaluation.scoring import BENCHMARKS
from evaluation.tables import COLUMNS
from evaluation.tsv import DataError, as_list, read_tsv
from shell.cli import pyplot
from shell.files import regular_file, write_text, writing
from shell.flags import flag

# Table S2's reference column (Appendix B.1): MMMU's explanation, LogicVista's reasoning, else the answer
REFERENCE = {"MMMU_DEV_VAL": "explanation", "LogicVista": "reasoning"}


def best_label(record: dict) -> str:
    """The report's label of the configuration a prediction's record names (score_files.config_label)."""
    return config_label(
        (
            record.get("pv"),
            record.get("pl"),
            record.get("vision_branch"),
            record.get("language_branch"),
            bool(record.get("shared_kv")),
            tuple(sorted((record.get("branches") or {}).items())),
        )
    )


def best_responses(
    files: list, best: dict, encode, near_cap: int = NEAR_CAP, rule: str = "retokenised"
) -> tuple[dict, list[str]]:
    """Table S2's last column: per benchmark the response lengths of the predictions file whose record
    is that benchmark's best configuration in report.json (`best`: {benchmark: label}); files of other
    configurations are left out and named. A routed or random-pair file is no configuration of the
    report's grid; two files of one benchmark's best are refused."""
    responses, left = {}, []
    for f in files:
        ((bench, (_, rows)),) = read_predictions([f]).items()
        rec = rows[0]
        label = None if rec.get("router") or rec.get("random_pair") is not None else best_label(rec)
        if best.get(bench) is None or label != best[bench]:
            left.append(
                f"{f} ({label or 'routed or random-pair'}; the best of {bench}: {best.get(bench) or 'none'})"
            )
            continue
        if bench in responses:
            raise DataError(
                f"{f}: a second predictions file of {bench}'s best configuration {label}"
            )
        responses[bench] = row_lengths(rows, encode, near_cap, rule)
    return responses, left


def descriptors(
    tsvs: list, encode, best: dict | None = None, responses: dict | None = None
) -> dict[str, dict]:
    """Table S2's columns per benchmark, from VLMEvalKit TSVs named <benchmark>.tsv (VLMEvalKit's own
    names): source pixels, question tokens, reference tokens (Appendix B.1: MMMU's `explanation`,
    LogicVista's `reasoning`, otherwise `answer`; an empty reference counts 0 tokens); `best`:
    report.json's {column: "Pv:Pl"}; `responses`: the best configuration's answer lengths
    ({benchmark: {index: tokens, None at the near cap}}, best_responses), whose mean over the answers
    below the near cap is a last column."""
    out = {}
    for path in map(Path, tsvs):
        bench = path.stem
        if bench not in BENCHMARKS:
            raise DataError(
                f"{path}: not a benchmark's TSV name ({', '.join(b + '.tsv' for b in BENCHMARKS)})"
            )
        ref = REFERENCE.get(bench, "answer")
        rows, pixels = read_tsv(path, ("index", "question", ref, "image")), []
        for r in rows:
            try:
                sizes = [open_base64(b, str(k)).size for k, b in enumerate(as_list(r["image"]))]
            except ImageError as e:
                raise DataError(f"{path}: row {r['index']}: unreadable image ({e})") from None
            pixels.append(sum(w * h for w, h in sizes))
        mine = (responses or {}).get(bench)
        clean = [n for n in (mine or {}).values() if n is not None]
        out[bench] = {
            "rows": len(rows),
            "pixels": float(np.mean(pixels)),
            "question_tokens": float(np.mean([len(encode(r["question"] or "")) for r in rows])),
            "reference": ref,
            "reference_tokens": float(np.mean([len(encode(r[ref] or "")) for r in rows])),
            "empty_references": sum(r[ref] is None for r in rows),
            "best": (best or {}).get(bench),
            "response_tokens": float(np.mean(clean)) if clean else None,
            "responses_near_cap": None if mine is None else len(mine) - len(clean),
        }
    return out


def descriptors_markdown(table: dict, left: list[str] = ()) -> str:
    """Table S2 in the paper's columns (dataset, source pixels, question and reference tokens, the best Pv:Pl),
    then what it does not print: the rows, the reference column, the best configuration's response tokens."""
    md = [
        "Table S2: Dataset workload descriptors and empirically best branch-count configurations (from Table S4; "
        "ties favor the lower-FLOP configuration).",
        "",
        "| Dataset | Avg. Source Pixels | Avg. Question Tokens | Avg. Reference Tokens | Best Empirical Pv:Pl | rows "
        "| reference column | its response tokens |",
        "|" + " --- |" * 8,
    ]
    for b, d in table.items():
        response = "-" if d["response_tokens"] is None else f"{d['response_tokens']:.1f}"
        if d["responses_near_cap"]:
            response += f" ({d['responses_near_cap']} near cap left out)"
        md.append(
            f"| {HEAD_NAMES.get(b, b)} | {d['pixels']:,.0f} | {d['question_tokens']:.1f} | "
            f"{d['reference_tokens']:.1f} | "
            f"{d['best'] or '-'} | {d['rows']} | {d['reference']} ({d['empty_references']} empty) | {response} |"
        )
    md += [f"Left out: {f}" for f in left]
    return "\n".join(md) + "\n"


def profile_key(pv: int, pl: int, shared_kv: bool, branches: dict | None) -> tuple:
    """What one Figure 4 point is profiled as: Pv:Pl, shared KV and the branch parameterisation."""
    return pv, pl, bool(shared_kv), tuple(sorted((branches or {}).items()))


def profile_command(key: tuple) -> str:
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in key[3])
    return f"profiling.py latency --pv {key[0]} --pl {key[1]}{flags} --batch 1{' --shared-kv' if key[2] else ''}"


def score_cost(report: dict, latency: dict, column: str = "All") -> tuple[list[dict], list[str]]:
    """Figure 4's points: each configuration of report.json with a score in `column`, beside the
    batch-1 per-sample latency and peak memory `profiling.py latency --json` measured for that very
    configuration (Pv:Pl, shared KV and branch parameterisation: a Figure 3 or Table S8 variant is its
    own profile). A configuration without its own profile is named and left out, never given
    another's; profiles of one configuration on two architectures are refused. Returns (points, the
    lines naming what was left out)."""
    profile: dict[tuple, dict] = {}
    for r in latency["rows"]:
        if r["batch"] != 1:
            continue
        key = profile_key(r["pv"], r["pl"], r["shared_kv"], r.get("branches"))
        if key in profile and profile[key].get("arch") != r.get("arch"):
            raise DataError(
                f"the profiles hold {profile_command(key).split(' --batch')[0]} on two architectures "
                f"({profile[key].get('arch')} and {r.get('arch')}): pass the one the report's runs use"
            )
        profile.setdefault(key, r)
    points, left = [], []
    for c in report["configs"]:
        if (
            c["vision_branch"] is not None
            or c["language_branch"] is not None
            or c["scores"].get(column) is None
        ):
            continue  # fixed-pair diagnostics and partial runs have no point
        if c.get("reference"):
            left.append(
                f"{c['label']}: a reference model (report --reference), not a configuration of the study"
            )
            continue
        key = profile_key(c["pv"], c["pl"], c["shared_kv"], c.get("branches"))
        if key not in profile:
            left.append(f"{c['label']}: no batch-1 profile of its own ({profile_command(key)})")
            continue
        points.append(
            {
                "label": c["label"],
                "score": c["scores"][column],
                "latency_s": profile[key]["latency_s"],
                "peak_gib": profile[key]["peak_gib"],
                "arch": profile[key].get("arch"),
            }
        )
    if not points:
        raise DataError(
            f"no configuration of the report has both a {column} score and its own batch-1 profile"
            + (f" ({'; '.join(left)})" if left else "")
        )
    return cost_ratios(points, profile.get(profile_key(1, 1, False, {})), left), left


def cost_ratios(points: list[dict], base: dict | None, left: list[str]) -> list[dict]:
    """Figure 4's axes as the paper states them, ratios to 1:1 ("increasing per-sample latency and peak memory to
    1.04x and 1.23x those of 1:1"): each point's latency and peak memory over standard 1:1's batch-1 profile, None
    without one (said in `left`)."""
    if base is None:
        left.append(
            f"the ratios to 1:1: no batch-1 profile of standard 1:1 ({profile_command((1, 1, False, ()))})"
        )
    for p in points:
        p |= {
            "latency_x": p["latency_s"] / base["latency_s"] if base else None,
            "peak_x": p["peak_gib"] / base["peak_gib"] if base else None,
        }
    return points


def plot_score_cost(points: list[dict], column: str, png: Path) -> None:
    """Figure 4: the score against per-sample latency and against peak memory, a point per configuration, both as
    ratios to 1:1 (the paper's axes; absolute where there is no 1:1 profile)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    ratios = all(p["latency_x"] is not None for p in points)
    axis = (
        (axes[0], "latency_x", "per-sample latency (× 1:1), batch 1"),
        (axes[1], "peak_x", "peak memory (× 1:1)"),
    )
    for ax, key, name in (
        axis
        if ratios
        else (
            (axes[0], "latency_s", "latency per sample (s), batch 1"),
            (axes[1], "peak_gib", "peak memory (GiB)"),
        )
    ):
        ax.scatter([p[key] for p in points], [p["score"] for p in points])
        for p in points:
            ax.annotate(
                p["label"],
                (p[key], p["score"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
        ax.set_xlabel(name), ax.set_ylabel(f"{column} score")
    fig.suptitle("Figure 4: performance-cost trade-off at batch size 1", fontsize=10)
    fig.tight_layout()
    with writing(png):
        fig.savefig(png, dpi=100)
    plt.close(fig)


# -- the commands (evaluate.py lengths, descriptors, cost) and their flags ---------------------------


@dataclass
class DescriptorsConfig:
    """`evaluate.py descriptors`'s flags."""

    data: list[str] = flag(
        None, "VLMEvalKit TSVs, named <benchmark>.tsv", positional=True, nargs="+", reads=True
    )
    model: str = flag(
        None,
        "checkpoint whose tokenizer counts the tokens (without --tokenizer)",
        required=True,
        reads=True,
    )
    tokenizer: str | None = flag(None, TOKENIZER_HELP, shown="--model's", metavar="DIR", reads=True)
    report: str | None = flag(
        None, "report.json of evaluate.py report: its best configuration per benchmark", reads=True
    )
    predictions: list[str] | None = flag(
        None,
        "predictions (evaluate.py run; with --report): per benchmark, the "
        "file of its best configuration gives the mean response tokens",
        nargs="+",
        metavar="JSONL",
        reads=True,
    )
    near_cap: int = flag(
        NEAR_CAP,
        "responses of this many tokens or more are left out",
        unit="tokens",
        range="[1, inf)",
        shown=f"{NEAR_CAP} of the 4096 budget, the paper's",
    )
    out: str | None = flag(None, "also write the JSON here", writes=True)


@dataclass
class CostConfig:
    """`evaluate.py cost`'s flags."""

    report: str = flag(None, "report.json of evaluate.py report", required=True, reads=True)
    latency: list[str] = flag(
        None,
        "outputs of profiling.py latency --json (their batch-1 rows), one per configuration",
        nargs="+",
        required=True,
        reads=True,
    )
    column: str = flag(
        "All", "the score column: a benchmark or an aggregate (Eq. A3)", choices=COLUMNS
    )
    out: str | None = flag(
        None,
        "folder for score_cost.json and, with matplotlib, score_cost.png",
        writes=("score_cost.json", "score_cost.png"),
    )


def read_json(path: str, what: str) -> dict:
    """A JSON file as a command wrote it: the whole file (report.json, indented), else its last line
    (profiling.py latency prints its table first, its JSON last)."""
    try:
        text = regular_file(path).read_text()  # a FIFO would block the read
    except OSError as e:
        raise DataError(f"{path}: not {what} ({type(e).__name__})") from None
    for candidate in (text, (text.strip().splitlines() or [""])[-1]):
        try:
            value = json.loads(candidate)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            return value
    raise DataError(f"{path}: not {what} (no JSON object)")


def descriptors_cmd(cfg: DescriptorsConfig) -> int:
    best = None
    if cfg.report:
        best = read_json(cfg.report, "a report.json of evaluate.py report").get("best")
        if not isinstance(best, dict):
            raise DataError(
                f"{cfg.report}: not a report.json of evaluate.py report (no best configurations)"
            )
    if cfg.predictions and best is None:
        raise DataError(
            "--predictions needs --report: each benchmark's response tokens are its best configuration's"
        )
    encode = counting_tokenizer(cfg.tokenizer, cfg.model).encode
    responses, left = (
        best_responses(cfg.predictions, best, encode, cfg.near_cap)
        if cfg.predictions
        else (None, [])
    )
    table = descriptors(cfg.data, encode, best, responses)
    print(descriptors_markdown(table, left), end="")
    if cfg.out:
        write_text(Path(cfg.out), json.dumps({"benchmarks": table, "left_out": left}) + "\n")
    return 0


def cost_cmd(cfg: CostConfig) -> int:
    report = read_json(cfg.report, "a report.json")
    profiles = [read_json(f, "profiling.py latency --json output") for f in cfg.latency]
    if "configs" not in report or not all("rows" in p for p in profiles):
        raise DataError(
            f"{cfg.report} / {' '.join(cfg.latency)}: need report.json's configs and the profiles' rows"
        )
    points, left = score_cost(
        report, {"rows": [r for p in profiles for r in p["rows"]]}, cfg.column
    )
    ratio = lambda x: "-" if x is None else f"{x:.2f}×"  # noqa: E731
    print(
        f"Figure 4: performance-cost trade-off at batch size 1 ({cfg.column} score; ratios to standard 1:1)\n\n"
        f"| configuration | {cfg.column} | latency (× 1:1) | peak memory (× 1:1) | latency per sample (s) | "
        f"peak memory (GiB) |\n|" + " --- |" * 6
    )
    for p in points:
        print(
            f"| {p['label']} | {p['score']:.1f} | {ratio(p['latency_x'])} | {ratio(p['peak_x'])} | "
            f"{p['latency_s']:.4f} | {p['peak_gib']:.3f} |"
        )
    for line in left:
        print(f"Left out: {line}")
    if cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        write_text(
            Path(cfg.out) / "score_cost.json",
            json.dumps({"points": points, "left_out": left}) + "\n",
        )
        try:
            plot_score_cost(points, cfg.column, Path(cfg.out) / "score_cost.png")
        except ValueError as e:  # matplotlib is optional: the table and JSON are written
            print(f"note: {e}; the figure is skipped", file=sys.stderr)
    return 0
