"""Tests for data/processor.py against an independent transcription of the official behaviour; then images as
files hold them (16-bit grey, several frames) and a tile budget past the model's context.

The `ref_*` functions below restate the official code (dynamic_preprocess, ToTensor + Normalize) and the internvl2_5
template (the "internvl2_5" template as `chat()` fills it) step by step, without calling data/processor.py's helpers.
Token ids are checked against transformers' AutoTokenizer (a test-only dependency) on the tiny
Qwen-style tokenizers from tests/tiny_tokenizer.py, in both the tokenizer.json and vocab layouts.

Run: python -m pytest tests/test_processor.py -q
"""

import io
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `pytest` works from anywhere
from commands import gen_main, one_line  # noqa: E402
from tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

from data import processor  # noqa: E402
from data.processor import ImageError, Tokenizer, build_prompt, load_image, open_rgb, place_images  # noqa: E402

REF_SYSTEM = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位"
    "联合开发的多模态大语言模型。"
)

# ---------------------------------------------------------------------------------------------
# Reference: InternVL's dynamic_preprocess / build_transform, transcribed literally


def ref_grid(width, height, min_num=1, max_num=12, image_size=448):
    """InternVL's dynamic_preprocess / find_closest_aspect_ratio: candidate set sorted by product;
    smallest |aspect - i/j|; ties go to the later candidate iff the image area exceeds half of its canvas."""
    aspect = width / height
    candidates = set()
    for n in range(min_num, max_num + 1):
        for i in range(1, n + 1):
            for j in range(1, n + 1):
                if min_num <= i * j <= max_num:
                    candidates.add((i, j))
    candidates = sorted(candidates, key=lambda ij: ij[0] * ij[1])
    best_diff, best = float("inf"), (1, 1)
    for i, j in candidates:
        diff = abs(aspect - i / j)
        if diff < best_diff:
            best_diff, best = diff, (i, j)
        elif diff == best_diff:
            if width * height > 0.5 * image_size * image_size * i * j:
                best = (i, j)
    return best


def ref_tiles(image, max_num=12, image_size=448, use_thumbnail=True):
    i, j = ref_grid(image.size[0], image.size[1], 1, max_num, image_size)
    canvas = image.resize((image_size * i, image_size * j))
    tiles = []
    for k in range(i * j):
        left, top = (k % i) * image_size, (k // i) * image_size
        tiles.append(canvas.crop((left, top, left + image_size, top + image_size)))
    if use_thumbnail and len(tiles) != 1:
        tiles.append(image.resize((image_size, image_size)))
    return tiles


def ref_pixels(image, max_num=12, use_thumbnail=True):
    """What torchvision's ToTensor then Normalize(ImageNet) compute, tile by tile."""
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float32).view(3, 1, 1)
    out = []
    for tile in ref_tiles(image.convert("RGB"), max_num, 448, use_thumbnail):
        x = torch.from_numpy(np.array(tile)).permute(2, 0, 1).contiguous().float().div(255)
        out.append(x.sub(mean).div(std))
    return torch.stack(out)


# Reference: the query string InternVLChatModel.chat() builds


def ref_query(question, num_patches_list, history=None, system=REF_SYSTEM):
    if history is None and num_patches_list and "<image>" not in question:
        question = "<image>\n" + question
    messages = []
    for old_q, old_a in history or []:
        messages += [("<|im_start|>user\n", old_q), ("<|im_start|>assistant\n", old_a)]
    messages += [("<|im_start|>user\n", question), ("<|im_start|>assistant\n", None)]
    query = "<|im_start|>system\n" + system + "<|im_end|>\n"  # MPT style: system + sep first
    for role, message in messages:
        if message:
            query += role + message + "<|im_end|>\n"
        else:
            query += role
    for n in num_patches_list:
        query = query.replace("<image>", "<img>" + "<IMG_CONTEXT>" * (256 * n) + "</img>", 1)
    return query


# ---------------------------------------------------------------------------------------------
# Tile grid


@pytest.mark.parametrize(
    "size, max_tiles, expected",
    [
        ((1, 1), 12, (1, 1)),
        ((448, 448), 12, (1, 1)),
        ((449, 448), 12, (1, 1)),
        ((1, 5000), 12, (1, 12)),
        ((5000, 1), 12, (12, 1)),
        ((1, 5000), 6, (1, 6)),
        ((5000, 1), 1, (1, 1)),
        ((800, 600), 12, (4, 3)),
        # Squares tie between (1,1), (2,2), (3,3); the bigger grid wins once the area passes half of
        # its canvas: 0.5 * 448^2 * 4 = 401408 (side 634) and * 9 = 903168 (side 951).
        ((633, 633), 12, (1, 1)),
        ((634, 634), 12, (2, 2)),
        ((950, 950), 12, (2, 2)),
        ((951, 951), 12, (3, 3)),
        ((4000, 4000), 6, (2, 2)),
        ((896, 448), 12, (2, 1)),  # ties with (4,2) but 401408 is not > 802816
        ((1268, 634), 12, (4, 2)),  # 803912 > 802816
        # Aspect 0.225 sits exactly between 1/4 and 1/5; the area decides (0.5 * 448^2 * 5 = 501760).
        ((171, 760), 12, (1, 4)),
        ((342, 1520), 12, (1, 5)),
        # Aspect 1.5 with max 2: (1,1) and (2,1) tie; 546x364 is below 0.5 * 448^2 * 2, 549x366 above.
        ((546, 364), 2, (1, 1)),
        ((549, 366), 2, (2, 1)),
    ],
)
def test_tile_grid_known_cases(size, max_tiles, expected):
    assert ref_grid(*size, max_num=max_tiles) == expected  # the reference agrees with the spec
    assert processor.tile_grid(*size, max_tiles=max_tiles) == expected


@pytest.mark.parametrize("max_tiles", [1, 2, 6, 12])
def test_tile_grid_sweep(max_tiles):
    sides = list(range(1, 200, 13)) + list(range(200, 4000, 61)) + [447, 448, 449, 896, 1344]
    for w in sides:
        for h in sides:
            assert processor.tile_grid(w, h, max_tiles) == ref_grid(w, h, 1, max_tiles), (w, h)


# (5, 5) and (9, 8) are settings where the order of equal-count grids changes some answers.
@pytest.mark.parametrize("max_tiles, min_tiles", [(6, 1), (12, 1), (12, 2), (5, 5), (9, 8)])
def test_tile_grid_exact_ties(max_tiles, min_tiles):
    """Sizes whose aspect is exactly midway between two candidate ratios, on both sides of every
    area threshold, so the tie rule (and the candidate order within a product) is exercised."""
    grids = sorted(
        {
            (i, j)
            for i in range(1, max_tiles + 1)
            for j in range(1, max_tiles + 1)
            if min_tiles <= i * j <= max_tiles
        },
        key=lambda ij: ij[0] * ij[1],
    )
    midpoints = set()  # (a + b) / 2 = p / q in lowest terms
    for a in grids:
        for b in grids:
            p, q = a[0] * b[1] + b[0] * a[1], 2 * a[1] * b[1]
            midpoints.add((p // np.gcd(p, q), q // np.gcd(p, q)))
    switched = 0
    for p, q in sorted(midpoints):
        for n in sorted({i * j for i, j in grids}):
            k0 = int((0.5 * 448 * 448 * n / (p * q)) ** 0.5)  # area threshold for n tiles
            for k in {1, max(k0, 1), k0 + 1}:
                w, h = p * k, q * k
                got = processor.tile_grid(w, h, max_tiles, min_tiles)
                assert got == ref_grid(w, h, min_tiles, max_tiles), (w, h)
                # min() keeps the first of equal errors, i.e. what the result would be without
                # the tie rule; count the cases where the rule changed the answer.
                switched += got != min(grids, key=lambda ij: abs(w / h - ij[0] / ij[1]))
    assert switched > 0, "no case reached the tie rule; the test lost its point"


def test_tile_grid_rejects_bad_arguments():
    with pytest.raises(ValueError):
        processor.tile_grid(100, 100, max_tiles=0)
    with pytest.raises(ValueError):
        processor.tile_grid(0, 100)


# ---------------------------------------------------------------------------------------------
# Tiles and pixels


def _random_image(mode, w, h, seed=0):
    rgb = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
    if mode == "P":
        return rgb.quantize(colors=64)
    if mode == "RGBA":
        alpha = Image.fromarray(np.random.default_rng(seed + 1).integers(0, 256, (h, w), np.uint8))
        rgba = rgb.convert("RGBA")
        rgba.putalpha(alpha)
        return rgba
    return rgb.convert(mode)


def test_tile_image_layout():
    img = _random_image("RGB", 1400, 700)
    tiles = processor.tile_image(img)
    assert len(tiles) == 8 + 1  # (4, 2) grid (it beats (2, 1) on area) plus thumbnail
    assert all(t.size == (448, 448) for t in tiles)
    for got, want in zip(tiles, ref_tiles(img)):
        assert got.tobytes() == want.tobytes()
    assert tiles[-1].tobytes() == img.resize((448, 448), Image.Resampling.BICUBIC).tobytes()
    assert len(processor.tile_image(img, use_thumbnail=False)) == 8
    assert len(processor.tile_image(img, max_tiles=1)) == 1  # one tile: no thumbnail


@pytest.mark.parametrize(
    "mode, w, h, max_tiles, thumb",
    [
        ("RGB", 500, 300, 12, True),
        ("RGBA", 333, 777, 12, True),
        ("L", 1001, 51, 12, True),
        ("P", 64, 64, 12, True),
        ("RGB", 1, 1, 12, True),
        ("RGB", 448, 448, 12, True),
        ("RGB", 1237, 913, 6, True),
        ("RGB", 913, 1237, 12, False),
    ],
)
def test_pixels_bit_identical_to_reference(mode, w, h, max_tiles, thumb):
    img = _random_image(mode, w, h)
    got = processor.load_image(img, max_tiles=max_tiles, use_thumbnail=thumb)
    want = ref_pixels(img, max_tiles, thumb)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_load_image_from_file(tmp_path, fmt):
    path = tmp_path / f"img.{fmt.lower()}"
    _random_image("RGB", 700, 450).save(path, fmt)
    got = processor.load_image(path)
    assert torch.equal(got, ref_pixels(Image.open(path).convert("RGB")))
    assert torch.equal(processor.load_image(str(path)), got)


# ---------------------------------------------------------------------------------------------
# Image errors


def _png_bytes(fmt="PNG"):
    buf = io.BytesIO()
    _random_image("RGB", 300, 200).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize(
    "name, data",
    [
        ("missing.png", None),
        ("corrupt.png", b"\x89PNG not really an image" * 20),
        ("text.jpg", b"hello"),
        ("truncated.png", _png_bytes("PNG")[:3000]),
        ("truncated.jpg", _png_bytes("JPEG")[:3000]),
    ],
)
def test_bad_images_raise_image_error(tmp_path, name, data):
    path = tmp_path / name
    if data is not None:
        path.write_bytes(data)
    with pytest.raises(ImageError, match=str(path)) as info:
        processor.load_image(path)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


# ---------------------------------------------------------------------------------------------
# Tokenizer

CASES = [("json", "qwen3"), ("vocab", "qwen3"), ("json", "qwen2"), ("vocab", "qwen2")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def toks(request, tmp_path_factory):
    """(ours, transformers', ids) for one tiny tokenizer folder."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("-".join(request.param))
    ids = write_tiny_tokenizer(folder, *request.param)
    return (
        Tokenizer.from_pretrained(folder),
        transformers.AutoTokenizer.from_pretrained(folder),
        ids,
    )


TEXTS = [
    "",
    "Hello world! Please describe the image in detail.",
    "你好，世界！请详细描述这张图片。",
    "It's I'M they'RE we'VE you'll he'd",
    "12345 and 3.14159, 2025-09-22",
    "  leading spaces\n\n\ttabs\r\n  trailing   ",
    "e\u0301 cafe\u0301 Å",  # decomposed accents: only equal if NFC runs first
    "emoji 🐱🚀 and symbols ©®™",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<img><IMG_CONTEXT><IMG_CONTEXT></img>\nWhat is it?",
    "<think>\nhmm\n</think>\n\nanswer<|endoftext|>",
    "a<box>[[1, 2, 3, 4]]</box>c<ref>the cat</ref> <quad></quad>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(toks, text):
    ours, hf, _ = toks
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"]  # default call, as chat() makes it: no BOS either
    assert ours.decode(ids) == hf.decode(ids) == unicodedata.normalize("NFC", text)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_tokenizer_ids(toks):
    ours, hf, ids = toks
    assert ours.vocab_size == len(hf) == ids["vocab_size_tokenizer"]
    assert ours.img_context_id == ids["img_context_id"] == hf.convert_tokens_to_ids("<IMG_CONTEXT>")
    assert ours.im_end_id == ids["im_end_id"]
    assert ours.eos_ids == [ids["im_end_id"], ids["endoftext_id"]]
    assert ours.token_to_id("</img>") == ids["img_end_id"]
    assert ours.token_to_id("<no such token>") is None
    assert ours.encode("<img>") == [ids["img_start_id"]]


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "absent")):
        Tokenizer.from_pretrained(tmp_path / "absent")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=str(bad)):
        Tokenizer.from_pretrained(bad)
    # A plain text tokenizer without InternVL's tags loads, but cannot place images.
    plain = tmp_path / "plain"
    eot = write_tiny_tokenizer(plain, "vocab")["bpe_vocab_size"]
    (plain / "added_tokens.json").write_text('{"<|endoftext|>": %d}' % eot)
    (plain / "tokenizer_config.json").write_text("{}")
    tok = Tokenizer.from_pretrained(plain)
    assert tok.eos_ids == [eot] and tok.vocab_size == eot + 1
    with pytest.raises(ValueError, match="<IMG_CONTEXT>"):
        tok.img_context_id  # noqa: B018  (reading the property is what must raise)


# ---------------------------------------------------------------------------------------------
# Prompts


def test_default_system_message():
    assert processor.DEFAULT_SYSTEM_MESSAGE == REF_SYSTEM


PROMPTS = {  # name -> (question, num_tiles, history or None, system or None)
    "single_image": ("Describe the image.", [3], None, None),
    "single_image_placed": ("What is this?\n<image>", [1], None, None),
    "multi_image": (place_images("What differs?", 2), [2, 1], None, None),
    "multi_turn": (
        "And the colour?",
        [1, 5],
        [("<image>\nWhat animal?", "A cat."), ("Now <image> this one?", "A dog.")],
        None,
    ),
    "multi_turn_text": ("你好吗？", [], [("Hi", "Hello!")], "You are a helpful assistant."),
    "text_only": ("What is 2+2?", [], None, None),
    "empty_system": ("Describe.", [2], None, ""),
    "empty_answer": ("Go on.", [], [("Start.", "")], None),
}


@pytest.mark.parametrize("name", PROMPTS)
def test_prompt_matches_reference(toks, name):
    ours, hf, ids = toks
    question, num_tiles, history, system = PROMPTS[name]
    want = ref_query(question, num_tiles, history, REF_SYSTEM if system is None else system)
    got = build_prompt(question, num_tiles, history or (), system)
    assert got == want
    token_ids = ours.encode(got)
    assert token_ids == hf(want)["input_ids"]
    assert token_ids.count(ids["img_context_id"]) == 256 * sum(num_tiles)
    assert (
        token_ids.count(ids["img_start_id"]) == token_ids.count(ids["img_end_id"]) == len(num_tiles)
    )


def test_prompt_layout_literal():
    """One hand-written expectation, independent of the reference function."""
    got = build_prompt("Hi", [1], system="S")
    assert got == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n<img>"
        + "<IMG_CONTEXT>" * 256
        + "</img>\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert build_prompt("Hi", []).endswith(
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_placeholder_rule():
    assert place_images("Compare.", 2) == "Image-1: <image>\nImage-2: <image>\nCompare."
    assert place_images("<image> vs <image>", 2) == "<image> vs <image>"  # placed by the question
    assert place_images("What is it?", 1) == "<image>\nWhat is it?"  # InternVL's chat()
    assert place_images("Is <image> a cat?", 1) == "Is <image> a cat?"
    # reorganize_prompt
    assert place_images("Is <image> a cat?", 1, always=True) == "<image>\nIs <image> a cat?"
    assert place_images("Hi", 0) == place_images("Hi", 0, always=True) == "Hi"


@pytest.mark.parametrize(
    "question, num_tiles, history, n_slots",
    [
        ("<image> and <image>", [1], (), 2),
        ("<image>", [], (), 1),
        ("No placeholder, but history means none is added.", [1], [("Hi", "Hello")], 0),
        ("<image>", [1, 1, 1], [("<image>", "ok")], 2),
    ],
)
def test_placeholder_mismatch(question, num_tiles, history, n_slots):
    with pytest.raises(
        ValueError, match=f"{n_slots} <image> placeholders .* {len(num_tiles)} images"
    ):
        build_prompt(question, num_tiles, history)


# -- images as files hold them, and tile budgets -------------------------------------------------------


def test_sixteen_bit_grey_png_is_scaled_not_clipped(tmp_path):
    grey = (np.arange(48 * 64, dtype=np.uint32).reshape(48, 64) * 21).astype(np.uint16)  # 0..64491
    Image.fromarray(grey).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    rgb = np.asarray(open_rgb(tmp_path / "g16.png"))
    # value >> 8, every channel
    assert rgb.shape == (48, 64, 3) and (rgb == (grey >> 8)[..., None]).all()
    assert (rgb == 255).mean() < 0.01  # convert("RGB") made 99.6 % of it white
    assert load_image(tmp_path / "g16.png", max_tiles=1).shape == (1, 3, 448, 448)


@pytest.mark.parametrize("fmt", ["gif", "tiff"])
def test_multi_frame_images_use_the_first_frame_and_say_so(tmp_path, capsys, fmt):
    frames = [Image.new("RGB", (40, 30), (200 * (k == 0), 100 * k, 0)) for k in range(3)]
    path = tmp_path / f"anim.{fmt}"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    rgb = np.asarray(open_rgb(path))
    assert tuple(rgb[0, 0]) == (200, 0, 0)  # the first frame
    assert (
        one_line(capsys.readouterr().err)
        == f"note: {path} has 3 frames (animated or multi-page); using the first"
    )


def test_tile_grid_large_budgets_keep_the_official_candidate_order():
    """The grid enumeration that replaced the official triple loop gives the official answer past
    the budgets the other tests sweep, exact ties included (aspects midway between two grids)."""
    for max_tiles, min_tiles in ((64, 1), (90, 7), (120, 30)):
        for w, h in (
            (5, 2),
            (7, 3),
            (3, 1),
            (1, 9),
            (448 * 5, 448 * 4),
            (13, 12),
            (2000, 3),
            (59, 2),
        ):
            for k in (1, 300):
                assert processor.tile_grid(w * k, h * k, max_tiles, min_tiles) == ref_grid(
                    w * k, h * k, min_tiles, max_tiles
                )


def test_a_tile_budget_past_the_context_is_refused_before_tiling(
    model_dir, tmp_path, capsys, monkeypatch
):
    """--max-tiles 64 (InternVL's most) on a 2000:1 image (a 64 x 1 grid) with 30,000 new tokens: the grid is chosen
    in O(max_tiles log max_tiles) and the prompt's length, known from it, is refused against the context before
    one tile is resized (--max-tiles 10000 took minutes and gigabytes before the flag was bounded)."""
    from loading.config_json import open_checkpoint

    wide = tmp_path / "wide.png"
    Image.fromarray(np.full((2, 4000, 3), 128, dtype=np.uint8)).save(wide)
    monkeypatch.setattr(
        processor, "tile_image", lambda *a, **k: pytest.fail("tiled before the context check")
    )
    mcfg, _ = open_checkpoint(model_dir)
    code, _, err = gen_main(
        capsys, wide, "q", "--model", model_dir, "--max-tiles", 64, "--max-new-tokens", 30000
    )
    line = one_line(err)
    n = int(line.split("prompt of ")[1].split()[0])
    assert code == 1 and line == (
        f"error: prompt of {n} tokens (image tokens included) + 30000 new tokens exceeds the "
        f"model context of {mcfg.llm.max_position_embeddings}"
    ), line
    # 64 tiles + thumbnail
    assert processor.tile_grid(4000, 2, 64) == (64, 1) and n > 65 * mcfg.tokens_per_tile
