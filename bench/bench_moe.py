"""Benchmark: four ways to run Qwen3-MoE's routed experts on CPU, one sparse layer at a time (moe.py).

  grouped   the tokens' (token, expert) pairs sorted by expert, one F.grouped_mm per projection (what
            moe.py runs in bf16, and in any dtype in eager on CPU)
  gathered  each pair's row times its expert's weights gathered into a batch, torch.bmm (what moe.py
            runs where grouped_mm cannot: a compiled fp32 step, fp32 on a GPU)
  loop      a Python loop over the experts that received tokens (the official block's eager loop:
            torch.where per expert, a host sync each, not compilable into one graph)
  dense     every expert on every token, the K chosen weighted, the rest multiplied by 0 (E/K times
            the work, no sorting)

Defaults: Qwen3-30B-A3B's routing (128 experts, 8 a token) at a quarter of its width (C 512, expert
width 192), a decode step of --decode tokens and a prefill of --prefill tokens. Each line: best of
--rounds, after one warm-up, and the max difference to `loop` in the same dtype.

    python bench/bench_moe.py
    python bench/bench_moe.py --hidden 2048 --width 768 --threads 1

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import LLMConfig  # noqa: E402
from moe import SparseMoE, gathered_experts, route  # noqa: E402


def loop(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The official eager block: per expert hit, its tokens found with torch.where, run, added."""
    w, idx = route(block.gate(x), block.top_k, block.renormalise, x.dtype)
    out = torch.zeros_like(x)
    E = block.experts
    for e in idx.unique().tolist():  # a host sync, then one more per expert
        token, slot = torch.where(idx == e)
        gate, up = F.linear(x[token], E.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, E.down_proj[e]) * w[token, slot, None]
        out.index_add_(0, token, y)
    return out


def dense(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token: [N,E,2I] then [N,E,C], weighted by the routing scattered to [N,E]."""
    w, idx = route(block.gate(x), block.top_k, block.renormalise, x.dtype)
    full = torch.zeros(x.shape[0], block.num_experts, dtype=x.dtype).scatter_(1, idx, w)  # [N,E]
    gate, up = torch.einsum("nc,eic->nei", x, block.experts.gate_up_proj).chunk(2, dim=-1)
    y = torch.einsum("nei,eci->nec", F.silu(gate) * up, block.experts.down_proj)
    return (y * full[..., None]).sum(1)


def gathered(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """moe.py's block with the gathered-weights experts in place of the grouped products."""
    w, idx = route(block.gate(x), block.top_k, block.renormalise, x.dtype)
    order = idx.flatten().argsort(stable=True)
    token, E = order // block.top_k, block.experts
    y = gathered_experts(x[token], idx.flatten()[order], E.gate_up_proj, E.down_proj)
    return torch.zeros_like(x).index_add_(0, token, y * w.flatten()[order, None])


def best_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--decode", type=int, default=4, help="tokens of the decode step")
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the prefill")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = LLMConfig(
        hidden_size=args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.width,
    )
    torch.manual_seed(0)
    block = SparseMoE(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=args.hidden**-0.5)
    rows = []
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            b = block.to(dtype)
            for phase, n in (("decode", args.decode), ("prefill", args.prefill)):
                x = torch.randn(n, args.hidden, dtype=dtype)
                want = loop(b, x).float()
                ways = {
                    "loop": loop,
                    "dense": dense,
                    "grouped": SparseMoE.__call__,
                    "gathered": gathered,
                }
                for way, fn in ways.items():
                    err = (fn(b, x).float() - want).abs().max().item()
                    ms = best_ms(partial(fn, b, x), args.rounds)
                    rows.append(
                        dict(dtype=str(dtype)[6:], phase=phase, tokens=n, way=way, ms=ms, err=err)
                    )
                    print(
                        f"{rows[-1]['dtype']:>9} {phase:>8} {n:>5} tokens {way:>9}: {ms:9.2f} ms"
                        f"  (max |diff| to loop {err:.2e})"
                    )
    print(json.dumps({"args": vars(args), "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
