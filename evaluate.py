"""Evaluation of ParVL on the paper's nine benchmarks (Appendix A.3), the allocation study's tables
(Tables 1, 2, 3, S2, S4, S9; analysis.py: S5, S2's descriptors, Figure 4) and ParScale's law fit.

    python evaluate.py run --benchmark TextVQA_VAL --data TextVQA_VAL.tsv --model DIR --out pred.jsonl
    torchrun --nproc-per-node 8 evaluate.py run ...          # data parallel, same merged output
    python evaluate.py score --benchmark TextVQA_VAL --data TextVQA_VAL.tsv --predictions pred.jsonl
    python evaluate.py report runs/*/score_*.json --out report/
    python evaluate.py fit-law losses.csv                    # columns params,p,loss

run: VLMEvalKit's TSV rows -> prompts as VLMEvalKit builds them for InternVL3.5 (vlm/internvl/
internvl_chat.py InternVLChat.build_prompt, set_max_num, generate_v2; vlm/internvl/utils.py
build_multi_choice_prompt, reorganize_prompt), greedy decoding with inference/engine.py's Engine, batched
and sorted by prompt length, resumable and sharded over torchrun ranks (shell/shards.py). score:
scoring.py, with an optional OpenAI-compatible answer extractor (--judge-url) fed VLMEvalKit's own
extraction prompts, which are read from a VLMEvalKit checkout (--vlmevalkit DIR) rather than copied
here. report: tables.py (Eq. A3 aggregates, Pl x Pv grids, best configuration with ties broken
toward fewer FLOPs). lengths, descriptors, cost: analysis.py. fit-law: ParScale's parametric_fit.py
(scaling_law.py: Huber on log L, delta 1e-3, L-BFGS from its grid of starts).

Formats: PRED.jsonl rows {"index", "prediction", "new_tokens", and RECORD_FIELDS: what produced it,
"pair" for a routed or random-pair row}; score JSON {"benchmark", "score" (0-100), "n",
"unresolved", "missing", CONFIG_FIELDS (the configuration and its checkpoint)}; fit-law CSV params
(raw parameter count N), p, loss.
Bad input: one line on stderr, exit 1 (bad input) or 2 (usage).
"""

from __future__ import annotations

import shell.early  # noqa: F401  first: a Ctrl-C during the imports below is one line, exit 130

# isort: split

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from evaluation import analysis, lengths, report
from evaluation.judge import JUDGE_READS, KEY_ENV, PAPER_JUDGE, Judge, judge_flags_problem
from evaluation.predict import RunConfig, file_fingerprint, predict_all
from evaluation.scaling_law import GRID, fit_law
from evaluation.scoring import BENCHMARKS, SCORE_COLUMNS, score
from evaluation.tsv import DataError, read_jsonl, read_tsv
from shell.cli import command, log, one_line
from shell.files import regular_file, write_text
from shell.flags import Command, dispatch, flag
from shell.outputs import check_folder

FIT_PARAMETERS = 4  # E, A, alpha, k of scaling_law.law
MAX_FIT_ROWS = 1000  # fit-law's rows: about half a minute on 2 CPU cores at this size (300 starts x rows per step)
# what a score file copies of the predictions' record: the configuration, the checkpoint it belongs to, and
# the weights' format (--dtype, --quant)
CONFIG_FIELDS = (
    "model",
    "model_fingerprint",
    "model_step",
    "pv",
    "pl",
    "vision_branch",
    "language_branch",
    "shared_kv",
    "router",
    "random_pair",
    "branches",
    "dtype",
    "quant",
)


# -- the flags of run, score and fit-law (report: tables.py; lengths, descriptors, cost: analysis.py) ----


@dataclass
class ScoreConfig:
    """`evaluate.py score`'s flags."""

    benchmark: str = flag(None, "VLMEvalKit dataset name", required=True)
    data: str = flag(None, "the benchmark's VLMEvalKit TSV", required=True, reads=True)
    predictions: str = flag(None, "JSONL from `run` (index, prediction)", required=True, reads=True)
    out: str | None = flag(None, "also write the score JSON here", writes=True)
    rows_out: str | None = flag(None, "write per-row results (JSONL) here", writes=True)
    judge_url: str | None = flag(None, "OpenAI-compatible base URL (…/v1) of an answer extractor")
    judge_model: str | None = flag(
        None, f"model name sent to the answer extractor (the paper: {PAPER_JUDGE})"
    )
    judge_cache: str | None = flag(
        None, "reply cache", shown="PREDICTIONS.judge-MODEL.jsonl", writes=True
    )
    vlmevalkit: str | None = flag(
        None, "a VLMEvalKit checkout, whose extraction prompts the judge is sent", reads=JUDGE_READS
    )
    judge_key_env: str = flag(
        KEY_ENV,
        "environment variable holding the extractor's API key, sent as a bearer "
        "token (a key is never a flag); unset: none sent",
    )

    def check(self) -> None:
        """The answer extractor's flags (judge.judge_flags_problem), and its reply cache as the output it is
        (paid-for replies: --out or --rows-out onto it, the default path included, would replace them): a flag
        error, exit 2."""
        if why := judge_flags_problem(
            self.judge_url, self.judge_model, self.vlmevalkit, self.judge_key_env
        ):
            raise ValueError(why)
        cache = self.cache_path()
        for name, out in (("--out", self.out), ("--rows-out", self.rows_out)):
            if cache and out and Path(out).resolve() == cache.resolve():
                raise ValueError(
                    f"{name} {out}: would write the answer extractor's reply cache {cache}; an output is "
                    f"never an input: pick another {name}"
                )

    def cache_path(self) -> Path | None:
        """Where the answer extractor's replies are cached (--judge-cache, else beside the predictions); None
        without one."""
        if not self.judge_url:
            return None
        return Path(
            self.judge_cache
            or str(self.predictions) + f".judge-{self.judge_model.replace('/', '_')}.jsonl"
        )


@dataclass
class FitLawConfig:
    """`evaluate.py fit-law`'s flags."""

    csv: str = flag(
        None, "CSV with columns params (raw parameter count), p, loss", positional=True, reads=True
    )


# -- run: prompts ------------------------------------------------------------------------------


# -- run: the loop -----------------------------------------------------------------------------


# -- score: scoring.py, with an optional answer extractor (judge.py) ------------------------------


def score_cmd(cfg: ScoreConfig) -> int:
    """`score`: the benchmark's native metric over the predictions of `run` (missing rows count as wrong), with
    the answer extractor where --judge-url gives one; prints the score JSON (and writes --out, --rows-out)."""
    if cfg.benchmark not in BENCHMARKS:
        raise DataError(f"unknown benchmark {cfg.benchmark!r}; choose from {', '.join(BENCHMARKS)}")
    for name, out in (("--out", cfg.out), ("--rows-out", cfg.rows_out)):
        if out:  # made as run makes its --out's folder; a file in the way named before any work
            check_folder(Path(out).parent, name, given=Path(out))
            Path(out).parent.mkdir(parents=True, exist_ok=True)
    required = ("index", "question", "answer") + SCORE_COLUMNS.get(cfg.benchmark, ())
    rows = read_tsv(cfg.data, required)
    preds = read_predictions(Path(cfg.predictions), rows, cfg)
    predictions = {str(p["index"]): str(p["prediction"]) for p in preds}
    # scored as wrong: an empty answer
    absent = [r["index"] for r in rows if r["index"] not in predictions]
    predictions |= dict.fromkeys(absent, "")
    judge = make_judge(cfg)
    extract = (
        None
        if judge is None
        else (lambda kind, row, pred: None if row["index"] in absent else judge(kind, row, pred))
    )
    result = score(cfg.benchmark, rows, predictions, extract)
    missing = len(absent)
    if missing:
        log(
            f"warning: {missing} TSV rows have no prediction and count as wrong (index {', '.join(absent[:10])}"
            f"{', ...' if missing > 10 else ''})"
        )
    if cfg.rows_out:
        write_text(
            Path(cfg.rows_out),
            "".join(json.dumps(x, ensure_ascii=False, default=str) + "\n" for x in result.per_row),
        )
    config = {k: preds[0].get(k) for k in CONFIG_FIELDS} if preds else {}
    line = {
        "benchmark": cfg.benchmark,
        "score": round(result.value, 4),
        "n": result.n,
        "unresolved": result.unresolved,
        "missing": missing,
        "missing_indices": absent,
        **config,
        **result.extra,
    }
    # which answer extractor made it, None for none: a report refuses a study that mixes the two (Table S6: "Both
    # variants use the same gpt-4o-2024-11-20 answer extractor")
    line |= {
        "judge_model": cfg.judge_model if judge else None,
        "judge_calls": judge.calls if judge else 0,
    }
    if cfg.out:
        write_text(Path(cfg.out), json.dumps(line) + "\n")
    print(json.dumps(line))
    return 0


def read_predictions(path: Path, rows: list[dict], cfg: ScoreConfig) -> list[dict]:
    """The prediction rows of `run` in `path`, each of an index of the TSV's rows, once, of this benchmark and
    made from this TSV; an empty file is refused (a wrong path or a run that never started, not a score of 0)."""
    if not path.exists():
        raise DataError(f"{path}: no such predictions file")
    preds = read_jsonl(path)
    if not preds:
        raise DataError(
            f"{path}: holds no prediction (evaluate.py run's output has one JSON line per row)"
        )
    known = {r["index"] for r in rows}
    for p in preds:
        if "index" not in p or "prediction" not in p:
            raise DataError(f"{path}: a row lacks 'index' or 'prediction': {json.dumps(p)[:120]}")
        if str(p["index"]) not in known:
            raise DataError(f"{path}: prediction index {p['index']!r} is not in {cfg.data}")
        if p.get("benchmark", cfg.benchmark) != cfg.benchmark:
            raise DataError(
                f"{path}: predictions of {p['benchmark']}, not of --benchmark {cfg.benchmark}"
            )
    seen: set[str] = set()
    for p in preds:
        if str(p["index"]) in seen:
            raise DataError(f"{path}: index {p['index']!r} is predicted twice")
        seen.add(str(p["index"]))
    made_from = {p["data_fingerprint"] for p in preds if "data_fingerprint" in p}
    if made_from and made_from != {file_fingerprint(cfg.data)}:
        raise DataError(
            f"{path}: made from another TSV than {cfg.data} (data fingerprint "
            f"{', '.join(sorted(made_from))}, this TSV {file_fingerprint(cfg.data)})"
        )
    return preds


def make_judge(cfg: ScoreConfig) -> Judge | None:
    """The answer extractor --judge-url names (judge.py), its replies cached beside the predictions; None without."""
    if not cfg.judge_url:
        return None  # the flags were checked at parse (ScoreConfig.check)
    return Judge(
        cfg.judge_url,
        cfg.judge_model,
        cfg.cache_path(),
        Path(cfg.vlmevalkit),
        cfg.benchmark,
        cfg.judge_key_env,
    )


# -- fit-law: ParScale's parallel scaling law (scaling_law.py) ------------------------------------


def fit_law_cmd(cfg) -> int:
    try:
        # -sig: a byte-order mark is not a column name; regular_file: a FIFO would block the read
        with open(regular_file(cfg.csv), newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            missing = [
                c
                for c in ("params", "p", "loss")
                if c not in (reader.fieldnames or ("params", "p", "loss"))
            ]
            if missing:  # before the rows: a TSV's base64 image cells would pass csv's field limit
                raise DataError(
                    f"{cfg.csv}: missing column(s) {', '.join(missing)} (a CSV of params,p,loss)"
                )
            rows = list(reader)
    except (
        OSError,
        UnicodeDecodeError,
        csv.Error,
    ) as e:  # csv.Error: a binary file, a field past the limit
        raise DataError(f"{cfg.csv}: not a readable CSV ({one_line(e)})") from None
    if not rows:
        raise DataError(f"{cfg.csv}: empty CSV (need a header params,p,loss and data rows)")
    try:
        N, P, L = ([float(r[c]) for r in rows] for c in ("params", "p", "loss"))
    except (TypeError, ValueError) as e:
        raise DataError(f"{cfg.csv}: a params, p or loss cell is not a number ({e})") from None
    if not all(map(math.isfinite, N + P + L)):
        raise DataError(f"{cfg.csv}: a params, p or loss cell is not finite (nan or inf)")
    if min(N) <= 0 or min(P) < 1 or min(L) <= 0:
        raise DataError(f"{cfg.csv}: need params > 0, p >= 1 and loss > 0")
    # rows at one (params, p) are one point of the law, whatever their losses
    points = set(zip(N, P))
    if len(points) < FIT_PARAMETERS + 1 or len(set(N)) < 2 or len(set(P)) < 2:
        # as many points as parameters fit them exactly (R^2 = 1 says nothing); A and alpha need two sizes, k two p
        rows_note = f" in {len(rows)} rows" if len(rows) != len(points) else ""
        raise DataError(
            f"{cfg.csv}: {len(points)} point{'s' * (len(points) > 1)}{rows_note}; the law has "
            f"{FIT_PARAMETERS} parameters (E, A, alpha, k), so fitting it needs at least "
            f"{FIT_PARAMETERS + 1} distinct (params, p) points with two params and two p values at least "
            f"(here {len(set(N))} and {len(set(P))})"
        )
    # every start's L-BFGS runs over every row: minutes past this, hours at 10**5
    if len(rows) > MAX_FIT_ROWS:
        raise DataError(
            f"{cfg.csv}: {len(rows)} rows; the fit runs {len(GRID)} L-BFGS starts over every row, which "
            f"takes too long past {MAX_FIT_ROWS:,} rows: average each (params, p)'s losses into one row"
        )
    fit = fit_law(N, P, L)
    if not all(math.isfinite(v) for k, v in fit.items() if k not in ("pred", "r2")):
        raise DataError(
            f"{cfg.csv}: the fit did not converge to finite parameters ({fit['E']}, {fit['A']}, "
            f"{fit['alpha']}, {fit['k']})"
        )
    print(f"{'params':>14} {'p':>4} {'loss':>8} {'fitted':>8} {'error':>8}")
    for n, p, l, q in zip(N, P, L, fit["pred"]):
        print(f"{n:>14,.0f} {p:>4g} {l:>8.4f} {q:>8.4f} {q - l:>+8.4f}")
    print(json.dumps({k: v for k, v in fit.items() if k != "pred"}))
    return 0


# -- the command ---------------------------------------------------------------------------------


DESCRIPTION = __doc__.split("\n\n")[0]
COMMANDS = {
    "run": Command(
        RunConfig,
        predict_all,
        "generate predictions for a benchmark TSV",
        writes=lambda cfg: Path(cfg.out),
        interrupted=lambda cfg: "the predictions written so far stay; the same command resumes",
    ),
    "score": Command(
        ScoreConfig, score_cmd, "score predictions with the benchmark's native metric"
    ),
    "report": Command(
        report.ReportConfig, report.report, "tables from score files of several configurations"
    ),
    "lengths": Command(
        lengths.LengthsConfig,
        lengths.lengths_cmd,
        "Table S5: decoded lengths of two configurations, paired, with a bootstrap interval",
    ),
    "descriptors": Command(
        analysis.DescriptorsConfig,
        analysis.descriptors_cmd,
        "Table S2: each benchmark's source pixels, question and reference tokens, best Pv:Pl",
    ),
    "cost": Command(
        analysis.CostConfig,
        analysis.cost_cmd,
        "Figure 4: the score of each configuration against its latency and peak memory",
    ),
    "fit-law": Command(
        FitLawConfig, fit_law_cmd, "fit ParScale's parallel scaling law to a CSV of losses"
    ),
}


def main(argv=None) -> int:
    return dispatch(DESCRIPTION, COMMANDS, argv)


if __name__ == "__main__":
    command(main)
