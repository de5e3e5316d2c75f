"""Peak memory of `evaluate.py run` against the number of rows, on TSVs whose rows share one image by index
(VLMEvalKit's short image cell: the index of the row that holds it), issue 38 item 12: it must be flat.

    python bench/bench_rows.py --rows 1000 10000 100000

Row 0 holds an 800 x 600 px PNG (2 MB of base64), every other row names it by index; --max-tiles (1 by
default: one 448 px tile, 256 image tokens a row) sets the work per row, not how memory grows with the rows.
Each size runs in a fresh process, so its peak RSS (ru_maxrss) is its own, on the tiny random checkpoint.
`--generate stub` (the default) replaces the engine's generate with a one-token answer: the model's memory
does not depend on the rows, and what is measured is the command's own per row (reading the TSV, prompts,
tiles, prediction lines, the merge) in a time 2 CPU cores allow for 10^5 rows; `--generate model` runs the
tiny model itself (slow). Ends with one JSON line.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def child(tsv: str, model: str, out: str, generate: str, batch: int, tiles: int) -> None:
    """One `evaluate.py run` in this process; prints its peak RSS and wall time as one JSON line."""
    import resource

    import torch

    import evaluate
    from inference import engine

    # a shared 2-core machine: two threads made each batch's torch.cat 4x slower
    torch.set_num_threads(1)

    if generate == "stub":

        def one_token(
            self,
            prompts,
            pixel_values,
            cfg,
            stop_ids,
            pad_id=0,
            callback=None,
            vision_branch=None,
            language_branch=None,
        ):
            assert pixel_values is None or pixel_values.shape[0] > 0
            return engine.Result(tokens=[[42] for _ in prompts])

        engine.Engine.generate = one_token
    t0 = time.perf_counter()
    code = evaluate.main(
        [
            "run",
            "--benchmark",
            "TextVQA_VAL",
            "--data",
            tsv,
            "--model",
            model,
            "--out",
            out,
            "--batch-size",
            str(batch),
            "--max-new-tokens",
            "1",
            "--max-tiles",
            str(tiles),
        ]
    )
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(
        json.dumps(
            {
                "code": code,
                "peak_rss_mib": round(peak_mib, 1),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


def write_rows(path: Path, rows: int) -> Path:
    """A TextVQA TSV of `rows` rows, row 0 holding the image and every other naming it by index."""
    from inputs import png_b64

    image = png_b64(800, 600, 0)
    with open(path, "w", encoding="utf-8") as f:
        f.write("index\tquestion\tanswer\timage\n")
        f.write(f"0\twhat is written on the sign?\t['x']\t{image}\n")
        for i in range(1, rows):
            f.write(f"{i}\twhat is written on sign number {i}?\t['x']\t0\n")
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--generate", choices=["stub", "model"], default="stub")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-tiles", type=int, default=1)
    # TSV MODEL OUT: one run, in this process
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child, args.generate, args.batch_size, args.max_tiles)
    from official import make_checkpoint

    tmp = Path(tempfile.mkdtemp())
    model = make_checkpoint(tmp, "qwen3", "original")
    results = {}
    for n in args.rows:
        tsv = write_rows(tmp / f"rows{n}.tsv", n)
        res = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(tsv),
                str(model),
                str(tmp / f"p{n}.jsonl"),
                "--generate",
                args.generate,
                "--batch-size",
                str(args.batch_size),
                "--max-tiles",
                str(args.max_tiles),
            ],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            sys.exit(f"{n} rows: exit {res.returncode}: {res.stderr[-2000:]}")
        line = json.loads(res.stdout.splitlines()[-1])
        answered = sum(1 for _ in open(tmp / f"p{n}.jsonl"))
        results[n] = line | {"answered": answered}
        print(
            f"{n:>7} rows: peak RSS {line['peak_rss_mib']:>7.1f} MiB, {line['seconds']:>6.1f} s, {answered} answered"
        )
    print(
        json.dumps(
            {
                "generate": args.generate,
                "batch_size": args.batch_size,
                "max_tiles": args.max_tiles,
                "rows": results,
            }
        )
    )


if __name__ == "__main__":
    main()
