"""Evaluation of ParVL on the paper's nine benchmarks (Appendix A.3), the allocation study's tables
(Tables 1, 2, 3, S2, S4, S9; analysis.py: S5, S2's descriptors, Figure 4) and ParScale's law fit.

    python evaluate.py run --benchmark TextVQA_VAL --data TextVQA_VAL.tsv --model DIR --out pred.jsonl
    torchrun --nproc-per-node 8 evaluate.py run ...          # data parallel, same merged output
    python evaluate.py score --benchmark TextVQA_VAL --data TextVQA_VAL.tsv --predictions pred.jsonl
    python evaluate.py report runs/*/score_*.json --out report/
    python evaluate.py fit-law losses.csv                    # columns params,p,loss

run: VLMEvalKit's TSV rows -> prompts as VLMEvalKit builds them for InternVL3.5 (vlm/internvl/
internvl_chat.py InternVLChat.build_prompt, set_max_num, generate_v2; vlm/internvl/utils.py
build_multi_choice_prompt, reorganize_prompt), greedy decoding with engine.py's Engine, batched
and sorted by prompt length, resumable and sharded over torchrun ranks (shards.py). score:
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

import csv
import hashlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from checkpoint import trained_step
from cli import (SEED, SEEDS, allocation, check_folder, check_shared, command, log, make_folder, one_line, rank,
                 world_size)
from config import branch_variant
from engine import GenerateConfig, context_check
from evaluation import analysis, tables
from evaluation.judge import KEY_ENV, PAPER_JUDGE, Judge, judge_flags_problem
from evaluation.prompts import RowImages
from evaluation.scaling_law import GRID, fit_law
from evaluation.scoring import BENCHMARKS, SCORE_COLUMNS, score
from evaluation.tsv import Benchmark, DataError, read_jsonl, read_tsv
from files import regular_file, write_text
from flags import Command, dispatch, flag
from gates import fingerprint
from inference import InferenceFlags, check_new_tokens, load_engine, open_model, process_device
from shards import LineParts, merged, resumed, share

MAX_NEW_TOKENS = 4096  # InternVLChat's default for all nine (vlmeval/config.py passes none for InternVL3.5)
WINDOW_ROWS = 512  # rows read, prompted and sorted by length at a time: memory is flat in the benchmark's rows
FIT_PARAMETERS = 4  # E, A, alpha, k of scaling_law.law
MAX_FIT_ROWS = 1000  # fit-law's rows: about half a minute on 2 CPU cores at this size (300 starts x rows per step)
# what a prediction row records of the run that produced it; a resume must match every one (the
# model by its fingerprint, not its path: a moved folder is the same model)
RECORD_FIELDS = ("benchmark", "model_fingerprint", "data_fingerprint", "pv", "pl", "vision_branch", "language_branch",
                 "shared_kv", "router", "random_pair", "branches", "max_new_tokens", "max_tiles", "dtype", "quant")
# what a score file copies of the predictions' record: the configuration, the checkpoint it belongs to, and
# the weights' format (--dtype, --quant)
CONFIG_FIELDS = ("model", "model_fingerprint", "model_step", "pv", "pl", "vision_branch", "language_branch",
                 "shared_kv", "router", "random_pair", "branches", "dtype", "quant")


# -- the flags of run, score and fit-law (report: tables.py; lengths, descriptors, cost: analysis.py) ----


@dataclass
class RunConfig(InferenceFlags):
    """`evaluate.py run`'s flags: the inference flags (inference.py), then its own."""
    benchmark: str = flag(None, f"VLMEvalKit dataset name: {', '.join(BENCHMARKS)}", required=True)
    data: str = flag(None, "the benchmark's VLMEvalKit TSV", required=True, reads=True)
    out: str = flag(None, "predictions JSONL; rows already there are skipped (resume)", required=True, writes=True)
    batch_size: int = flag(8, "prompts per generate call", range="[1, inf)")
    max_new_tokens: int = flag(MAX_NEW_TOKENS, "token budget per answer", unit="tokens", range="[1, inf)",
                               shown=f"{MAX_NEW_TOKENS}, VLMEvalKit's")
    random_pair: bool = flag(False, "one branch pair per row drawn at random, seeded by --seed and the row's index "
                                    "(Table 3's baseline)")
    seed: int = flag(SEED, "seed of --random-pair", shown=f"{SEED}, the paper's", range=SEEDS)

    def check(self) -> None:
        super().check()
        if self.random_pair and self.shared_kv:  # one pair per row has no branches to share a cache over
            raise ValueError("--random-pair runs one branch pair per row; it cannot be combined with --shared-kv")
        for name, used in (("--router", self.router), ("--vision-branch", self.vision_branch is not None),
                           ("--language-branch", self.language_branch is not None)):
            if self.random_pair and used:
                raise ValueError(f"--random-pair picks the branches per row; it cannot be combined with {name}")


@dataclass
class ScoreConfig:
    """`evaluate.py score`'s flags."""
    benchmark: str = flag(None, "VLMEvalKit dataset name", required=True)
    data: str = flag(None, "the benchmark's VLMEvalKit TSV", required=True, reads=True)
    predictions: str = flag(None, "JSONL from `run` (index, prediction)", required=True, reads=True)
    out: str | None = flag(None, "also write the score JSON here", writes=True)
    rows_out: str | None = flag(None, "write per-row results (JSONL) here", writes=True)
    judge_url: str | None = flag(None, "OpenAI-compatible base URL (…/v1) of an answer extractor")
    judge_model: str | None = flag(None, f"model name sent to the answer extractor (the paper: {PAPER_JUDGE})")
    judge_cache: str | None = flag(None, "reply cache", shown="PREDICTIONS.judge-MODEL.jsonl", writes=True)
    vlmevalkit: str | None = flag(None, "a VLMEvalKit checkout, whose extraction prompts the judge is sent",
                                  reads=True)
    judge_key_env: str = flag(KEY_ENV, "environment variable holding the extractor's API key, sent as a bearer "
                                       "token (a key is never a flag); unset: none sent")

    def check(self) -> None:
        """The answer extractor's flags (judge.judge_flags_problem): a flag error, exit 2."""
        if why := judge_flags_problem(self.judge_url, self.judge_model, self.vlmevalkit, self.judge_key_env):
            raise ValueError(why)


@dataclass
class FitLawConfig:
    """`evaluate.py fit-law`'s flags."""
    csv: str = flag(None, "CSV with columns params (raw parameter count), p, loss", positional=True, reads=True)


# -- run: prompts ------------------------------------------------------------------------------


# -- run: the loop -----------------------------------------------------------------------------


def random_pair(seed: int, index: str, pv: int, pl: int) -> tuple[int, int]:
    """Table 3's random baseline: row `index`'s (vision, language) branch pair, uniform and seeded by
    (seed, index) alone, so it does not depend on the batch, the world size or a resume."""
    rng = random.Random(f"{seed}:{index}")  # a str seed hashes with sha512: the same in every process
    return rng.randrange(pv), rng.randrange(pl)


def file_fingerprint(path) -> str:
    """The first 16 hex digits of a file's sha256 (a benchmark TSV: which rows were asked)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]



def predict_all(cfg: RunConfig) -> int:
    """`run`: the greedy answer to every row of a benchmark TSV, one resumable job the ranks share
    (shards.py): rank r answers rows r, r + W, ... of the rows no earlier run finished, appends them
    to OUT.part{r} batch by batch, and rank 0 merges every part into OUT in TSV order. The TSV is read in a
    stream (tsv.Benchmark), WINDOW_ROWS rows at a time, and an image rows share is decoded once. One --out, one
    writer (COMMANDS' writes: cli.one_writer): a second run at the same --out is refused before it reads
    anything there."""
    if cfg.benchmark not in BENCHMARKS:
        raise DataError(f"unknown benchmark {cfg.benchmark!r}; choose from {', '.join(BENCHMARKS)}")
    bench = Benchmark(cfg.data, ("index", "question", "image") + SCORE_COLUMNS.get(cfg.benchmark, ()))
    device = process_device(cfg)  # under torchrun: cuda:LOCAL_RANK
    out = Path(cfg.out)
    if rank() == 0:
        make_folder(out.parent, "--out")
    check_shared(out.parent, "--out")  # more than one machine: every rank writes its part beside it
    parts = LineParts(out, read_jsonl, key=lambda p: str(p["index"]))
    resumed(parts.mend)  # a line an interrupted run cut short goes, before any rank reads the parts
    done = resumed(parts.done)  # rows finished by an earlier run, of any world size
    todo = [i for i in bench.order if i not in done]
    folder, mcfg, tok = open_model(cfg)  # checked before the weights load
    check_new_tokens(cfg.max_new_tokens, mcfg)
    engine = load_engine(cfg, folder, device)
    par = engine.model.cfg.par
    meta = run_record(cfg, folder, engine.model, engine.dtype)
    check_same_run(parts, meta)
    log(f"{cfg.benchmark}: {len(bench.order)} rows, {len(done)} done, {len(todo)} to run on {world_size()} rank(s); "
        f"Pv:Pl = {par.pv}:{par.pl}, {engine.dtype}, {device}, batch {cfg.batch_size}")
    t0 = time.perf_counter()
    with parts.appending() as keep:
        n_done, skipped = answer_rows(cfg, engine, tok, bench, set(share(todo)), meta, keep)
    elapsed = time.perf_counter() - t0
    skipped = ranks_total(skipped, device)  # every part file is complete; corrupt rows counted over all ranks
    rows_merged = merged(lambda: parts.merge(bench.order))  # one file in TSV order, whatever the world size
    if rank() == 0:
        print(json.dumps({"benchmark": cfg.benchmark, "rows": rows_merged, "new": rows_merged - len(done),
                          "skipped": skipped, "seconds": round(elapsed, 3),
                          "samples_per_s": round(n_done / elapsed, 3) if elapsed > 0 else None,
                          "world_size": world_size(), "batch_size": cfg.batch_size}))
    return 0


def answer_rows(cfg: RunConfig, engine, tok, bench: Benchmark, mine: set, meta: dict, keep) -> tuple[int, int]:
    """This rank's rows (`mine`), read from the TSV WINDOW_ROWS at a time, each window's prompts sorted longest
    first and answered batch by batch into this rank's part (keep): how many rows were answered and skipped.
    Memory holds one window of rows and one batch of pixels, whatever the benchmark's size."""
    images, mcfg, t0 = RowImages(bench.shared.values()), engine.model.cfg, time.perf_counter()
    n_done = new_tokens = skipped = 0
    for window in windows((r for r in bench.rows() if r["index"] in mine), max(WINDOW_ROWS, cfg.batch_size)):
        items, bad = prompts(cfg, window, mcfg, tok, images)
        skipped += bad
        for records in predict(cfg, engine, tok, items, meta, images):
            keep(records)
            n_done += len(records)
            new_tokens += sum(p["new_tokens"] for p in records)
            dt = time.perf_counter() - t0
            log(f"rank {rank()}: {n_done}/{len(mine)} rows, {n_done / dt:.2f} samples/s, {new_tokens / dt:.1f} new "
                f"tok/s", every_rank=True)
    return n_done, skipped


def windows(rows: Iterator[dict], size: int) -> Iterator[list[dict]]:
    """rows, `size` at a time."""
    window: list[dict] = []
    for r in rows:
        window.append(r)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def run_record(cfg: RunConfig, folder: Path, model, dtype: torch.dtype) -> dict:
    """What every prediction row records of the run that produced it: RECORD_FIELDS and the model's folder."""
    par = model.cfg.par
    return {"benchmark": cfg.benchmark, "model": str(folder), "model_fingerprint": fingerprint(model),
            "model_step": trained_step(folder),  # the run's step it was exported at (Table 3 names its checkpoint)
            "data_fingerprint": file_fingerprint(cfg.data), "pv": par.pv, "pl": par.pl,
            "vision_branch": cfg.vision_branch, "language_branch": cfg.language_branch, "shared_kv": cfg.shared_kv,
            "router": cfg.router, "random_pair": cfg.seed if cfg.random_pair else None,
            "branches": branch_variant(par), "max_new_tokens": cfg.max_new_tokens, "max_tiles": cfg.max_tiles,
            "dtype": str(dtype).removeprefix("torch."), "quant": model.quant}


def check_same_run(parts: LineParts, meta: dict) -> None:
    """A resume continues the same run only: every row already written must record what meta says."""
    for f in parts.files():
        for p in read_jsonl(f):
            differ = next((k for k in RECORD_FIELDS if p.get(k) != meta[k]), None)
            if differ is not None:
                raise DataError(f"{f}: holds predictions of another run ({differ} {p.get(differ)!r} there, "
                                f"{meta[differ]!r} now); remove it or pick another --out")


def prompts(cfg: RunConfig, rows: list[dict], mcfg, tok, images: RowImages) -> tuple[list, int]:
    """This rank's rows with their prompts' token ids, longest first (similar lengths share a batch: less
    padding), and how many rows were skipped, each reported: a corrupt image, a question that cannot be a
    prompt (processor.check_text), a prompt whose answer would pass the model's context. Only the ids are kept:
    the tiles are counted here and made batch by batch, so memory holds one batch of pixels, not the window's."""
    items, skipped = [], 0
    for r in rows:
        try:  # a row that cannot be asked (a corrupt image, a prompt past the context) is named and skipped
            prompt, _ = images.inputs(cfg.benchmark, r, cfg.max_tiles, mcfg, tiles=False)
            ids = tok.encode(prompt)
            context_check(len(ids), cfg.max_new_tokens, mcfg.llm.max_position_embeddings)
        except ValueError as e:
            log(f"row {r['index']}: {one_line(e)[:300]}; skipped", every_rank=True)
            skipped += 1
            continue
        items.append((r, ids))
    items.sort(key=lambda x: -len(x[1]))
    return items, skipped


def predict(cfg: RunConfig, engine, tok, items: list, meta: dict, images: RowImages) -> Iterator[list[dict]]:
    """Greedy answers to items, --batch-size prompts per generate call: each batch's prediction rows
    (the answer as the official chat() decodes it, its token count, meta, and the pair a routed or
    random-pair row ran)."""
    mcfg, gen = engine.model.cfg, GenerateConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0)
    for b in range(0, len(items), cfg.batch_size):
        batch = items[b:b + cfg.batch_size]
        with allocation(f"--batch-size {cfg.batch_size} (longest prompt {len(batch[0][1])} tokens, up to "
                        f"{gen.max_new_tokens} new)", "--batch-size, --max-tiles or --max-new-tokens"):
            pixels = [p for p in (images.inputs(cfg.benchmark, r, cfg.max_tiles, mcfg)[1] for r, _ in batch)
                      if p is not None]  # the batch's tiles, on the device
            pv = torch.cat(pixels).to(engine.device, engine.dtype) if pixels else None
            drawn = ([random_pair(cfg.seed, r["index"], mcfg.par.pv, mcfg.par.pl) for r, _ in batch]
                     if cfg.random_pair else None)
            kw = {"vision_branch": [v for v, _ in drawn], "language_branch": [l for _, l in drawn]} if drawn else {}
            res = engine.generate([ids for _, ids in batch], pv, gen, stop_ids=tok.eos_ids, pad_id=0, **kw)
        records = []
        for k, ((r, _), toks) in enumerate(zip(batch, res.tokens)):
            routed = {"pair": list(drawn[k] if drawn else res.pairs[k])} if drawn or res.pairs is not None else {}
            records.append({"index": r["index"], "prediction": tok.answer(toks),  # the official chat()'s decoding
                            **meta, "new_tokens": len(toks), **routed})
        yield records


def ranks_total(n: int, device: torch.device) -> int:
    """n summed over the ranks."""
    if not dist.is_initialized():
        return n
    count = torch.tensor([n], device=device)
    dist.all_reduce(count)
    return int(count)


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
    absent = [r["index"] for r in rows if r["index"] not in predictions]  # scored as wrong: an empty answer
    predictions |= dict.fromkeys(absent, "")
    judge = make_judge(cfg)
    extract = None if judge is None else (
        lambda kind, row, pred: None if row["index"] in absent else judge(kind, row, pred))
    result = score(cfg.benchmark, rows, predictions, extract)
    missing = len(absent)
    if missing:
        log(f"warning: {missing} TSV rows have no prediction and count as wrong (index {', '.join(absent[:10])}"
            f"{', ...' if missing > 10 else ''})")
    if cfg.rows_out:
        write_text(Path(cfg.rows_out), "".join(json.dumps(x, ensure_ascii=False, default=str) + "\n"
                                               for x in result.per_row))
    config = {k: preds[0].get(k) for k in CONFIG_FIELDS} if preds else {}
    line = {"benchmark": cfg.benchmark, "score": round(result.value, 4), "n": result.n,
            "unresolved": result.unresolved, "missing": missing, "missing_indices": absent, **config, **result.extra}
    # which answer extractor made it, None for none: a report refuses a study that mixes the two (Table S6: "Both
    # variants use the same gpt-4o-2024-11-20 answer extractor")
    line |= {"judge_model": cfg.judge_model if judge else None, "judge_calls": judge.calls if judge else 0}
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
        raise DataError(f"{path}: holds no prediction (evaluate.py run's output has one JSON line per row)")
    known = {r["index"] for r in rows}
    for p in preds:
        if "index" not in p or "prediction" not in p:
            raise DataError(f"{path}: a row lacks 'index' or 'prediction': {json.dumps(p)[:120]}")
        if str(p["index"]) not in known:
            raise DataError(f"{path}: prediction index {p['index']!r} is not in {cfg.data}")
        if p.get("benchmark", cfg.benchmark) != cfg.benchmark:
            raise DataError(f"{path}: predictions of {p['benchmark']}, not of --benchmark {cfg.benchmark}")
    seen: set[str] = set()
    for p in preds:
        if str(p["index"]) in seen:
            raise DataError(f"{path}: index {p['index']!r} is predicted twice")
        seen.add(str(p["index"]))
    made_from = {p["data_fingerprint"] for p in preds if "data_fingerprint" in p}
    if made_from and made_from != {file_fingerprint(cfg.data)}:
        raise DataError(f"{path}: made from another TSV than {cfg.data} (data fingerprint "
                        f"{', '.join(sorted(made_from))}, this TSV {file_fingerprint(cfg.data)})")
    return preds


def make_judge(cfg: ScoreConfig) -> Judge | None:
    """The answer extractor --judge-url names (judge.py), its replies cached beside the predictions; None without."""
    if not cfg.judge_url:
        return None  # the flags were checked at parse (ScoreConfig.check)
    cache = Path(cfg.judge_cache or str(cfg.predictions) + f".judge-{cfg.judge_model.replace('/', '_')}.jsonl")
    return Judge(cfg.judge_url, cfg.judge_model, cache, Path(cfg.vlmevalkit), cfg.benchmark, cfg.judge_key_env)


# -- fit-law: ParScale's parallel scaling law (scaling_law.py) ------------------------------------


def fit_law_cmd(cfg) -> int:
    try:
        # -sig: a byte-order mark is not a column name; regular_file: a FIFO would block the read
        with open(regular_file(cfg.csv), newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            missing = [c for c in ("params", "p", "loss") if c not in (reader.fieldnames or ("params", "p", "loss"))]
            if missing:  # before the rows: a TSV's base64 image cells would pass csv's field limit
                raise DataError(f"{cfg.csv}: missing column(s) {', '.join(missing)} (a CSV of params,p,loss)")
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:  # csv.Error: a binary file, a field past the limit
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
    points = set(zip(N, P))  # rows at one (params, p) are one point of the law, whatever their losses
    if len(points) < FIT_PARAMETERS + 1 or len(set(N)) < 2 or len(set(P)) < 2:
        # as many points as parameters fit them exactly (R^2 = 1 says nothing); A and alpha need two sizes, k two p
        rows_note = f" in {len(rows)} rows" if len(rows) != len(points) else ""
        raise DataError(f"{cfg.csv}: {len(points)} point{'s' * (len(points) > 1)}{rows_note}; the law has "
                        f"{FIT_PARAMETERS} parameters (E, A, alpha, k), so fitting it needs at least "
                        f"{FIT_PARAMETERS + 1} distinct (params, p) points with two params and two p values at least "
                        f"(here {len(set(N))} and {len(set(P))})")
    if len(rows) > MAX_FIT_ROWS:  # every start's L-BFGS runs over every row: minutes past this, hours at 10**5
        raise DataError(f"{cfg.csv}: {len(rows)} rows; the fit runs {len(GRID)} L-BFGS starts over every row, which "
                        f"takes too long past {MAX_FIT_ROWS:,} rows: average each (params, p)'s losses into one row")
    fit = fit_law(N, P, L)
    if not all(math.isfinite(v) for k, v in fit.items() if k not in ("pred", "r2")):
        raise DataError(f"{cfg.csv}: the fit did not converge to finite parameters ({fit['E']}, {fit['A']}, "
                        f"{fit['alpha']}, {fit['k']})")
    print(f"{'params':>14} {'p':>4} {'loss':>8} {'fitted':>8} {'error':>8}")
    for n, p, l, q in zip(N, P, L, fit["pred"]):
        print(f"{n:>14,.0f} {p:>4g} {l:>8.4f} {q:>8.4f} {q - l:>+8.4f}")
    print(json.dumps({k: v for k, v in fit.items() if k != "pred"}))
    return 0


# -- the command ---------------------------------------------------------------------------------


DESCRIPTION = __doc__.split("\n\n")[0]
COMMANDS = {
    "run": Command(RunConfig, predict_all, "generate predictions for a benchmark TSV", writes=lambda cfg: Path(cfg.out),
                   interrupted=lambda cfg: "the predictions written so far stay; the same command resumes"),
    "score": Command(ScoreConfig, score_cmd, "score predictions with the benchmark's native metric"),
    "report": Command(tables.ReportConfig, tables.report, "tables from score files of several configurations"),
    "lengths": Command(analysis.LengthsConfig, analysis.lengths_cmd, "Table S5: decoded lengths of two "
                       "configurations, paired, with a bootstrap interval"),
    "descriptors": Command(analysis.DescriptorsConfig, analysis.descriptors_cmd, "Table S2: each benchmark's source "
                           "pixels, question and reference tokens, best Pv:Pl"),
    "cost": Command(analysis.CostConfig, analysis.cost_cmd, "Figure 4: the score of each configuration against its "
                    "latency and peak memory"),
    "fit-law": Command(FitLawConfig, fit_law_cmd, "fit ParScale's parallel scaling law to a CSV of losses"),
}


def main(argv=None) -> int:
    return dispatch(DESCRIPTION, COMMANDS, argv)


if __name__ == "__main__":
    command(main)
