"""Benchmark: train.py with sequence packing against one padded row per sample, side by side on CPU.

A mid-size random ParVL (the tests' tiny InternViT, a 4-layer Qwen3-shaped decoder of width 512)
trains on one synthetic dataset with a realistic length mix: mostly short rows (a question and a
short answer), some medium ones, a few long ones, and one in ten with a 448 px image (256 image
tokens). The same global batches go through

    unpacked, micro-batch 1    one sample per forward: no padding, many small forwards
    unpacked, micro-batch M    M samples per forward, padded to the longest
    packed, micro-batch 1      first fit into rows of --max-seq-len tokens, one row per forward

in interleaved rounds (A B C, A B C, ...), each round a fresh train.py run of --steps steps. From
its metrics.jsonl: samples/s (the steps after the first) and the padding fraction (padding tokens
over all token slots of the forwards). The table shows the best round (another process can only
add time on a shared CPU) and the median. Not a test (pytest never collects it): it lives in tests/
because the checkpoint helpers are test-only.

    python bench/bench_packing.py                  # defaults below, a few minutes on 2 cores
    python bench/bench_packing.py --rounds 3 --steps 6

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

from config import PRESETS  # noqa: E402
from loading.pretrained import save_pretrained  # noqa: E402
from parvl import ParVL  # noqa: E402

WORDS = [
    "the",
    "chart",
    "shows",
    "a",
    "value",
    "of",
    "image",
    "red",
    "blue",
    "line",
    "sum",
    "what",
    "is",
    "cat",
]
# (share of rows, words in the answer): the length mix
MIX = [(0.70, (5, 30)), (0.25, (50, 150)), (0.05, (350, 650))]  # about 2.8 tokens a word


def write_run_inputs(folder: Path, rows: int, seed: int = 0) -> tuple[Path, Path]:
    """A random-weight checkpoint and `rows` SFT rows of the length mix; returns (model, meta)."""
    ids = write_tiny_tokenizer(folder / "model")
    cfg = PRESETS["tiny"]
    llm = replace(
        cfg.llm,
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
    )
    save_pretrained(
        ParVL.from_config(replace(cfg, llm=llm, image_token_id=ids["img_context_id"]), seed=seed),
        folder / "model",
    )
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (448, 448, 3), dtype=np.uint8)).save(folder / "img.png")
    lines = []
    for i in range(rows):
        lo, hi = MIX[rng.choice(len(MIX), p=[m[0] for m in MIX])][1]
        q = " ".join(rng.choice(WORDS, 12))
        a = " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))
        row = {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        if i % 10 == 0:
            row = {
                "image": "img.png",
                "conversations": [
                    {"from": "human", "value": "<image>\n" + q},
                    {"from": "gpt", "value": a},
                ],
            }
        lines.append(row)
    (folder / "rows.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    meta = {
        "mix": {
            "root": str(folder),
            "annotation": str(folder / "rows.jsonl"),
            "repeat_time": 1,
            "length": rows,
        }
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / "model", folder / "meta.json"


def train(model: Path, meta: Path, out: Path, args, flags: list[str]) -> list[dict]:
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--model",
        str(model),
        "--data",
        str(meta),
        "--out",
        str(out),
        "--overwrite",
        "--dtype",
        "fp32",
        "--global-batch",
        str(args.global_batch),
        "--max-steps",
        str(args.steps),
        "--max-tiles",
        "1",
        "--max-seq-len",
        str(args.max_seq_len),
        "--num-workers",
        "1",
        "--save-every",
        "100000",
        "--no-activation-checkpointing",
        *flags,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode:
        sys.exit(f"train.py failed: {res.stderr[-2000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the three layouts")
    p.add_argument(
        "--steps", type=int, default=5, help="optimizer steps per run (the first is left out)"
    )
    p.add_argument("--global-batch", type=int, default=16, help="samples per step")
    p.add_argument(
        "--micro-batch", type=int, default=8, help="M, samples per forward of the padded layout"
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=2048,
        help="tokens per packed row (and the longest sample)",
    )
    p.add_argument("--threads", type=int, default=2, help="OMP threads of each run")
    args = p.parse_args(argv)
    layouts = {
        "unpacked, micro-batch 1": ["--no-packing", "--micro-batch", "1"],
        f"unpacked, micro-batch {args.micro_batch}": [
            "--no-packing",
            "--micro-batch",
            str(args.micro_batch),
        ],
        "packed, micro-batch 1": ["--packing", "--micro-batch", "1"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model, meta = write_run_inputs(Path(tmp), args.global_batch * args.steps)
        speed = {k: [] for k in layouts}
        pad = {}
        for r in range(args.rounds):
            for name, flags in layouts.items():
                lines = train(model, meta, Path(tmp) / "run", args, flags)
                steady = lines[1:]
                # samples over time, G per step
                speed[name].append(len(steady) / sum(1 / m["samples_per_s"] for m in steady))
                pad[name] = statistics.mean(m["pad_frac"] for m in steady)
                print(
                    f"round {r + 1}: {name}: {speed[name][-1]:.2f} samples/s, padding {pad[name]:.1%}",
                    file=sys.stderr,
                )
    print(
        "| layout | samples/s best | median | padding | x best unpacked |\n| --- | --- | --- | --- | --- |"
    )
    best_unpacked = max(max(speed[k]) for k in list(layouts)[:2])
    for name in layouts:
        print(
            f"| {name} | {max(speed[name]):.2f} | {statistics.median(speed[name]):.2f} | {pad[name]:.1%} | "
            f"{max(speed[name]) / best_unpacked:.2f} |"
        )
    print(json.dumps({"args": vars(args), "samples_per_s": speed, "pad_frac": pad}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
