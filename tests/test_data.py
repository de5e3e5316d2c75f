"""Tests for data/sft.py: the official InternVL SFT data format, label masking, batching and sharding; rows the
official preprocessing reads (a first turn from gpt) and rows it does not (role/content, not valid Unicode,
not JSON), named with their line and cause, by --validate-data too; the loader's workers.

Expected token ids are built by hand from the segment strings of preprocess_internvl2_5 and encoded with the
tiny Qwen-style tokenizer from tests/tiny_tokenizer.py; expected pixels come from
processor.load_image. Every dataset is written with pillow into tmp_path.

Run: python -m pytest tests/test_data.py -q
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `pytest` works from anywhere
from commands import COMMON, ROOT, one_line, run_main, train_here, tree  # noqa: E402
from conftest import NOT_UTF8  # noqa: E402
from inputs import write_dataset  # noqa: E402
from tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

import train  # noqa: E402
from data import bad_rows  # noqa: E402
from data import sft as D  # noqa: E402
from data.bad_rows import check_bad_fraction, validate  # noqa: E402
from data.batches import RankSampler, collate, make_loader  # noqa: E402
from data.processor import DEFAULT_SYSTEM_MESSAGE, Tokenizer, load_image  # noqa: E402
from data.sft import BadRow, Sample, SFTData  # noqa: E402
from loss import loss_weights  # noqa: E402

CTX = "<IMG_CONTEXT>"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder, layout="json", family="qwen3")
    return Tokenizer.from_pretrained(folder)


def image(path: Path, w: int, h: int, seed: int = 0) -> str:
    """A noisy RGB image (noise, so JPEG re-encoding visibly changes it); returns its name."""
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path.name


def chat(*turns, image=None, system=None) -> dict:
    """A row from alternating human/gpt texts."""
    conv = [{"from": "system", "value": system}] if system is not None else []
    conv += [{"from": ("human", "gpt")[k % 2], "value": t} for k, t in enumerate(turns)]
    return {"conversations": conv} if image is None else {"image": image, "conversations": conv}


def write_meta(tmp_path: Path, datasets: dict) -> Path:
    """datasets: name -> (rows or raw lines, meta fields). Annotation paths are relative."""
    meta = {}
    for name, (rows, fields) in datasets.items():
        lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        meta[name] = {
            "root": str(tmp_path),
            "annotation": f"{name}.jsonl",
            "repeat_time": 1,
            "length": len(rows),
            "data_augment": False,
            **fields,
        }
    path = tmp_path / "meta.json"
    path.write_text(json.dumps(meta))
    return path


def make_data(tmp_path, tok, rows, fields=None, **kw) -> SFTData:
    return SFTData(write_meta(tmp_path, {"ds": (rows, fields or {})}), tok, **kw)


def segments(tok, system, turns):
    """Hand-built ids and labels of preprocess_internvl2_5 for [(role, text)] turns (images already expanded)."""
    head = len(tok.encode("<|im_start|>assistant\n"))
    ids, labels = tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n"), None
    labels = [-100] * len(ids)
    for role, text in turns:
        seg = tok.encode(
            f"<|im_start|>{'user' if role == 'human' else 'assistant'}\n{text}<|im_end|>\n"
        )
        ids += seg
        labels += ([-100] * head + seg[head:-1] + [-100]) if role == "gpt" else [-100] * len(seg)
    return ids, labels


def expand(n_tiles: int) -> str:
    return "<img>" + CTX * (256 * n_tiles) + "</img>"


# ----------------------------------------------------------------------------- tokens and labels


def test_label_masking_two_turns(tmp_path, tok):
    q1, a1, q2, a2 = "What is shown?", "A cat on a red chair.", "Where is it?", "Near the window."
    d = make_data(tmp_path, tok, [chat(q1, a1, q2, a2)])
    s = d[0]
    assert isinstance(s, Sample) and s.row == 0 and s.pixel_values.shape == (0, 3, 448, 448)
    ids, labels = segments(
        tok, DEFAULT_SYSTEM_MESSAGE, [("human", q1), ("gpt", a1), ("human", q2), ("gpt", a2)]
    )
    assert s.input_ids.tolist() == ids and s.labels.tolist() == labels
    # Supervised: exactly each response followed by its <|im_end|>, nothing else.
    im_end = tok.token_to_id("<|im_end|>")
    sup = s.labels[s.labels != -100].tolist()
    assert sup == tok.encode(a1) + [im_end] + tok.encode(a2) + [im_end]
    assert (s.labels[s.labels != -100] == s.input_ids[s.labels != -100]).all()
    assert tok.decode(sup) == a1 + "<|im_end|>" + a2 + "<|im_end|>"


def test_system_turn_and_system_argument(tmp_path, tok):
    d = make_data(
        tmp_path,
        tok,
        [chat("hi", "hello", system="Be brief."), chat("hi", "hello")],
        system="You are a helpful assistant.",
    )
    assert (
        d[0].input_ids.tolist()
        == segments(tok, "Be brief.", [("human", "hi"), ("gpt", "hello")])[0]
    )
    assert (
        d[1].input_ids.tolist()
        == segments(tok, "You are a helpful assistant.", [("human", "hi"), ("gpt", "hello")])[0]
    )


@pytest.mark.parametrize("n_images", [0, 1, 3])
@pytest.mark.parametrize("placeholders", [True, False])
def test_image_tokens_count_and_placement(tmp_path, tok, n_images, placeholders):
    names = [image(tmp_path / f"im{k}.png", 300 + 200 * k, 150, seed=k) for k in range(n_images)]
    q = "".join(f"Image-{k + 1}: <image>\n" for k in range(n_images)) if placeholders else ""
    row = chat(
        q + "Compare them.",
        "They differ.",
        image=names if n_images > 1 else (names[0] if names else None),
    )
    s = make_data(tmp_path, tok, [row])[0]
    assert isinstance(s, Sample), s
    budget = max(1, 12 // max(n_images, 1))
    expected_pix = [load_image(tmp_path / n, max_tiles=budget) for n in names]
    assert s.num_tiles == [p.shape[0] for p in expected_pix]
    # Without placeholders, "<image>\n" per image goes in front of the first human turn (the official preprocessing).
    text = (
        "".join(
            (f"Image-{k + 1}: " if placeholders else "") + expand(n) + "\n"
            for k, n in enumerate(s.num_tiles)
        )
        + "Compare them."
    )
    ids, labels = segments(tok, DEFAULT_SYSTEM_MESSAGE, [("human", text), ("gpt", "They differ.")])
    assert s.input_ids.tolist() == ids and s.labels.tolist() == labels
    assert int((s.input_ids == tok.img_context_id).sum()) == 256 * sum(s.num_tiles)
    assert torch.equal(
        s.pixel_values, torch.cat(expected_pix) if names else torch.zeros(0, 3, 448, 448)
    )


def test_per_image_tile_budget(tmp_path, tok):
    wide = image(tmp_path / "wide.png", 800, 200)  # aspect 4: grid (4,1) if allowed
    rows = [
        chat("<image>\nWhat?", "Wide.", image=wide),
        chat("<image>\n<image>\nWhat?", "Two.", image=[wide, wide]),
        chat("<image><image><image>What?", "Three.", image=[wide, wide, wide]),
    ]
    d = make_data(tmp_path, tok, rows, max_tiles=4)
    # max(1, 4 // n): 4 tiles -> (4,1)+thumbnail; 2 -> (2,1)+thumbnail; 1 -> a single tile.
    assert [d[i].num_tiles for i in range(3)] == [[5], [3, 3], [1, 1, 1]]
    for i, n in enumerate((1, 2, 3)):
        ref = load_image(tmp_path / wide, max_tiles=max(1, 4 // n))
        assert torch.equal(d[i].pixel_values, torch.cat([ref] * n))
    # A per-dataset max_dynamic_patch overrides max_tiles.
    d = make_data(tmp_path, tok, rows, {"max_dynamic_patch": 12}, max_tiles=4)
    assert [d[i].num_tiles for i in range(3)] == [[5], [5, 5], [5, 5, 5]]


def test_repeat_time(tmp_path, tok):
    rows = [chat("q", f"answer {k}") for k in range(10)]
    meta = write_meta(
        tmp_path, {"a": (rows, {"repeat_time": 0.35}), "b": (rows, {"repeat_time": 2.7})}
    )
    d = SFTData(meta, tok)
    assert len(d) == 3 + 20  # floor(10 * 0.35) first lines, then int(2.7) copies in order

    def answer(i):
        return tok.decode(d[i].labels[d[i].labels != -100].tolist()).removesuffix("<|im_end|>")

    assert [answer(i) for i in range(len(d))] == [
        f"answer {k}" for k in [0, 1, 2] + list(range(10)) * 2
    ]


def test_epoch_order(tmp_path, tok):
    d = make_data(tmp_path, tok, [chat("q", "a")] * 50)
    o = d.epoch_order(3)
    assert sorted(o.tolist()) == list(range(50)) and torch.equal(o, d.epoch_order(3))
    assert not torch.equal(o, d.epoch_order(4))


# ----------------------------------------------------------------------------- bad rows


def test_bad_rows_detected_counted_and_deterministic(tmp_path, tok):
    good = image(tmp_path / "good.png", 500, 300)
    (tmp_path / "garbage.jpg").write_bytes(b"this is not an image")
    Image.new("RGB", (600, 400), (1, 2, 3)).save(tmp_path / "full.jpg")
    (tmp_path / "cut.jpg").write_bytes((tmp_path / "full.jpg").read_bytes()[:300])  # truncated
    rows = [
        chat("<image>\nok?", "ok", image=good),  # good
        chat("<image>\nok?", "ok", image="nowhere.png"),  # missing_image
        chat("<image><image>ok?", "ok", image=[good, "nowhere.png"]),  # missing_image
        chat("<image>\nok?", "ok", image="garbage.jpg"),  # corrupt_image
        chat("<image>\nok?", "ok", image="cut.jpg"),  # corrupt_image
        chat("<image>\n<image>\nok?", "ok", image=good),  # placeholder_mismatch
        chat("<image>\nok?", "ok"),  # placeholder_mismatch
        chat("<image>\nok?", "ok", image=[good, good]),  # placeholder_mismatch
        chat(f"the tag {CTX} in text", "ok"),  # placeholder_mismatch
        chat("word " * 2500, "ok"),  # too_long
        chat("<image>" * 12 + "ok?", "ok", image=[good] * 12),  # too_long
        '{"conversations": [{"from": "human", "value": "x"}',  # bad_row
        {"image": good},  # bad_row
        chat("only a question"),  # bad_row
        {
            "conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]
        },  # bad_row
        chat("q", "a"),  # good
    ]
    d = make_data(tmp_path, tok, rows, max_seq_len=2000, max_tiles=12)
    want = (
        ["good"]
        + ["missing_image"] * 2
        + ["corrupt_image"] * 2
        + ["placeholder_mismatch"] * 4
        + ["too_long"] * 2
        + ["bad_row"] * 4
        + ["good"]
    )
    got = [d[i] for i in range(len(d))]
    assert [D._outcome(s) for s in got] == want
    for s in got:
        if isinstance(s, BadRow):
            assert "\n" not in s.detail and s.detail.startswith("ds line "), s.detail
    # same reason and detail every time
    assert [d[i] for i in range(len(d)) if isinstance(got[i], BadRow)] == [
        s for s in got if isinstance(s, BadRow)
    ]
    counts = validate(d)
    assert counts == {
        "good": 2,
        "missing_image": 2,
        "corrupt_image": 2,
        "placeholder_mismatch": 4,
        "too_long": 2,
        "bad_row": 4,
    }
    check_bad_fraction(counts, 16, 14 / 16)  # at the bound: accepted
    with pytest.raises(ValueError, match="14 of the data set's 16 rows are bad"):
        check_bad_fraction(counts, 16, 0.5)
    # A trainer gives the bad rows met so far, against the whole data set's rows (the same rule).
    check_bad_fraction({"too_long": 2, "bad_row": 3}, 20, 0.25)
    with pytest.raises(ValueError, match="5 of the data set's 20 rows are bad"):
        check_bad_fraction({"too_long": 2, "bad_row": 3}, 20, 0.2)


def test_validate_counts_repeats(tmp_path, tok):
    rows = [chat("q", "a"), "not json", chat("q", "b")]
    meta = write_meta(tmp_path, {"a": (rows, {"repeat_time": 3})})
    assert validate(SFTData(meta, tok)) == dict.fromkeys(("good",) + D.BAD_REASONS, 0) | {
        "good": 6,
        "bad_row": 3,
    }


def test_fatal_meta_and_annotation_errors(tmp_path, tok):
    with pytest.raises(ValueError, match="nope.json"):
        SFTData(tmp_path / "nope.json", tok)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        SFTData(tmp_path / "broken.json", tok)
    (tmp_path / "meta.json").write_text(
        json.dumps({"x": {"root": ".", "annotation": "gone.jsonl"}})
    )
    with pytest.raises(ValueError, match="gone.jsonl"):
        SFTData(tmp_path / "meta.json", tok)
    good = write_meta(tmp_path, {"ok": ([chat("q", "a")], {})})
    assert len(SFTData(good, tok, image_token_id=tok.img_context_id)) == 1
    with pytest.raises(ValueError, match="image_token_id"):
        SFTData(good, tok, image_token_id=tok.img_context_id + 1)
    (tmp_path / "arr.jsonl").write_text(json.dumps([chat("q", "a")], indent=1))
    (tmp_path / "meta.json").write_text(json.dumps({"x": {"root": ".", "annotation": "arr.jsonl"}}))
    with pytest.raises(ValueError, match="arr.jsonl"):
        SFTData(tmp_path / "meta.json", tok)


def test_a_tile_budget_past_internvl_in_the_meta_file_is_one_line(model_dir, tmp_path, capsys):
    """A max_dynamic_patch of 10**9 in the meta file filled the memory (issue 38, item 13): one line naming the
    meta file and the dataset, exit 1, before any row is read."""
    rows = [chat("<image>\nq", "a", image="img.png")]
    meta = write_meta(tmp_path, {"ds": (rows, {"max_dynamic_patch": 10**9})})
    code, err = run_main(
        capsys,
        train.main,
        ["--model", model_dir, "--data", meta, "--validate-data", "--num-workers", "0"],
    )
    assert code == 1 and err == [
        f"error: {meta}: dataset 'ds' has max_dynamic_patch=1000000000, need an integer in "
        f"[1, 64] (the most tiles InternVL's pipelines give)"
    ], err


def test_a_root_that_is_a_link_loop_is_one_line(model_dir, tmp_path, capsys):
    """A dataset root that is a symbolic link loop made every image row a "missing_image" bad row, the root named
    nowhere (issue 38, item 22): one line naming the meta file, the dataset and the root, exit 1."""
    rows = [chat("<image>\nq", "a", image="img.png")]
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    meta = write_meta(tmp_path, {"ds": (rows, {"root": str(tmp_path / "loop")})})
    code, err = run_main(
        capsys,
        train.main,
        ["--model", model_dir, "--data", meta, "--validate-data", "--num-workers", "0"],
    )
    assert code == 1 and err == [
        f"error: {meta}: dataset 'ds' has root {tmp_path / 'loop'}, a symbolic link loop "
        f"(links that point at each other, never at a folder)"
    ], err


# ----------------------------------------------------------------------------- augmentation


def test_data_augment_is_seeded_jpeg(tmp_path, tok):
    name = image(tmp_path / "n.png", 700, 300)
    rows = [chat("<image>\nq", "a", image=name)] * 2
    plain = make_data(tmp_path, tok, rows)
    aug = make_data(tmp_path, tok, rows, {"data_augment": True}, seed=1)
    ref = load_image(tmp_path / name, max_tiles=12)
    assert torch.equal(plain[0].pixel_values, ref)
    x = aug[0].pixel_values
    assert x.shape == ref.shape and not torch.equal(x, ref)
    assert (x - ref).abs().mean() < 1.0  # a degraded copy of the image, not another image
    assert torch.equal(x, aug[0].pixel_values)  # same (seed, row) -> same JPEG qualities
    assert not torch.equal(x, aug[1].pixel_values)  # another row, other qualities
    again = make_data(tmp_path, tok, rows, {"data_augment": True}, seed=1)
    assert torch.equal(again[0].pixel_values, x)


# ----------------------------------------------------------------------------- batching


def test_collate_shapes_and_padding(tmp_path, tok):
    pic = image(tmp_path / "p.png", 448, 448)
    rows = [
        chat("<image>\nq", "a", image=pic),
        "broken",
        chat("a much longer question here", "yes"),
    ]
    d = make_data(tmp_path, tok, rows)
    items = [d[i] for i in range(3)]
    b = collate(items, pad_id=7)
    n0, n2 = len(items[0].input_ids), len(items[2].input_ids)
    T = max(n0, n2)
    assert (
        b.input_ids.shape
        == b.labels.shape
        == b.attention_mask.shape
        == b.position_ids.shape
        == (3, T)
    )
    assert b.attention_mask.dtype == torch.bool
    for r, n in ((0, n0), (2, n2)):
        assert torch.equal(b.input_ids[r, :n], items[r].input_ids)
        assert torch.equal(b.labels[r, :n], items[r].labels)
        assert (b.input_ids[r, n:] == 7).all() and (b.labels[r, n:] == -100).all()
        assert b.attention_mask[r].sum() == n and b.attention_mask[r, :n].all()
    # The bad row: one pad token, attended, never supervised.
    assert (b.input_ids[1] == 7).all() and (b.labels[1] == -100).all()
    assert b.attention_mask[1].tolist() == [True] + [False] * (T - 1)
    assert torch.equal(b.pixel_values, items[0].pixel_values) and b.num_tiles == [1, 0, 0]
    assert b.num_samples == 2 and b.bad == {"bad_row": 1} and b.rows == [0, 1, 2]
    text_only = collate([items[2], items[1]], pad_id=0)
    assert text_only.pixel_values.shape == (0, 3, 448, 448) and text_only.input_ids.shape == (2, n2)
    only_bad = collate([items[1]], pad_id=0)
    assert only_bad.input_ids.shape == (1, 1) and loss_weights(only_bad.labels).sum() == 0


def test_loss_weights_hand_computation():
    I = -100  # noqa: E741
    labels = torch.tensor([[I, I, 5, 6, 7, I], [I, 9, I, I, I, I], [I, I, I, I, I, I]])
    w = loss_weights(labels)
    # Column t weighs the prediction of labels[:, t+1]; n = 3, 1, 0 supervised labels.
    a = 1 / 3**0.5
    expected = torch.tensor(
        [[0, a, a, a, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32
    )
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-7)


# ----------------------------------------------------------------------------- sharding and resume


def test_rank_slices_partition_global_batch_for_any_world():
    order = torch.randperm(70, generator=torch.Generator().manual_seed(0))
    G = 16
    for world in (1, 2, 4):
        for micro in (1, 2, 4):
            samplers = [RankSampler(order, r, world, G, micro) for r in range(world)]
            assert samplers[0].num_steps == 70 // G
            for step in range(70 // G):
                # Concatenating the ranks' slices in rank order gives the global batch, in order.
                rows = sum((s.rows(step) for s in samplers), [])
                assert rows == order[step * G : (step + 1) * G].tolist()
            for s in samplers:  # micro-batches of a rank tile its slices, step by step
                flat = sum(list(s), [])
                assert flat == sum((s.rows(k) for k in range(s.num_steps)), [])
                assert len(list(s)) == len(s) == s.num_steps * (G // world // micro)
    with pytest.raises(AssertionError):
        RankSampler(order, 0, 3, G)


def test_resume_equals_tail_of_uninterrupted_run():
    order = torch.randperm(100, generator=torch.Generator().manual_seed(1))
    for world, micro in ((1, 4), (2, 2), (4, 1)):
        for rank in range(world):
            full = RankSampler(order, rank, world, 8, micro)
            sched = list(full.schedule())
            for k in (0, 3, 12):
                resumed = RankSampler(order, rank, world, 8, micro, start_step=k)
                cut = next((j for j, (s, _) in enumerate(sched) if s >= k), len(sched))
                assert list(resumed) == list(full)[cut:]
                assert list(resumed.schedule()) == sched[cut:]


@pytest.mark.parametrize("packing", [False, True])
def test_make_loader_workers_match_single_process(tmp_path, tok, packing):
    pics = [image(tmp_path / f"w{k}.png", 200 + 150 * k, 180, seed=k) for k in range(3)]
    rows = [chat("<image>\nq", f"a{k}", image=pics[k % 3]) for k in range(9)] + [
        "bad",
        chat("t", "x"),
    ]
    d = make_data(tmp_path, tok, rows, {"data_augment": True}, seed=5)
    order = d.epoch_order(0)

    def run(workers, start=0):
        return list(
            make_loader(
                d,
                order,
                rank=1,
                world=2,
                global_batch=4,
                micro_batch=1,
                start_step=start,
                num_workers=workers,
                pad_id=0,
                packing=packing,
            )
        )

    single, multi = run(0), run(2)
    assert [s for s, _ in single] == [s for s, _ in multi] == [0, 1]
    for (_, b0), (_, b1) in zip(single, multi):
        # packed: the 2 samples of a step share a row
        assert len(b0) == len(b1) == (1 if packing else 2)
        for x, y in zip(b0, b1):
            assert x.rows == y.rows and x.bad == y.bad and x.bad_rows == y.bad_rows
            for f in ("input_ids", "labels", "attention_mask", "pixel_values", "segment_ids"):
                assert (getattr(x, f) is None and getattr(y, f) is None) or torch.equal(
                    getattr(x, f), getattr(y, f)
                ), f
    # This rank's rows: the second half of each global batch of 4, in order (bad ones named apart).
    seen = [b.rows + (b.bad_rows if packing else []) for _, bs in single for b in bs]
    assert sorted(sum(seen, [])) == sorted(order[2:4].tolist() + order[6:8].tolist())
    assert [[b.rows for b in bs] for _, bs in run(0, start=1)] == [
        [b.rows for b in bs] for _, bs in single[1:]
    ]


# -- rows as the official preprocessing reads them; bad rows named -------------------------------------


def test_first_turn_from_gpt_is_kept_as_the_official_preprocessing_does(model_dir, tmp_path):
    """preprocess_internvl2_5 (InternVL's internvl_chat/internvl/train/dataset.py, the template of
    InternVL3.5) appends every turn in order after the system message and supervises every gpt turn,
    a leading one too; only the older templates' preprocess functions skip a first non-human turn."""
    tok = Tokenizer.from_pretrained(model_dir)
    turns = [("gpt", "Hello there."), ("human", "What is 2+2?"), ("gpt", "Four.")]
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"conversations": [{"from": r, "value": v} for r, v in turns]}) + "\n"
    )
    (tmp_path / "meta.json").write_text(json.dumps({"ds": {"root": ".", "annotation": "a.jsonl"}}))
    s = SFTData(tmp_path / "meta.json", tok)[0]
    header = {"human": "user", "gpt": "assistant"}
    segs = [tok.encode(f"<|im_start|>system\n{D.DEFAULT_SYSTEM_MESSAGE}<|im_end|>\n")] + [
        tok.encode(f"<|im_start|>{header[r]}\n{v}<|im_end|>\n") for r, v in turns
    ]
    assert s.input_ids.tolist() == sum(segs, [])
    n = len(tok.encode("<|im_start|>assistant\n"))
    want = [-100] * len(segs[0])
    for (role, _), seg in zip(turns, segs[1:]):
        want += [-100] * n + seg[n:-1] + [-100] if role == "gpt" else [-100] * len(seg)
    assert s.labels.tolist() == want


def test_role_content_rows_are_told_the_format(model_dir, tmp_path):
    tok = Tokenizer.from_pretrained(model_dir)
    rows = [
        {
            "conversations": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"},
            ]
        },
        {"messages": [{"role": "user", "content": "hi"}]},
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "meta.json").write_text(json.dumps({"ds": {"root": ".", "annotation": "a.jsonl"}}))
    data = SFTData(tmp_path / "meta.json", tok)
    first, second = data[0], data[1]
    assert (
        isinstance(first, D.BadRow)
        and "from/value" in first.detail
        and first.detail.startswith(f"ds line 1 of {tmp_path / 'a.jsonl'}: ")
    ), first.detail
    assert (
        isinstance(second, D.BadRow)
        and "'messages'" in second.detail
        and "from/value" in second.detail
    )


def test_a_training_row_that_is_not_unicode_is_a_bad_row(model_dir, tmp_path, capsys):
    meta = write_dataset(tmp_path / "d", rows=4)
    lines = (tmp_path / "d" / "train.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace("Describe it.", "Describe \\udcff it.")
    (tmp_path / "d" / "train.jsonl").write_text("\n".join(lines) + "\n")
    code = train.main(
        [
            "--validate-data",
            "--model",
            str(model_dir),
            "--data",
            str(meta),
            "--num-workers",
            "0",
            "--max-bad-frac",
            "0.5",
        ]
    )
    out = capsys.readouterr().out
    assert (
        code == 0
        and (
            f"bad row: tiny line 2 of {tmp_path / 'd' / 'train.jsonl'}: turn 1 is not valid Unicode: "
            + NOT_UTF8.format(k=18)
            + " [bad_row]"
        )
        in out
    ), out
    assert json.loads(out.strip().splitlines()[-1]) == {
        "good": 3,
        "missing_image": 0,
        "corrupt_image": 0,
        "placeholder_mismatch": 0,
        "too_long": 0,
        "bad_row": 1,
    }


def test_validate_data_lists_bad_rows_capped(model_dir, tmp_path, monkeypatch):
    meta = write_dataset(tmp_path / "d", rows=6, bad=2)
    jsonl = meta.parent / "train.jsonl"
    # a blank line, then a row that is not JSON: named by its line in the file
    with open(jsonl, "a") as f:
        f.write("\n{not json\n")
    before = tree(meta.parent)
    res = train_here(
        "--validate-data",
        "--model",
        model_dir,
        "--data",
        meta,
        "--max-bad-frac",
        "0.5",
        *COMMON,
        check=False,
    )
    code, out, err = res.returncode, res.stdout, res.stderr
    lines = out.strip().splitlines()
    assert (
        code == 0
        and err == ""
        and json.loads(lines[-1])["missing_image"] == 2
        and json.loads(lines[-1])["bad_row"] == 1
    )
    listed = lines[:-1]
    assert len(listed) == 3 and all(
        x.startswith("bad row: tiny line ") and f"of {jsonl}: " in x for x in listed
    ), listed
    # 9 is blank
    assert listed[-1].startswith("bad row: tiny line 10 of") and listed[-1].endswith("[bad_row]"), (
        listed
    )
    monkeypatch.setattr(bad_rows, "MAX_NAMED", 1)
    res = train_here(
        "--validate-data",
        "--model",
        model_dir,
        "--data",
        meta,
        "--max-bad-frac",
        "0.1",
        *COMMON,
        check=False,
    )
    code, out, err = res.returncode, res.stdout, res.stderr
    lines = out.strip().splitlines()
    assert code == 1 and len(lines) == 3 and lines[1] == "... and 2 more bad rows", lines
    assert one_line(err).startswith("error: 3 of the data set's 9 rows are bad")
    assert tree(meta.parent) == before


def test_jsonl_given_as_meta_gets_a_hint(model_dir, meta, tmp_path):
    jsonl = meta.parent / "train.jsonl"
    res = train_here("--validate-data", "--model", model_dir, "--data", jsonl, *COMMON, check=False)
    code, err = res.returncode, res.stderr
    line = one_line(err)
    assert code == 1 and "JSONL annotation file" in line and "meta JSON" in line, line


# -- the loader's workers ------------------------------------------------------------------------------


def test_a_loader_worker_is_quiet_when_the_trainer_leaves_mid_handshake():
    """A loader worker hands each batch's tensors over by fd passing (multiprocessing.resource_sharer).
    When a signal stops the trainer while it fetches one, the trainer drops the connection midway,
    and the worker's sharing thread reports the EOFError (or a broken pipe) through sys.excepthook.
    Here a worker, set up as the loader sets it up, offers an fd, and a client connects to its
    sharer and leaves at once: nothing may reach stderr, while other errors still do."""
    code = f"""
import os, socket, sys, time
sys.path.insert(0, {str(ROOT)!r})
from multiprocessing import connection, current_process, resource_sharer
from data import batches
batches.leave_signals_to_the_trainer(0)
r, w = os.pipe()
offered = resource_sharer.DupFd(r)  # what pickling a shared tensor in a worker does
for half in (False, True):  # the trainer leaves before the handshake, or halfway through it
    client = socket.socket(socket.AF_UNIX)
    client.connect(resource_sharer._resource_sharer._address)
    if half:  # it answers the worker's challenge, then is gone before sending its own: EOFError there
        conn = connection.Connection(client.detach())
        connection.answer_challenge(conn, current_process().authkey)
        conn.close()
    else:
        client.close()  # a broken pipe when the worker sends its challenge
    time.sleep(0.5)
sys.excepthook(ValueError, ValueError("still reported"), None)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "ValueError: still reported", res.stderr
