"""The paper's analyses of finished runs beyond the score tables: Table S5 (how long the answers of
two configurations are), Table S2's workload descriptors (what each benchmark asks) and Figure 4
(each configuration's score against its batch-1 latency and peak memory, from `evaluate.py report`'s
report.json and `profiling.py latency --json`).

Table S5. Each answer is re-tokenised with the checkpoint's tokenizer (the text `evaluate.py run` kept, not its
token count, so every configuration is measured alike). An answer at or above the near-cap threshold
(the paper: 4090 of the 4096-token budget) is a truncated run-on, not a length, and is left out:
the clean mean of a configuration is over its answers below the threshold, the paired difference
over the rows below it in both. Domain and overall columns average their benchmarks with equal
weight (Eq. A3's grouping). The interval is a benchmark-balanced paired bootstrap: each resample
draws every benchmark's paired rows with replacement, takes each benchmark's mean difference and
averages those with equal weight; the 2.5th and 97.5th percentiles of 10,000 resamples (seed 42,
the paper's) bound the overall difference.

Table S2. Per benchmark TSV: the mean source-image pixels of a row (width x height summed over its
images, before tiling: read from each image's header), the mean question and reference lengths in
tokens (the `question` and `answer` cells, before any prompt template), next to the best Pv:Pl of
`evaluate.py report` when its report.json is given.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from checkpoint import resolve_model
from cli import SEED
from flags import flag
from processor import Tokenizer
from scoring import BENCHMARKS, GROUPS
from tsv import DataError, as_list, read_jsonl, read_tsv

NEAR_CAP = 4090  # the paper's threshold for its 4096-token budget


def lengths(files: list, encode, near_cap: int = NEAR_CAP) -> dict[str, dict[str, int | None]]:
    """{benchmark: {index: tokens}} of prediction files (`evaluate.py run`), each file's benchmark read
    from its own record; two files of one benchmark are refused. A row whose generation reached
    near_cap tokens (its recorded new_tokens; without one, its re-tokenised length) is None: cut at
    the budget, however its text re-tokenises."""
    out: dict[str, dict[str, int | None]] = {}
    for f in files:
        rows = read_jsonl(Path(f))
        benches = {r.get("benchmark") for r in rows}
        if len(benches) != 1 or None in benches or not rows:
            raise DataError(f"{f}: not the predictions of one benchmark (evaluate.py run's output)")
        bench = benches.pop()
        if not all("index" in r and "prediction" in r for r in rows):  # a score JSON has a benchmark too
            raise DataError(f"{f}: rows without index and prediction: not the predictions of evaluate.py run "
                            f"(a score file?)")
        if bench in out:
            raise DataError(f"{f}: a second predictions file of {bench}")
        out[bench] = {}
        for r in rows:
            n = len(encode(str(r["prediction"])))
            out[bench][str(r["index"])] = None if r.get("new_tokens", n) >= near_cap else n
    return out


def compare(a: dict, b: dict, near_cap: int = NEAR_CAP, resamples: int = 10_000, seed: int = SEED) -> dict:
    """Table S5 of configurations a and b ({benchmark: {index: tokens, None for a row cut at the
    budget}}, the same benchmarks): per benchmark, domain and overall the clean means of a and b, the
    paired difference b - a, and the bootstrap 95 % interval of the overall paired difference."""
    if a.keys() != b.keys():
        raise DataError(f"the two sets of predictions cover other benchmarks: {sorted(a)} against {sorted(b)}")
    rng = np.random.default_rng(seed)
    table, draws = {}, []
    for bench in [x for x in BENCHMARKS if x in a]:
        clean = lambda n: n is not None and n < near_cap  # noqa: E731
        clean_a = [n for n in a[bench].values() if clean(n)]
        clean_b = [n for n in b[bench].values() if clean(n)]
        both = [i for i in a[bench] if i in b[bench] and clean(a[bench][i]) and clean(b[bench][i])]
        if not both:
            raise DataError(f"{bench}: no row is answered below {near_cap} tokens in both configurations")
        diff = np.array([b[bench][i] - a[bench][i] for i in both], dtype=np.float64)
        table[bench] = {"a": float(np.mean(clean_a)), "b": float(np.mean(clean_b)), "delta": float(diff.mean()),
                        "n_a": len(clean_a), "n_b": len(clean_b), "n_paired": len(both)}
        # [resamples], drawn in blocks of at most 2**22 indices: the same draws as one [resamples, n] block
        block = max(1, 2**22 // len(diff))
        draws.append(np.concatenate([diff[rng.integers(0, len(diff), size=(min(block, resamples - k), len(diff)))]
                                     .mean(1) for k in range(0, resamples, block)]))
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


def descriptors(tsvs: list, encode, best: dict | None = None, responses: dict | None = None) -> dict[str, dict]:
    """Table S2's columns per benchmark, from VLMEvalKit TSVs named <benchmark>.tsv (VLMEvalKit's own
    names); `best`: report.json's {column: "Pv:Pl"}; `responses`: the best configuration's answer
    lengths ({benchmark: {index: tokens}}, `lengths`), whose mean is a last column."""
    from processor import ImageError, open_base64

    out = {}
    for path in map(Path, tsvs):
        bench = path.stem
        if bench not in BENCHMARKS:
            raise DataError(f"{path}: not a benchmark's TSV name ({', '.join(b + '.tsv' for b in BENCHMARKS)})")
        rows, pixels = read_tsv(path, ("index", "question", "answer", "image")), []
        for r in rows:
            try:
                sizes = [open_base64(b, str(k)).size for k, b in enumerate(as_list(r["image"]))]
            except ImageError as e:
                raise DataError(f"{path}: row {r['index']}: unreadable image ({e})") from None
            pixels.append(sum(w * h for w, h in sizes))
        out[bench] = {"rows": len(rows), "pixels": float(np.mean(pixels)),
                      "question_tokens": float(np.mean([len(encode(r["question"] or "")) for r in rows])),
                      "reference_tokens": float(np.mean([len(encode(r["answer"] or "")) for r in rows])),
                      "best": (best or {}).get(bench),
                      "response_tokens": (float(np.mean(list(responses[bench].values())))
                                          if bench in (responses or {}) else None)}
    return out


def descriptors_markdown(table: dict) -> str:
    md = ["| Benchmark | rows | source pixels | question tokens | reference tokens | best Pv:Pl "
          "| its response tokens |",
          "|" + " --- |" * 7]
    for b, d in table.items():
        response = "-" if d["response_tokens"] is None else f"{d['response_tokens']:.1f}"
        md.append(f"| {b} | {d['rows']} | {d['pixels']:,.0f} | {d['question_tokens']:.1f} | "
                  f"{d['reference_tokens']:.1f} | {d['best'] or '-'} | {response} |")
    return "\n".join(md) + "\n"


def score_cost(report: dict, latency: dict, column: str = "All") -> list[dict]:
    """Figure 4's points: each configuration of report.json with a score in `column`, beside the
    batch-1 per-sample latency and peak memory `profiling.py latency --json` measured for its Pv:Pl
    (and shared KV). A configuration the profile lacks is refused (its point would be missing)."""
    profile = {(r["pv"], r["pl"], bool(r["shared_kv"])): r for r in latency["rows"] if r["batch"] == 1}
    points = []
    for c in report["configs"]:
        if c["vision_branch"] is not None or c["language_branch"] is not None or c["scores"].get(column) is None:
            continue  # fixed-pair diagnostics and partial runs have no point
        key = (c["pv"], c["pl"], bool(c["shared_kv"]))
        if key not in profile:
            raise DataError(f"the latency profile has no batch-1 row for {c['label']} (profiling.py latency --pv "
                            f"{key[0]} --pl {key[1]} --batch 1{' --compare-shared' if key[2] else ''})")
        points.append({"label": c["label"], "score": c["scores"][column], "latency_s": profile[key]["latency_s"],
                       "peak_gib": profile[key]["peak_gib"]})
    if not points:
        raise DataError(f"no configuration of the report has a {column} score")
    return points


def plot_score_cost(points: list[dict], column: str, png: Path) -> None:
    """Figure 4: the score against per-sample latency and against peak memory, a point per configuration."""
    from cli import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, key, name in ((axes[0], "latency_s", "latency per sample (s), batch 1"),
                          (axes[1], "peak_gib", "peak memory (GiB)")):
        ax.scatter([p[key] for p in points], [p["score"] for p in points])
        for p in points:
            ax.annotate(p["label"], (p[key], p["score"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(name), ax.set_ylabel(f"{column} score")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


# -- the commands (evaluate.py lengths, descriptors, cost) and their flags ---------------------------


@dataclass
class LengthsConfig:
    """`evaluate.py lengths`'s flags."""
    model: str = flag(None, "checkpoint whose tokenizer re-tokenises the answers", required=True)
    a: list[str] = flag(None, "configuration A's predictions (evaluate.py run), one file per benchmark", nargs="+",
                        required=True, metavar="JSONL")
    b: list[str] = flag(None, "configuration B's predictions (evaluate.py run), one file per benchmark", nargs="+",
                        required=True, metavar="JSONL")
    names: list[str] = flag(help="the two configurations' names in the table", nargs=2, factory=lambda: ["A", "B"])
    near_cap: int = flag(NEAR_CAP, "answers of this many tokens or more are left out", unit="tokens", range="[1, inf)",
                         shown=f"{NEAR_CAP} of the 4096 budget, the paper's")
    resamples: int = flag(10_000, "bootstrap resamples", range="[1, 1000000]")
    seed: int = flag(SEED, "bootstrap seed", shown=f"{SEED}, the paper's")
    out: str | None = flag(None, "also write the JSON here")


@dataclass
class DescriptorsConfig:
    """`evaluate.py descriptors`'s flags."""
    data: list[str] = flag(None, "VLMEvalKit TSVs, named <benchmark>.tsv", positional=True, nargs="+")
    model: str = flag(None, "checkpoint whose tokenizer counts the tokens", required=True)
    report: str | None = flag(None, "report.json of evaluate.py report: its best configuration per benchmark")
    predictions: list[str] | None = flag(None, "the best configuration's predictions (one file per benchmark): their "
                                               "mean response tokens", nargs="+", metavar="JSONL")
    out: str | None = flag(None, "also write the JSON here")


@dataclass
class CostConfig:
    """`evaluate.py cost`'s flags."""
    report: str = flag(None, "report.json of evaluate.py report", required=True)
    latency: list[str] = flag(None, "outputs of profiling.py latency --json (their batch-1 rows)", nargs="+",
                              required=True)
    column: str = flag("All", "the score column")
    out: str | None = flag(None, "folder for score_cost.json and, with matplotlib, score_cost.png")


def lengths_cmd(cfg: LengthsConfig) -> int:
    encode = Tokenizer.from_pretrained(resolve_model(cfg.model)).encode
    a, b = lengths(cfg.a, encode, cfg.near_cap), lengths(cfg.b, encode, cfg.near_cap)
    result = compare(a, b, cfg.near_cap, cfg.resamples, cfg.seed)
    print(markdown(result, tuple(cfg.names)), end="")
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(result | {"names": cfg.names}) + "\n")
    return 0


def descriptors_cmd(cfg: DescriptorsConfig) -> int:
    best = None
    if cfg.report:
        try:
            best = json.loads(Path(cfg.report).read_text())["best"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{cfg.report}: not a report.json of evaluate.py report ({type(e).__name__})") from None
    encode = Tokenizer.from_pretrained(resolve_model(cfg.model)).encode
    table = descriptors(cfg.data, encode, best, lengths(cfg.predictions, encode) if cfg.predictions else None)
    print(descriptors_markdown(table), end="")
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(table) + "\n")
    return 0


def cost_cmd(cfg: CostConfig) -> int:
    def last_json(path, what):
        try:
            return json.loads(Path(path).read_text().strip().splitlines()[-1])
        except (OSError, IndexError, ValueError) as e:
            raise DataError(f"{path}: not {what} ({type(e).__name__})") from None

    report = last_json(cfg.report, "a report.json")
    profiles = [last_json(f, "profiling.py latency --json output") for f in cfg.latency]  # one run per Pv:Pl, say
    if "configs" not in report or not all("rows" in p for p in profiles):
        raise DataError(f"{cfg.report} / {' '.join(cfg.latency)}: need report.json's configs and the profiles' rows")
    points = score_cost(report, {"rows": [r for p in profiles for r in p["rows"]]}, cfg.column)
    print(f"| configuration | {cfg.column} | latency per sample (s) | peak memory (GiB) |\n| --- | --- | --- | --- |")
    for p in points:
        print(f"| {p['label']} | {p['score']:.1f} | {p['latency_s']:.4f} | {p['peak_gib']:.3f} |")
    if cfg.out:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "score_cost.json").write_text(json.dumps(points) + "\n")
        try:
            plot_score_cost(points, cfg.column, Path(cfg.out) / "score_cost.png")
        except ValueError as e:  # matplotlib is optional: the table and JSON are written
            print(f"note: {e}; the figure is skipped", file=sys.stderr)
    return 0
