"""CUDA paths (bench/h200.sh runs these; skipped without a GPU): compiled decode with
mode="reduce-overhead" (CUDA graphs) against eager, greedy tokens in fp32 and the step's logits in
bf16, for 1:1, 4:4, shared KV and per-sample pairs; packed training rows (flex_attention with a
BlockMask) against the same samples unpacked; no host sync in a training micro-batch. The kernel each
attention case gets and the graph-break check are in test_kernels.py. The decode and packing tests
also run on CPU, marked slow (`pytest -m slow`): CI has no GPU, and the first H200 run found the
training tests calling micro_loss with a plain ParVL (no train_states), a failure on any machine."""

from dataclasses import replace

import pytest
import torch

from config import PRESETS, ParConfig
from inference.engine import Engine, GenerateConfig, decode_one_token, prefill
from parvl import ParVL
from training.fsdp import TrainedParVL

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = [pytest.mark.gpu, needs_cuda]
# the same bodies on CPU (slow: inductor compiles each variant): the properties hold there too, and a test
# that no longer runs is found without a GPU
DEVICES = [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=CUDA)]
NEW = 12


def setup(pv: int, pl: int, dtype: torch.dtype, device: str):
    cfg = replace(PRESETS["tiny"], par=ParConfig(pv=pv, pl=pl, vit_prefix_len=8, llm_prefix_len=8))
    model = ParVL.from_config(cfg, dtype, device, seed=pv * 10 + pl).eval()
    model.init_branches(std=0.5)
    g = torch.Generator().manual_seed(pv + pl)
    per = cfg.tokens_per_tile
    prompts, tiles = [], []
    for n_tiles, text in [(1, 9), (0, 21), (2, 5)]:
        ids = torch.randint(0, cfg.image_token_id, (text,), generator=g)
        if n_tiles:
            ids = torch.cat([ids[:2], torch.full((per * n_tiles,), cfg.image_token_id), ids[2:]])
            tiles.append(torch.randn(n_tiles, 3, 448, 448, generator=g))
        prompts.append(ids.tolist())
    return model, prompts, torch.cat(tiles).to(device, dtype)


@pytest.mark.parametrize(
    "pv,pl,shared,pairs",
    [(1, 1, False, False), (4, 4, False, False), (4, 4, True, False), (4, 4, False, True)],
    ids=["1:1", "4:4", "4:4 shared KV", "4:4 per-sample pairs"],
)
@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_reduce_overhead_decode_equals_eager(pv, pl, shared, pairs, device):
    """Greedy tokens in fp32, recorded and replayed, equal eager's. Not in bf16: this random tiny model's
    logits are nearly flat (about 0.48, the two best often one unit in the last place apart, at times
    equal), so any other summation order, inductor's, picks the other token of a tie and the sequences
    part (seen on CPU, 1:1, the two-tile prompt's 6th token). bf16 is held to the step's logits below."""
    model, prompts, pixels = setup(pv, pl, torch.float32, device)
    kw = dict(vision_branch=[3, 0, 1], language_branch=[2, 2, 0]) if pairs else {}
    cfg = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
    eager = Engine(model, shared_kv=shared).generate(prompts, pixels, cfg, [], **kw).tokens
    fast = Engine(model, compile=True, shared_kv=shared)  # reduce-overhead on CUDA, gemv on CPU
    assert fast.generate(prompts, pixels, cfg, [], **kw).tokens == eager
    # a graph replay, not only the recording
    assert fast.generate(prompts, pixels, cfg, [], **kw).tokens == eager

    # the step's logits on one cache state: compiled with CUDA graphs vs eager, within bf16 rounding
    model, prompts, pixels = setup(pv, pl, torch.bfloat16, device)
    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    valid = torch.zeros(B, T, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], valid[b, T - len(p) :] = torch.tensor(p), True
    rows = model.language_rows(kw.get("language_branch"), B, device, shared)
    model.language_model.setup_cache(rows, T + 8)
    logits = prefill(model, ids, pixels, valid, True, kw.get("vision_branch"), rows)
    key_valid = torch.ones(B, T + 8, dtype=torch.bool, device=device)
    key_valid[:, :T] = valid
    step = (
        logits.argmax(-1, keepdim=True),
        torch.tensor([T], device=device),
        valid.sum(-1, keepdim=True),
        key_valid,
        rows,
    )
    want = decode_one_token(model, *step)
    compiled = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, recording, replay
        got = compiled(model, *step).clone()
    # bf16: 8 bits of mantissa, two orders of sums
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


def training_samples(cfg):
    """Three SFT samples: one tile, text only, two tiles; the last tokens supervised."""
    from data.sft import Sample
    from loss import IGNORE

    per, g, samples = cfg.tokens_per_tile, torch.Generator().manual_seed(0), []
    for k, (tiles, text) in enumerate([(1, 20), (0, 13), (2, 31)]):
        ids = torch.randint(0, cfg.image_token_id, (text,), generator=g)
        if tiles:
            ids = torch.cat([ids[:2], torch.full((per * tiles,), cfg.image_token_id), ids[2:]])
        labels = torch.full_like(ids, IGNORE)
        labels[-5:] = ids[-5:]
        samples.append(
            Sample(
                ids,
                labels,
                torch.randn(tiles, 3, 448, 448, generator=g),
                [tiles] if tiles else [],
                k,
            )
        )
    return samples


def pinned(batch):
    for f in ("input_ids", "labels", "attention_mask", "pixel_values", "segment_ids"):
        if getattr(batch, f) is not None:
            setattr(batch, f, getattr(batch, f).pin_memory())
    return batch


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.gpu
@needs_cuda
def test_training_micro_batch_has_no_host_sync(packed):
    """training.step.micro_loss forward and backward on a 2:2 model with images, padding (or packing) and a
    text-only row, under torch.cuda.set_sync_debug_mode("error"): any host synchronisation raises. The
    property is the training loop's steady state: one micro-batch runs first, outside the check (it
    compiles flex_attention and autotunes, which synchronise once per shape, not once per step)."""
    from data.batches import collate, pack_step
    from training.step import micro_loss

    cfg = replace(PRESETS["tiny"], par=ParConfig(pv=2, pl=2, vit_prefix_len=8, llm_prefix_len=8))
    # micro_loss takes train.py's model
    model = TrainedParVL.from_config(cfg, torch.float32, "cuda").train()
    samples = training_samples(cfg)
    batch = pinned(pack_step(samples, 4096, 1, 0)[0] if packed else collate(samples, pad_id=0))
    weight_sum = torch.ones((), device="cuda")
    micro_loss(model, batch, weight_sum, 1, torch.device("cuda"))[0].backward()  # the warm-up
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, ent = micro_loss(model, batch, weight_sum, 1, torch.device("cuda"))
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item() and all(
        p.grad is not None for n, p in model.named_parameters() if "prefix" in n
    )


@pytest.mark.parametrize("pv,pl", [(1, 1), (2, 2)])
@pytest.mark.parametrize("device", DEVICES)
def test_packed_flex_attention_training_equals_unpacked(pv, pl, device):
    """On CUDA a packed row runs flex_attention (compiled) under the BlockMask of packing.packed_mask (on
    CPU SDPA under packing's dense mask): loss and gradients equal the three samples as one-sample
    micro-batches (SDPA), fp32."""
    from data.batches import collate, pack_step
    from loss import loss_weights
    from training.step import micro_loss

    cfg = replace(PRESETS["tiny"], par=ParConfig(pv=pv, pl=pl, vit_prefix_len=8, llm_prefix_len=8))
    # micro_loss takes train.py's model
    model = TrainedParVL.from_config(cfg, torch.float32, device).train()
    model.init_branches(std=0.3)
    samples = training_samples(cfg)

    def run(batches):
        model.zero_grad(set_to_none=False)
        norm = sum(float(loss_weights(b.labels, b.segment_ids).sum()) for b in batches)
        total = 0.0
        for b in batches:
            loss = micro_loss(model, b, norm, 1, torch.device(device))[0]
            loss.backward()
            total += float(loss.detach())
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = run([collate([s], pad_id=0) for s in samples])
    got, grads = run(pack_step(samples, 4096, 1, 0))
    # fp32; flex and SDPA sum the softmax in other orders
    assert got == pytest.approx(want, rel=1e-4)
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-3, atol=1e-5, msg=name)
