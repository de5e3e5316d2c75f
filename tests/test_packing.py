"""Sequence packing: the packed-row mask (dense and BlockMask) against a hand-built one, flex_attention
against SDPA, per-sample Eq. 6 weights, first-fit packing, and the loss and gradients of packed
micro-batches against the same samples unpacked, in process and through train.py (1 and 2 ranks)."""

import math

import pytest
import torch
import torch.nn.functional as F
from commands import COMMON, metrics, run_train, train_here
from torch.nn.attention.flex_attention import create_mask

from aggregate import Rows, prefix_attention
from data.batches import collate, pack_step
from data.processor import Tokenizer
from data.sft import BadRow, Sample, SFTData
from loading.pretrained import load_pretrained
from loss import IGNORE, loss_weights
from packing import BLOCK, pack_rows, packed_mask, segment_positions
from training.fsdp import TrainedParVL
from training.step import micro_loss

# Rows of packed samples: lengths of the samples in each row, then the row's padding (the last row
# is the longest). Samples of one token, a row that is one sample, and blocks that straddle the
# prefix end and sample boundaries are all in there.
LAYOUTS = [[[80, 70, 150], [120, 1, 1, 10]], [[300], [5, 255, 40]], [[128, 128, 44], [1] * 7]]


def segments_of(layout: list[list[int]]) -> torch.Tensor:
    T = max(sum(r) for r in layout)
    seg = torch.empty(len(layout), T, dtype=torch.long)
    for b, row in enumerate(layout):
        seg[b] = len(row)  # the padding: one more segment
        t = 0
        for k, n in enumerate(row):
            seg[b, t : t + n] = k
            t += n
    return seg


def hand_mask(layout: list[list[int]], Lp: int) -> torch.Tensor:
    """[B,1,T,Lp+T]: every query sees the Lp prefix slots, then its own sample causally; the padding
    after the samples attends causally among itself."""
    T = max(sum(r) for r in layout)
    m = torch.zeros(len(layout), 1, T, Lp + T, dtype=torch.bool)
    m[..., :Lp] = True
    for b, row in enumerate(layout):
        t = 0
        for n in row + [T - sum(row)]:
            for i in range(n):
                m[b, 0, t + i, Lp + t : Lp + t + i + 1] = True
            t += n
    return m


@pytest.mark.parametrize("Lp", [0, 48, 96])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_masks_equal_the_hand_built_mask(layout, Lp):
    seg, want = segments_of(layout), hand_mask(layout, Lp)
    B, T = seg.shape
    rows = Rows.choose(None, 1, B, "cpu")
    assert torch.equal(packed_mask(seg, rows, Lp, flex=False), want)
    bm = packed_mask(seg, rows, Lp, flex=True)
    # its mask_mod, token by token
    assert torch.equal(create_mask(bm.mask_mod, B, 1, T, Lp + T, device="cpu"), want)
    # The blocks: listed (partial or full) iff they hold a visible pair; full only where every pair is
    # visible, so skipping mask_mod there is exact.
    nq, nk = -(-T // BLOCK), -(-(Lp + T) // BLOCK)
    padded = F.pad(want, (0, nk * BLOCK - Lp - T, 0, nq * BLOCK - T)).view(
        B, 1, nq, BLOCK, nk, BLOCK
    )
    some, every = padded.any(5).any(3), padded.all(5).all(3)
    assert torch.equal(bm.to_dense().bool(), some)
    full = torch.zeros_like(some)
    for b in range(B):
        for q in range(nq):
            full[b, 0, q, bm.full_kv_indices[b, 0, q, : bm.full_kv_num_blocks[b, 0, q]].long()] = (
                True
            )
    assert torch.equal(full, every)
    # a 300-token sample has full blocks
    assert (some & ~full).any() and (full.any() or layout is not LAYOUTS[1])


def test_dense_rows_repeat_the_mask_per_branch_and_positions_restart():
    layout = LAYOUTS[0]
    seg = segments_of(layout)
    rows = Rows.choose(None, 3, 2, "cpu")  # 3 branches, dense: row p*B + b is branch p of row b
    assert torch.equal(
        packed_mask(seg, rows, 8, flex=False), hand_mask(layout, 8).repeat(3, 1, 1, 1)
    )
    pos = segment_positions(seg)
    assert pos[0].tolist() == list(range(80)) + list(range(70)) + list(range(150))
    assert pos[1].tolist() == list(range(120)) + [0, 0] + list(range(10)) + list(range(300 - 132))


@pytest.mark.parametrize("Lp", [0, 48])
def test_flex_attention_with_the_block_mask_equals_sdpa_with_the_dense_mask(Lp):
    """Forward only: flex_attention has no backward on CPU (train.py takes the dense mask there); on
    CUDA tests/test_gpu.py checks the backward too."""
    layout = LAYOUTS[1]
    seg = segments_of(layout)
    B, T = seg.shape
    rows = Rows.choose(None, 2, B, "cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2 * B, 4, T, 32, generator=g)
    k, v = torch.randn(2, 2 * B, 2, T, 32, generator=g)
    pk, pv = torch.randn(2, 2 * B, 2, Lp, 32, generator=g)
    dense = prefix_attention(
        q, k, v, pk, pv, causal=True, mask=packed_mask(seg, rows, Lp, flex=False)
    )
    with torch.no_grad():
        flex = prefix_attention(
            q, k, v, pk, pv, causal=True, mask=packed_mask(seg, rows, Lp, flex=True)
        )
    # fp32, the same softmax over the same keys in another order: agreement to a few ulps of O(1) outputs
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_loss_weights_are_per_sample_in_packed_rows():
    # row 0: sample A (3 tokens, 2 supervised), sample B (4 tokens, 3 supervised), 1 padding token
    labels = torch.tensor([[IGNORE, 5, 6, IGNORE, 7, 8, 9, IGNORE]])
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    a, b = 1 / math.sqrt(2), 1 / math.sqrt(3)
    # column t weighs the target labels[t+1]; column 2 -> 3 crosses into B (and B's first label is ignored)
    assert loss_weights(labels, seg)[0].tolist() == pytest.approx([a, a, 0, b, b, b, 0, 0])
    # the same samples unpacked give the same weights
    assert loss_weights(labels[:, :3])[0].tolist() == pytest.approx([a, a, 0])
    assert loss_weights(labels[:, 3:7])[0].tolist() == pytest.approx([b, b, b, 0])
    # a supervised first token of the next sample is still not predicted across the boundary
    cross = torch.tensor([[IGNORE, 5, 6, 7, 8]])
    assert loss_weights(cross, torch.tensor([[0, 0, 0, 1, 1]]))[0, 2] == 0


def test_first_fit_packing_in_order_and_bad_rows_counted():
    # 6 opens row 0, 5 row 1, 3 fits row 0, 4 row 1, 2 fits neither, 10 needs its own, 1 fills row 0
    assert pack_rows([6, 5, 3, 4, 2, 10, 1], 10) == [[0, 2, 6], [1, 3], [4], [5]]
    assert pack_rows([], 10) == [] and pack_rows([10, 10], 10) == [[0], [1]]

    def sample(n, row):
        ids = torch.arange(n) + 10
        return Sample(
            ids,
            torch.where(ids % 2 == 0, ids, IGNORE),
            torch.full((row % 2, 3, 8, 8), float(row)),
            [row % 2] * (row % 2),
            row,
        )

    items = [
        sample(6, 0),
        BadRow("missing_image", "x", 1),
        sample(5, 2),
        sample(3, 3),
        BadRow("too_long", "y", 4),
        sample(3, 5),
    ]
    batches = pack_step(items, max_seq_len=10, rows_per_batch=1, pad_id=0, image_size=8)
    assert [b.rows for b in batches] == [[0, 3], [2, 5]] and [b.num_samples for b in batches] == [
        2,
        2,
    ]
    assert (
        batches[0].bad == {"missing_image": 1, "too_long": 1}
        and batches[0].bad_rows == [1, 4]
        and not batches[1].bad
    )
    first = batches[0]
    assert first.segment_ids.tolist() == [[0] * 6 + [1] * 3] and first.position_ids.tolist() == [
        list(range(6)) + [0, 1, 2]
    ]
    assert (
        first.input_ids[0].tolist() == list(range(10, 16)) + [10, 11, 12]
        and first.attention_mask.all()
    )
    # row 3's tile; row 0 has none
    assert first.num_tiles == [1] and first.pixel_values[:, 0, 0, 0].tolist() == [3.0]
    # rows of 9 and 8 tokens
    two = pack_step(items, max_seq_len=10, rows_per_batch=2, pad_id=0, image_size=8)[0]
    assert two.segment_ids[1].tolist() == [0] * 5 + [1] * 3 + [2] and two.attention_mask[
        1
    ].tolist() == [True] * 8 + [False]
    # row by row, sample by sample
    assert two.num_tiles == [1, 1] and two.pixel_values[:, 0, 0, 0].tolist() == [3.0, 5.0]
    only_bad = pack_step([items[1]], 10, 1, 0, 8)
    assert (
        len(only_bad) == 1
        and only_bad[0].num_samples == 0
        and loss_weights(only_bad[0].labels).sum() == 0
    )


@pytest.mark.parametrize("pv,pl", [(1, 1), (2, 2)])
def test_packed_loss_and_gradients_equal_unpacked(model_dir, meta, pv, pl):
    """The same 8 samples (one image, two images, text only) as 8 one-sample micro-batches and packed
    two ways; fp32. Loss and gradients agree to float rounding: the sums run in another order (other
    matmul shapes, masked SDPA over other key sets), a few ulps per op through 2+2 layers, so 1e-5
    relative on the loss and the gradient norm, 1e-4 relative (1e-7 absolute) per gradient entry."""
    torch.manual_seed(0)
    # train mode: text-only batches take a dummy tile
    model = load_pretrained(model_dir, pv=pv, pl=pl, model_class=TrainedParVL).train()
    model.init_branches(std=0.3)
    tok = Tokenizer.from_pretrained(model_dir)
    data = SFTData(meta, tok, max_tiles=2, max_seq_len=32768)
    samples = [data[i] for i in range(8)]
    assert {len(s.num_tiles) for s in samples} == {0, 1, 2}
    lengths = [len(s.input_ids) for s in samples]

    def run(batches):
        model.zero_grad(set_to_none=False)
        norm = sum(float(loss_weights(b.labels, b.segment_ids).sum()) for b in batches)
        total = 0.0
        for b in batches:
            loss = micro_loss(model, b, norm, 1, "cpu")[0]
            loss.backward()
            total += float(loss.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return total, grads, torch.cat([g.flatten() for g in grads.values()]).norm()

    want, want_grads, want_norm = run([collate([s], pad_id=0) for s in samples])
    for max_len, per_batch in [(sum(lengths), 1), (max(lengths) + min(lengths), 2)]:
        batches = pack_step(samples, max_len, per_batch, 0, data.image_size)
        assert max(int(b.segment_ids.max()) for b in batches) >= 2  # rows do hold several samples
        loss, grads, norm = run(batches)
        assert loss == pytest.approx(want, rel=1e-5) and float(norm) == pytest.approx(
            float(want_norm), rel=1e-5
        )
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.slow
def test_train_packed_equals_unpacked_on_one_and_two_ranks(model_dir, meta, tmp_path):
    """train.py 2:2 for 3 steps of 4 samples (627, 849, 352, 89 tokens, ...) with --max-seq-len 1000:
    one padded row per sample; packed, 2 rows per micro-batch; packed on 2 ranks, where step 2 gives
    one rank 2 rows and the other 1 (a filler micro-batch evens them out). Same loss and gradient
    norm every step, to fp32 rounding (the runs sum in other orders; see the in-process test)."""
    args = [
        "--model",
        model_dir,
        "--data",
        meta,
        "--pv",
        "2",
        "--pl",
        "2",
        "--max-steps",
        "3",
        "--max-seq-len",
        "1000",
        *COMMON,
    ]
    # one process: train.main in this one
    train_here(*args, "--no-packing", "--out", tmp_path / "unpacked")
    train_here(*args, "--micro-batch", "2", "--out", tmp_path / "packed")
    run_train(*args, "--out", tmp_path / "two", nproc=2)
    runs = [metrics(tmp_path / name) for name in ("unpacked", "packed", "two")]
    for a, b, c in zip(*runs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) == pytest.approx(c["loss"], rel=1e-5)
        assert (
            a["grad_norm"]
            == pytest.approx(b["grad_norm"], rel=1e-4)
            == pytest.approx(c["grad_norm"], rel=1e-4)
        )
