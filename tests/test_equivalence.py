"""Equivalence of ParVL (P=1, no prefix) with the transformers InternVL reference, part by part, and the
fixtures it rests on.

The reference (`conftest.build_reference`) and ParVL hold the same tiny random weights; ParVL reads
them from checkpoint folders in each official layout (original, -HF new-style, -HF legacy), so these
tests cover key renaming, qkv fusing and config parsing as well as the forward maths.
Compared in fp32 on CPU: ViT last hidden state (at 448 px and at other sizes, the position embedding
interpolated), connector output, and full multimodal logits for Qwen3 and Qwen2 decoders (one image with
one or several tiles, several images, a left-padded batch with different tile counts and lengths, text
only); then greedy generation against transformers' generate. First, the fixtures on their own. Reading a
checkpoint (shards, bf16, the layouts' state dicts, load errors): test_checkpoint.py.

Run: python -m pytest tests/test_equivalence.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from inputs import left_pad, prompt_ids, random_pixels
from official import (
    ARCHITECTURES,
    FAMILIES,
    LAYOUTS,
    hf_greedy,
    hf_to_legacy,
    hf_to_original,
    original_to_hf,
    read_safetensors,
    text_family,
    tokenizer_ids,
)

from data.processor import Tokenizer, build_prompt
from inference.engine import Engine, GenerateConfig
from loading.pretrained import load_pretrained

# Both sides run the same fp32 maths in a different order (fused vs split qkv, SDPA vs the reference's
# attention path, masked vs unmasked softmax), which leaves ~1e-6 differences on O(1) activations;
# 2e-5 abs / 1e-5 rel keeps a 10x margin over that yet is far below any real bug (a swapped or
# mis-scaled tensor moves the logits by 1e-2 or more with these random weights).
ATOL, RTOL = 2e-5, 1e-5


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    err = (actual.double() - expected.double()).abs()
    print(
        f"{what}: max abs err {err.max().item():.2e}, mean abs err {err.mean().item():.2e}, "
        f"|ref| max {expected.abs().max().item():.2f}"
    )
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def reference_logits(ref, ids: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
    """Reference logits [T,V] of one unpadded sample."""
    return ref(input_ids=ids[None], pixel_values=pixels).logits[0]


# -- the fixtures on their own ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_reference_is_untied_and_random(reference, family):
    ref = reference(family)
    assert (
        not ref.config.tie_word_embeddings and not ref.config.get_text_config().tie_word_embeddings
    )
    assert not torch.equal(ref.lm_head.weight, ref.model.language_model.embed_tokens.weight)
    assert ref.config.image_token_id == tokenizer_ids(family)["img_context_id"]
    assert ref.config.text_config.vocab_size > tokenizer_ids(family)["vocab_size_tokenizer"]
    for name, p in ref.named_parameters():  # nothing left at a constant init value
        assert p.numel() == 1 or p.std() > 0.01, f"{name} is not randomized"


@pytest.mark.parametrize("layout", ["hf", "hf_legacy"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_hf_folder_reloads_in_transformers(checkpoint, reference, family, layout):
    from transformers import InternVLForConditionalGeneration

    ref = reference(family)
    loaded = InternVLForConditionalGeneration.from_pretrained(
        str(checkpoint(family, layout))
    ).eval()
    got, want = loaded.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert (
        loaded.lm_head.weight.data_ptr()
        != loaded.model.language_model.embed_tokens.weight.data_ptr()
    )
    ids, px = prompt_ids(checkpoint(family, layout), [1]), random_pixels(1)
    with torch.no_grad():
        assert torch.equal(reference_logits(loaded, ids, px), reference_logits(ref, ids, px))


def test_fixture_hf_legacy_is_what_save_pretrained_writes(checkpoint, reference, tmp_path):
    reference("qwen3").save_pretrained(str(tmp_path))
    saved, ours = read_safetensors(tmp_path), read_safetensors(checkpoint("qwen3", "hf_legacy"))
    assert set(saved) == set(ours)
    assert all(torch.equal(saved[k], ours[k]) for k in saved)


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_original_folder_converts_back(checkpoint, reference, family):
    folder = checkpoint(family, "original")
    files, want = read_safetensors(folder), reference(family).state_dict()
    back = original_to_hf(files)
    assert set(back) == set(want)
    for k in want:
        assert torch.equal(back[k], want[k]), k
    assert files["vision_model.encoder.layers.0.attn.qkv.weight"].shape == (3 * 64, 64)
    assert set(files) == set(hf_to_original(want)) and set(hf_to_legacy(want)) != set(want)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "internvl_chat" and cfg["ps_version"] == "v2"
    assert cfg["llm_config"]["architectures"] == [ARCHITECTURES[text_family(family)]]


# -- the vision tower and the connector -------------------------------------------------------------------------------


@pytest.mark.parametrize("vision", ["qwen3", "qwen3+vit6b"])  # InternViT-300M, -6B-style
@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_vit_last_hidden_state(parvl, reference, layout, vision):
    px = random_pixels(2, seed=1)
    got = parvl(vision, layout).vision_model(px)
    want = reference(vision).model.vision_tower(pixel_values=px).last_hidden_state
    assert got.shape == (2, 1025, 64)
    assert_close(got, want, f"ViT [{vision} {layout}]")


@pytest.mark.parametrize("size", [(224, 224), (336, 448)])
@torch.no_grad()
def test_vit_interpolates_position_embedding(parvl, reference, size):
    """A patch grid other than the checkpoint's 32 x 32: the position embedding is resized bicubically
    (align_corners False; fp32 here, where the original and the -HF port agree)."""
    px = torch.randn((1, 3, *size), generator=torch.Generator().manual_seed(3))
    got = parvl("qwen3", "original").vision_model(px)
    want = reference("qwen3").model.vision_tower(pixel_values=px).last_hidden_state
    assert got.shape == (1, 1 + (size[0] // 14) * (size[1] // 14), 64)
    assert_close(got, want, f"ViT {size}")


@pytest.mark.parametrize("vision", ["qwen3", "qwen3+vit6b"])
@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_connector_output(parvl, reference, layout, vision):
    px = random_pixels(2, seed=2)
    got = parvl(vision, layout).extract_features(px)
    want = reference(vision).get_image_features(pixel_values=px).pooler_output
    assert got.shape == (2, 256, 64)
    assert_close(got, want, f"connector [{vision} {layout}]")


# -- the logits -------------------------------------------------------------------------------------------------------


# (tiles per image) for one prompt: one image of 1 tile, one image of 3 tiles (2x1 grid + thumbnail),
# two images (2 tiles, then 1 tile), no image at all.
PROMPTS = {"1img-1tile": [1], "1img-3tiles": [3], "2imgs": [2, 1], "text-only": []}


# The kinds added for 14B-241B (Qwen3-MoE, the 6B-style encoder) run every prompt in the original layout
# and one in each -HF one: the layouts' loaded weights are equal tensor for tensor
# (test_checkpoint.py::test_layouts_give_identical_state_dicts), so more would repeat it (CI's budget).
CASES = [
    (family, layout, prompt)
    for family in FAMILIES
    for layout in LAYOUTS
    for prompt in PROMPTS
    if family in ("qwen3", "qwen2") or layout == "original" or prompt == "1img-1tile"
]


@pytest.mark.parametrize("family, layout, prompt", CASES)
@torch.no_grad()
def test_logits_single_prompt(parvl, reference, checkpoint, family, layout, prompt):
    tiles = PROMPTS[prompt]
    ids = prompt_ids(checkpoint(family, layout), tiles)
    px = random_pixels(sum(tiles), seed=3) if tiles else None
    got = parvl(family, layout)(ids[None], px)
    want = reference_logits(reference(family), ids, px)
    assert_close(got[0], want, f"logits [{family} {layout} {prompt}]")


@pytest.mark.parametrize(
    "family, layout",
    [(f, lay) for f in FAMILIES for lay in LAYOUTS if f in ("qwen3", "qwen2") or lay == "original"],
)
@torch.no_grad()
def test_logits_left_padded_batch(parvl, reference, checkpoint, family, layout):
    # Three samples with 1, 3 (two images) and 0 tiles and different text: different lengths, so
    # two are left-padded. Each must equal the reference run on that sample alone, unpadded
    # (positions restart at 0 after the padding); padded positions are not compared.
    folder = checkpoint(family, layout)
    samples = [
        ([1], "What is shown in this picture?"),
        ([2, 1], "Compare the two images. What are the differences between them?"),
        ([], "Hello"),
    ]
    seqs = [prompt_ids(folder, tiles, q) for tiles, q in samples]
    pixels = [
        random_pixels(sum(tiles), seed=10 + i) if tiles else None
        for i, (tiles, _) in enumerate(samples)
    ]
    ids, mask = left_pad(seqs, pad_id=tokenizer_ids(family)["endoftext_id"])
    assert len(set(map(len, seqs))) == 3
    got = parvl(family, layout)(
        ids, torch.cat([p for p in pixels if p is not None]), attention_mask=mask
    )
    assert got.shape == (3, ids.shape[1], reference(family).config.text_config.vocab_size)
    for b, (seq, px) in enumerate(zip(seqs, pixels)):
        want = reference_logits(reference(family), seq, px)
        assert_close(got[b, mask[b].bool()], want, f"batch logits [{family} {layout} sample {b}]")


# -- greedy generation ------------------------------------------------------------------------------------------------


NEW = 10  # new tokens of the greedy comparison: enough to cover several cached steps, cheap on CPU


CHATS = {  # name -> (num_tiles per image, question, history)
    "single-image": ([3], "Describe the image.", []),
    "multi-image": ([2, 1], "Image-1: <image>\nImage-2: <image>\nWhat differs?", []),
    "multi-turn": ([1], "And the colour?", [("<image>\nWhat is it?", "A cat.")]),
    "text-only": ([], "Tell me a story about the sea.", []),
}


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "qwen3_moe+vit6b"])
@pytest.mark.parametrize("case", list(CHATS))
def test_greedy_matches_transformers(checkpoint, reference, family, case):
    folder = checkpoint(family, "original")
    model, tok = load_pretrained(folder), Tokenizer.from_pretrained(folder)
    tiles, question, history = CHATS[case]
    ids = tok.encode(build_prompt(question, tiles, history=history))
    pv = random_pixels(sum(tiles), seed=1) if tiles else None
    ours = Engine(model).generate(
        [ids], pv, GenerateConfig(max_new_tokens=NEW, ignore_eos=True), tok.eos_ids
    )
    assert ours.tokens[0] == hf_greedy(reference(family), ids, pv, NEW)
