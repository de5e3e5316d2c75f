"""Benchmark: the training loss from the final states, chunked (loss.chunked_sft_loss, what train.py
runs) against lm_head + loss.sft_loss on the whole [T, V] logits, side by side on CPU.

One packed row of --tokens positions (a few samples, their prompts unsupervised), width --hidden,
InternVL3.5's vocabulary by default. Each side runs forward + backward in its own fresh process, so
its peak resident memory (ru_maxrss) is its own; the sides alternate for --rounds rounds and the
table shows the best time and the peak memory over the inputs' own (h, W, labels and their
gradients, measured the same way with no loss at all). The losses and gradients are compared too.

    python bench/bench_loss.py                            # 4096 positions, width 1024, 151,936 words
    python bench/bench_loss.py --tokens 8192 --chunk 1024

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def inputs(tokens: int, hidden: int, vocab: int):
    import torch

    torch.manual_seed(0)
    h = torch.randn(1, tokens, hidden, requires_grad=True)
    W = (torch.randn(vocab, hidden) * hidden**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens))
    seg = torch.arange(tokens)[None] * 4 // tokens  # 4 samples in the row
    first = torch.nonzero(seg[0, 1:] != seg[0, :-1]).flatten() + 1
    for s in [0, *first.tolist()]:
        labels[0, s : s + 64] = -100  # each sample's prompt
    return h, W, labels, seg


def one_side(side: str, tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    """Forward + backward of one side in this process: seconds, peak RSS, loss, gradient norms."""
    import torch

    from loss import chunked_sft_loss, sft_loss

    torch.set_num_threads(2)
    h, W, labels, seg = inputs(tokens, hidden, vocab)
    t0 = time.perf_counter()
    if side == "inputs only":
        loss = (h.sum() + W.sum()) * 0
    elif side == "whole logits":
        loss = sft_loss(torch.nn.functional.linear(h, W), labels, 100.0, seg)
    else:
        loss = chunked_sft_loss(h, W, labels, 100.0, seg, chunk=chunk)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "loss": float(loss),
        "grad_h": float(h.grad.norm()),
        "grad_w": float(W.grad.norm()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="positions in the row (default 4096)")
    p.add_argument(
        "--hidden", type=int, default=1024, help="width C (default 1024, InternVL3.5-1B's)"
    )
    p.add_argument(
        "--vocab", type=int, default=151936, help="vocabulary V (default 151936, InternVL3.5's)"
    )
    p.add_argument(
        "--chunk", type=int, default=0, help="positions per chunk (default 0 = loss.LOSS_CHUNK)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternating rounds; the best time is shown (default 2)",
    )
    p.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side and print its JSON
    args = p.parse_args(argv)
    if args.chunk == 0:
        from loss import LOSS_CHUNK

        args.chunk = LOSS_CHUNK
    if args.side:
        print(json.dumps(one_side(args.side, args.tokens, args.hidden, args.vocab, args.chunk)))
        return 0
    sides = ["inputs only", "whole logits", "chunked"]
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for _ in range(args.rounds):
        for side in sides:
            cmd = [
                sys.executable,
                __file__,
                "--side",
                side,
                "--tokens",
                str(args.tokens),
                "--hidden",
                str(args.hidden),
                "--vocab",
                str(args.vocab),
                "--chunk",
                str(args.chunk),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[side].append(json.loads(out.strip().splitlines()[-1]))
    base = max(r["peak_gib"] for r in runs["inputs only"])
    best = {s: min(runs[s], key=lambda r: r["seconds"]) for s in sides}
    print(
        f"one row of {args.tokens} positions, width {args.hidden}, vocabulary {args.vocab}, fp32, "
        f"chunk {args.chunk}; best of {args.rounds} alternating rounds"
    )
    print(f"{'side':<16}{'forward+backward s':>20}{'peak GiB over inputs':>22}{'loss':>12}")
    for s in sides[1:]:
        print(
            f"{s:<16}{best[s]['seconds']:>20.3f}{max(r['peak_gib'] for r in runs[s]) - base:>22.2f}"
            f"{best[s]['loss']:>12.6f}"
        )
    whole, chunked = best["whole logits"], best["chunked"]
    rel = {k: abs(chunked[k] - whole[k]) / abs(whole[k]) for k in ("loss", "grad_h", "grad_w")}
    extra = {s: max(r["peak_gib"] for r in runs[s]) - base for s in ("chunked", "whole logits")}
    print(
        f"chunked vs whole: time {chunked['seconds'] / whole['seconds']:.2f}x, extra memory "
        f"{extra['chunked'] / extra['whole logits']:.2f}x; "
        f"relative difference of the loss {rel['loss']:.1e}, "
        f"gradient norms {rel['grad_h']:.1e} (h) {rel['grad_w']:.1e} (W)"
    )
    print(
        json.dumps(
            {
                "bench": "loss",
                "config": {k: v for k, v in vars(args).items() if k != "side"},
                "runs": runs,
                "relative_difference": rel,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
