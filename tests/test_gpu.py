"""CUDA paths (bench/h200.sh runs these; skipped without a GPU): compiled decode with
mode="reduce-overhead" (CUDA graphs) against eager, in bf16, for 1:1, 4:4, shared KV and per-sample
pairs; packed training rows (flex_attention with a BlockMask) against the same samples unpacked;
no host sync in a training micro-batch. The kernel each attention case gets and the graph-break
check are in test_kernels.py."""
from dataclasses import replace

import pytest
import torch

from config import PRESETS, ParConfig
from engine import Engine, GenerateConfig, decode_one_token, prefill
from parvl import ParVL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NEW = 12


def setup(pv: int, pl: int):
    cfg = replace(PRESETS["tiny"], par=ParConfig(pv=pv, pl=pl, vit_prefix_len=8, llm_prefix_len=8))
    model = ParVL.from_config(cfg, torch.bfloat16, "cuda", seed=pv * 10 + pl).eval()
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
    return model, prompts, torch.cat(tiles).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("pv,pl,shared,pairs", [(1, 1, False, False), (4, 4, False, False), (4, 4, True, False),
                                                (4, 4, False, True)],
                         ids=["1:1", "4:4", "4:4 shared KV", "4:4 per-sample pairs"])
@torch.no_grad()
def test_reduce_overhead_decode_equals_eager(pv, pl, shared, pairs):
    model, prompts, pixels = setup(pv, pl)
    kw = dict(vision_branch=[3, 0, 1], language_branch=[2, 2, 0]) if pairs else {}
    cfg = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
    eager = Engine(model, shared_kv=shared).generate(prompts, pixels, cfg, [], **kw).tokens
    fast = Engine(model, compile=True, shared_kv=shared)  # reduce-overhead on CUDA
    assert fast.generate(prompts, pixels, cfg, [], **kw).tokens == eager
    assert fast.generate(prompts, pixels, cfg, [], **kw).tokens == eager  # a graph replay, not only the recording

    # the step's logits on one cache state: compiled with CUDA graphs vs eager, within bf16 rounding
    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.long, device="cuda")
    valid = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], valid[b, T - len(p):] = torch.tensor(p), True
    rows = model.language_rows(kw.get("language_branch"), B, "cuda", shared)
    model.language_model.setup_cache(rows, T + 8)
    logits = prefill(model, ids, pixels, valid, True, kw.get("vision_branch"), rows)
    key_valid = torch.ones(B, T + 8, dtype=torch.bool, device="cuda")
    key_valid[:, :T] = valid
    step = (logits.argmax(-1, keepdim=True), torch.tensor([T], device="cuda"), valid.sum(-1, keepdim=True),
            key_valid, rows)
    want = decode_one_token(model, *step)
    compiled = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, recording, replay
        got = compiled(model, *step).clone()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)  # bf16: 8 bits of mantissa, two orders of sums


def training_samples(cfg):
    """Three SFT samples: one tile, text only, two tiles; the last tokens supervised."""
    from data import Sample
    from loss import IGNORE

    per, g, samples = cfg.tokens_per_tile, torch.Generator().manual_seed(0), []
    for k, (tiles, text) in enumerate([(1, 20), (0, 13), (2, 31)]):
        ids = torch.randint(0, cfg.image_token_id, (text,), generator=g)
        if tiles:
            ids = torch.cat([ids[:2], torch.full((per * tiles,), cfg.image_token_id), ids[2:]])
        labels = torch.full_like(ids, IGNORE)
        labels[-5:] = ids[-5:]
        samples.append(Sample(ids, labels, torch.randn(tiles, 3, 448, 448, generator=g), [tiles] if tiles else [], k))
    return samples


def pinned(batch):
    for f in ("input_ids", "labels", "attention_mask", "pixel_values", "segment_ids"):
        if getattr(batch, f) is not None:
            setattr(batch, f, getattr(batch, f).pin_memory())
    return batch


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_training_micro_batch_has_no_host_sync(packed):
    """train.micro_loss forward and backward on a 2:2 model with images, padding (or packing) and a
    text-only row, under torch.cuda.set_sync_debug_mode("error"): any host synchronisation raises."""
    from batches import collate, pack_step
    from train import micro_loss

    cfg = replace(PRESETS["tiny"], par=ParConfig(pv=2, pl=2, vit_prefix_len=8, llm_prefix_len=8))
    model = ParVL.from_config(cfg, torch.float32, "cuda").train()
    samples = training_samples(cfg)
    batch = pinned(pack_step(samples, 4096, 1, 0)[0] if packed else collate(samples, pad_id=0))
    weight_sum = torch.ones((), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, ent = micro_loss(model, batch, weight_sum, 1, torch.device("cuda"))
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item() and all(p.grad is not None for n, p in model.named_parameters() if "prefix" in n)


@pytest.mark.parametrize("pv,pl", [(1, 1), (2, 2)])
def test_packed_flex_attention_training_equals_unpacked(pv, pl):
    """On CUDA a packed row runs flex_attention (compiled) under the BlockMask of packing.packed_mask:
    loss and gradients equal the three samples as one-sample micro-batches (SDPA), fp32."""
    from batches import collate, pack_step
    from loss import loss_weights
    from train import micro_loss

    cfg = replace(PRESETS["tiny"], par=ParConfig(pv=pv, pl=pl, vit_prefix_len=8, llm_prefix_len=8))
    model = ParVL.from_config(cfg, torch.float32, "cuda").train()
    model.init_branches(std=0.3)
    samples = training_samples(cfg)

    def run(batches):
        model.zero_grad(set_to_none=False)
        norm = sum(float(loss_weights(b.labels, b.segment_ids).sum()) for b in batches)
        total = 0.0
        for b in batches:
            loss = micro_loss(model, b, norm, 1, torch.device("cuda"))[0]
            loss.backward()
            total += float(loss.detach())
        return total, {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = run([collate([s], pad_id=0) for s in samples])
    got, grads = run(pack_step(samples, 4096, 1, 0))
    assert got == pytest.approx(want, rel=1e-4)  # fp32; flex and SDPA sum the softmax in other orders
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-3, atol=1e-5, msg=name)
