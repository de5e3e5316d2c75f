"""Equivalence of ParVL (P=1, no prefix) with the transformers InternVL reference, and checkpoint loading.

The reference (`conftest.build_reference`) and ParVL hold the same tiny random weights; ParVL reads
them from checkpoint folders in each official layout (original, -HF new-style, -HF legacy), so these
tests cover key renaming, qkv fusing and config parsing as well as the forward maths.
Compared in fp32 on CPU: ViT last hidden state, connector output, and full multimodal logits for
Qwen3 and Qwen2 decoders (one image with one or several tiles, several images, a left-padded batch
with different tile counts and lengths, text only). Then loading invariants and load errors.

Run: python -m pytest tests/test_core.py -q
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import (FAMILIES, LAYOUTS, hf_to_legacy, hf_to_original, left_pad, original_to_hf, prompt_ids,
                      random_pixels, read_safetensors, tokenizer_ids)
from parvl import ParVL

# Both sides run the same fp32 maths in a different order (fused vs split qkv, SDPA vs the reference's
# attention path, masked vs unmasked softmax), which leaves ~1e-6 differences on O(1) activations;
# 2e-5 abs / 1e-5 rel keeps a 10x margin over that yet is far below any real bug (a swapped or
# mis-scaled tensor moves the logits by 1e-2 or more with these random weights).
ATOL, RTOL = 2e-5, 1e-5

# bf16 against fp32 on the same weights: the bf16 checkpoint loaded as stored and once more upcast to
# fp32, so the difference is bf16 arithmetic alone. Measured on the tiny qwen3 model (one 1-tile
# prompt, 285 positions, logits std ~1 and |max| ~5), weight seeds 0-3 x 2 pixel seeds: max abs error
# 0.043-0.068, mean abs error 0.006-0.0075, greedy argmax equal on 97.5-98.6 % of the positions (the
# rest are near-ties of a random model). The bounds sit 3-4x above the worst of those. Wrong bf16
# maths (a missed cast, a skipped or mis-scaled tensor) moves these logits by O(1) and leaves ~1/640
# of the argmaxes equal.
BF16_MAX_ABS, BF16_MEAN_ABS, BF16_ARGMAX_AGREE = 0.25, 0.025, 0.9


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).abs()
    print(f"{what}: max abs err {err.max().item():.2e}, mean abs err {err.mean().item():.2e}, "
          f"|ref| max {expected.abs().max().item():.2f}")
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def parvl(checkpoint):
    """`parvl(family, layout) -> ParVL` loaded in fp32 from that checkpoint folder (cached; don't modify)."""
    models: dict[tuple[str, str], ParVL] = {}

    def get(family: str = "qwen3", layout: str = "original") -> ParVL:
        if (family, layout) not in models:
            models[family, layout] = ParVL.from_pretrained(checkpoint(family, layout), dtype=torch.float32,
                                                           device="cpu")
        return models[family, layout]
    return get


def reference_logits(ref, ids: torch.Tensor, pixels: torch.Tensor | None) -> torch.Tensor:
    """Reference logits [T,V] of one unpadded sample."""
    return ref(input_ids=ids[None], pixel_values=pixels).logits[0]


# ------------------------------------------------------------------------------ fixtures on their own

@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_reference_is_untied_and_random(reference, family):
    ref = reference(family)
    assert not ref.config.tie_word_embeddings and not ref.config.get_text_config().tie_word_embeddings
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
    loaded = InternVLForConditionalGeneration.from_pretrained(str(checkpoint(family, layout))).eval()
    got, want = loaded.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert loaded.lm_head.weight.data_ptr() != loaded.model.language_model.embed_tokens.weight.data_ptr()
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
    assert cfg["llm_config"]["architectures"] == [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]]


# ------------------------------------------------------------------------------ equivalence

@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_vit_last_hidden_state(parvl, reference, layout):
    px = random_pixels(2, seed=1)
    got = parvl("qwen3", layout).vision_model(px)
    want = reference("qwen3").model.vision_tower(pixel_values=px).last_hidden_state
    assert got.shape == (2, 1025, 64)
    assert_close(got, want, f"ViT [{layout}]")


@pytest.mark.parametrize("layout", LAYOUTS)
@torch.no_grad()
def test_connector_output(parvl, reference, layout):
    px = random_pixels(2, seed=2)
    got = parvl("qwen3", layout).extract_features(px)
    want = reference("qwen3").get_image_features(pixel_values=px).pooler_output
    assert got.shape == (2, 256, 64)
    assert_close(got, want, f"connector [{layout}]")


# (tiles per image) for one prompt: one image of 1 tile, one image of 3 tiles (2x1 grid + thumbnail),
# two images (2 tiles, then 1 tile), no image at all.
PROMPTS = {"1img-1tile": [1], "1img-3tiles": [3], "2imgs": [2, 1], "text-only": []}


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_logits_single_prompt(parvl, reference, checkpoint, family, layout, prompt):
    tiles = PROMPTS[prompt]
    ids = prompt_ids(checkpoint(family, layout), tiles)
    px = random_pixels(sum(tiles), seed=3) if tiles else None
    got = parvl(family, layout)(ids[None], px)
    want = reference_logits(reference(family), ids, px)
    assert_close(got[0], want, f"logits [{family} {layout} {prompt}]")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_logits_left_padded_batch(parvl, reference, checkpoint, family, layout):
    # Three samples with 1, 3 (two images) and 0 tiles and different text: different lengths, so
    # two are left-padded. Each must equal the reference run on that sample alone, unpadded
    # (positions restart at 0 after the padding); padded positions are not compared.
    folder = checkpoint(family, layout)
    samples = [([1], "What is shown in this picture?"),
               ([2, 1], "Compare the two images. What are the differences between them?"),
               ([], "Hello")]
    seqs = [prompt_ids(folder, tiles, q) for tiles, q in samples]
    pixels = [random_pixels(sum(tiles), seed=10 + i) if tiles else None for i, (tiles, _) in enumerate(samples)]
    ids, mask = left_pad(seqs, pad_id=tokenizer_ids(family)["endoftext_id"])
    assert len(set(map(len, seqs))) == 3
    got = parvl(family, layout)(ids, torch.cat([p for p in pixels if p is not None]), attention_mask=mask)
    assert got.shape == (3, ids.shape[1], reference(family).config.text_config.vocab_size)
    for b, (seq, px) in enumerate(zip(seqs, pixels)):
        want = reference_logits(reference(family), seq, px)
        assert_close(got[b, mask[b].bool()], want, f"batch logits [{family} {layout} sample {b}]")


# ------------------------------------------------------------------------------ loading

@pytest.mark.parametrize("layout", ["original", "hf"])
@torch.no_grad()
def test_sharded_equals_unsharded(checkpoint, parvl, layout):
    sharded = ParVL.from_pretrained(checkpoint("qwen3", layout, shards=3), dtype=torch.float32, device="cpu")
    whole = parvl("qwen3", layout)
    a, b = sharded.state_dict(), whole.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids, px = prompt_ids(checkpoint("qwen3", layout), [2]), random_pixels(2, seed=4)
    assert torch.equal(sharded(ids[None], px), whole(ids[None], px))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_checkpoint_stays_bf16(checkpoint, reference, layout):
    model = ParVL.from_pretrained(checkpoint("qwen3", layout, dtype=torch.bfloat16), dtype=None, device="cpu")
    not_bf16 = [n for n, p in model.named_parameters() if p.dtype != torch.bfloat16]
    assert not not_bf16, f"parameters not bf16: {not_bf16[:5]}"
    want = hf_to_original(reference("qwen3").state_dict())
    for k, v in model.state_dict().items():  # exactly the stored bf16 values
        assert torch.equal(v, want[k].to(torch.bfloat16)), k
    fp32 = ParVL.from_pretrained(checkpoint("qwen3", layout, dtype=torch.bfloat16), dtype=torch.float32, device="cpu")
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    ids, px = prompt_ids(checkpoint("qwen3", layout), [1]), random_pixels(1)
    with torch.no_grad():
        logits = model(ids[None], px)[0]  # fp32 pixels: the model casts them itself
        ref_logits = fp32(ids[None], px)[0]
    assert logits.dtype == torch.bfloat16 and ref_logits.dtype == torch.float32
    err = (logits.float() - ref_logits).abs()
    agree = (logits.float().argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    print(f"bf16 vs fp32 [{layout}]: max abs err {err.max().item():.4f}, mean {err.mean().item():.5f}, "
          f"argmax agree {agree:.4f}, |fp32| max {ref_logits.abs().max().item():.2f}")
    assert err.max().item() < BF16_MAX_ABS and err.mean().item() < BF16_MEAN_ABS, (err.max().item(), err.mean().item())
    assert agree >= BF16_ARGMAX_AGREE, agree


@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_give_identical_state_dicts(parvl, family):
    base = parvl(family, "original").state_dict()
    for layout in ("hf", "hf_legacy"):
        other = parvl(family, layout).state_dict()
        assert list(other) == list(base), layout
        for k in base:
            assert torch.equal(other[k], base[k]), f"{layout}: {k}"


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_keys_are_the_original_layout(checkpoint, parvl, family):
    with safe_open(str(checkpoint(family, "original") / "model.safetensors"), framework="pt") as f:
        file_keys = set(f.keys())
    model_keys = set(parvl(family, "hf").state_dict())
    assert model_keys == file_keys, (sorted(model_keys - file_keys), sorted(file_keys - model_keys))


# ------------------------------------------------------------------------------ load errors

LOAD_ERRORS = (ValueError, FileNotFoundError)


def broken_copy(checkpoint, tmp_path, **kw):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint("qwen3", **kw), folder)
    return folder


def assert_one_line_naming(exc: pytest.ExceptionInfo, name: str) -> None:
    msg = str(exc.value)
    print(f"{type(exc.value).__name__}: {msg}")
    assert name in msg, f"message does not name {name!r}: {msg}"
    assert "\n" not in msg.strip(), f"message is not one line: {msg!r}"


def test_error_missing_shard(checkpoint, tmp_path):
    folder = broken_copy(checkpoint, tmp_path, layout="original", shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(LOAD_ERRORS) as exc:
        ParVL.from_pretrained(folder, dtype=torch.float32)
    assert_one_line_naming(exc, "model-00002-of-00003.safetensors")


@pytest.mark.parametrize("layout", ["original", "hf"])
def test_error_no_config(checkpoint, tmp_path, layout):
    folder = broken_copy(checkpoint, tmp_path, layout=layout)
    (folder / "config.json").unlink()
    with pytest.raises(LOAD_ERRORS) as exc:
        ParVL.from_pretrained(folder, dtype=torch.float32)
    assert_one_line_naming(exc, "config.json")


def _rewrite(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = read_safetensors(folder)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["original", "hf"])
def test_error_unexpected_key(checkpoint, tmp_path, layout):
    folder = broken_copy(checkpoint, tmp_path, layout=layout)
    key = "vision_model.bogus_tensor" if layout == "original" else "model.vision_tower.bogus_tensor"
    _rewrite(folder, lambda t: t.__setitem__(key, torch.zeros(3)))
    with pytest.raises(LOAD_ERRORS) as exc:
        ParVL.from_pretrained(folder, dtype=torch.float32)
    assert_one_line_naming(exc, "bogus_tensor")


@pytest.mark.parametrize("key", ["mlp1.1.bias", "vision_model.encoder.layers.1.ls2",
                                 "language_model.model.layers.0.self_attn.q_norm.weight"])
def test_error_missing_key(checkpoint, tmp_path, key):
    # (language_model.lm_head.weight is not in this list: a missing head legitimately means tied.)
    folder = broken_copy(checkpoint, tmp_path, layout="original")
    _rewrite(folder, lambda t: t.pop(key))
    with pytest.raises(LOAD_ERRORS) as exc:
        ParVL.from_pretrained(folder, dtype=torch.float32)
    assert_one_line_naming(exc, key)


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
