"""Which SDPA kernel every attention case gets (torch.profiler), and no graph break in the decode step.

On CPU every case must reach the fused CPU flash kernel; on CUDA (marked gpu) a flash or
memory-efficient (or cuDNN) kernel, never the math path. The cases: causal prefill (no mask),
prefixed prefill (ParVL branches, causal aligned bottom-right), masked prefill (left padding),
decode (one query over the cache under a mask), shared KV (stacked branch queries), and the
training forward and backward with prefixes. With PARVL_KERNEL_REPORT set, the kernels seen are
written there as JSON (bench/h200.sh keeps them)."""

import json
import os
from dataclasses import replace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from config import PRESETS, ParConfig
from inference.engine import decode_one_token, decode_step, prefill
from parvl import ParVL

# aten::_scaled_dot_product_<kind>...
FUSED = ("flash_attention", "efficient_attention", "cudnn_attention")
MATH = "_scaled_dot_product_attention_math"
REPORT: dict = {}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


def sdpa_kernels(fn) -> list[str]:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return sorted(
        {
            e.key
            for e in prof.key_averages()
            if "scaled_dot_product" in e.key and e.key != "aten::scaled_dot_product_attention"
        }
    )


def model_and_inputs(device: str, pv: int, pl: int):
    # the fused CUDA kernels want 16-bit
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = replace(PRESETS["tiny"], par=ParConfig(pv=pv, pl=pl, vit_prefix_len=8, llm_prefix_len=8))
    model = ParVL.from_config(cfg, dtype, device).eval()
    T, per = 300, cfg.tokens_per_tile
    ids = torch.randint(0, cfg.image_token_id, (2, T), device=device)
    ids[:, 3 : 3 + per] = cfg.image_token_id
    pixels = torch.randn(2, 3, 448, 448, device=device, dtype=dtype)
    valid = torch.ones(2, T, dtype=torch.bool, device=device)
    valid[1, :5] = False  # sample 1 left-padded
    return model, ids, pixels, valid


def cases(model, ids, pixels, valid) -> dict:
    """name -> (prepare, call): prepare runs outside the profiler (a decode step needs its prefill)."""
    dev, T, branches = ids.device, ids.shape[1], model.cfg.par.pl > 1
    out = {
        "prefixed prefill" if branches else "causal prefill": (None, lambda: model(ids, pixels)),
        "masked prefill": (None, lambda: model(ids, pixels, valid.long())),
    }
    key_valid = torch.ones(2, T + 8, dtype=torch.bool, device=dev)
    key_valid[:, :T] = valid
    for name, shared in (("decode", False), ("shared KV decode", True))[: 2 if branches else 1]:
        rows = model.language_rows(None, 2, dev, shared)

        def prepare(rows=rows):
            model.language_model.setup_cache(rows, T + 8)
            prefill(model, ids, pixels, valid, True, None, rows)

        def call(rows=rows):
            decode_one_token(
                model,
                ids[:, :1],
                torch.tensor([T], device=dev),
                valid.sum(-1, keepdim=True),
                key_valid,
                rows,
            )

        out[name] = (prepare, call)

    def train_step():
        model.train()
        model(ids, pixels).float().sum().backward()
        model.eval()

    out["training forward and backward" + (" with prefixes" if branches else "")] = (
        None,
        train_step,
    )
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_every_attention_case_gets_a_fused_kernel(device):
    seen = {}
    for pv, pl in ((1, 1), (2, 2)):
        model, ids, pixels, valid = model_and_inputs(device, pv, pl)
        for name, (prepare, call) in cases(model, ids, pixels, valid).items():
            with torch.set_grad_enabled(name.startswith("training")):
                if prepare is not None:
                    prepare()
                kernels = sdpa_kernels(call)
            seen[f"{name} ({pv}:{pl})"] = {
                "kernels": kernels,
                "fused": any(k in x for x in kernels for k in FUSED),
            }
    REPORT[device] = seen
    if os.environ.get("PARVL_KERNEL_REPORT"):
        with open(os.environ["PARVL_KERNEL_REPORT"], "w") as f:
            json.dump(
                {f"{d}: {k}": v for d, r in REPORT.items() for k, v in r.items()}, f, indent=2
            )
    slow = {
        k: v["kernels"]
        for k, v in seen.items()
        if not v["fused"] or any(MATH in x for x in v["kernels"])
    }
    assert not slow, f"attention cases off the fused kernels: {slow}"


@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_has_no_graph_break(device):
    """torch._dynamo.explain over decode_step for 1:1, dense 2:2, shared KV and per-sample pairs."""
    for pv, pl, choice, shared in (
        (1, 1, None, False),
        (2, 2, None, False),
        (2, 2, None, True),
        (2, 2, [1, 0], False),
    ):
        model, ids, pixels, valid = model_and_inputs(device, pv, pl)
        rows = model.language_rows(choice, 2, device, shared)
        T = ids.shape[1]
        model.language_model.setup_cache(rows, T + 8)
        key_valid = torch.ones(2, T + 8, dtype=torch.bool, device=device)
        key_valid[:, :T] = valid
        with torch.no_grad():
            prefill(model, ids, pixels, valid, True, None, rows)
            # the graph Engine compiles: decode, sampling (top-k, top-p, the exponential race) and the stop check
            explained = torch._dynamo.explain(decode_step)(
                model,
                ids[:, 0],
                torch.tensor([T], device=device),
                valid.sum(-1, keepdim=True),
                key_valid,
                rows,
                torch.zeros(2, dtype=torch.bool, device=device),
                torch.tensor([5, 7], device=device),
                0,
                0.8,
                20,
                0.9,
            )
        assert explained.graph_break_count == 0 and explained.graph_count == 1, (
            pv,
            pl,
            choice,
            shared,
            explained.break_reasons,
        )
