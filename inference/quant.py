"""Weight-only quantization for inference, gpt-fast style: int8 per output channel, int4 per group,
applied to the language model right after it loads (from the official bf16 safetensors: no conversion
step, nothing written).

    model = load_pretrained(folder, dtype=torch.bfloat16)
    quantize(model, "int8")                    # or quantize(model, "int4", group_size=128)
    engine = Engine(model, compile=True)

What is quantized, and why. A decode step reads every weight of the language model once per token:
decode is weight bandwidth, so one byte a weight (int8) halves what bf16 reads and half a byte (int4)
halves it again. Quantized: every linear of the decoder blocks (q, k, v, o, gate, up, down) and the LM
head, the largest matrix (V x C). Left in the model's dtype: the embedding table (a step reads one row
of it); the norms, the branch prefixes, the aggregators and the router (small, and the method's own
numerics); and the ViT with its connector, which run once per image in the prefill, where each weight
is read once for a thousand tokens or more: compute-bound matrix products that a weight-only format
makes no faster, only less accurate.

The formats (w [N,K] a linear's weight, N outputs, K inputs):
- int8: q = round(w / s) in [-127, 127] with one scale per output channel, s_n = max_k |w_nk| / 127
  (symmetric); |w - q s| <= s / 2 per weight.
- int4: per group of G consecutive inputs (G = group_size) an asymmetric range, s = (max - min) / 15
  and q = round((w - min) / s) in [0, 15], so w ~ q s + min; |w - w^| <= s / 2 per weight (min is
  rounded down and s up to bf16 first, and q computed against the rounded values). The zero point (min) pays:
  a group's range max - min is narrower than the symmetric 2 max |w|, and it costs the kernels nothing
  (they take scale and zero together).

Kernels, measured against the alternatives (docs/performance.md, "Weight-only quantization"):
- CPU, int8: the compiled decode step of one row reads the weights with int8_words_gemv, inductor's
  own reduction over 32-bit words of four int8 weights each (stored in word order), sign-extended in
  registers: each weight read once, as one byte, fp32 sums. It widens each weight once per row, so
  from WORDS_ROWS + 1 rows on (branches, batches), as in eager decode and bf16 prefill,
  aten._weight_int8pack_mm runs, vectorised for bf16 activations only; fp32 prefill is MKL on the
  weights converted to fp32 (compute-bound: a thousand rows per weight read).
- CPU, int4: aten._weight_int4pack_mm_for_cpu, eager and compiled (inductor lowers it to its packed
  int4 kernel), bf16 activations; weights packed by aten._convert_weight_to_int4pack_for_cpu. A
  reduction over words of eight nibbles, as int8's, ran the LM head 1.8x faster for one row and 0.6x
  for four, and needs a layout of its own (ATen's is blocked by 32 outputs): not kept
  (docs/performance.md).
- CUDA: int8 as gpt-fast: in the compiled decode step a linear of few rows is one reduction over the
  int8 weights with the dequantise fused into it (inductor writes one kernel; the weights are read
  once, as int8); otherwise F.linear on the weights converted to the activations' dtype. int4:
  aten._weight_int4pack_mm (tinygemm), bf16 only, weights packed by aten._convert_weight_to_int4pack.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from inference.cpu_decode import (  # int8 linears of at most GEMV_ROWS rows: one reduction, compiled
    GEMV_ROWS,
    realized,
)

MODES = ("int8", "int4")
# rows up to which the compiled CPU step takes int8_words_gemv rather than ATen's kernel: it widens each weight
# once per row, ATen's once for all rows (LM head, 1 / 2 / 4 rows: 6.2 / 13.7 / 27.2 ms against 11.2 / 12.9 /
# 18.4; docs/performance.md)
WORDS_ROWS = 1
GROUP_SIZES = (32, 64, 128, 256)  # int4 groups tinygemm and the CPU kernel both take


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N,K] -> q [N,K] int8 in [-127, 127], scale [N] fp32 (symmetric, per output channel)."""
    w = w.float()
    scale = w.abs().amax(1).clamp(min=1e-12) / 127  # an all-zero row keeps a finite scale
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_int4(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N,K] -> q [N,K] uint8 in [0, 15], scale and low [N,K/G] bf16 with w ~ q * scale + low per group
    of G = group_size inputs (asymmetric min-max). Both are bf16 (what the kernels take), low rounded
    down and scale up, so the group's range stays inside [low, low + 15 scale] and q's rounding is the
    only error: |w - w^| <= scale / 2."""
    N, K = w.shape
    wg = w.float().view(N, K // group_size, group_size)  # [N,K/G,G]
    low = round_bf16(wg.amin(-1), down=True)
    # 0 range: finite
    scale = round_bf16(((wg.amax(-1) - low.float()) / 15).clamp(min=1e-8), down=False)
    q = torch.round((wg - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return q.to(torch.uint8).view(N, K), scale, low


def round_bf16(x: torch.Tensor, down: bool) -> torch.Tensor:
    """fp32 x to the nearest bf16 at or below it (down) or at or above it."""
    r = x.bfloat16()
    wrong = r.float() > x if down else r.float() < x
    return torch.where(
        wrong, torch.nextafter(r, torch.full_like(r, -torch.inf if down else torch.inf)), r
    )


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N,K] that (q, scale, low) stand for: q * scale + low per group."""
    N, K = q.shape
    wg = q.float().view(N, scale.shape[1], -1) * scale.float()[..., None] + low.float()[..., None]
    return wg.view(N, K)


def word_order(t: torch.Tensor, fields: int) -> torch.Tensor:
    """[...,K] -> [...,K] with position fields*j + i holding input i*K/fields + j: the inputs a packed word
    j carries, next to each other (int8: the 4 bytes of a 32-bit word)."""
    K = t.shape[-1]
    return t.reshape(*t.shape[:-1], fields, K // fields).transpose(-1, -2).reshape(t.shape)


def int8_words_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The compiled CPU decode step's int8 linear, x [M,K] fp32 -> [M,N] fp32, one reduction over K/4:
    q [N,K] int8 in word order is read as 32-bit words, each holding the weights of inputs j, K/4 + j,
    K/2 + j, 3K/4 + j, sign-extended in registers by shifts and multiplied by four contiguous slices of
    x. Read as float and bitcast (inductor loads 32-bit floats at full vector width; its int8 and int32
    loads go through a scratch copy, docs/performance.md), so each weight is read once, as one byte."""
    M, K = x.shape
    words = q.view(torch.float32).view(torch.int32)  # [N,K/4]
    xs = realized(x.contiguous()).view(M, 1, 4, K // 4)
    acc = xs[:, :, 3] * (words >> 24).float()  # [M,N,K/4]: the top byte needs one arithmetic shift
    for i in range(3):
        acc = acc + xs[:, :, i] * ((words << (24 - 8 * i)) >> 24).float()
    return acc.sum(-1) * scale  # [M,N]


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W = q * scale per output channel; q int8 [N,K] and scale [N] fp32 are buffers,
    the bias (Qwen2's q/k/v) stays a parameter in the model's dtype. On CPU q is stored in word order
    (word_order): the compiled decode step reads it with int8_words_gemv, ATen's kernel (eager, bf16
    activations) with x put in the same order."""

    QUANTIZED = True  # gates.fingerprint hashes it as the nn.Linear it replaced

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight.detach())
        self.register_buffer("weight", word_order(q, 4) if q.device.type == "cpu" else q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [...,K] -> [...,N]
        x2 = x.reshape(-1, x.shape[-1])  # [M,K]
        few = x2.shape[0] <= GEMV_ROWS
        if x.device.type == "cpu" and x2.shape[0] <= WORDS_ROWS and torch.compiler.is_compiling():
            # the decode step of one row, fp32 sums
            y = int8_words_gemv(x2.float(), self.weight, self.scale)
        # prefill: MKL on the fp32 weights
        elif x.device.type == "cpu" and x.dtype == torch.float32 and not few:
            y = F.linear(word_order(x2, 4), self.weight.float()) * self.scale
        elif (
            x.device.type == "cpu"
        ):  # eager decode, or bf16: ATen's kernel, vectorised for bf16 only
            # stored operands: inductor lowers this op only on buffers (a computed input failed to compile)
            xw, scale = (
                realized(word_order(x2, 4).bfloat16().contiguous()),
                realized(self.scale.bfloat16()),
            )
            y = torch.ops.aten._weight_int8pack_mm(xw, self.weight, scale)
        elif few:  # CUDA decode: fp32 sums, as on CPU
            if torch.compiler.is_compiling():
                # gpt-fast's int8 decode: one reduction over K per output with the int8 -> float conversion
                # fused into it, so the weights are read once, as int8 (eager would materialise [M,N,K])
                y = (x2[:, None, :].float() * self.weight.float()).sum(-1) * self.scale  # [M,N]
            else:
                y = F.linear(x2.float(), self.weight.float()) * self.scale
        else:  # CUDA prefill: a matrix product on the weights in the activations' dtype (int8 is exact in bf16)
            y = F.linear(x2, self.weight.to(x.dtype)) * self.scale
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)  # [...,N]
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W = q * scale + low per group of `group_size` inputs, q 4-bit packed two to a
    byte in the layout of the device's kernel (CPU: _convert_weight_to_int4pack_for_cpu; CUDA:
    _convert_weight_to_int4pack), scale and low together as the kernels take them, [K/G,N,2] bf16."""

    QUANTIZED = True  # gates.fingerprint hashes it as the nn.Linear it replaced

    def __init__(self, linear: nn.Linear, group_size: int):
        super().__init__()
        N, K = linear.out_features, linear.in_features
        self.in_features, self.out_features, self.group_size = K, N, group_size
        q, scale, low = quantize_int4(linear.weight.detach(), group_size)
        # the kernels dequantise as (q - 8) * scale + zero: zero = low + 8 * scale
        zero = (low.float() + 8 * scale.float()).bfloat16()
        # [K/G,N,2]
        self.register_buffer(
            "scale_zero", torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
        )
        if q.device.type == "cpu":
            # [N,K/2] uint8
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:  # tinygemm: bytes (even k << 4 | odd k), then its tiled layout
            inner_k_tiles = next(t for t in (8, 4, 2) if K % (16 * t) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack(
                (q[:, ::2] << 4 | q[:, 1::2]).contiguous(), inner_k_tiles
            )
        self.register_buffer("weight", packed)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [...,K] -> [...,N]
        # [M,K]: both kernels take bf16 activations, CUDA's (tinygemm) only contiguous ones: prefill's
        # last position h[:, -1] is a strided view
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.weight, self.group_size, self.scale_zero
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm(
                x2, self.weight, self.group_size, self.scale_zero
            )
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)  # [...,N]
        return y if self.bias is None else y + self.bias


def check(mode: str | None, group_size: int, model=None) -> None:
    """Refuse a mode, group size or model the formats cannot take, before any weight changes."""
    if mode is None:
        return
    if mode not in MODES:
        raise ValueError(f"--quant must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "int4" and group_size not in GROUP_SIZES:
        raise ValueError(
            f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))} for int4, got {group_size}"
        )
    if model is None:
        return
    for name, linear in quantized_linears(model):
        N, K = linear.out_features, linear.in_features
        if mode == "int4" and (K % group_size or N % 16):
            raise ValueError(
                f"--quant int4: {name} is {N} x {K}; int4 needs inputs divisible by the group size "
                f"{group_size} and outputs by 16"
            )


def quantized_linears(model) -> list[tuple[str, nn.Linear]]:
    """The linears `quantize` replaces: every nn.Linear under language_model (blocks and LM head)."""
    lm = model.language_model
    return [
        (f"language_model.{name}", m) for name, m in lm.named_modules() if isinstance(m, nn.Linear)
    ]


@torch.no_grad()
def quantize(model, mode: str | None, group_size: int = 128):
    """Replace the language model's linears by Int8Linear / Int4Linear in place (module by module, so
    the full-precision weights are freed as they go) and return the model; mode None leaves it as it is.
    A tied LM head gets a quantized copy, the embedding keeps the original. model.quant names the format
    ("int8", "int4-g128" or None)."""
    check(mode, group_size, model)
    # what the logs say
    model.quant = None if mode is None else mode if mode == "int8" else f"int4-g{group_size}"
    if mode is None:
        return model
    for name, linear in quantized_linears(model):
        owner, _, attr = name.rpartition(".")
        new = Int8Linear(linear) if mode == "int8" else Int4Linear(linear, group_size)
        setattr(model.get_submodule(owner), attr, new)
    return model


def weight_bytes(model) -> int:
    """Bytes of the model's weights as they sit in memory: its parameters (a tied tensor once) and the
    quantized linears' packed weights and scales, which are buffers."""
    packed = sum(
        b.nbytes
        for m in model.modules()
        if getattr(m, "QUANTIZED", False)
        for b in m.buffers(recurse=False)
    )
    return sum(p.nbytes for p in model.parameters()) + packed
