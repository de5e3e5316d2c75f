"""Table S5: how long the answers of two configurations are (`evaluate.py lengths`).

Each answer is re-tokenised (the text `evaluate.py run` kept, not its token count, so every configuration
is measured alike) with --tokenizer, read as the paper's Qwen2Tokenizer (use_fast=False) reads its folder,
else with the checkpoint's tokenizer; no special tokens are added (B.4: add_special_tokens=False). An answer
whose re-tokenised length is at or above the near-cap threshold (Appendix B.4: 4090 of the 4096-token
budget) is a truncated run-on, not a length, and is left out: the clean mean of a configuration is over its
answers below the threshold, the paired difference over the rows below it in both; only rows both
configurations answered, from the same TSV and budgets, pair. Domain and overall columns average their
benchmarks with equal weight (Eq. A3's grouping). The intervals come from one benchmark-balanced paired
bootstrap: each resample draws every benchmark's paired rows with replacement and takes each benchmark's
mean difference; a domain's (and All's) resample averages its benchmarks' with equal weight; the 2.5th and
97.5th percentiles of 10,000 resamples (seed 42, the paper's) bound each column's difference (the paper's
[-3.1, 13.3] is the Math domain's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.processor import Tokenizer
from evaluation.paper_tables import HEAD_NAMES
from evaluation.scoring import BENCHMARKS, GROUPS
from evaluation.tsv import DataError, read_jsonl
from loading.hub import resolve_model
from shell.cli import SEED, SEEDS
from shell.files import write_text
from shell.flags import flag

# the fields that name one configuration (one checkpoint, its branches, how it was run)
CONFIGURATION = (
    "model_fingerprint",
    "pv",
    "pl",
    "vision_branch",
    "language_branch",
    "shared_kv",
    "router",
    "random_pair",
    "branches",
)


TOKENIZER_HELP = (
    "folder of the tokenizer that counts tokens (the paper's: Qwen3-VL-2B-Instruct's Qwen2Tokenizer, "
    "use_fast=False, no special tokens): its vocab.json + merges.txt, the files the slow tokenizer reads"
)


def counting_tokenizer(folder: str | None, model: str) -> Tokenizer:
    """The tokenizer Tables S5 and S2 count with: --tokenizer's folder read as the slow Qwen2Tokenizer reads
    it (vocab.json + merges.txt; Appendix B.1, B.4), else --model's."""
    if folder is None:
        return Tokenizer.from_pretrained(resolve_model(model))
    if not Path(folder).is_dir():
        raise DataError(
            f"--tokenizer {folder}: not a folder (a tokenizer's files: vocab.json, merges.txt)"
        )
    return Tokenizer.from_pretrained(folder, slow_files=True)


NEAR_CAP = 4090  # the paper's threshold for its 4096-token budget


# which count a near-cap answer is judged by: the paper's (B.4) re-tokenised length, or the run's own
# count of generated tokens (evaluate.py run's new_tokens)
NEAR_CAP_RULES = {
    "retokenised": "re-tokenised length",
    "generated": "generated tokens (new_tokens)",
}


# the fields of a prediction's record that make two runs' answers comparable row by row: the same TSV,
# the same token budget and tile budget
PRODUCED_ALIKE = ("data_fingerprint", "max_new_tokens", "max_tiles")


def read_predictions(files: list) -> dict[str, tuple[str, list[dict]]]:
    """{benchmark: (file, rows)} of prediction files (`evaluate.py run`), each file's benchmark read from
    its own record; two files of one benchmark, or a file mixing runs, are refused."""
    out: dict[str, tuple[str, list[dict]]] = {}
    for f in files:
        rows = read_jsonl(Path(f))
        benches = {r.get("benchmark") for r in rows}
        if len(benches) != 1 or None in benches or not rows:
            raise DataError(f"{f}: not the predictions of one benchmark (evaluate.py run's output)")
        bench = benches.pop()
        # a score JSON has a benchmark too
        if not all("index" in r and "prediction" in r for r in rows):
            raise DataError(
                f"{f}: rows without index and prediction: not the predictions of evaluate.py run "
                f"(a score file?)"
            )
        if bench in out:
            raise DataError(
                f"{f}: a second predictions file of {bench} (the first: {out[bench][0]})"
            )
        for field in PRODUCED_ALIKE + CONFIGURATION:
            if len({json.dumps(r.get(field), sort_keys=True) for r in rows}) > 1:
                raise DataError(
                    f"{f}: its rows record more than one {field}: not one run's predictions"
                )
        out[bench] = (str(f), rows)
    return out


def row_lengths(
    rows: list[dict], encode, near_cap: int = NEAR_CAP, rule: str = "retokenised"
) -> dict[str, int | None]:
    """{index: tokens} of one file's answers, each re-tokenised; None for an answer at the near cap by
    `rule`: its re-tokenised length (the paper's) or its recorded new_tokens reaching near_cap."""
    out = {}
    for r in rows:
        n = len(encode(str(r["prediction"])))
        if rule == "generated" and "new_tokens" not in r:
            raise DataError(
                f"row {r['index']} of {r.get('benchmark')} records no new_tokens for --near-cap-rule "
                f"generated"
            )
        out[str(r["index"])] = (
            None if (r["new_tokens"] if rule == "generated" else n) >= near_cap else n
        )
    return out


def lengths(
    files: list, encode, near_cap: int = NEAR_CAP, rule: str = "retokenised"
) -> dict[str, dict]:
    """{benchmark: {index: tokens, None at the near cap}} of prediction files (read_predictions)."""
    return {
        b: row_lengths(rows, encode, near_cap, rule)
        for b, (_, rows) in read_predictions(files).items()
    }


def check_alike(a: dict, b: dict) -> None:
    """Configurations A and B ({benchmark: (file, rows)}) pair only where their answers were produced
    alike: each side one configuration, and per benchmark the same TSV, token budget and tile budget."""
    for name, side in (("A", a), ("B", b)):
        ids = {
            json.dumps({k: rows[0].get(k) for k in CONFIGURATION}, sort_keys=True): f
            for f, rows in side.values()
        }
        if len(ids) > 1:
            raise DataError(
                f"the {name} files are of more than one configuration ({', '.join(ids.values())})"
            )
    for bench in a.keys() & b.keys():
        (fa, ra), (fb, rb) = a[bench], b[bench]
        for field in PRODUCED_ALIKE:
            if ra[0].get(field) != rb[0].get(field):
                raise DataError(
                    f"{bench}: {fa} and {fb} were produced with another {field} ({ra[0].get(field)!r} "
                    f"against {rb[0].get(field)!r}): their answers do not pair"
                )


def compare(
    a: dict,
    b: dict,
    near_cap: int = NEAR_CAP,
    resamples: int = 10_000,
    seed: int = SEED,
    rule: str = "retokenised",
) -> dict:
    """Table S5 of configurations a and b ({benchmark: {index: tokens, None for a row at the near cap}},
    the same benchmarks), over the rows both answered: per benchmark, domain and overall the clean
    means of a and b, the paired difference b - a, and the 95 % interval of each column's paired
    difference from one benchmark-balanced paired bootstrap (a domain's resample: the equal-weight mean
    of its benchmarks' resampled mean differences). What was left out is counted per benchmark."""
    if a.keys() != b.keys():
        raise DataError(
            f"the two sets of predictions cover other benchmarks: {sorted(a)} against {sorted(b)}"
        )
    rng = np.random.default_rng(seed)
    table, draws = {}, {}
    for bench in [x for x in BENCHMARKS if x in a]:
        clean = lambda n: n is not None and n < near_cap  # noqa: E731
        # rows only one side answered pair with nothing
        common = [i for i in a[bench] if i in b[bench]]
        clean_a = [a[bench][i] for i in common if clean(a[bench][i])]
        clean_b = [b[bench][i] for i in common if clean(b[bench][i])]
        both = [i for i in common if clean(a[bench][i]) and clean(b[bench][i])]
        if not both:
            raise DataError(
                f"{bench}: no row is answered below {near_cap} tokens in both configurations"
            )
        diff = np.array([b[bench][i] - a[bench][i] for i in both], dtype=np.float64)
        table[bench] = {
            "a": float(np.mean(clean_a)),
            "b": float(np.mean(clean_b)),
            "delta": float(diff.mean()),
            "n_a": len(clean_a),
            "n_b": len(clean_b),
            "n_paired": len(both),
            "only_a": len(a[bench]) - len(common),
            "only_b": len(b[bench]) - len(common),
            "near_cap_a": len(common) - len(clean_a),
            "near_cap_b": len(common) - len(clean_b),
        }
        # [resamples], drawn in blocks of at most 2**22 indices: the same draws as one [resamples, n] block
        block = max(1, 2**22 // len(diff))
        draws[bench] = np.concatenate(
            [
                diff[rng.integers(0, len(diff), size=(min(block, resamples - k), len(diff)))].mean(
                    1
                )
                for k in range(0, resamples, block)
            ]
        )
    intervals = {}
    for group, members in [*((m, (m,)) for m in list(table)), *GROUPS.items(), ("All", BENCHMARKS)]:
        present = [m for m in members if m in table]
        if present:
            if group not in table:
                table[group] = {
                    k: float(np.mean([table[m][k] for m in present])) for k in ("a", "b", "delta")
                }
            low, high = np.percentile(np.mean([draws[m] for m in present], axis=0), [2.5, 97.5])
            intervals[group] = [float(low), float(high)]
    return {
        "table": table,
        "interval_95": intervals,
        "near_cap": near_cap,
        "near_cap_rule": rule,
        "resamples": resamples,
        "seed": seed,
    }


def markdown(result: dict, names: tuple[str, str]) -> str:
    """The Table S5 layout: benchmarks, then domains and the overall average, as columns; the paired
    bootstrap's 95 % interval under each; the near-cap rule and what was left out."""
    cols = list(result["table"])
    md = [
        f"Table S5: Decoded output length, {names[0]} against {names[1]}. Mean lengths exclude outputs at or above "
        f"the near-cap threshold; paired differences keep only examples below it for both configurations; domain "
        f"and overall columns average the benchmark-level means with equal weight.",
        "",
        "| Statistic | "
        + " | ".join(HEAD_NAMES.get(c, c) for c in cols)
        + " |",  # the paper's names
        "|" + " --- |" * (len(cols) + 1),
    ]
    for key, label in (
        ("a", f"Clean mean ({names[0]})"),
        ("b", f"Clean mean ({names[1]})"),
        ("delta", f"Clean paired Δ ({names[1]} − {names[0]})"),
    ):
        md.append(
            f"| {label} | "
            + " | ".join(
                f"{result['table'][c][key]:+.1f}"
                if key == "delta"
                else f"{result['table'][c][key]:.1f}"
                for c in cols
            )
            + " |"
        )
    md.append(
        "| Paired Δ, 95 % interval | "
        + " | ".join("[{:.1f}, {:.1f}]".format(*result["interval_95"][c]) for c in cols)
        + " |"
    )
    md += [
        "",
        f"Intervals: benchmark-balanced paired bootstrap, {result['resamples']} resamples, seed "
        f"{result['seed']}. Near cap: {NEAR_CAP_RULES[result['near_cap_rule']]} >= {result['near_cap']} "
        f"tokens{' (the paper’s rule)' if result['near_cap_rule'] == 'retokenised' else ''}.",
    ]
    left = []
    for c in cols:
        t = result["table"][c]
        parts = [
            f"{t[k]} {what}"
            for k, what in (
                ("near_cap_a", f"near cap in {names[0]}"),
                ("near_cap_b", f"near cap in {names[1]}"),
                ("only_a", f"answered in {names[0]} only"),
                ("only_b", f"answered in {names[1]} only"),
            )
            if t.get(k)
        ]
        if parts:
            left.append(f"{c}: {', '.join(parts)}")
    md.append("Left out: " + ("; ".join(left) if left else "nothing") + ".")
    return "\n".join(md) + "\n"


@dataclass
class LengthsConfig:
    """`evaluate.py lengths`'s flags."""

    model: str = flag(
        None,
        "checkpoint whose tokenizer re-tokenises the answers (without --tokenizer)",
        required=True,
        reads=True,
    )
    tokenizer: str | None = flag(None, TOKENIZER_HELP, shown="--model's", metavar="DIR", reads=True)
    a: list[str] = flag(
        None,
        "configuration A's predictions (evaluate.py run), one file per benchmark",
        nargs="+",
        required=True,
        metavar="JSONL",
        reads=True,
    )
    b: list[str] = flag(
        None,
        "configuration B's predictions (evaluate.py run), one file per benchmark",
        nargs="+",
        required=True,
        metavar="JSONL",
        reads=True,
    )
    names: list[str] = flag(
        help="the two configurations' names in the table", nargs=2, factory=lambda: ["A", "B"]
    )
    near_cap: int = flag(
        NEAR_CAP,
        "answers of this many tokens or more are left out",
        unit="tokens",
        range="[1, inf)",
        shown=f"{NEAR_CAP} of the 4096 budget, the paper's",
    )
    near_cap_rule: str = flag(
        "retokenised",
        "what is counted against --near-cap: the re-tokenised answer (the "
        "paper's) or the generated tokens the run recorded",
        choices=list(NEAR_CAP_RULES),
    )
    resamples: int = flag(10_000, "bootstrap resamples", range="[1, 1000000]")
    seed: int = flag(SEED, "bootstrap seed", shown=f"{SEED}, the paper's", range=SEEDS)
    out: str | None = flag(None, "also write the JSON here", writes=True)


def lengths_cmd(cfg: LengthsConfig) -> int:
    encode = counting_tokenizer(cfg.tokenizer, cfg.model).encode
    pa, pb = read_predictions(cfg.a), read_predictions(cfg.b)
    check_alike(pa, pb)
    a, b = (
        {
            k: row_lengths(rows, encode, cfg.near_cap, cfg.near_cap_rule)
            for k, (_, rows) in p.items()
        }
        for p in (pa, pb)
    )
    result = compare(a, b, cfg.near_cap, cfg.resamples, cfg.seed, cfg.near_cap_rule)
    print(markdown(result, tuple(cfg.names)), end="")
    if cfg.out:
        write_text(Path(cfg.out), json.dumps(result | {"names": cfg.names}) + "\n")
    return 0
