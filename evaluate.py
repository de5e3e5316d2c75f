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
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from PIL import Image

from cli import SEED, allocation, check_shared, command, log, make_folder, one_line, rank, world_size
from config import branch_variant
from engine import GenerateConfig, context_check
from evaluation import analysis, tables
from evaluation.judge import Judge
from evaluation.scaling_law import GRID, fit_law
from evaluation.scoring import BENCHMARKS, SCORE_COLUMNS, score
from evaluation.tsv import DataError, as_list, options, read_jsonl, read_tsv
from flags import Command, dispatch, flag
from gates import fingerprint
from inference import InferenceFlags, load_engine, open_model, process_device
from processor import ImageError, build_prompt, load_image, open_base64, place_images
from shards import LineParts, merged, resumed, share

# Per benchmark: prompt kind (InternVLChat.build_prompt by DATASET_TYPE), tile budget (set_max_num:
# 12 for ChartQA_TEST / MMMU_DEV_VAL, 18 for DocVQA_VAL, 24 for OCRBench, else 6). max_new_tokens
# is InternVLChat's default of 4096 for all nine (vlmeval/config.py passes none for InternVL3.5).
PROTOCOL = {
    "MMMU_DEV_VAL": ("mcq", 12), "MathVista_MINI": ("plain", 6), "MathVision_MINI": ("plain", 6),
    "LogicVista": ("plain", 6), "WeMath": ("mcq", 6), "ChartQA_TEST": ("short", 12),
    "TextVQA_VAL": ("short", 6), "DocVQA_VAL": ("short", 18), "OCRBench": ("short", 24),
}
MAX_NEW_TOKENS = 4096
TOTAL_MAX_TILES = 64  # set_max_num's total_max_num: a row's images share 64 tiles
FIT_PARAMETERS = 4  # E, A, alpha, k of scaling_law.law
MAX_FIT_ROWS = 1000  # fit-law's rows: about half a minute on 2 CPU cores at this size (300 starts x rows per step)
# what a prediction row records of the run that produced it; a resume must match every one (the
# model by its fingerprint, not its path: a moved folder is the same model)
RECORD_FIELDS = ("benchmark", "model_fingerprint", "data_fingerprint", "pv", "pl", "vision_branch", "language_branch",
                 "shared_kv", "router", "random_pair", "branches", "max_new_tokens", "max_tiles", "dtype", "quant")
# what a score file copies of the predictions' record: the configuration, and the checkpoint it belongs to
CONFIG_FIELDS = ("model", "model_fingerprint", "pv", "pl", "vision_branch", "language_branch", "shared_kv", "router",
                 "random_pair", "branches")
_CJK = re.compile("[\u4e00-\u9fa5]")  # smp/misc.py cn_string


# -- the flags of run, score and fit-law (report: tables.py; lengths, descriptors, cost: analysis.py) ----


@dataclass
class RunConfig(InferenceFlags):
    """`evaluate.py run`'s flags: the inference flags (inference.py), then its own."""
    benchmark: str = flag(None, f"VLMEvalKit dataset name: {', '.join(BENCHMARKS)}", required=True)
    data: str = flag(None, "the benchmark's VLMEvalKit TSV", required=True)
    out: str = flag(None, "predictions JSONL; rows already there are skipped (resume)", required=True)
    batch_size: int = flag(8, "prompts per generate call", range="[1, inf)")
    max_new_tokens: int = flag(MAX_NEW_TOKENS, "token budget per answer", unit="tokens", range="[1, inf)",
                               shown=f"{MAX_NEW_TOKENS}, VLMEvalKit's")
    random_pair: bool = flag(False, "one branch pair per row drawn at random, seeded by --seed and the row's index "
                                    "(Table 3's baseline)")
    seed: int = flag(SEED, "seed of --random-pair", shown=f"{SEED}, the paper's")

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
    data: str = flag(None, "the benchmark's VLMEvalKit TSV", required=True)
    predictions: str = flag(None, "JSONL from `run` (index, prediction)", required=True)
    out: str | None = flag(None, "also write the score JSON here")
    rows_out: str | None = flag(None, "write per-row results (JSONL) here")
    judge_url: str | None = flag(None, "OpenAI-compatible base URL (…/v1) of an answer extractor")
    judge_model: str | None = flag(None, "model name sent to the answer extractor (the paper: gpt-4o-2024-11-20)")
    judge_cache: str | None = flag(None, "reply cache", shown="PREDICTIONS.judge-MODEL.jsonl")
    vlmevalkit: str | None = flag(None, "a VLMEvalKit checkout, whose extraction prompts the judge is sent")


@dataclass
class FitLawConfig:
    """`evaluate.py fit-law`'s flags."""
    csv: str = flag(None, "CSV with columns params (raw parameter count), p, loss", positional=True)


# -- run: prompts ------------------------------------------------------------------------------


def question_text(benchmark: str, row: dict) -> str:
    """The text InternVLChat.build_prompt produces for one TSV row."""
    kind = PROTOCOL[benchmark][0]
    q = row["question"] or "nan"
    if kind == "short":  # VQA datasets listed for a one-word answer
        return q + "\nAnswer the question using a single word or phrase."
    if kind == "plain":  # MathVista, MathVision, LogicVista: the question as stored
        return q
    # utils.py build_multi_choice_prompt: hint, question, "\nA. ...", then the instruction
    if row.get("hint") is not None:
        q = row["hint"] + "\n" + q
    opts = options(row)
    q += "".join(f"\n{k}. {v}" for k, v in opts.items())
    cn = _CJK.search(q) is not None
    if opts:
        return q + ("\n请直接回答选项字母。" if cn
                    else "\nAnswer with the option's letter from the given choices directly.")
    return q + ("\n请直接回答问题。" if cn else "\nAnswer the question directly.")


def decode_images(row: dict) -> list:
    """The row's images as RGB PIL images (VLMEvalKit writes them to PNG first: lossless)."""
    return [open_base64(b64, str(k)) for k, b64 in enumerate(as_list(row["image"]))]


def row_inputs(benchmark: str, row: dict, max_tiles: int | None, mcfg):
    """(prompt string, pixel tiles [N,3,px,px] or None) for one row, as generate_v2 builds them; tile
    size, thumbnail and tokens per tile from the model config mcfg. A corrupt image raises ValueError."""
    try:
        images = decode_images(row) if row.get("image") is not None else []
        budget = max_tiles or PROTOCOL[benchmark][1]
        per_image = max(1, min(budget, TOTAL_MAX_TILES // max(1, len(images))))
        if images and benchmark == "MMMU_DEV_VAL":  # generate_v2 upscales MMMU's first image 2x
            images[0] = images[0].resize((images[0].width * 2, images[0].height * 2), Image.BILINEAR)
        tiles = [load_image(img, max_tiles=per_image, use_thumbnail=mcfg.use_thumbnail,
                            image_size=mcfg.vit.image_size) for img in images]
    except (ImageError, OSError, ValueError) as e:
        raise ValueError(f"corrupt image: {one_line(e)[:200]}") from None
    text = question_text(benchmark, row)
    text = place_images(text, len(images), always=True)  # reorganize_prompt's placeholders
    prompt = build_prompt(text, [t.shape[0] for t in tiles], tokens_per_tile=mcfg.tokens_per_tile)
    return prompt, (torch.cat(tiles) if tiles else None)


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
    to OUT.part{r} batch by batch, and rank 0 merges every part into OUT in TSV order. One --out, one
    writer (COMMANDS' writes: cli.one_writer): a second run at the same --out is refused before it reads
    anything there."""
    if cfg.benchmark not in BENCHMARKS:
        raise DataError(f"unknown benchmark {cfg.benchmark!r}; choose from {', '.join(BENCHMARKS)}")
    rows = read_tsv(cfg.data, ("index", "question", "image") + SCORE_COLUMNS.get(cfg.benchmark, ()))
    device = process_device(cfg)  # under torchrun: cuda:LOCAL_RANK
    out = Path(cfg.out)
    if rank() == 0:
        make_folder(out.parent, "--out")
    check_shared(out.parent, "--out")  # more than one machine: every rank writes its part beside it
    parts = LineParts(out, read_jsonl, key=lambda p: str(p["index"]))
    done = resumed(parts.done)  # rows finished by an earlier run, of any world size
    todo = [r for r in rows if r["index"] not in done]
    folder, _, tok = open_model(cfg)  # checked before the weights load
    engine = load_engine(cfg, folder, device)
    model, dtype = engine.model, engine.dtype
    par = model.cfg.par
    meta = run_record(cfg, folder, model, dtype)
    check_same_run(parts, meta)
    log(f"{cfg.benchmark}: {len(rows)} rows, {len(done)} done, {len(todo)} to run on {world_size()} rank(s); "
        f"Pv:Pl = {par.pv}:{par.pl}, {dtype}, {device}, batch {cfg.batch_size}")
    items, skipped = prompts(cfg, share(todo), model.cfg, tok)
    t0, n_done, new_tokens = time.perf_counter(), 0, 0
    with parts.appending() as keep:
        for records in predict(cfg, engine, tok, model.cfg, items, meta, device, dtype):
            keep(records)
            n_done += len(records)
            new_tokens += sum(p["new_tokens"] for p in records)
            dt = time.perf_counter() - t0
            log(f"rank {rank()}: {n_done}/{len(items)} rows, {n_done / dt:.2f} samples/s, {new_tokens / dt:.1f} new "
                f"tok/s", every_rank=True)
    elapsed = time.perf_counter() - t0
    skipped = ranks_total(skipped, device)  # every part file is complete; corrupt rows counted over all ranks
    order = {r["index"]: k for k, r in enumerate(rows)}
    rows_merged = merged(lambda: parts.merge(order))  # one file in TSV order, whatever the world size and resumes
    if rank() == 0:
        print(json.dumps({"benchmark": cfg.benchmark, "rows": rows_merged, "new": rows_merged - len(done),
                          "skipped": skipped, "seconds": round(elapsed, 3),
                          "samples_per_s": round(n_done / elapsed, 3) if elapsed > 0 else None,
                          "world_size": world_size(), "batch_size": cfg.batch_size}))
    return 0


def run_record(cfg: RunConfig, folder: Path, model, dtype: torch.dtype) -> dict:
    """What every prediction row records of the run that produced it: RECORD_FIELDS and the model's folder."""
    par = model.cfg.par
    return {"benchmark": cfg.benchmark, "model": str(folder), "model_fingerprint": fingerprint(model),
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


def prompts(cfg: RunConfig, rows: list[dict], mcfg, tok) -> tuple[list, int]:
    """This rank's rows with their prompts' token ids, longest first (similar lengths share a batch: less
    padding), and how many rows were skipped, each reported: a corrupt image, a question that cannot be a
    prompt (processor.check_text), a prompt whose answer would pass the model's context. Only the ids are kept:
    the tiles are rebuilt batch by batch, so memory holds one batch of pixels, not the benchmark's."""
    items, skipped = [], 0
    for r in rows:
        try:  # a row that cannot be asked (a corrupt image, a prompt past the context) is named and skipped
            prompt, _ = row_inputs(cfg.benchmark, r, cfg.max_tiles, mcfg)
            ids = tok.encode(prompt)
            context_check(len(ids), cfg.max_new_tokens, mcfg.llm.max_position_embeddings)
        except ValueError as e:
            log(f"row {r['index']}: {one_line(e)[:300]}; skipped", every_rank=True)
            skipped += 1
            continue
        items.append((r, ids))
    items.sort(key=lambda x: -len(x[1]))
    return items, skipped


def predict(cfg: RunConfig, engine, tok, mcfg, items: list, meta: dict, device, dtype) -> Iterator[list[dict]]:
    """Greedy answers to items, --batch-size prompts per generate call: each batch's prediction rows
    (the answer as the official chat() decodes it, its token count, meta, and the pair a routed or
    random-pair row ran)."""
    par, gen = mcfg.par, GenerateConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0)
    for b in range(0, len(items), cfg.batch_size):
        batch = items[b:b + cfg.batch_size]
        pixels = [p for p in (row_inputs(cfg.benchmark, r, cfg.max_tiles, mcfg)[1] for r, _ in batch) if p is not None]
        pv = torch.cat(pixels).to(device, dtype) if pixels else None
        with allocation(f"--batch-size {cfg.batch_size} (longest prompt {len(batch[0][1])} tokens, up to "
                        f"{gen.max_new_tokens} new)", "--batch-size, --max-tiles or --max-new-tokens"):
            drawn = [random_pair(cfg.seed, r["index"], par.pv, par.pl) for r, _ in batch] if cfg.random_pair else None
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
        Path(cfg.rows_out).write_text("".join(json.dumps(x, ensure_ascii=False, default=str) + "\n"
                                              for x in result.per_row))
    config = {k: preds[0].get(k) for k in CONFIG_FIELDS} if preds else {}
    line = {"benchmark": cfg.benchmark, "score": round(result.value, 4), "n": result.n,
            "unresolved": result.unresolved, "missing": missing, "missing_indices": absent, **config, **result.extra}
    if judge is not None:
        line |= {"judge_model": cfg.judge_model, "judge_calls": judge.calls}
    if cfg.out:
        Path(cfg.out).write_text(json.dumps(line) + "\n")
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
        return None
    if not cfg.judge_model or not cfg.vlmevalkit:
        raise DataError("--judge-url needs --judge-model and --vlmevalkit (a VLMEvalKit checkout, for its prompts)")
    cache = Path(cfg.judge_cache or str(cfg.predictions) + f".judge-{cfg.judge_model.replace('/', '_')}.jsonl")
    return Judge(cfg.judge_url, cfg.judge_model, cache, Path(cfg.vlmevalkit), cfg.benchmark)


# -- fit-law: ParScale's parallel scaling law (scaling_law.py) ------------------------------------


def fit_law_cmd(cfg) -> int:
    try:
        with open(cfg.csv, newline="", encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not a column name
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
