"""The training objective in one place: Eq. 6, the square-root re-weighted supervised loss of the
ParVL paper (Appendix A.1; InternVL's `len2weight` with square reduction), its chunked form that
training runs, and the answer NLL of router.py's offline path teacher (Appendix E).

Labels follow the official code: a token's label is its id where the assistant speaks, IGNORE
elsewhere, and position t predicts labels[:, t+1]. Nothing here knows the model: the functions take
logits, final states and the lm_head weight.

Shape legend: aggregate.py's (here B rows and N scored positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # label of tokens that carry no loss (LabelSmoother.ignore_index upstream)


def loss_weights(labels: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 6 weights [B, T]: w[b, t] = 1/sqrt(n) where labels[b, t+1] is supervised, n the number of
    supervised labels of its sample: the row's (one sample per row), or its segment's in a packed row
    (segment_ids [B, T]), where a prediction across two samples weighs 0.

    Column t weighs the prediction made at position t (target labels[:, t+1]); the last column is
    0. Samples with no supervised label get w = 0. No host sync: training calls it on the device.
    """
    sup = labels != IGNORE  # [B, T]
    seg = torch.zeros_like(labels) if segment_ids is None else segment_ids
    # [B, T]: column s counts the supervised labels of segment s
    per_segment = torch.zeros(labels.shape, device=labels.device).scatter_add_(1, seg, sup.float())
    n = per_segment.gather(1, seg).clamp(min=1)  # [B, T] supervised labels of each token's sample
    w = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    w[:, :-1] = (sup[:, 1:] & (seg[:, 1:] == seg[:, :-1])).float() / n[:, 1:].sqrt()
    return w


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy [B, T-1] in fp32: column t scores labels[:, t+1] under logits[:, t]
    [B, T, V]; 0 where the target is not supervised."""
    B, T, V = logits.shape
    ce = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, V),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    )
    return ce.view(B, T - 1)


def sft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weight_sum: float | torch.Tensor,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 6 (ParVL paper, Appendix A.1; InternVL's square-root loss re-weighting): every supervised
    token of sample b weighs 1/sqrt(n_b), and the weighted sum of token losses is divided by
    `weight_sum`, the sum of the weights over the whole global batch (all micro-batches and ranks,
    loss_weights(...).sum() all-reduced), so the loss does not depend on how the batch is split, nor
    on whether its samples are packed (segment_ids, see loss_weights)."""
    w = loss_weights(labels, segment_ids)[:, :-1]  # [B, T-1]
    return (token_nll(logits, labels) * w).sum() / weight_sum


LOSS_CHUNK = (
    2048  # positions whose logits exist at once in chunked_sft_loss: [2048, 151936] fp32 is 1.2 GB
)


def chunked_sft_loss(
    h: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    weight_sum: float | torch.Tensor,
    segment_ids: torch.Tensor | None = None,
    chunk: int = LOSS_CHUNK,
) -> torch.Tensor:
    """sft_loss(h @ head.T, labels, weight_sum, segment_ids) from the final hidden states h [B, T, C]
    and the lm_head weight [V, C], without the [B, T, V] logits: at 32K tokens and InternVL3.5's
    151,936-word vocabulary those are 20 GB in fp32, plus as much again for their gradient.
    ChunkedLinearNLL scores `chunk` positions at a time and computes their gradients right there, so
    one chunk's logits exist at once and nothing is recomputed in backward."""
    # [B*(T-1)], 0 where the target is not supervised
    w = loss_weights(labels, segment_ids)[:, :-1].reshape(-1)
    x = h[:, :-1].reshape(-1, h.shape[-1])  # [B*(T-1), C] position t predicts labels[:, t+1]
    y = labels[:, 1:].reshape(-1)  # [B*(T-1)]
    if torch.is_grad_enabled() and (x.requires_grad or head.requires_grad):
        return ChunkedLinearNLL.apply(x, head, y, w, chunk) / weight_sum
    return linear_nll(x, head, y, w, chunk, False, False)[0] / weight_sum  # no gradients to compute


def linear_nll(
    x: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    chunk: int,
    need_x: bool,
    need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """ChunkedLinearNLL's work: x [N, C], weight [V, C], y [N], w [N] -> the weighted NLL sum and, where
    asked for, its gradients dx [N, C] (x's dtype) and dW [V, C] (fp32)."""
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x) if need_x else None  # [N, C]
    # [V, C]
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if need_w else None
    for s in range(0, x.shape[0], chunk):
        # IGNORE weighs 0 anyway
        xs, ys, ws = (x[s : s + chunk], y[s : s + chunk].clamp(min=0), w[s : s + chunk])
        logits = F.linear(xs, weight).float()  # [n, V]
        lse = logits.logsumexp(-1)  # [n]
        total += ((lse - logits.gather(1, ys[:, None]).squeeze(1)) * ws).sum()
        if need_x or need_w:
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            # - onehot (no host sync)
            g.scatter_add_(1, ys[:, None], g.new_full((len(ys), 1), -1.0))
            g = g.mul_(ws[:, None]).to(x.dtype)  # [n, V] d total / d logits
            if need_x:
                dx[s : s + chunk] = g @ weight
            if need_w:
                dw += (g.t() @ xs).float()
    return total, dx, dw


class ChunkedLinearNLL(torch.autograd.Function):
    """sum_n w[n] * CE(x[n] @ W^T, y[n]), the logits and the CE in fp32 as token_nll has them, chunk by
    chunk. The forward also computes d/dlogits = w (softmax - onehot) for the chunk and from it dx and
    dW (accumulated in fp32), so backward only scales them by the incoming gradient: the FLOPs of a
    plain lm_head + cross-entropy, one chunk's logits in memory. w must be 0 where y is IGNORE."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, w: torch.Tensor, chunk: int
    ):
        total, dx, dw = linear_nll(x, weight, y, w, chunk, *ctx.needs_input_grad[:2])
        # not inputs or outputs: plain attributes
        ctx.grads, ctx.weight_dtype = ((dx, dw), weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        dx, dw = ctx.grads
        del ctx.grads
        return (
            None if dx is None else dx * grad.to(dx.dtype),
            None if dw is None else (dw * grad).to(ctx.weight_dtype),
            None,
            None,
            None,
        )


def answer_nll(
    h: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, chunk: int = 4096
) -> torch.Tensor:
    """The answer NLL of each row: the mean next-token CE over the supervised tokens of final states h
    [R,T,C] under the lm_head weight head [V,C], labels [R,T] (one row of labels per row of states:
    fold them with aggregate.to_rows for branch rows) -> [R] fp32. The head runs on supervised positions
    only, `chunk` at a time."""
    target = labels[:, 1:]  # [R,T-1] column t scores token t+1
    sel = target != IGNORE
    hs, tg, row = h[:, :-1][sel], target[sel], sel.nonzero()[:, 0]  # [N,C], [N], [N]
    total = torch.zeros(h.shape[0], device=h.device)
    for i in range(0, len(tg), chunk):
        logits = F.linear(hs[i : i + chunk], head).float()
        total.index_add_(
            0, row[i : i + chunk], F.cross_entropy(logits, tg[i : i + chunk], reduction="none")
        )
    return total / sel.sum(1).clamp(min=1)
