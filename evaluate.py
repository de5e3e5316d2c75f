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
and sorted by prompt length, resumable, sharded over torchrun ranks. score: scoring.py, with an
optional OpenAI-compatible answer extractor (--judge-url) fed VLMEvalKit's own extraction prompts,
which are read from a VLMEvalKit checkout (--vlmevalkit DIR) rather than copied here. report:
Eq. A3 aggregates, Pl x Pv grids, best configuration with ties broken toward fewer FLOPs
(flops.py). fit-law: ParScale's parametric_fit.py (Huber on log L, delta 1e-3, L-BFGS from its
grid of starts).

Formats: PRED.jsonl rows {"index", "prediction", "new_tokens", and RECORD_FIELDS: what produced it,
"pair" for a routed or random-pair row}; score JSON {"benchmark", "score" (0-100), "n",
"unresolved", "missing", configuration fields}; fit-law CSV params (raw parameter count N), p, loss.
Bad input: one line on stderr, exit 1 (bad input) or 2 (usage).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import json
import math
import os
import random
import re
import time
from pathlib import Path

import torch

import analysis
from checkpoint import resolve_model
from cli import (SEED, Interrupted, OneLineParser, allocation, check_shared, command, end_processes, error, interruptible,
                 log, make_folder, one_line, os_error, pyplot, rank, resolve_device, resolve_dtype,
                 start_processes, world_size)
from judge import Judge
from scaling_law import fit_law
from scoring import BENCHMARKS, SCORE_COLUMNS, DataError, aggregates, as_list, options, read_jsonl, read_tsv, score

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
# what a prediction row records of the run that produced it; a resume must match every one (the
# model by its fingerprint, not its path: a moved folder is the same model)
RECORD_FIELDS = ("benchmark", "model_fingerprint", "data_fingerprint", "pv", "pl", "vision_branch", "language_branch",
                 "shared_kv", "router", "random_pair", "branches", "max_new_tokens", "max_tiles", "dtype")
CONFIG_FIELDS = ("model", "pv", "pl", "vision_branch", "language_branch", "shared_kv", "router", "random_pair", "branches")
_CJK = re.compile("[\u4e00-\u9fa5]")  # smp/misc.py cn_string


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
        return q + ("\n请直接回答选项字母。" if cn else "\nAnswer with the option's letter from the given choices directly.")
    return q + ("\n请直接回答问题。" if cn else "\nAnswer the question directly.")


def decode_images(row: dict) -> list:
    """The row's images as RGB PIL images (VLMEvalKit writes them to PNG first: lossless)."""
    from processor import open_base64
    return [open_base64(b64, str(k)) for k, b64 in enumerate(as_list(row["image"]))]


def row_inputs(benchmark: str, row: dict, max_tiles: int | None, mcfg):
    """(prompt string, pixel tiles [N,3,px,px] or None) for one row, as generate_v2 builds them; tile
    size, thumbnail and tokens per tile from the model config mcfg. A corrupt image raises ValueError."""
    from PIL import Image

    from processor import ImageError, build_prompt, load_image, place_images
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


def branch_variant(par) -> dict:
    """The checkpoint's branch parameterisation where it is not the paper's (Figure 3, Table S8): the
    ParConfig fields other than the counts that differ from their defaults ({} for the paper's)."""
    from dataclasses import asdict

    from config import ParConfig
    unused = "lora_rank" if par.vision_branches == "prefix" else "vit_prefix_len"
    return {k: v for k, v in asdict(par).items() if k not in ("pv", "pl", unused) and v != getattr(ParConfig(), k)}


def random_pair(seed: int, index: str, pv: int, pl: int) -> tuple[int, int]:
    """Table 3's random baseline: row `index`'s (vision, language) branch pair, uniform and seeded by
    (seed, index) alone, so it does not depend on the batch, the world size or a resume."""
    rng = random.Random(f"{seed}:{index}")  # a str seed hashes with sha512: the same in every process
    return rng.randrange(pv), rng.randrange(pl)


def file_fingerprint(path) -> str:
    """The first 16 hex digits of a file's sha256 (a benchmark TSV: which rows were asked)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def run(args) -> int:
    import torch.distributed as dist

    from config import open_checkpoint
    from engine import GenerateConfig, engine_from_flags
    from gates import fingerprint, router_flag
    from parvl import ParVL

    if args.benchmark not in BENCHMARKS:
        raise DataError(f"unknown benchmark {args.benchmark!r}; choose from {', '.join(BENCHMARKS)}")
    rows = read_tsv(args.data, ("index", "question", "image"))
    distributed = "RANK" in os.environ
    device = start_processes(resolve_device(args.device).type == "cuda")  # under torchrun: cuda:LOCAL_RANK
    me, world = rank(), world_size()
    dtype = resolve_dtype(args.dtype, device)
    out = Path(args.out)
    if me == 0:
        make_folder(out.parent, "--out")
    check_shared(out.parent, "--out")  # more than one machine: every rank writes its part beside it
    part = lambda r: out.with_name(f"{out.name}.part{r}")  # noqa: E731  each rank appends to its own file
    # rows finished by an earlier run, of any world size: the merged file plus unmerged parts
    earlier = lambda: [out] + sorted(out.parent.glob(out.name + ".part*"))  # noqa: E731
    done = {str(p["index"]) for f in earlier() for p in read_jsonl(f)}
    if distributed:
        dist.barrier()  # every rank has read the old files before any rank appends to them
    todo = [r for r in rows if r["index"] not in done]
    folder = resolve_model(args.model)
    _, tok = open_checkpoint(folder)  # checked before the weights load
    model = ParVL.from_pretrained(folder, dtype=dtype, device=device)
    par = model.cfg.par
    engine = engine_from_flags(model, args, router_flag(args.router, model))
    cfg = GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    meta = {"benchmark": args.benchmark, "model": str(folder), "model_fingerprint": fingerprint(model),
            "data_fingerprint": file_fingerprint(args.data), "pv": par.pv, "pl": par.pl,
            "vision_branch": args.vision_branch, "language_branch": args.language_branch, "shared_kv": args.shared_kv,
            "router": args.router, "random_pair": args.seed if args.random_pair else None, "branches": branch_variant(par),
            "max_new_tokens": args.max_new_tokens, "max_tiles": args.max_tiles,
            "dtype": str(dtype).removeprefix("torch.")}
    for f in earlier():  # a resume continues the same run only: every row records what produced it
        for p in read_jsonl(f):
            differ = next((k for k in RECORD_FIELDS if p.get(k) != meta[k]), None)
            if differ is not None:
                raise DataError(f"{f}: holds predictions of another run ({differ} {p.get(differ)!r} there, "
                                f"{meta[differ]!r} now); remove it or pick another --out")
    if me == 0:
        log(f"{args.benchmark}: {len(rows)} rows, {len(done)} done, {len(todo)} to run on {world} rank(s); "
            f"Pv:Pl = {par.pv}:{par.pl}, {dtype}, {device}, batch {args.batch_size}")

    # first pass over this rank's rows: prompt lengths (to sort) and corrupt images (reported, skipped);
    # the tiles are rebuilt batch by batch, so memory holds one batch of pixels, not the benchmark's
    items, skipped = [], 0
    for r in todo[me::world]:
        try:
            prompt, _ = row_inputs(args.benchmark, r, args.max_tiles, model.cfg)
        except ValueError as e:
            log(f"row {r['index']}: {e}; skipped", every_rank=True)
            skipped += 1
            continue
        items.append((r, tok.encode(prompt)))
    items.sort(key=lambda x: -len(x[1]))  # longest first: similar lengths share a batch, less padding
    t0, n_done, new_tokens = time.perf_counter(), 0, 0
    with open(part(me), "a", encoding="utf-8") as f:
        for b in range(0, len(items), args.batch_size):
            batch = items[b:b + args.batch_size]
            pixels = [p for p in (row_inputs(args.benchmark, r, args.max_tiles, model.cfg)[1] for r, _ in batch) if p is not None]
            pv = torch.cat(pixels).to(device, dtype) if pixels else None
            with allocation(f"--batch-size {args.batch_size} (longest prompt {len(batch[0][1])} tokens, up to "
                            f"{cfg.max_new_tokens} new)", "--batch-size, --max-tiles or --max-new-tokens"):
                drawn = [random_pair(args.seed, r["index"], par.pv, par.pl) for r, _ in batch] if args.random_pair else None
                kw = {"vision_branch": [v for v, _ in drawn], "language_branch": [l for _, l in drawn]} if drawn else {}
                res = engine.generate([ids for _, ids in batch], pv, cfg, stop_ids=tok.eos_ids, pad_id=0, **kw)
            lines = []
            for k, ((r, _), toks) in enumerate(zip(batch, res.tokens)):
                text = tok.answer(toks)  # the official chat()'s decoding (processor.Tokenizer.answer)
                routed = {"pair": list(drawn[k] if drawn else res.pairs[k])} if drawn or res.pairs is not None else {}
                lines.append(json.dumps({"index": r["index"], "prediction": text, **meta, "new_tokens": len(toks), **routed},
                                        ensure_ascii=False) + "\n")
                new_tokens += len(toks)
            f.write("".join(lines))  # one call: an interrupt (signals run between calls) leaves whole lines
            f.flush()
            n_done += len(batch)
            dt = time.perf_counter() - t0
            log(f"rank {me}: {n_done}/{len(items)} rows, {n_done / dt:.2f} samples/s, {new_tokens / dt:.1f} new tok/s",
                every_rank=True)
    elapsed = time.perf_counter() - t0
    if distributed:  # every part file is complete; corrupt rows counted over all ranks
        count = torch.tensor([skipped], device=device)
        dist.all_reduce(count)
        skipped = int(count)
    if me == 0:  # merge: one file in TSV order, whatever the world size and the resume history
        order = {r["index"]: k for k, r in enumerate(rows)}
        parts = earlier()
        merged = {str(p["index"]): p for f in parts for p in read_jsonl(f)}
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n"
                               for p in sorted(merged.values(), key=lambda p: order.get(str(p["index"]), len(order)))),
                       encoding="utf-8")
        os.replace(tmp, out)
        for f in parts[1:]:
            f.unlink()
        print(json.dumps({"benchmark": args.benchmark, "rows": len(merged), "new": len(merged) - len(done), "skipped": skipped,
                          "seconds": round(elapsed, 3), "samples_per_s": round(n_done / elapsed, 3) if elapsed > 0 else None,
                          "world_size": world, "batch_size": args.batch_size}))
    end_processes()
    return 0


def score_cmd(args) -> int:
    if args.benchmark not in BENCHMARKS:
        raise DataError(f"unknown benchmark {args.benchmark!r}; choose from {', '.join(BENCHMARKS)}")
    required = ("index", "answer") + SCORE_COLUMNS.get(args.benchmark, ())
    rows = read_tsv(args.data, required)
    preds_path = Path(args.predictions)
    if not preds_path.exists():
        raise DataError(f"{preds_path}: no such predictions file")
    preds = read_jsonl(preds_path)
    known = {r["index"] for r in rows}
    for p in preds:
        if "index" not in p or "prediction" not in p:
            raise DataError(f"{preds_path}: a row lacks 'index' or 'prediction': {json.dumps(p)[:120]}")
        if str(p["index"]) not in known:
            raise DataError(f"{preds_path}: prediction index {p['index']!r} is not in {args.data}")
        if p.get("benchmark", args.benchmark) != args.benchmark:
            raise DataError(f"{preds_path}: predictions of {p['benchmark']}, not of --benchmark {args.benchmark}")
    seen: set[str] = set()
    for p in preds:
        if str(p["index"]) in seen:
            raise DataError(f"{preds_path}: index {p['index']!r} is predicted twice")
        seen.add(str(p["index"]))
    made_from = {p["data_fingerprint"] for p in preds if "data_fingerprint" in p}
    if made_from and made_from != {file_fingerprint(args.data)}:
        raise DataError(f"{preds_path}: made from another TSV than {args.data} (data fingerprint "
                        f"{', '.join(sorted(made_from))}, this TSV {file_fingerprint(args.data)})")
    predictions = {str(p["index"]): str(p["prediction"]) for p in preds}
    absent = [r["index"] for r in rows if r["index"] not in predictions]  # scored as wrong: an empty answer
    predictions |= dict.fromkeys(absent, "")
    judge = None
    if args.judge_url:
        if not args.judge_model or not args.vlmevalkit:
            raise DataError("--judge-url needs --judge-model and --vlmevalkit (a VLMEvalKit checkout, for its prompts)")
        cache = Path(args.judge_cache or str(preds_path) + f".judge-{args.judge_model.replace('/', '_')}.jsonl")
        judge = Judge(args.judge_url, args.judge_model, cache, Path(args.vlmevalkit), args.benchmark)
    extract = None if judge is None else (lambda kind, row, pred: None if row["index"] in absent else judge(kind, row, pred))
    result = score(args.benchmark, rows, predictions, extract)
    missing = len(absent)
    if missing:
        log(f"warning: {missing} TSV rows have no prediction and count as wrong (index {', '.join(absent[:10])}"
            f"{', ...' if missing > 10 else ''})")
    if args.rows_out:
        Path(args.rows_out).write_text("".join(json.dumps(x, ensure_ascii=False, default=str) + "\n" for x in result.per_row))
    config = {k: preds[0].get(k) for k in CONFIG_FIELDS} if preds else {}
    line = {"benchmark": args.benchmark, "score": round(result.value, 4), "n": result.n,
            "unresolved": result.unresolved, "missing": missing, "missing_indices": absent, **config, **result.extra}
    if judge is not None:
        line |= {"judge_model": args.judge_model, "judge_calls": judge.calls}
    if args.out:
        Path(args.out).write_text(json.dumps(line) + "\n")
    print(json.dumps(line))
    return 0


# -- report: the allocation study's tables ------------------------------------------------------


def config_label(c: tuple) -> str:
    if len(c) == 3:  # Table 3's (pv, pl, policy)
        return f"{c[0]}:{c[1]} {c[2]}"
    pv, pl, vb, lb, shared, variant = c
    label = f"{pv}:{pl}" + "".join(f" {k}={v}" for k, v in variant)
    if vb is not None or lb is not None:
        label += f" pair ({'*' if vb is None else vb},{'*' if lb is None else lb})"
    return label + (" sharedKV" if shared else "")


def report(args) -> int:
    from flops import profile_params

    runs: dict[tuple, dict[str, float]] = {}
    policies: dict[tuple, dict[str, float]] = {}  # Table 3: (pv, pl, "random pair (seed S)" or "router R") -> scores
    for name in args.runs:
        try:
            text = Path(name).read_text().strip()
            s = json.loads(text.splitlines()[-1])
            bench, value = s["benchmark"], float(s["score"])
            key = (int(s["pv"]), int(s["pl"]), s.get("vision_branch"), s.get("language_branch"), bool(s.get("shared_kv")),
                   tuple(sorted((s.get("branches") or {}).items())))  # Figure 3 / Table S8 variants apart
        except (OSError, IndexError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{name}: not a score file with benchmark, score, pv, pl ({type(e).__name__}: {e})") from None
        if bench not in BENCHMARKS:
            raise DataError(f"{name}: unknown benchmark {bench!r}")
        into = runs  # a routed or random-pair run goes to Table 3 alone, beside its dense configuration
        if s.get("router") or s.get("random_pair") is not None:
            policy = f"router {s['router']}" if s.get("router") else f"random pair (seed {s['random_pair']})"
            key, into = (key[0], key[1], policy), policies
        if bench in into.setdefault(key, {}):
            raise DataError(f"{name}: a second {bench} score for configuration {config_label(key)}")
        into[key][bench] = value
    configs = sorted(runs, key=lambda c: (c[4], c[2] is not None or c[3] is not None, c[5], c[0], c[1], c[2] or 0, c[3] or 0))
    columns = list(BENCHMARKS) + ["General", "Math", "OCR", "All"]
    table = {c: runs[c] | aggregates(runs[c]) for c in configs}
    flops = {}  # the Table S3 workload on --arch; a fixed branch runs alone: one vision or language branch's cost
    for c in configs:
        flops[c] = profile_params(args.arch, 1 if c[2] is not None else c[0], 1 if c[3] is not None else c[1],
                                  **dict(c[5]))["total_gflops"]
    # Table S2: best configuration per column among full (dense) runs, ties at the reported precision
    # going to fewer FLOPs (fixed-pair runs are diagnostics, Table S9, and do not compete; shared-KV
    # runs are another decoder, Table 4, and compete only with --best-with-shared-kv)
    best = {}
    for col in columns:
        cands = [c for c in configs if c[2] is None and c[3] is None and not c[5] and table[c].get(col) is not None
                 and (args.best_with_shared_kv or not c[4])]  # from Table S4: the paper's parameterisation
        if cands:
            top = max(round(table[c][col], args.tie_decimals) for c in cands)
            tied = [c for c in cands if round(table[c][col], args.tie_decimals) == top]
            best[col] = min(tied, key=lambda c: flops[c])
    fmt = lambda v: "-" if v is None else f"{v:.{args.tie_decimals}f}"  # noqa: E731
    md = ["| Pv:Pl | GFLOPs | " + " | ".join(columns) + " |", "|" + " --- |" * (len(columns) + 2)]
    md += [f"| {config_label(c)} | {flops[c]:.2f} | " + " | ".join(fmt(table[c].get(k)) for k in columns) + " |" for c in configs]
    md += ["", "Best configuration (ties to fewer FLOPs):", ""]
    md += ["| " + " | ".join(best) + " |", "|" + " --- |" * len(best), "| " + " | ".join(config_label(c) for c in best.values()) + " |"]
    grids = {}  # Table 2 / S4 as the paper prints them: Pl rows x Pv columns, per benchmark and aggregate, dense runs only
    dense = [c for c in configs if c[2] is None and c[3] is None and not c[4] and not c[5]]
    pvs, pls = sorted({c[0] for c in dense}), sorted({c[1] for c in dense})
    for col in columns:
        grid = [[table.get((pv, pl, None, None, False, ()), {}).get(col) for pv in pvs] for pl in pls]
        if any(v is not None for row in grid for v in row):
            grids[col] = grid
            md += ["", f"{col}", "", "| Pl \\ Pv | " + " | ".join(map(str, pvs)) + " |", "|" + " --- |" * (len(pvs) + 1)]
            md += [f"| {pl} | " + " | ".join(fmt(v) for v in row) + " |" for pl, row in zip(pls, grid)]
    pairs = fixed_pairs(table, configs, columns)  # Table S9
    for col, p in pairs.items():
        md += ["", f"{col}: fixed pairs (vision branch rows, language branch columns; marginals; best {p['best']})", "",
               "| v \\ l | " + " | ".join(map(str, p["l"])) + " | mean |", "|" + " --- |" * (len(p["l"]) + 2)]
        md += [f"| {v} | " + " | ".join(fmt(x) for x in row) + f" | {fmt(m)} |" for v, row, m in zip(p["v"], p["grid"], p["vision_mean"])]
        md += ["| mean | " + " | ".join(fmt(m) for m in p["language_mean"]) + " | |"]
    table3 = []  # Table 3: per Pv:Pl with a routed or random-pair run, its dense row, then one pair per sample
    for pv, pl in sorted({k[:2] for k in policies}):
        dense_key = (pv, pl, None, None, False, ())
        rows = [(f"{pv}:{pl} dense", runs[dense_key])] if dense_key in runs else []
        rows += [(config_label(k), policies[k]) for k in sorted(policies) if k[:2] == (pv, pl)]
        md += ["", f"Table 3, {pv}:{pl}: one branch pair per sample", "", "| policy | " + " | ".join(columns) + " |",
               "|" + " --- |" * (len(columns) + 1)]
        for label, scores in rows:
            table3.append({"label": label, "pv": pv, "pl": pl, "scores": scores | aggregates(scores)})
            md += [f"| {label} | " + " | ".join(fmt(table3[-1]["scores"].get(k)) for k in columns) + " |"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(md) + "\n")
    data = {"configs": [{"label": config_label(c), "pv": c[0], "pl": c[1], "vision_branch": c[2], "language_branch": c[3],
                         "shared_kv": c[4], "branches": dict(c[5]), "gflops": flops[c], "scores": table[c]} for c in configs],
            "best": {k: config_label(c) for k, c in best.items()}, "grid_pv": pvs, "grid_pl": pls, "grids": grids,
            "pairs": pairs, "table3": table3}
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    print("\n".join(md))
    heatmaps(grids, pvs, pls, out)
    print(json.dumps({"report": str(out / "report.md"), "configs": len(configs), "best": data["best"]}))
    return 0


def fixed_pairs(table: dict, configs: list, columns: list) -> dict:
    """Table S9 from fixed-pair runs (both branches set): per column the vision x language matrix, each
    branch's mean over its partners (only where all partners were run) and the post-hoc best pair."""
    runs = [c for c in configs if c[2] is not None and c[3] is not None]
    out = {}
    for col in columns:
        mine = [c for c in runs if table[c].get(col) is not None]
        if not mine:
            continue
        got = {(c[2], c[3]): table[c][col] for c in mine}
        vs, ls = list(range(max(c[0] for c in mine))), list(range(max(c[1] for c in mine)))  # every branch
        grid = [[got.get((v, l)) for l in ls] for v in vs]
        mean = lambda xs: sum(xs) / len(xs) if None not in xs else None  # noqa: E731
        top = max(got.values())
        out[col] = {"v": vs, "l": ls, "grid": grid, "vision_mean": [mean(row) for row in grid],
                    "language_mean": [mean([row[j] for row in grid]) for j in range(len(ls))],
                    "best": [list(k) for k, x in got.items() if x == top]}
    return out


def heatmaps(grids: dict, pvs: list, pls: list, out: Path) -> None:
    """One PNG per grid (the Table S4 heatmaps); matplotlib is optional."""
    try:
        plt = pyplot()
    except ValueError:  # matplotlib is optional
        log("matplotlib is not installed: heatmaps skipped (the tables are written)")
        return
    for col, grid in grids.items():
        fig, ax = plt.subplots(figsize=(3.2, 2.8))
        vals = [[math.nan if v is None else v for v in row] for row in grid]
        im = ax.imshow(vals, cmap="viridis")
        ax.set_xticks(range(len(pvs)), pvs), ax.set_yticks(range(len(pls)), pls)
        ax.set_xlabel("Pv"), ax.set_ylabel("Pl"), ax.set_title(col)
        for i, j in itertools.product(range(len(pls)), range(len(pvs))):
            if not math.isnan(vals[i][j]):
                ax.text(j, i, f"{vals[i][j]:.1f}", ha="center", va="center", color="w")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(out / f"heatmap_{col}.png", dpi=100)
        plt.close(fig)


# -- fit-law: ParScale's parallel scaling law (scaling_law.py) ------------------------------------


def fit_law_cmd(args) -> int:
    try:
        with open(args.csv, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in ("params", "p", "loss") if c not in (reader.fieldnames or ("params", "p", "loss"))]
            if missing:  # before the rows: a TSV's base64 image cells would pass csv's field limit
                raise DataError(f"{args.csv}: missing column(s) {', '.join(missing)} (a CSV of params,p,loss)")
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as e:  # csv.Error: a binary file, a field past the limit
        raise DataError(f"{args.csv}: not a readable CSV ({one_line(e)})") from None
    if not rows:
        raise DataError(f"{args.csv}: empty CSV (need a header params,p,loss and data rows)")
    try:
        N, P, L = ([float(r[c]) for r in rows] for c in ("params", "p", "loss"))
    except (TypeError, ValueError) as e:
        raise DataError(f"{args.csv}: a params, p or loss cell is not a number ({e})") from None
    if not all(map(math.isfinite, N + P + L)):
        raise DataError(f"{args.csv}: a params, p or loss cell is not finite (nan or inf)")
    if min(N) <= 0 or min(P) < 1 or min(L) <= 0:
        raise DataError(f"{args.csv}: need params > 0, p >= 1 and loss > 0")
    if len(rows) < FIT_PARAMETERS + 1:  # as many points as parameters fit them exactly: R^2 = 1 says nothing
        raise DataError(f"{args.csv}: {len(rows)} points; the law has {FIT_PARAMETERS} parameters (E, A, alpha, k), "
                        f"so fitting it needs at least {FIT_PARAMETERS + 1}")
    fit = fit_law(N, P, L)
    if not all(math.isfinite(v) for k, v in fit.items() if k != "pred"):
        raise DataError(f"{args.csv}: the fit did not converge to finite parameters ({fit['E']}, {fit['A']}, {fit['alpha']}, {fit['k']})")
    print(f"{'params':>14} {'p':>4} {'loss':>8} {'fitted':>8} {'error':>8}")
    for n, p, l, q in zip(N, P, L, fit["pred"]):
        print(f"{n:>14,.0f} {p:>4g} {l:>8.4f} {q:>8.4f} {q - l:>+8.4f}")
    print(json.dumps({k: v for k, v in fit.items() if k != "pred"}))
    return 0


# -- the command ---------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="generate predictions for a benchmark TSV")
    r.add_argument("--benchmark", required=True, help=f"VLMEvalKit dataset name: {', '.join(BENCHMARKS)}")
    r.add_argument("--data", required=True, help="the benchmark's VLMEvalKit TSV")
    r.add_argument("--model", default=os.environ.get("PARVL_MODEL"), help="checkpoint folder or hub repo id (default: $PARVL_MODEL, else OpenGVLab/InternVL3_5-1B)")
    r.add_argument("--out", required=True, help="predictions JSONL; rows already there are skipped (resume)")
    r.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    r.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, help=f"token budget per answer (default {MAX_NEW_TOKENS}, VLMEvalKit's)")
    r.add_argument("--max-tiles", type=int, default=None, help="tiles per image (default: VLMEvalKit's budget for the benchmark)")
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default bf16 on CUDA, fp32 on CPU")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (each rank its LOCAL_RANK's GPU) or cpu")
    r.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decode step (default: on for CUDA, off for CPU)")
    r.add_argument("--shared-kv", action="store_true", help="one mean-reduced token KV cache per sample (Appendix C.2)")
    r.add_argument("--vision-branch", type=int, default=None, help="run only this vision branch (Table S9; default all)")
    r.add_argument("--language-branch", type=int, default=None, help="run only this language branch (default all)")
    r.add_argument("--router", default=None, help="router folder (router.py train): one branch pair per row, chosen "
                                                  "by the router (Table 3; default: none)")
    r.add_argument("--random-pair", action="store_true", help="one branch pair per row drawn at random, seeded by "
                                                              "--seed and the row's index (Table 3's baseline)")
    r.add_argument("--seed", type=int, default=SEED, help=f"seed of --random-pair (default {SEED}, the paper's)")
    s = sub.add_parser("score", help="score predictions with the benchmark's native metric")
    s.add_argument("--benchmark", required=True)
    s.add_argument("--data", required=True, help="the benchmark's VLMEvalKit TSV")
    s.add_argument("--predictions", required=True, help="JSONL from `run` (index, prediction)")
    s.add_argument("--out", help="also write the score JSON here")
    s.add_argument("--rows-out", help="write per-row results (JSONL) here")
    s.add_argument("--judge-url", help="OpenAI-compatible base URL (…/v1) of an answer extractor")
    s.add_argument("--judge-model", help="model name sent to the answer extractor (the paper: gpt-4o-2024-11-20)")
    s.add_argument("--judge-cache", help="reply cache (default: PREDICTIONS.judge-MODEL.jsonl)")
    s.add_argument("--vlmevalkit", help="a VLMEvalKit checkout, whose extraction prompts the judge is sent")
    rp = sub.add_parser("report", help="tables from score files of several configurations")
    rp.add_argument("runs", nargs="+", help="score JSON files written by `score --out` (or its stdout)")
    rp.add_argument("--out", default="report", help="output folder for report.md, report.json, heatmaps (default report)")
    rp.add_argument("--arch", default="1b", help="backbone for the FLOPs tie-break (flops.py; default 1b)")
    rp.add_argument("--tie-decimals", type=int, default=1, help="scores equal at this many decimals tie (default 1, the paper's)")
    rp.add_argument("--best-with-shared-kv", action="store_true", help="let shared-KV runs compete for the best configuration")
    ln = sub.add_parser("lengths", help="Table S5: decoded lengths of two configurations, paired, with a bootstrap interval")
    ln.add_argument("--model", required=True, help="checkpoint whose tokenizer re-tokenises the answers")
    for side in ("a", "b"):
        ln.add_argument(f"--{side}", nargs="+", required=True, metavar="JSONL", help=f"configuration {side.upper()}'s "
                        "predictions (evaluate.py run), one file per benchmark")
    ln.add_argument("--names", nargs=2, default=["A", "B"], help="the two configurations' names in the table")
    ln.add_argument("--near-cap", type=int, default=4090, help="answers of this many tokens or more are left out (default "
                                                                "4090 of the 4096 budget, the paper's)")
    ln.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    ln.add_argument("--seed", type=int, default=SEED, help=f"bootstrap seed (default {SEED}, the paper's)")
    ln.add_argument("--out", help="also write the JSON here")
    d = sub.add_parser("descriptors", help="Table S2: each benchmark's source pixels, question and reference tokens, best Pv:Pl")
    d.add_argument("data", nargs="+", help="VLMEvalKit TSVs, named <benchmark>.tsv")
    d.add_argument("--model", required=True, help="checkpoint whose tokenizer counts the tokens")
    d.add_argument("--report", help="report.json of evaluate.py report: its best configuration per benchmark")
    d.add_argument("--predictions", nargs="+", metavar="JSONL", help="the best configuration's predictions (one file "
                                                                     "per benchmark): their mean response tokens")
    d.add_argument("--out", help="also write the JSON here")
    c = sub.add_parser("cost", help="Figure 4: the score of each configuration against its latency and peak memory")
    c.add_argument("--report", required=True, help="report.json of evaluate.py report")
    c.add_argument("--latency", required=True, nargs="+", help="outputs of profiling.py latency --json (their batch-1 rows)")
    c.add_argument("--column", default="All", help="the score column (default All)")
    c.add_argument("--out", help="folder for score_cost.json and, with matplotlib, score_cost.png")
    f = sub.add_parser("fit-law", help="fit ParScale's parallel scaling law to a CSV of losses")
    f.add_argument("csv", help="CSV with columns params (raw parameter count), p, loss")
    args = p.parse_args(argv)
    p.check_ranges(args, {"near_cap": "[1, inf)", "resamples": "[1, inf)", "batch_size": "[1, inf)",
                          "max_new_tokens": "[1, inf)", "max_tiles": "[1, inf)"})
    if args.cmd == "run":
        if args.random_pair and args.shared_kv:  # one pair per row has no branches to share a cache over
            p.error("--random-pair runs one branch pair per row; it cannot be combined with --shared-kv")
        for flag, used in (("--router", args.router), ("--vision-branch", args.vision_branch is not None),
                           ("--language-branch", args.language_branch is not None)):
            if args.random_pair and used:
                p.error(f"--random-pair picks the branches per row; it cannot be combined with {flag}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from checkpoint import CheckpointError
    from processor import ImageError
    try:
        with interruptible():
            commands = {"run": run, "score": score_cmd, "report": report, "lengths": analysis.lengths_cmd,
                        "descriptors": analysis.descriptors_cmd, "cost": analysis.cost_cmd, "fit-law": fit_law_cmd}
            return commands[args.cmd](args)
    except (DataError, CheckpointError, ImageError, ValueError) as e:
        error(f"error: {one_line(e)}")
        return 1
    except OSError as e:  # --out on a read-only file system, or a file where a folder must be
        error(f"error: {os_error(e)}")
        return 1
    except Interrupted as e:  # the predictions written so far stay: the same command resumes
        log(f"interrupted by {e}" + (": the predictions written so far stay; the same command resumes"
                                     if args.cmd == "run" else ""))
        return e.code


if __name__ == "__main__":
    command(main)
