"""The CPU decode step's compiler backend: inductor, with every fp32 linear of few rows as inductor's
own reduction (gemv) instead of the BLAS call. engine.compile_step uses it for the decode step on CPU;
on CUDA the step runs as CUDA graphs and nothing here is used.

Why: on CPU a decode step is a few matrix-vector products per layer over every weight,
bandwidth-bound work that MKL's sgemm does poorly with few rows (it streams the weights on one
thread). Inductor's own reduction kernel, parallel over the outputs and vectorised along K, reads
them near the memory's rate, so the compiled CPU step turns each linear of few rows into multiply +
sum (gemv) before inductor lowers it: every weight is still read once per row, and the sums
accumulate in fp32 as the BLAS's do. The measurements behind this and GEMV_ROWS are in
docs/performance.md, "CPU decode".

fp32 only. In bf16 (and fp16) torch's own kernel is the faster one: F.linear of one row takes ATen's
reduced-precision gemv (fp32 sums, both threads), while inductor's reduction (torch 2.13) loads the
bf16 weights 8 lanes of 16 at a time through a scratch copy: 5-6x slower for one row, 30x for two
(docs/performance.md). The weight-only quantized linears (quant.py) call their own kernels and are
not F.linear: they pass through untouched.

    step = torch.compile(decode_step, backend=cpu_backend, fullgraph=True)

Shapes here: a linear's input x [...,K] (M rows, samples x branches, in all), weight [N,K].
"""
from __future__ import annotations

import torch


GEMV_ROWS = 4  # linears of at most this many rows (samples x branches) become gemv; past 4 MKL wins


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for few rows as one fp32 reduction over K per output: x [...,K], weight [N,K] -> [...,N].
    Only for compiled code: inductor fuses the product into the sum, eager would materialise it."""
    rows = x.reshape(-1, 1, x.shape[-1])  # [M,1,K]
    out = (rows.float() * weight.float()).sum(-1)  # [M,N,K] -> [M,N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])  # [...,N]


def cpu_backend(gm: torch.fx.GraphModule, example_inputs):
    """The CPU decode backend: inductor, after turning every fp32 linear of at most GEMV_ROWS rows in
    dynamo's graph into gemv. The rewrite is in the graph inductor receives (not in its decomposition
    table, which its caches do not key on), so a cached plain graph is never handed back for it."""
    from torch._inductor.compile_fx import compile_fx  # here: importing inductor takes seconds, paid only to compile

    for node in gm.graph.find_nodes(op="call_function", target=torch.nn.functional.linear):
        x = node.args[0].meta["example_value"]
        if x.dtype == torch.float32 and x.numel() <= GEMV_ROWS * x.shape[-1]:
            node.target = gemv
    gm.recompile()
    # store small activations (the RMSNorm output) rather than let inductor recompute them in the gemv loop for
    # every weight row (25 -> 19 ms per step at the benchmark's default size: docs/performance.md, "CPU decode")
    return compile_fx(gm, example_inputs, config_patches={"realize_opcount_threshold": 4})
