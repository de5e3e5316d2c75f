"""Benchmark of the sparse router (paper Table 3's claim: a 4:4 checkpoint run at 1:1 cost).

    python bench/bench_router.py                      # CPU, fp32, evaluation/flops.py's "mid" model, ~5 min
    python bench/bench_router.py --device cuda --dtype bf16 --batch 8 --iters 5

Measured side by side in one run, the three engines interleaved (in rotating order) in every
iteration, so load changes on a shared machine hit all of them alike; the best iteration counts:
- time per sample of routed generation (Engine(router=): vision gate, one ViT branch, language gate,
  one LLM branch per sample) vs dense 4:4 generation vs a 1:1 model with the same backbone weights
  (no prefixes, no aggregators). Goal: routed <= 1.15 x 1:1 and <= 0.35 x dense.
- label throughput (router_labels.label_batch: each vision branch once, the Pl language branches folded,
  lm_head on answer tokens only) vs Pv x Pl plain single-pair forwards of the same batches with
  loss.token_nll. Goal: <= 0.5 x.
The model and router are random (timing does not depend on the values); the router's weights are
scaled so that its choices vary across samples, as a trained one's do. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from config import ParConfig  # noqa: E402
from data.batches import Batch  # noqa: E402
from evaluation.flops import MID  # noqa: E402
from gates import Router, RouterConfig  # noqa: E402
from inference.engine import Engine, GenerateConfig, sync  # noqa: E402
from loss import token_nll  # noqa: E402
from parvl import ParVL, is_branch_tensor  # noqa: E402
from training.router_labels import label_batch  # noqa: E402

IM_START = 31999  # a text id standing in for <|im_start|> in the random prompts


def models(pv: int, pl: int, dtype, device) -> tuple[ParVL, ParVL]:
    """A random Pv:Pl model and the 1:1 model with the same backbone tensors."""
    big = ParVL.from_config(
        replace(MID, par=ParConfig(pv=pv, pl=pl)), dtype=dtype, device=device, seed=0
    ).eval()
    one = ParVL.from_config(
        replace(MID, par=ParConfig()), dtype=dtype, device=device, seed=1
    ).eval()
    one.load_state_dict({k: v for k, v in big.state_dict().items() if not is_branch_tensor(k)})
    return big, one


def prompts(n: int, tiles: int, text: int, seed: int, image_id: int):
    """n prompts: a system-like turn, a user turn with one image of `tiles` tiles, an assistant header."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, 30000, (text,), generator=g)
        # three turns: the question is the middle one
        t[0], t[text // 4], t[-2] = (IM_START, IM_START, IM_START)
        out.append(
            torch.cat(
                [t[: text // 4 + 2], torch.full((256 * tiles,), image_id), t[text // 4 + 2 :]]
            ).tolist()
        )
    return out, torch.randn(n * tiles, 3, 448, 448, generator=g)


def timed(fn) -> float:
    sync(DEVICE)
    t0 = time.perf_counter()
    fn()
    sync(DEVICE)
    return time.perf_counter() - t0


def main() -> int:
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument(
        "--batch", type=int, default=4, help="prompts per generate call / label batch (default 4)"
    )
    p.add_argument("--tiles", type=int, default=1, help="448 px tiles per prompt (default 1)")
    p.add_argument(
        "--text-tokens", type=int, default=64, help="text tokens per prompt (default 64)"
    )
    p.add_argument(
        "--new-tokens", type=int, default=32, help="generated tokens, exactly (default 32)"
    )
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=32,
        help="supervised tokens per labelled sample (default 32)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=5,
        help="timed iterations after one warm-up; the best counts (default 5)",
    )
    args = p.parse_args()
    DEVICE = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.set_grad_enabled(False)
    big, one = models(4, 4, dtype, DEVICE)
    rcfg = RouterConfig(
        pv=4,
        pl=4,
        vision_width=MID.vit.hidden_size,
        text_width=MID.llm.hidden_size,
        im_start_id=IM_START,
    )
    torch.manual_seed(0)
    router = Router(rcfg).to(DEVICE).eval()
    for w in router.parameters():
        w.normal_(std=1.0)
    ids, pix = prompts(args.batch, args.tiles, args.text_tokens, 0, MID.image_token_id)
    pix = pix.to(DEVICE, dtype)
    cfg = GenerateConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    # one model object per engine: an engine keeps its KV cache in the model's layers
    engines = {
        "routed 4:4": Engine(big, router=router),
        "dense 4:4": Engine(copy.deepcopy(big)),
        "1:1": Engine(one),
    }
    times = {k: [] for k in engines}
    pairs = None
    names = list(engines)
    for it in range(args.iters + 1):  # iteration 0 warms up (cache allocation, allocator)
        # rotate the order: no engine always runs first
        for name in names[it % 3 :] + names[: it % 3]:
            engine = engines[name]
            res = []
            dt = timed(
                lambda engine=engine, res=res: res.append(engine.generate(ids, pix, cfg, []))
            )
            pairs = res[0].pairs if res[0].pairs is not None else pairs
            if it:
                times[name].append(dt / args.batch)
    gen = {k: min(v) for k, v in times.items()}

    # labels: the same batch as router_labels.label_batch vs Pv x Pl single-pair forwards
    T = len(ids[0]) + args.answer_tokens
    g = torch.Generator().manual_seed(1)
    input_ids = torch.tensor(
        [x + torch.randint(0, 30000, (args.answer_tokens,), generator=g).tolist() for x in ids]
    )
    labels = torch.full_like(input_ids, -100)
    labels[:, -args.answer_tokens :] = input_ids[:, -args.answer_tokens :]
    batch = Batch(
        input_ids,
        labels,
        torch.ones_like(input_ids, dtype=torch.bool),
        torch.arange(T).expand(args.batch, T),
        pix,
        [args.tiles] * args.batch,
        args.batch,
        {},
        list(range(args.batch)),
    )

    def single_pairs():
        out = torch.zeros(args.batch, 4, 4)
        for v in range(4):
            for l in range(4):
                logits = big(input_ids.to(DEVICE), pix, vision_branch=v, language_branch=l)
                out[:, v, l] = (
                    token_nll(logits, labels.to(DEVICE)).sum(1) / args.answer_tokens
                ).cpu()
        return out

    lab, base = [], []
    for it in range(args.iters + 1):
        got = {}
        t_lab = timed(lambda got=got: got.update(label_batch(big, batch, IM_START)))
        t_base = timed(lambda got=got: got.update(ref=single_pairs()))
        if it:
            lab.append(t_lab)
            base.append(t_base)
    err = (got["nll"] - got["ref"]).abs().max().item()  # the two compute the same numbers
    t_lab, t_base = min(lab), min(base)

    print(
        f"CPU threads {torch.get_num_threads()}, {args.device} {args.dtype}, flops.MID ViT {MID.vit.hidden_size}x"
        f"{MID.vit.num_layers} LLM {MID.llm.hidden_size}x{MID.llm.num_layers} vocab {MID.llm.vocab_size}, "
        f"batch {args.batch}, {args.tiles} tile(s) + {args.text_tokens} text tokens, {args.new_tokens} new tokens, "
        f"best of {args.iters} (a shared CPU: the minimum is the least disturbed)"
    )
    for name, s in gen.items():
        print(
            f"  generate {name:<10} {s:7.3f} s per sample  ({s / gen['1:1']:.2f} x 1:1, "
            f"{s / gen['dense 4:4']:.2f} x dense)"
        )
    print(f"  routed pairs (v, l) per sample: {pairs}")
    print(
        f"  label: {args.batch / t_lab:.3f} samples/s; "
        f"Pv x Pl single-pair forwards {args.batch / t_base:.3f} samples/s; "
        f"cost {t_lab / t_base:.2f} x (max |NLL difference| {err:.1e})"
    )
    print(
        json.dumps(
            {
                "routed_s": gen["routed 4:4"],
                "dense_s": gen["dense 4:4"],
                "one_one_s": gen["1:1"],
                "routed_vs_one_one": gen["routed 4:4"] / gen["1:1"],
                "routed_vs_dense": gen["routed 4:4"] / gen["dense 4:4"],
                "label_samples_per_s": args.batch / t_lab,
                "label_vs_single_pairs": t_lab / t_base,
                "label_max_abs_err": err,
                "pairs": pairs,
            }
        )
    )
    return 0


DEVICE = torch.device("cpu")

if __name__ == "__main__":
    sys.exit(main())
