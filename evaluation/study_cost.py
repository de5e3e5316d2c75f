"""What the study's pieces cost, priced at --plan before a cluster is committed to them: each piece's compute from
the FLOP counter (flops.py, Table S3's calflops count) times the samples it processes, and the total in GPU-hours
at a stated model FLOPs utilisation (--mfu) of a stated peak (--peak-tflops).

A piece's work (Piece.work, set where the plan builds it) names the configuration one sample runs through
(arch, Pv:Pl, branch flags), the forward passes per sample and where its samples are counted:
  - training: 3 passes (a backward costs about two forwards: 6N against 2N FLOPs a token, Kaplan et al. 2020)
    over one epoch of the training data (the subsample: --data-fraction of --data's rows, or its meta.json once
    drawn);
  - a benchmark run: 1 pass per TSV row (its prompt and answer: Table S3's workload); a fixed pair, the random
    pair and the router run one branch pair (1:1's cost, as Table S3 counts a fixed pair);
  - router labels: one 1:1 pass per pair per row (Appendix E: the NLL of all Pv x Pl pairs; 16 at 4:4), on
    --router-data or the whole training subsample (the default: 4.62M rows at the paper's scale);
  - router training: one 1:1 pass per labelled row; profiles: their warm-up and timed generate calls.
Every sample is priced at Table S3's fixed workload (3 tiles, 256 text tokens, 128 response tokens): real SFT
rows have from none to 12 tiles, so the figure is the order of the cost, not a bill. Scoring, the export and
the tables run on the CPU or in seconds: no price. A sample count that cannot be read yet (a missing --data or
TSV) is said, not guessed.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from evaluation.flops import ARCHS, profile_params

TRAIN_PASSES = 3  # forward + backward, in forward passes
SCAN = 64 * 2**20  # bytes of an annotation file read to count (or estimate) its rows
# profiling.py latency: three untimed warm-up and ten timed calls per batch (C.1)
PROFILE_CALLS = 3 + 10


@lru_cache(maxsize=None)
def forward_flops(arch: str, pv: int, pl: int, branches: tuple = ()) -> float:
    """FLOPs of one sample's forward at Table S3's workload (flops.profile_params)."""
    return profile_params(arch, pv, pl, **dict(branches))["total_gflops"] * 1e9


def branch_dict(flags: list[str]) -> tuple:
    """train.py's branch flags (--vit-prefix-len 72, --vision-branches lora --lora-rank 16, --aggregation mean)
    as ParConfig fields, hashable."""
    pairs = zip(flags[::2], flags[1::2])
    return tuple((k[2:].replace("-", "_"), int(v) if v.isdigit() else v) for k, v in pairs)


@lru_cache(maxsize=None)
def meta_rows(path: str) -> int | None:
    """Rows of an SFT meta JSON as train.py counts them (each entry's "length", else its annotation's lines,
    times repeat_time), or None when it cannot be read yet."""
    try:
        meta, total = json.loads(Path(path).read_text()), 0
        for m in meta.values():
            n = m.get("length")
            if n is None:
                n = lines_of(Path(path).resolve().parent / m["annotation"])
            r = float(m.get("repeat_time", 1))
            total += int(n * r) if r < 1 else n * max(int(r), 1)
        return total
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def lines_of(path: Path) -> int:
    """An annotation file's rows: counted up to SCAN bytes; a larger file's estimated from the mean length of
    its first SCAN bytes' lines, so that --plan stays quick on a collection of many GB (its meta entries'
    "length", when given, is exact)."""
    with open(path, "rb") as f:
        head = f.read(SCAN)
        size = f.seek(0, 2)
    lines = sum(1 for line in head.splitlines() if line.strip())
    return lines if size <= SCAN else round(lines * size / len(head))


@lru_cache(maxsize=None)
def tsv_rows(path: str) -> int | None:
    """Rows of a VLMEvalKit TSV (lines after the header), or None when it is not there."""
    try:
        with open(path, "rb") as f:
            return max(sum(1 for line in f if line.strip()) - 1, 0)
    except OSError:
        return None


def samples(work: dict, training: tuple[str, float]) -> int | None:
    """The samples a piece processes: a TSV's rows, a meta JSON's, or the training data's (a fraction of
    --data until the subsample is drawn)."""
    kind, path = work["rows"]
    if kind == "tsv":
        return tsv_rows(str(path))
    if kind == "meta":
        return meta_rows(str(path))
    if kind == "fixed":
        return path
    source, fraction = training
    rows = meta_rows(source)
    return None if rows is None else round(fraction * rows) if fraction else rows


def piece_flops(work: dict | None, training: tuple[str, float]) -> float | None:
    """A piece's FLOPs (0 for no GPU work), None when its samples or its architecture are unknown."""
    if work is None:
        return 0.0
    n = samples(work, training)
    if n is None or work["arch"] not in ARCHS:
        return None
    one = forward_flops(work["arch"], work["pv"], work["pl"], work.get("branches", ()))
    return work.get("passes", 1) * n * one


def gpu_hours(flops: float, mfu: float, peak_tflops: float) -> float:
    return flops / (mfu * peak_tflops * 1e12) / 3600
