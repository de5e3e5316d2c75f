"""One training step, the torchtitan way (train.py runs it): the step's micro-batches on every rank (bad rows
named, packed steps evened out so that every rank runs the same FSDP collectives), each micro-batch's
loss (Eq. 6, summed token loss over the global count of supervised tokens) and backward, the gradient
clip, a finiteness check with no host sync, the optimizer and learning-rate steps."""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from aggregate import entropy
from data.bad_rows import MAX_NAMED
from data.batches import filler_batch
from data.sft import BAD_REASONS, BadRow, SFTData
from loss import chunked_sft_loss, loss_weights
from parvl import ParVL
from shell.cli import allocation, rank
from training.fsdp import TrainedParVL


def name_bad_rows(data: SFTData, batches, named: int) -> int:
    """Name this rank's bad rows on stderr (file, line, why), the first MAX_NAMED of them. A Batch
    keeps only their indices, so a bad row is read again for its reason: rare, and cheap next to a
    training step."""
    for row in (row for b in batches for row in b.bad_rows):
        if named >= MAX_NAMED:
            break
        item = data[row]
        if isinstance(item, BadRow):
            named += 1
            print(
                f"warning: skipped bad row {item.detail} [{item.reason}]"
                + (f" (naming no more on rank {rank()})" if named == MAX_NAMED else ""),
                file=sys.stderr,
                flush=True,
            )
    return named


def match_micro_batch_counts(batches: list, group, pad_id: int, image_size: int) -> list:
    """Packed steps: give every rank as many micro-batches as the one with the most (filler batches,
    data.filler_batch), so that all ranks run the same FSDP collectives. The count is all-reduced on
    the host (a gloo group): no device sync."""
    n = torch.tensor([len(batches)])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return batches + [
        filler_batch(pad_id, image_size) for _ in range(max(1, int(n)) - len(batches))
    ]


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor to `device` without waiting for it: pinned and non-blocking on CUDA."""
    return (
        t.pin_memory().to(device, non_blocking=True)
        if torch.device(device).type == "cuda"
        else t.to(device)
    )


def micro_loss(model: TrainedParVL, batch, weight_sum: float | torch.Tensor, world: int, device):
    """This micro-batch's share of the Eq. 6 loss (loss.sft_loss over the global weight sum, scored chunk
    by chunk from the final states: loss.chunked_sft_loss), times the world size since FSDP averages
    gradients over ranks. Also returns the branch weights' entropies (nan if none)."""
    ids, labels = to_device(batch.input_ids, device), to_device(batch.labels, device)
    # packed rows
    segments = None if batch.segment_ids is None else to_device(batch.segment_ids, device)
    pixels = to_device(batch.pixel_values, device)
    tiles = pixels.shape[0]
    if tiles == 0 and model.cfg.vit is not None:
        size = model.cfg.vit.image_size
        # text only: a dummy tile, see ParVL.embed
        pixels = torch.zeros(1, 3, size, size, device=device)
    # no padding (e.g. one sample per micro-batch): no mask, so attention keeps the causal fast path
    mask = (
        None
        if segments is not None or bool(batch.attention_mask.all())
        else to_device(batch.attention_mask, device)
    )
    h, w_vision, w_language = model.train_states(
        ids, pixels if pixels.shape[0] else None, mask, segments
    )
    loss = (
        chunked_sft_loss(h, model.language_model.lm_head.weight, labels, weight_sum, segments)
        * world
    )
    nan = torch.full((), float("nan"), device=device)  # a fill, not a host-to-device copy
    w_vision = w_vision if tiles else None  # a dummy tile's weights say nothing
    # no host sync
    ent = torch.stack(
        [entropy(w.detach()) if w is not None else nan for w in (w_vision, w_language)]
    )
    return loss, ent


def train_step(model: ParVL, optim, sched, batches: list, cfg, device, s: int) -> dict:
    """One optimizer step over this rank's micro-batches (cfg: train.py's TrainConfig): the Eq. 6 loss
    (micro_loss), one gradient reduce-scatter, clipping, the update. Returns the step's global figures,
    read in one host sync."""
    world = dist.get_world_size()
    # one all-reduce for everything known before the forward (Eq. 6 weight sum, counts, bad rows by
    # reason); it stays on the device, where the loss divides by the weight sum, and the host reads
    # it together with the loss and the gradient norm: one host sync per step
    local = torch.tensor(
        [
            sum(float(loss_weights(b.labels, b.segment_ids).sum()) for b in batches),
            sum(b.num_samples for b in batches),
            sum(int(b.attention_mask.sum()) for b in batches),
            sum(b.input_ids.numel() for b in batches),
            sum(b.pixel_values.shape[0] for b in batches),
            *(sum(b.bad.get(r, 0) for b in batches) for r in BAD_REASONS),
        ],
        dtype=torch.float64,
    )
    counts = to_device(local, device)
    dist.all_reduce(counts)
    loss_sum, ents = torch.zeros((), device=device), []
    for i, batch in enumerate(batches):
        model.set_requires_gradient_sync(i == len(batches) - 1)  # reduce-scatter once per step
        with allocation(
            f"--micro-batch {cfg.micro_batch} (this one {batch.input_ids.shape[0]} rows of "
            f"{batch.input_ids.shape[1]} tokens)",
            "--micro-batch or --max-seq-len",
        ):
            loss, ent = micro_loss(model, batch, counts[0].clamp_min(1e-12), world, device)
            loss.backward()
        loss_sum = loss_sum + loss.detach()
        if batch.num_samples:  # a filler or all-bad micro-batch's weights say nothing
            ents.append(ent)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.requires_grad], cfg.clip
    )
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    # the global loss is the ranks' sum over the world size (see micro_loss)
    dist.all_reduce(loss_sum)
    _, good, text_tokens, slots, tiles, *bad, loss_value, grad_value = (
        torch.cat(  # the step's one host sync
            [counts, torch.stack([loss_sum / world, grad_norm]).double()]
        ).tolist()
    )
    if not (math.isfinite(loss_value) and math.isfinite(grad_value)):
        raise ValueError(
            f"step {s + 1}: non-finite loss {loss_value} or grad norm {grad_value}; "
            f"stopped before the update, last checkpoint kept"
        )
    lrs = {g["name"]: g["lr"] for g in optim.param_groups}  # the rates this update uses
    optim.step()
    sched.step()
    optim.zero_grad(set_to_none=True)
    return {
        "loss": loss_value,
        "grad_norm": grad_value,
        "lr": lrs,
        "good": good,
        "text_tokens": text_tokens,
        "slots": slots,
        "tiles": tiles,
        "bad": dict(zip(BAD_REASONS, bad)),
        "ents": ents,
    }
