"""Table S5: how long the answers of two configurations are, benchmark by benchmark.

Each answer is re-tokenised with the checkpoint's tokenizer (the text `evaluate.py run` kept, not its
token count, so every configuration is measured alike). An answer at or above the near-cap threshold
(the paper: 4090 of the 4096-token budget) is a truncated run-on, not a length, and is left out:
the clean mean of a configuration is over its answers below the threshold, the paired difference
over the rows below it in both. Domain and overall columns average their benchmarks with equal
weight (Eq. A3's grouping). The interval is a benchmark-balanced paired bootstrap: each resample
draws every benchmark's paired rows with replacement, takes each benchmark's mean difference and
averages those with equal weight; the 2.5th and 97.5th percentiles of 10,000 resamples (seed 42,
the paper's) bound the overall difference.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from scoring import BENCHMARKS, GROUPS, DataError, read_jsonl

NEAR_CAP = 4090  # the paper's threshold for its 4096-token budget


def lengths(files: list, encode) -> dict[str, dict[str, int]]:
    """{benchmark: {index: tokens}} of prediction files (`evaluate.py run`), each file's benchmark read
    from its own record; two files of one benchmark are refused."""
    out: dict[str, dict[str, int]] = {}
    for f in files:
        rows = read_jsonl(Path(f))
        benches = {r.get("benchmark") for r in rows}
        if len(benches) != 1 or None in benches or not rows:
            raise DataError(f"{f}: not the predictions of one benchmark (evaluate.py run's output)")
        bench = benches.pop()
        if bench in out:
            raise DataError(f"{f}: a second predictions file of {bench}")
        out[bench] = {str(r["index"]): len(encode(str(r["prediction"]))) for r in rows}
    return out


def compare(a: dict, b: dict, near_cap: int = NEAR_CAP, resamples: int = 10_000, seed: int = 42) -> dict:
    """Table S5 of configurations a and b ({benchmark: {index: tokens}}, the same benchmarks): per
    benchmark, domain and overall the clean means of a and b, the paired difference b - a, and the
    bootstrap 95 % interval of the overall paired difference."""
    if a.keys() != b.keys():
        raise DataError(f"the two sets of predictions cover other benchmarks: {sorted(a)} against {sorted(b)}")
    rng = np.random.default_rng(seed)
    table, draws = {}, []
    for bench in [x for x in BENCHMARKS if x in a]:
        clean_a = [n for n in a[bench].values() if n < near_cap]
        clean_b = [n for n in b[bench].values() if n < near_cap]
        both = [i for i in a[bench] if i in b[bench] and a[bench][i] < near_cap and b[bench][i] < near_cap]
        if not both:
            raise DataError(f"{bench}: no row is answered below {near_cap} tokens in both configurations")
        diff = np.array([b[bench][i] - a[bench][i] for i in both], dtype=np.float64)
        table[bench] = {"a": float(np.mean(clean_a)), "b": float(np.mean(clean_b)), "delta": float(diff.mean()),
                        "n_a": len(clean_a), "n_b": len(clean_b), "n_paired": len(both)}
        draws.append(diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(1))  # [resamples]
    for group, members in [*GROUPS.items(), ("All", BENCHMARKS)]:
        present = [table[m] for m in members if m in table]
        if present:
            table[group] = {k: float(np.mean([t[k] for t in present])) for k in ("a", "b", "delta")}
    low, high = np.percentile(np.mean(draws, axis=0), [2.5, 97.5])
    return {"table": table, "interval_95": [float(low), float(high)], "near_cap": near_cap, "resamples": resamples,
            "seed": seed}


def markdown(result: dict, names: tuple[str, str]) -> str:
    """The Table S5 layout: benchmarks, then domains and the overall average, as columns."""
    cols = list(result["table"])
    md = ["| Statistic | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for key, label in (("a", f"Clean mean ({names[0]})"), ("b", f"Clean mean ({names[1]})"),
                       ("delta", f"Clean paired Δ ({names[1]} − {names[0]})")):
        md.append(f"| {label} | " + " | ".join(f"{result['table'][c][key]:+.1f}" if key == "delta" else
                                                f"{result['table'][c][key]:.1f}" for c in cols) + " |")
    low, high = result["interval_95"]
    md += ["", f"Overall paired Δ, benchmark-balanced paired bootstrap ({result['resamples']} resamples, seed "
               f"{result['seed']}): 95 % interval [{low:.1f}, {high:.1f}] tokens"]
    return "\n".join(md) + "\n"
