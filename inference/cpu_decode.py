"""The CPU decode step's compiler backend: inductor, with every fp32 or bf16 linear of few rows as
inductor's own reduction (gemv, bf16_gemv) instead of the BLAS call. engine.compile_step uses it for the
decode step on CPU; on CUDA the step runs as CUDA graphs and nothing here is used.

Why: on CPU a decode step is a few matrix-vector products per layer over every weight,
bandwidth-bound work that MKL's sgemm does poorly with few rows (it streams the weights on one
thread). Inductor's own reduction kernel, parallel over the outputs and vectorised along K, reads
them near the memory's rate, so the compiled CPU step turns each linear of few rows into multiply +
sum (gemv) before inductor lowers it: every weight is still read once per row, and the sums
accumulate in fp32 as the BLAS's do. The measurements behind this and GEMV_ROWS are in
docs/performance.md, "CPU decode".

bf16 weights are read as 32-bit words of two weights each (bf16_gemv): inductor (torch 2.13) loads
bf16 8 lanes of 16 at a time through a scratch copy, 5-6x slower than ATen's own bf16 gemv for one
row, while a 32-bit load is a full-width vector load and the two bf16 halves of a word become fp32
with one shift or one mask (1.7x ATen's gemv on the LM head, docs/performance.md). fp16 keeps ATen's
kernel. The weight-only quantized linears (quant.py) call their own kernels and are not F.linear:
they pass through untouched.

Every reduction here reads its activation through `realized`, a stored buffer, so that inductor never
recomputes the producer (a norm, a conversion) inside the loop over the weights.

    step = torch.compile(decode_step, backend=cpu_backend, fullgraph=True)

Shapes here: a linear's input x [...,K] (M rows, samples x branches, in all), weight [N,K].
"""

from __future__ import annotations

import torch

GEMV_ROWS = 4  # linears of at most this many rows (samples x branches) become gemv; past 4 MKL wins


def realized(x: torch.Tensor) -> torch.Tensor:
    """x, stored by inductor as a buffer of its own before the reduction that reads it: inductor realizes
    the input of an as_strided (it needs a storage). Without it, inductor may inline a small producer (a
    norm, a dtype conversion, a transpose) into the reduction and recompute it for every weight row, or
    tile the reduction around a transposed load: the LM head's int8 gemv ran 8x slower that way."""
    return x.as_strided(x.shape, x.stride())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for few rows as one fp32 reduction over K per output: x [...,K], weight [N,K] -> [...,N].
    Only for compiled code: inductor fuses the product into the sum, eager would materialise it."""
    rows = realized(x.reshape(-1, 1, x.shape[-1]).float().contiguous())  # [M,1,K]
    out = (rows * weight.float()).sum(-1)  # [M,N,K] -> [M,N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])  # [...,N]


def bf16_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear for few rows of bf16 weights as one fp32 reduction over K/2 per output, reading the weights
    as 32-bit words of two bf16 each: word j of a row holds inputs 2j (low half) and 2j + 1 (high half),
    and a bf16 is the top half of the fp32 of the same value, so `word << 16` and `word & 0xffff0000` are
    the two weights as fp32, exactly. x [...,K] -> [...,N]; x goes in as fp32 split into its even and odd
    inputs, [M,2,K/2], stored once. Loaded as fp32 and bitcast: inductor loads 32-bit floats at full
    vector width, bf16 through a scratch copy (the module docstring), so each weight is read once, as
    two bytes. Only for compiled code."""
    K = x.shape[-1]
    rows = x.reshape(-1, K // 2, 2).float().transpose(1, 2)  # [M,2,K/2]: even inputs, odd inputs
    rows = realized(rows.contiguous()).unsqueeze(1)  # [M,1,2,K/2]
    words = weight.view(torch.float32).view(torch.int32)  # [N,K/2]
    low = (words << 16).view(torch.float32)  # inputs 2j
    high = (words & -65536).view(torch.float32)  # inputs 2j + 1 (-65536 = 0xffff0000)
    out = (rows[:, :, 0] * low + rows[:, :, 1] * high).sum(-1)  # [M,N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])  # [...,N]


# inductor's settings for the decode step (docs/performance.md, "CPU decode"):
# - realize_opcount_threshold 4: small activations (the RMSNorm output) are stored rather than recomputed in
#   a loop over weight rows (25 -> 19 ms per step at the benchmark's default size); the gemvs read theirs
#   through `realized` as well, which the threshold alone had not ensured.
# - FMA contraction (-ffp-contract=fast): a multiply-add in one instruction and one rounding, where
#   inductor's default compiles two; the dequantising gemvs are bound by instructions, not bytes.
CONFIG = {"realize_opcount_threshold": 4, "cpp.enable_floating_point_contract_flag": "fast"}
# the linears of few rows cpu_backend rewrites, by dtype
REWRITE = {torch.float32: gemv, torch.bfloat16: bf16_gemv}


def cpu_backend(gm: torch.fx.GraphModule, example_inputs):
    """The CPU decode backend: inductor, after turning every fp32 linear of at most GEMV_ROWS rows in
    dynamo's graph into gemv. The rewrite is in the graph inductor receives (not in its decomposition
    table, which its caches do not key on), so a cached plain graph is never handed back for it."""
    from torch._inductor.compile_fx import (
        compile_fx,  # here: importing inductor takes seconds, paid only to compile
    )

    for node in gm.graph.find_nodes(op="call_function", target=torch.nn.functional.linear):
        x = node.args[0].meta["example_value"]
        w = node.args[1].meta["example_value"]
        # bf16 as 32-bit words
        pairs = x.shape[-1] % 2 == 0 and w.is_contiguous() and w.storage_offset() % 2 == 0
        if x.numel() <= GEMV_ROWS * x.shape[-1] and (x.dtype != torch.bfloat16 or pairs):
            node.target = REWRITE.get(x.dtype, node.target)
    gm.recompile()
    return compile_fx(gm, example_inputs, config_patches=CONFIG)
