"""Throughput of `evaluate.py run` on CPU with a tiny random checkpoint: one prompt per generate call
versus batches, on the same TSV (TextVQA-style rows, one 448 px tile each, every row a different
image and question length).

    python bench/bench_evaluate.py --rows 32 --batch-sizes 1 8 --new-tokens 16

Each configuration runs in-process on a fresh output file; samples/s is rows / wall time of the
generation loop (prompt building and model loading excluded), as `run` reports it. Configurations
are interleaved over --repeats rounds and the best round is kept (the CPU is shared, so the best is
the least disturbed). Ends with one JSON line.
"""

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the checkpoint builders
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from inputs import png_b64, write_tsv  # noqa: E402  (needs transformers: test-only)
from official import make_checkpoint  # noqa: E402  (needs transformers: test-only)

import evaluate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    folder = make_checkpoint(tmp, "qwen3", "original")
    words = "what is the name written on the sign in this picture please".split()
    rows = [
        {
            "index": str(i),
            "question": " ".join(words[: 3 + i % 8]) + "?",
            "answer": "['x']",
            "image": png_b64(24 + i % 5, 24 + i % 5, i),
        }
        for i in range(args.rows)
    ]
    tsv = write_tsv(tmp / "TextVQA_VAL.tsv", rows)
    results = {}
    for rep in range(args.repeats):
        for bs in args.batch_sizes:
            out = tmp / f"pred_bs{bs}_{rep}.jsonl"
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                evaluate.main(
                    [
                        "run",
                        "--benchmark",
                        "TextVQA_VAL",
                        "--data",
                        str(tsv),
                        "--model",
                        str(folder),
                        "--out",
                        str(out),
                        "--batch-size",
                        str(bs),
                        "--max-new-tokens",
                        str(args.new_tokens),
                    ]
                )
            summary = json.loads(buf.getvalue().splitlines()[-1])
            results[bs] = max(results.get(bs, 0.0), summary["samples_per_s"])
            print(
                f"round {rep}, batch {bs:>3}: {summary['samples_per_s']:.2f} samples/s "
                f"({summary['seconds']:.2f} s for {args.rows} rows)"
            )
    base = results[args.batch_sizes[0]]
    print(
        json.dumps(
            {
                "rows": args.rows,
                "new_tokens": args.new_tokens,
                "best_samples_per_s": results,
                "speedup": {bs: round(v / base, 2) for bs, v in results.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
