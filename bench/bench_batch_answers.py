"""How many greedy answers `evaluate.py run` changes when it batches (left padding) against one prompt per
generate call, as VLMEvalKit runs InternVL: the same rows, the same model, --batch-size 1 and N, each dtype.

    python bench/bench_batch_answers.py --rows 64 --batch 8 --dtypes bf16 fp32            # tiny checkpoint, CPU
    python bench/bench_batch_answers.py --model InternVL3_5-1B --data TextVQA_VAL.tsv --benchmark TextVQA_VAL \\
        --rows 500 --batch 8 --dtypes bf16 --device cuda                                  # a real one

Without --model it builds the tests' tiny random checkpoint and a TextVQA-style TSV (one tile a row, a
different image and question length each), so that rows of one batch have different lengths and the
padding matters. A row counts as changed when its prediction text differs; the first differing token is
said for a few. Ends with one JSON line.
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


def tiny(tmp: Path, rows: int) -> tuple[Path, Path]:
    """The tiny random checkpoint and a TSV of rows of varied lengths."""
    words = "what is the name written on the sign in this picture please".split()
    table = [
        {
            "index": str(i),
            "question": " ".join(words[: 3 + i % 8]) + "?",
            "answer": "['x']",
            "image": png_b64(24 + i % 5, 24 + i % 5, i),
        }
        for i in range(rows)
    ]
    return make_checkpoint(tmp, "qwen3", "original"), write_tsv(tmp / "TextVQA_VAL.tsv", table)


def predictions(args, model: Path, data: Path, batch: int, dtype: str, out: Path) -> dict:
    argv = ["run", "--benchmark", args.benchmark, "--data", str(data), "--model", str(model)]
    argv += ["--out", str(out), "--batch-size", str(batch), "--dtype", dtype]
    argv += ["--max-new-tokens", str(args.new_tokens), "--device", args.device]
    with contextlib.redirect_stdout(io.StringIO()):
        assert evaluate.main(argv) == 0, argv
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    return {r["index"]: r["prediction"] for r in rows[: args.rows]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint folder (default: the tiny random one)")
    p.add_argument("--data", help="its benchmark's TSV (default: a TextVQA-style one)")
    p.add_argument("--benchmark", default="TextVQA_VAL")
    p.add_argument("--rows", type=int, default=64, help="rows compared (the first of the TSV)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model, data = (Path(args.model), Path(args.data)) if args.model else tiny(tmp, args.rows)
    result = {}
    for dtype in args.dtypes:
        one = predictions(args, model, data, 1, dtype, tmp / f"{dtype}_1.jsonl")
        many = predictions(args, model, data, args.batch, dtype, tmp / f"{dtype}_n.jsonl")
        changed = [i for i in one if one[i] != many.get(i)]
        result[dtype] = {"rows": len(one), "changed": len(changed)}
        print(
            f"{dtype}: {len(changed)} of {len(one)} greedy answers differ, batch {args.batch} vs 1"
        )
        for i in changed[:3]:
            print(
                f"  row {i}: batch 1 {one[i]!r}\n  {'':>{len(i) + 4}} batch {args.batch} {many[i]!r}"
            )
    print(json.dumps({"batch": args.batch, "new_tokens": args.new_tokens, "answers": result}))


if __name__ == "__main__":
    main()
