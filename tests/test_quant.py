"""Weight-only quantization (quant.py): each format's error per weight, each quantized linear within the
bound that error puts on its outputs, the tiny official-format checkpoint's logits within the bound
derived from every linear's per-channel error, greedy tokens as bf16's, what is left unquantized, the
command's flag, and the compiled decode step (one graph, each packed weight read once, by one kernel).

The bounds, derived rather than fitted:
- per weight: int8 |w - q s| <= s/2 with s = max|w_n| / 127 per output channel; int4 |w - w^| <= s/2
  with s = (max - min) / 15 per group (quant.py's formats).
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
from torch._inductor.utils import run_and_get_code

from conftest import first_decode_step, random_pixels
from config import PRESETS, ParConfig
from cpu_decode import cpu_backend
from engine import Engine, GenerateConfig, decode_one_token
from parvl import ParVL
from processor import Tokenizer, build_prompt
from quant import (Int4Linear, Int8Linear, dequantize_int4, for_compiled_cpu_decode, quantize, quantize_int4,
                   quantize_int8, quantized_linears, unpack_int4_cpu)

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


@pytest.mark.parametrize("mode,group,words", [(m, g, False) for m, g in MODES] + [("int4", GROUP, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_within_per_channel_bound(mode, group, words, dtype):
    """Each output of a quantized linear (with a bias, as Qwen2's q/k/v) is within the per-channel bound;
    a wrong packing or scale layout would be off by the weights' own size. int4 in both CPU layouts:
    ATen's kernel's and the words of the compiled decode step (here eager: W dequantised)."""
    torch.manual_seed(1)
    linear = nn.Linear(256, 96).to(dtype)
    x = torch.randn(5, 256).to(dtype)
    qlinear = Int8Linear(linear) if mode == "int8" else Int4Linear(linear, group)
    if words:
        qlinear.to_words()
        assert qlinear.words
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


def test_int4_words_layout_is_atens_weight():
    """to_words repacks ATen's CPU layout without changing W: unpacking ATen's packing gives q back, the
    words layout dequantises to ATen's (q - 8) * scale + zero, and the compiled decode step's gemv over
    the words equals the product with that W in fp32 (one reduction each, in another order), for 1 and
    GEMV_ROWS rows."""
    from cpu_decode import GEMV_ROWS

    torch.manual_seed(2)
    for N, K in [(32, 32), (96, 256), (160, 512)]:
        q = torch.randint(0, 16, (N, K), dtype=torch.int32)
        assert torch.equal(unpack_int4_cpu(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), N, K).int(), q)
    for group in (32, 64, 128, 256):
        qlinear = Int4Linear(nn.Linear(512, 96), group)
        q = unpack_int4_cpu(qlinear.weight, 96, 512).float()  # as packed for ATen (checked above)
        atens = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(512, dtype=torch.bfloat16), qlinear.weight,
                                                            group, qlinear.scale_zero).float().T  # ATen's W, in bf16
        scale, zero = (t.repeat_interleave(group, 1) for t in qlinear.scale_zero.float().transpose(0, 1).unbind(-1))
        qlinear.to_words()
        w = qlinear.dequantized(slice(None))  # [N,K] fp32
        torch.testing.assert_close(w, (q - 8) * scale + zero, atol=0, rtol=1e-6)  # one fp32 rounding either way
        torch.testing.assert_close(w, atens, atol=0, rtol=2**-8)  # ATen's product rounds W to bf16
        if group not in (32, 256):
            continue  # the compiled gemv at the smallest and largest group (two compiles each)
        gemv = torch.compile(qlinear.forward, backend=cpu_backend, fullgraph=True)
        for rows in (1, GEMV_ROWS):
            x = torch.randn(rows, 512)
            want = x @ w.T + qlinear.bias.detach()
            tol = 512 * 2**-24 * (x.abs() @ w.abs().T).max().item()  # fp32 sums of K terms, either order
            torch.testing.assert_close(gemv(x), want, atol=tol, rtol=0)


def test_engine_repacks_int4_only_to_compile_on_cpu():
    """Eager keeps ATen's layout (its kernel is the fast eager one); an Engine that compiles on CPU puts
    every int4 linear of outputs a multiple of 32 in words, once, without changing what it computes."""
    model = quantize(ParVL.from_config(PRESETS["tiny"], torch.bfloat16).eval(), "int4", GROUP)
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    x = torch.randn(3, linears[0].in_features, dtype=torch.bfloat16)
    before = linears[0](x).float()
    Engine(model)
    assert not any(m.words for m in linears)
    Engine(model, compile=True)  # torch.compile is lazy: nothing compiles here
    assert all(m.words == (m.out_features % 32 == 0) for m in linears) and any(m.words for m in linears)
    torch.testing.assert_close(linears[0](x).float(), before, atol=0, rtol=2**-7)  # bf16 x in ATen's: 2^-8 apart


@pytest.fixture(scope="module")
def bf16(checkpoint):
    """The tiny Qwen3 checkpoint (official layout) loaded in bf16, and its tokenizer."""
    folder = checkpoint("qwen3", "original")
    return folder, ParVL.from_pretrained(folder, dtype=torch.bfloat16), Tokenizer.from_pretrained(folder)


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
    model = ParVL.from_pretrained(folder, dtype=torch.bfloat16)
    E = first_order_bound(model, mode)
    quantize(model, mode, group or 128)
    for tiles, question, history in PROMPTS.values():
        ids = torch.tensor([tok.encode(build_prompt(question, tiles, history=history))])
        pv = random_pixels(sum(tiles), seed=1).bfloat16() if tiles else None
        with torch.no_grad():
            want, got = base(ids, pv).float(), model(ids, pv).float()
        rel = ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt().item()
        print(f"{mode}: relative rms logit error {rel:.4f}, first-order bound E {E:.4f} ({rel / E:.2f} E), "
              f"max abs {(got - want).abs().max().item():.3f}")
        assert 0 < rel <= E, (rel, E)


def test_int8_greedy_as_bf16(bf16):
    """int8 decodes bf16's greedy tokens on every test prompt, except past a step where bf16 itself has a
    tie: its two best logits within one bf16 step of each other, which no weight error can be held to.
    (The tiny random checkpoint has one: the text-only prompt's 7th token.)"""
    folder, base, tok = bf16
    model = quantize(ParVL.from_pretrained(folder, dtype=torch.bfloat16), "int8")
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
        ulp = 2.0 ** (math.floor(math.log2(top2[0].abs().item())) - 7)  # bf16 keeps 8 significant bits
        assert top2[0] - top2[1] <= ulp, (name, i, top2.tolist())


def test_scope_and_checks():
    """quantize replaces the language model's linears and the LM head, nothing else: the ViT, the
    connector, the embedding, the norms, the branch prefixes and the aggregators keep their tensors
    and dtype; a 2:2 model still generates. Bad modes, groups and shapes are refused first."""
    cfg = PRESETS["tiny"]
    cfg = type(cfg)(**{**cfg.__dict__, "par": ParConfig(pv=2, pl=2, vit_prefix_len=4, llm_prefix_len=4)})
    model = ParVL.from_config(cfg, torch.bfloat16).eval()
    before = {k: v for k, v in model.state_dict().items() if ".mlp." not in k and "proj" not in k
              and "lm_head" not in k}
    with pytest.raises(ValueError, match="--quant"):
        quantize(model, "int3")
    with pytest.raises(ValueError, match="--group-size"):
        quantize(model, "int4", 48)
    with pytest.raises(ValueError, match=r"language_model\..*divisible by the group size 256"):
        quantize(model, "int4", 256)
    assert quantize(model, None) is model and not any(isinstance(m, Int8Linear) for m in model.modules())
    quantize(model, "int8")
    linears = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("language_model")]
    assert not linears and sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 7 + 1
    after = model.state_dict()
    for k, v in before.items():  # the ViT, connector, aggregators, prefixes, norms, embedding: untouched
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
    to exactly one kernel call (inductor's own reductions, quant.int8_words_gemv / int4_words_gemv; an
    int4 linear of outputs not a multiple of 32 keeps ATen's layout and kernel, which inductor lowers to
    quantized.int4mm_packed_weight_cpu), and no buffer of a weight's full shape is allocated (nothing
    dequantises a weight into memory first)."""
    folder = checkpoint("qwen3", "original")
    model = quantize(ParVL.from_pretrained(folder), mode, group or 128)
    for_compiled_cpu_decode(model)  # as Engine does when it compiles on CPU: int4 as words
    tok = Tokenizer.from_pretrained(folder)
    ids = tok.encode(build_prompt("Describe the image.", [1]))
    step = first_decode_step(model, ids, random_pixels(1, seed=4))
    with torch.no_grad():
        eager = decode_one_token(model, *step)
        compiled = torch.compile(decode_one_token, backend=cpu_backend, fullgraph=True)  # as Engine on CPU
        got, code = run_and_get_code(compiled, model, *step)
    # eager runs ATen's kernels on bf16 activations (int8: the compiled step sums fp32 ones): 2^-8 apart
    torch.testing.assert_close(got, eager, atol=2e-2, rtol=2e-2)
    quantized = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert len(quantized) == 2 * 7 + 1
    wrapper = code[0][code[0].index("def call("):]
    calls = [line for line in wrapper.splitlines() if re.search(r"\w\(.*\barg\d+_1\b", line)
             and "assert_size_stride" not in line and "del " not in line]
    packed = {tuple(m.weight.shape) for m in quantized}
    # the embedding table can have the LM head's shape; its kernels read one row of it (the token's)
    table = {a for line in calls if "embedding" in line for a in re.findall(r"\barg\d+_1\b", line)}
    for arg, shape in re.findall(r"assert_size_stride\((arg\d+_1), \(([\d, ]+)\)", wrapper):
        if tuple(int(d) for d in shape.split(",") if d.strip()) in packed and arg not in table:
            users = [line for line in calls if re.search(rf"\b{arg}\b", line)]
            assert len(users) == 1, (arg, users)
    full = {f"({m.out_features}, {m.in_features})" for m in quantized}
    assert not any(f"empty_strided_cpu({shape}" in wrapper for shape in full), "a weight dequantised into memory"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode,group", MODES)
@torch.no_grad()
def test_cuda_graphs_decode_equals_eager(mode, group):
    """On CUDA the quantized decode step compiles with mode="reduce-overhead" (CUDA graphs) and decodes
    eager's tokens, recorded and replayed."""
    model = quantize(ParVL.from_config(PRESETS["tiny"], torch.bfloat16, "cuda").eval(), mode, group or 128)
    prompts, cfg = [[5, 9, 301, 7, 8], [11, 12]], GenerateConfig(max_new_tokens=12, ignore_eos=True)
    eager = Engine(model).generate(prompts, None, cfg, []).tokens
    fast = Engine(model, compile=True)
    assert fast.generate(prompts, None, cfg, []).tokens == eager
    assert fast.generate(prompts, None, cfg, []).tokens == eager  # a graph replay, not only the recording
