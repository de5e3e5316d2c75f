"""Weight-only quantization (inference/quant.py): each format's error per weight, each quantized linear within the
bound that error puts on its outputs, the tiny official-format checkpoint's logits within the bound
derived from every linear's per-channel error, greedy tokens as bf16's, what is left unquantized, the
command's flag, and the compiled decode step (one graph, each packed weight read once, by one kernel).

The bounds, derived rather than fitted:
- per weight: int8 |w - q s| <= s/2 with s = max|w_n| / 127 per output channel; int4 |w - w^| <= s/2
  with s = (max - min) / 15 per group (inference/quant.py's formats).
- per linear: y_n - y^_n = sum_k e_nk x_k, so |y_n - y^_n| <= sum_k |e_nk| |x_k| <= (s_n / 2) ||x||_1;
  the kernels also round the activations and the output to bf16 (relative 2^-9 each), which adds at
  most 2^-8 sum_k |w^_nk| |x_k| (and 2^-9 of the bias when it is added in bf16).
- whole model: linear i's weight error e_i makes its output wrong by a relative eps_i = rms(e_i) / rms(w_i)
  (e is independent of the input: rms(e x) = rms(e) ||x||, rms(w x) = rms(w) ||x||). To first order
  the errors of the L linears on the path add up independently, and the residual stream and the norms
  pass a relative error on unamplified, so the logits' relative rms error is at most
  E = sqrt(sum_i eps_i^2). Measured on the tiny checkpoint: 0.5-0.7 E for int8 and int4.
"""

import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from inputs import first_decode_step, random_pixels
from torch._inductor.utils import run_and_get_code

from config import PRESETS, ParConfig
from data.processor import Tokenizer, build_prompt
from inference.cpu_decode import cpu_backend
from inference.engine import Engine, GenerateConfig, decode_one_token
from inference.quant import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    quantize,
    quantize_int4,
    quantize_int8,
    quantized_linears,
)
from loading.pretrained import load_pretrained
from parvl import ParVL

GROUP = 32  # int4 group of the tiny checkpoint (its widths are 64, 96 and 128)
MODES = [("int8", None), ("int4", GROUP)]
PROMPTS = {  # the test prompts: name -> (num_tiles per image, question, history)
    "single-image": ([3], "Describe the image.", []),
    "multi-image": ([2, 1], "Image-1: <image>\nImage-2: <image>\nWhat differs?", []),
    "multi-turn": ([1], "And the colour?", [("<image>\nWhat is it?", "A cat.")]),
    "text-only": ([], "Tell me a story about the sea.", []),
}


def weight_error(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(w - w^, the per-weight bound s/2 broadcast to w's shape) of one format."""
    w = w.float()
    if mode == "int8":
        q, s = quantize_int8(w)
        return w - q.float() * s[:, None], (s / 2)[:, None].expand_as(w)
    q, s, low = quantize_int4(w, GROUP)
    half = (s.float() / 2).repeat_interleave(GROUP, dim=1)  # [N,K/G] -> [N,K]
    return w - dequantize_int4(q, s, low), half


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_error_within_half_a_step(mode):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    w[3] = 0  # an all-zero channel (and group) keeps a finite scale and comes back exact
    w[5, :GROUP] = 0.7  # a constant group
    err, half = weight_error(w, mode)
    assert torch.isfinite(err).all() and err[3].abs().max() == 0
    # the rounding error of q, plus float32's own rounding of q * s (+ low) at the weights' size
    assert (err.abs() <= half * (1 + 1e-5) + 1e-6 * w.abs()).all(), (err.abs() / half).max()


@pytest.mark.parametrize("mode,group", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_within_per_channel_bound(mode, group, dtype):
    """Each output of a quantized linear (with a bias, as Qwen2's q/k/v) is within the per-channel bound;
    a wrong packing or scale layout would be off by the weights' own size."""
    torch.manual_seed(1)
    linear = nn.Linear(256, 96).to(dtype)
    x = torch.randn(5, 256).to(dtype)
    qlinear = Int8Linear(linear) if mode == "int8" else Int4Linear(linear, group)
    got = qlinear(x).float()
    assert got.dtype == torch.float32 and qlinear(x).dtype == dtype and got.shape == (5, 96)
    w, b, xf = linear.weight.float(), linear.bias.float(), x.float()
    err, half = weight_error(w, mode)
    exact = xf @ w.T + b
    quant_part = xf.abs() @ err.abs().T  # sum_k |e_nk| |x_k| <= (s_n / 2) ||x||_1
    assert (quant_part <= xf.abs() @ half.T * (1 + 1e-5)).all()
    rounding = 2**-8 * (xf.abs() @ (w - err).abs().T) + 2**-9 * b.abs() * (dtype == torch.bfloat16)
    bound = quant_part + rounding + 1e-5
    assert ((got - exact).abs() <= bound).all(), ((got - exact).abs() / bound).max()


def test_compiled_int8_linear_at_every_row_count():
    """The compiled CPU int8 linear takes int8_words_gemv for one row, ATen's kernel for more (quant.WORDS_ROWS)
    and for bf16 batches, MKL on the fp32 weights for fp32 ones past GEMV_ROWS; each compiles (ATen's took
    only stored operands) and is within the per-channel bound of the exact product plus bf16's roundings
    (activations into ATen's kernel, a bf16 output: 2^-7 of the terms' magnitudes)."""
    from inference.cpu_decode import GEMV_ROWS

    torch.manual_seed(3)
    linear = nn.Linear(256, 96)
    qlinear = Int8Linear(linear)
    compiled = torch.compile(qlinear.forward, backend=cpu_backend, fullgraph=True)
    err, half = weight_error(linear.weight.detach(), "int8")
    cases = [(r, torch.float32) for r in range(1, GEMV_ROWS + 3)] + [
        (2, torch.bfloat16),
        (8, torch.bfloat16),
    ]
    for rows, dtype in cases:
        x = torch.randn(rows, 256).to(dtype)
        exact = F.linear(x.float(), linear.weight.detach(), linear.bias.detach())
        bound = (
            x.float().abs() @ half.T
            + 2**-7 * (x.float().abs() @ linear.weight.detach().abs().T)
            + 1e-5
        )
        assert ((compiled(x).float() - exact).abs() <= bound).all(), (rows, dtype)


@pytest.fixture(scope="module")
def bf16(checkpoint):
    """The tiny Qwen3 checkpoint (official layout) loaded in bf16, and its tokenizer."""
    folder = checkpoint("qwen3", "original")
    return folder, load_pretrained(folder, dtype=torch.bfloat16), Tokenizer.from_pretrained(folder)


def first_order_bound(model, mode: str) -> float:
    """E = sqrt(sum_i eps_i^2) over the linears quantize replaces, eps_i = rms(w_i - w^_i) / rms(w_i)."""
    eps = []
    for _, linear in quantized_linears(model):
        err, _ = weight_error(linear.weight, mode)
        eps.append((err.pow(2).mean() / linear.weight.float().pow(2).mean()).sqrt().item())
    return math.sqrt(sum(e * e for e in eps))


@pytest.mark.parametrize("mode,group", MODES)
def test_logits_within_derived_bound(bf16, mode, group):
    folder, base, tok = bf16
    model = load_pretrained(folder, dtype=torch.bfloat16)
    E = first_order_bound(model, mode)
    quantize(model, mode, group or 128)
    for tiles, question, history in PROMPTS.values():
        ids = torch.tensor([tok.encode(build_prompt(question, tiles, history=history))])
        pv = random_pixels(sum(tiles), seed=1).bfloat16() if tiles else None
        with torch.no_grad():
            want, got = base(ids, pv).float(), model(ids, pv).float()
        rel = ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()
        print(
            f"{mode}: relative rms logit error {rel:.4f}, first-order bound E {E:.4f} ({rel / E:.2f} E), "
            f"max abs {(got - want).abs().max().item():.3f}"
        )
        assert 0 < rel <= E, (rel, E)


def test_int8_greedy_as_bf16(bf16):
    """int8 decodes bf16's greedy tokens on every test prompt, except past a step where bf16 itself has a
    tie: its two best logits within one bf16 step of each other, which no weight error can be held to.
    (The tiny random checkpoint has one: the text-only prompt's 7th token.)"""
    folder, base, tok = bf16
    model = quantize(load_pretrained(folder, dtype=torch.bfloat16), "int8")
    cfg = GenerateConfig(max_new_tokens=10, ignore_eos=True)
    for name, (tiles, question, history) in PROMPTS.items():
        ids = tok.encode(build_prompt(question, tiles, history=history))
        pv = random_pixels(sum(tiles), seed=1).bfloat16() if tiles else None
        want = Engine(base).generate([ids], pv, cfg, tok.eos_ids).tokens[0]
        got = Engine(model).generate([ids], pv, cfg, tok.eos_ids).tokens[0]
        if got == want:
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        with torch.no_grad():  # bf16's logits where the two part
            top2 = base(torch.tensor([ids + want[:i]]), pv)[0, -1].float().topk(2).values
        # bf16 keeps 8 significant bits
        ulp = 2.0 ** (math.floor(math.log2(top2[0].abs().item())) - 7)
        assert top2[0] - top2[1] <= ulp, (name, i, top2.tolist())


def test_scope_and_checks():
    """quantize replaces the language model's linears and the LM head, nothing else: the ViT, the
    connector, the embedding, the norms, the branch prefixes and the aggregators keep their tensors
    and dtype; a 2:2 model still generates. Bad modes, groups and shapes are refused first."""
    cfg = PRESETS["tiny"]
    cfg = type(cfg)(
        **{**cfg.__dict__, "par": ParConfig(pv=2, pl=2, vit_prefix_len=4, llm_prefix_len=4)}
    )
    model = ParVL.from_config(cfg, torch.bfloat16).eval()
    before = {
        k: v
        for k, v in model.state_dict().items()
        if ".mlp." not in k and "proj" not in k and "lm_head" not in k
    }
    with pytest.raises(ValueError, match="--quant"):
        quantize(model, "int3")
    with pytest.raises(ValueError, match="--group-size"):
        quantize(model, "int4", 48)
    with pytest.raises(ValueError, match=r"language_model\..*divisible by the group size 256"):
        quantize(model, "int4", 256)
    assert quantize(model, None) is model and not any(
        isinstance(m, Int8Linear) for m in model.modules()
    )
    quantize(model, "int8")
    linears = [
        m
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.startswith("language_model")
    ]
    assert not linears and sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 7 + 1
    after = model.state_dict()
    # the ViT, connector, aggregators, prefixes, norms, embedding: untouched
    for k, v in before.items():
        assert after[k] is v or torch.equal(after[k], v), k
        assert after[k].dtype == torch.bfloat16, k
    ids = [[5, 9, 301, 7], [11, 12]]  # 300 is the tiny preset's image token
    out = Engine(model).generate(ids, None, GenerateConfig(max_new_tokens=3, ignore_eos=True), [])
    assert [len(t) for t in out.tokens] == [3, 3]


@pytest.mark.slow  # compiles the decode step twice (~10-20 s each on 2 cores)
@pytest.mark.parametrize("mode,group", MODES)
def test_compiled_step_reads_each_packed_weight_once(checkpoint, mode, group):
    """The CPU decode step with quantized linears compiles as one graph (fullgraph: a break is an error),
    equals eager, and reads each packed weight once: every graph input of a packed weight's shape goes
    to exactly one kernel call (int8: inductor's own reduction, quant.int8_words_gemv; int4: ATen's
    kernel, which inductor lowers to quantized.int4mm_packed_weight_cpu), and no buffer of a weight's
    full shape is allocated (nothing dequantises a weight into memory first)."""
    folder = checkpoint("qwen3", "original")
    model = quantize(load_pretrained(folder), mode, group or 128)
    tok = Tokenizer.from_pretrained(folder)
    ids = tok.encode(build_prompt("Describe the image.", [1]))
    step = first_decode_step(model, ids, random_pixels(1, seed=4))
    with torch.no_grad():
        eager = decode_one_token(model, *step)
        # as Engine on CPU
        compiled = torch.compile(decode_one_token, backend=cpu_backend, fullgraph=True)
        got, code = run_and_get_code(compiled, model, *step)
    # eager runs ATen's kernels on bf16 activations (int8: the compiled step sums fp32 ones): 2^-8 apart
    torch.testing.assert_close(got, eager, atol=2e-2, rtol=2e-2)
    quantized = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert len(quantized) == 2 * 7 + 1
    wrapper = code[0][code[0].index("def call(") :]
    calls = [
        line
        for line in wrapper.splitlines()
        if re.search(r"\w\(.*\barg\d+_1\b", line)
        and "assert_size_stride" not in line
        and "del " not in line
    ]
    packed = {tuple(m.weight.shape) for m in quantized}
    # the embedding table can have the LM head's shape; its kernels read one row of it (the token's)
    table = {a for line in calls if "embedding" in line for a in re.findall(r"\barg\d+_1\b", line)}
    for arg, shape in re.findall(r"assert_size_stride\((arg\d+_1), \(([\d, ]+)\)", wrapper):
        if tuple(int(d) for d in shape.split(",") if d.strip()) in packed and arg not in table:
            users = [line for line in calls if re.search(rf"\b{arg}\b", line)]
            assert len(users) == 1, (arg, users)
    full = {f"({m.out_features}, {m.in_features})" for m in quantized}
    assert not any(f"empty_strided_cpu({shape}" in wrapper for shape in full), (
        "a weight dequantised into memory"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode,group", MODES)
@torch.no_grad()
def test_cuda_graphs_decode_equals_eager(mode, group):
    """On CUDA the quantized decode step compiles with mode="reduce-overhead" (CUDA graphs) and decodes
    eager's tokens, recorded and replayed."""
    model = quantize(
        ParVL.from_config(PRESETS["tiny"], torch.bfloat16, "cuda").eval(), mode, group or 128
    )
    prompts, cfg = [[5, 9, 301, 7, 8], [11, 12]], GenerateConfig(max_new_tokens=12, ignore_eos=True)
    eager = Engine(model).generate(prompts, None, cfg, []).tokens
    fast = Engine(model, compile=True)
    assert fast.generate(prompts, None, cfg, []).tokens == eager
    # a graph replay, not only the recording
    assert fast.generate(prompts, None, cfg, []).tokens == eager
