"""`evaluate.py run`: a model's answers to a VLMEvalKit benchmark TSV, one JSON line per row, as VLMEvalKit
asks InternVL3.5 (prompts.py) and with the greedy decoding it uses. The TSV is streamed WINDOW_ROWS rows at
a time, each window's prompts sorted by length into batches; ranks share the rows (shell/shards.py), each
part written as it completes, and a rerun resumes. Every row records what produced it (RECORD_FIELDS): a
resume with other settings or another checkpoint is refused."""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from config import branch_variant
from evaluation.prompts import RowImages
from evaluation.scoring import BENCHMARKS, SCORE_COLUMNS
from evaluation.tsv import Benchmark, DataError, read_jsonl
from gates import fingerprint
from inference.engine import GenerateConfig, context_check
from inference.flags import (
    InferenceFlags,
    check_new_tokens,
    load_engine,
    open_model,
    process_device,
)
from loading.config_json import trained_step
from shell.cli import SEED, SEEDS, allocation, log, one_line, rank, world_size
from shell.flags import flag
from shell.outputs import check_shared, make_folder
from shell.shards import LineParts, merged, resumed, share

MAX_NEW_TOKENS = (
    4096  # InternVLChat's default for all nine (vlmeval/config.py passes none for InternVL3.5)
)


WINDOW_ROWS = 512  # rows read, prompted and sorted by length at a time: memory is flat in the benchmark's rows


# what a prediction row records of the run that produced it; a resume must match every one (the
# model by its fingerprint, not its path: a moved folder is the same model)
RECORD_FIELDS = (
    "benchmark",
    "model_fingerprint",
    "data_fingerprint",
    "pv",
    "pl",
    "vision_branch",
    "language_branch",
    "shared_kv",
    "router",
    "random_pair",
    "branches",
    "max_new_tokens",
    "max_tiles",
    "dtype",
    "quant",
)


@dataclass
class RunConfig(InferenceFlags):
    """`evaluate.py run`'s flags: the inference flags (inference/flags.py), then its own."""

    benchmark: str = flag(None, f"VLMEvalKit dataset name: {', '.join(BENCHMARKS)}", required=True)
    data: str = flag(None, "the benchmark's VLMEvalKit TSV", required=True, reads=True)
    out: str = flag(
        None,
        "predictions JSONL; rows already there are skipped (resume)",
        required=True,
        writes=True,
    )
    batch_size: int = flag(8, "prompts per generate call", range="[1, inf)")
    max_new_tokens: int = flag(
        MAX_NEW_TOKENS,
        "token budget per answer",
        unit="tokens",
        range="[1, inf)",
        shown=f"{MAX_NEW_TOKENS}, VLMEvalKit's",
    )
    random_pair: bool = flag(
        False,
        "one branch pair per row drawn at random, seeded by --seed and the row's index "
        "(Table 3's baseline)",
    )
    seed: int = flag(SEED, "seed of --random-pair", shown=f"{SEED}, the paper's", range=SEEDS)

    def check(self) -> None:
        super().check()
        # one pair per row has no branches to share a cache over
        if self.random_pair and self.shared_kv:
            raise ValueError(
                "--random-pair runs one branch pair per row; it cannot be combined with --shared-kv"
            )
        for name, used in (
            ("--router", self.router),
            ("--vision-branch", self.vision_branch is not None),
            ("--language-branch", self.language_branch is not None),
        ):
            if self.random_pair and used:
                raise ValueError(
                    f"--random-pair picks the branches per row; it cannot be combined with {name}"
                )


def random_pair(seed: int, index: str, pv: int, pl: int) -> tuple[int, int]:
    """Table 3's random baseline: row `index`'s (vision, language) branch pair, uniform and seeded by
    (seed, index) alone, so it does not depend on the batch, the world size or a resume."""
    # a str seed hashes with sha512: the same in every process
    rng = random.Random(f"{seed}:{index}")
    return rng.randrange(pv), rng.randrange(pl)


def file_fingerprint(path) -> str:
    """The first 16 hex digits of a file's sha256 (a benchmark TSV: which rows were asked)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def predict_all(cfg: RunConfig) -> int:
    """`run`: the greedy answer to every row of a benchmark TSV, one resumable job the ranks share
    (shell/shards.py): rank r answers rows r, r + W, ... of the rows no earlier run finished, appends them
    to OUT.part{r} batch by batch, and rank 0 merges every part into OUT in TSV order. The TSV is read in a
    stream (tsv.Benchmark), WINDOW_ROWS rows at a time, and an image rows share is decoded once. One --out, one
    writer (COMMANDS' writes: outputs.one_writer): a second run at the same --out is refused before it reads
    anything there."""
    if cfg.benchmark not in BENCHMARKS:
        raise DataError(f"unknown benchmark {cfg.benchmark!r}; choose from {', '.join(BENCHMARKS)}")
    bench = Benchmark(
        cfg.data, ("index", "question", "image") + SCORE_COLUMNS.get(cfg.benchmark, ())
    )
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
    log(
        f"{cfg.benchmark}: {len(bench.order)} rows, {len(done)} done, {len(todo)} to run on {world_size()} rank(s); "
        f"Pv:Pl = {par.pv}:{par.pl}, {engine.dtype}, {device}, batch {cfg.batch_size}"
    )
    t0 = time.perf_counter()
    with parts.appending() as keep:
        n_done, skipped = answer_rows(cfg, engine, tok, bench, set(share(todo)), meta, keep)
    elapsed = time.perf_counter() - t0
    # every part file is complete; corrupt rows counted over all ranks
    skipped = ranks_total(skipped, device)
    # one file in TSV order, whatever the world size
    rows_merged = merged(lambda: parts.merge(bench.order))
    if rank() == 0:
        print(
            json.dumps(
                {
                    "benchmark": cfg.benchmark,
                    "rows": rows_merged,
                    "new": rows_merged - len(done),
                    "skipped": skipped,
                    "seconds": round(elapsed, 3),
                    "samples_per_s": round(n_done / elapsed, 3) if elapsed > 0 else None,
                    "world_size": world_size(),
                    "batch_size": cfg.batch_size,
                }
            )
        )
    return 0


def answer_rows(
    cfg: RunConfig, engine, tok, bench: Benchmark, mine: set, meta: dict, keep
) -> tuple[int, int]:
    """This rank's rows (`mine`), read from the TSV WINDOW_ROWS at a time, each window's prompts sorted longest
    first and answered batch by batch into this rank's part (keep): how many rows were answered and skipped.
    Memory holds one window of rows and one batch of pixels, whatever the benchmark's size."""
    images, mcfg, t0 = RowImages(bench.shared.values()), engine.model.cfg, time.perf_counter()
    n_done = new_tokens = skipped = 0
    for window in windows(
        (r for r in bench.rows() if r["index"] in mine), max(WINDOW_ROWS, cfg.batch_size)
    ):
        items, bad = prompts(cfg, window, mcfg, tok, images)
        skipped += bad
        for records in predict(cfg, engine, tok, items, meta, images):
            keep(records)
            n_done += len(records)
            new_tokens += sum(p["new_tokens"] for p in records)
            dt = time.perf_counter() - t0
            log(
                f"rank {rank()}: {n_done}/{len(mine)} rows, {n_done / dt:.2f} samples/s, {new_tokens / dt:.1f} new "
                f"tok/s",
                every_rank=True,
            )
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
    return {
        "benchmark": cfg.benchmark,
        "model": str(folder),
        "model_fingerprint": fingerprint(model),
        "model_step": trained_step(
            folder
        ),  # the run's step it was exported at (Table 3 names its checkpoint)
        "data_fingerprint": file_fingerprint(cfg.data),
        "pv": par.pv,
        "pl": par.pl,
        "vision_branch": cfg.vision_branch,
        "language_branch": cfg.language_branch,
        "shared_kv": cfg.shared_kv,
        "router": cfg.router,
        "random_pair": cfg.seed if cfg.random_pair else None,
        "branches": branch_variant(par),
        "max_new_tokens": cfg.max_new_tokens,
        "max_tiles": cfg.max_tiles,
        "dtype": str(dtype).removeprefix("torch."),
        "quant": model.quant,
    }


def check_same_run(parts: LineParts, meta: dict) -> None:
    """A resume continues the same run only: every row already written must record what meta says."""
    for f in parts.files():
        for p in read_jsonl(f):
            differ = next((k for k in RECORD_FIELDS if p.get(k) != meta[k]), None)
            if differ is not None:
                raise DataError(
                    f"{f}: holds predictions of another run ({differ} {p.get(differ)!r} there, "
                    f"{meta[differ]!r} now); remove it or pick another --out"
                )


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


def predict(
    cfg: RunConfig, engine, tok, items: list, meta: dict, images: RowImages
) -> Iterator[list[dict]]:
    """Greedy answers to items, --batch-size prompts per generate call: each batch's prediction rows
    (the answer as the official chat() decodes it, its token count, meta, and the pair a routed or
    random-pair row ran)."""
    mcfg, gen = engine.model.cfg, GenerateConfig(max_new_tokens=cfg.max_new_tokens, temperature=0.0)
    for b in range(0, len(items), cfg.batch_size):
        batch = items[b : b + cfg.batch_size]
        with allocation(
            f"--batch-size {cfg.batch_size} (longest prompt {len(batch[0][1])} tokens, up to "
            f"{gen.max_new_tokens} new)",
            "--batch-size, --max-tiles or --max-new-tokens",
        ):
            # the batch's tiles, on the device
            pixels = [
                p
                for p in (images.inputs(cfg.benchmark, r, cfg.max_tiles, mcfg)[1] for r, _ in batch)
                if p is not None
            ]
            pv = torch.cat(pixels).to(engine.device, engine.dtype) if pixels else None
            drawn = (
                [random_pair(cfg.seed, r["index"], mcfg.par.pv, mcfg.par.pl) for r, _ in batch]
                if cfg.random_pair
                else None
            )
            kw = (
                {"vision_branch": [v for v, _ in drawn], "language_branch": [l for _, l in drawn]}
                if drawn
                else {}
            )
            res = engine.generate(
                [ids for _, ids in batch], pv, gen, stop_ids=tok.eos_ids, pad_id=0, **kw
            )
        records = []
        for k, ((r, _), toks) in enumerate(zip(batch, res.tokens)):
            routed = (
                {"pair": list(drawn[k] if drawn else res.pairs[k])}
                if drawn or res.pairs is not None
                else {}
            )
            records.append(
                {
                    "index": r["index"],
                    "prediction": tok.answer(toks),  # the official chat()'s decoding
                    **meta,
                    "new_tokens": len(toks),
                    **routed,
                }
            )
        yield records


def ranks_total(n: int, device: torch.device) -> int:
    """n summed over the ranks."""
    if not dist.is_initialized():
        return n
    count = torch.tensor([n], device=device)
    dist.all_reduce(count)
    return int(count)
