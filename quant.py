"""Weight-only quantization for inference, gpt-fast style: int8 per output channel, int4 per group,
applied to the language model right after it loads (from the official bf16 safetensors: no conversion
step, nothing written).

    model = ParVL.from_pretrained(folder, dtype=torch.bfloat16)
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
- CPU: torch's weight-only kernels, aten._weight_int8pack_mm and aten._weight_int4pack_mm_for_cpu, in
  eager and in the compiled decode step, where inductor calls them as extern kernels and fuses what is
  around them. Both are vectorised for bf16 activations only (fp32 falls to a scalar loop), so the
  activations enter them in bf16 whatever the model's dtype. The weights are stored as the kernels
  want them: int8 [N,K] with bf16 scales; int4 packed by aten._convert_weight_to_int4pack_for_cpu.
- CUDA: int8 as gpt-fast: in the compiled decode step a linear of few rows is one reduction over the
  int8 weights with the dequantise fused into it (inductor writes one kernel; the weights are read
  once, as int8); otherwise F.linear on the weights converted to the activations' dtype. int4:
  aten._weight_int4pack_mm (tinygemm), bf16 only, weights packed by aten._convert_weight_to_int4pack.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cpu_decode import GEMV_ROWS  # CUDA: int8 linears of at most this many rows run as one reduction when compiled

MODES = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)  # int4 groups tinygemm and the CPU kernel both take
# the spellings of the one command-line flag, --quant: mode and int4 group size
QUANT_SPECS = {"int8": ("int8", 128), "int4": ("int4", 128), **{f"int4-g{g}": ("int4", g) for g in GROUP_SIZES}}


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N,K] -> q [N,K] int8 in [-127, 127], scale [N] fp32 (symmetric, per output channel)."""
    w = w.float()
    scale = w.abs().amax(1).clamp(min=1e-12) / 127  # an all-zero row keeps a finite scale
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N,K] -> q [N,K] uint8 in [0, 15], scale and low [N,K/G] bf16 with w ~ q * scale + low per group
    of G = group_size inputs (asymmetric min-max). Both are bf16 (what the kernels take), low rounded
    down and scale up, so the group's range stays inside [low, low + 15 scale] and q's rounding is the
    only error: |w - w^| <= scale / 2."""
    N, K = w.shape
    wg = w.float().view(N, K // group_size, group_size)  # [N,K/G,G]
    low = round_bf16(wg.amin(-1), down=True)
    scale = round_bf16(((wg.amax(-1) - low.float()) / 15).clamp(min=1e-8), down=False)  # 0 range: finite
    q = torch.round((wg - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return q.to(torch.uint8).view(N, K), scale, low


def round_bf16(x: torch.Tensor, down: bool) -> torch.Tensor:
    """fp32 x to the nearest bf16 at or below it (down) or at or above it."""
    r = x.bfloat16()
    wrong = r.float() > x if down else r.float() < x
    return torch.where(wrong, torch.nextafter(r, torch.full_like(r, -torch.inf if down else torch.inf)), r)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N,K] that (q, scale, low) stand for: q * scale + low per group."""
    N, K = q.shape
    wg = q.float().view(N, scale.shape[1], -1) * scale.float()[..., None] + low.float()[..., None]
    return wg.view(N, K)


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W = q * scale per output channel; q int8 [N,K] and scale [N] are buffers,
    the bias (Qwen2's q/k/v) stays a parameter in the model's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight.detach())
        self.register_buffer("weight", q)
        # the CPU kernel takes its scales in the activations' dtype and is vectorised for bf16 only
        self.register_buffer("scale", scale.bfloat16() if q.device.type == "cpu" else scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [...,K] -> [...,N]
        x2 = x.reshape(-1, x.shape[-1])  # [M,K]
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x2.to(self.scale.dtype), self.weight, self.scale)
        elif x2.shape[0] <= GEMV_ROWS:  # decode: fp32 sums, as the CPU kernel's
            if torch.compiler.is_compiling():
                # gpt-fast's int8 decode: one reduction over K per output with the int8 -> float conversion
                # fused into it, so the weights are read once, as int8 (eager would materialise [M,N,K])
                y = (x2[:, None, :].float() * self.weight.float()).sum(-1)  # [M,N]
            else:
                y = F.linear(x2.float(), self.weight.float())
            y = y * self.scale
        else:  # prefill: a matrix product on the weights in the activations' dtype (int8 is exact in bf16)
            y = F.linear(x2, self.weight.to(x.dtype)) * self.scale
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)  # [...,N]
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W = q * scale + low per group of `group_size` inputs, q 4-bit packed two to a
    byte in the layout of the device's kernel (CPU: _convert_weight_to_int4pack_for_cpu; CUDA:
    _convert_weight_to_int4pack), scale and low together as the kernels take them, [K/G,N,2] bf16."""

    def __init__(self, linear: nn.Linear, group_size: int):
        super().__init__()
        N, K = linear.out_features, linear.in_features
        self.in_features, self.out_features, self.group_size = K, N, group_size
        q, scale, low = quantize_int4(linear.weight.detach(), group_size)
        # the kernels dequantise as (q - 8) * scale + zero: zero = low + 8 * scale
        zero = (low.float() + 8 * scale.float()).bfloat16()
        self.register_buffer("scale_zero", torch.stack([scale, zero], -1).transpose(0, 1).contiguous())  # [K/G,N,2]
        if q.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)  # [N,K/2] uint8
        else:  # tinygemm: bytes (even k << 4 | odd k), then its tiled layout
            inner_k_tiles = next(t for t in (8, 4, 2) if K % (16 * t) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(),
                                                                inner_k_tiles)
        self.register_buffer("weight", packed)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [...,K] -> [...,N]
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M,K]: both kernels take bf16 activations
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.weight, self.group_size, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.weight, self.group_size, self.scale_zero)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)  # [...,N]
        return y if self.bias is None else y + self.bias


def check(mode: str | None, group_size: int, model=None) -> None:
    """Refuse a mode, group size or model the formats cannot take, before any weight changes."""
    if mode is None:
        return
    if mode not in MODES:
        raise ValueError(f"--quant must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "int4" and group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))} for int4, got {group_size}")
    if model is None:
        return
    for name, linear in quantized_linears(model):
        N, K = linear.out_features, linear.in_features
        if mode == "int4" and (K % group_size or N % 16):
            raise ValueError(f"--quant int4: {name} is {N} x {K}; int4 needs inputs divisible by the group size "
                             f"{group_size} and outputs by 16")


def quantized_linears(model) -> list[tuple[str, nn.Linear]]:
    """The linears `quantize` replaces: every nn.Linear under language_model (blocks and LM head)."""
    lm = model.language_model
    return [(f"language_model.{name}", m) for name, m in lm.named_modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def quantize(model, mode: str | None, group_size: int = 128):
    """Replace the language model's linears by Int8Linear / Int4Linear in place (module by module, so
    the full-precision weights are freed as they go) and return the model; mode None leaves it as it is.
    A tied LM head gets a quantized copy, the embedding keeps the original."""
    check(mode, group_size, model)
    if mode is None:
        return model
    for name, linear in quantized_linears(model):
        owner, _, attr = name.rpartition(".")
        new = Int8Linear(linear) if mode == "int8" else Int4Linear(linear, group_size)
        setattr(model.get_submodule(owner), attr, new)
    model.quant = (mode, group_size if mode == "int4" else None)
    return model
