"""InternVL's chat API on the engine: `chat` and `batch_chat` as InternVLChatModel (the official
remote code) has them, with the model as the first argument instead of `self`. (The streamed answer and
the interactive session of `generate.py --chat` are the command's own, in generate.py.)

    from inference.chat import chat
    response, history = chat(model, tokenizer, pixel_values, "Describe the image.",
                             dict(max_new_tokens=256, do_sample=False), return_history=True)

The model keeps one Engine (model.engine), made here on first use, so that a conversation keeps one
cache and one compiled graph.
"""

from __future__ import annotations

import re

import torch

from data.processor import (
    IMAGE_PLACEHOLDER,
    IMG_CONTEXT,
    IMG_END,
    IMG_START,
    Tokenizer,
    build_prompt,
    place_images,
)
from inference.engine import Engine, GenerateConfig
from parvl import ParVL


def engine_of(model: ParVL) -> Engine:
    """The Engine chat and batch_chat run on: model.engine, made here on the first call
    (compiled on CUDA, as the commands' default) and kept with the model, so that a conversation keeps
    one cache and one compiled graph. For other settings (branches, shared KV) set model.engine =
    Engine(model, ...) first. The attribute is this API's, not the architecture's: parvl.py never reads it."""
    if getattr(model, "engine", None) is None:
        model.engine = Engine(model, compile=None)
    return model.engine


GENERATION_KEYS = {
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "num_beams",
    "eos_token_id",
    "pad_token_id",
}


def to_generate_config(generation_config: dict | GenerateConfig | None) -> GenerateConfig:
    """A transformers-style generation_config dict, as InternVL's chat() takes it, as a GenerateConfig:
    do_sample=False is greedy; with do_sample, temperature, top_p and top_k keep transformers' defaults
    (1.0, 1.0, 50). Without max_new_tokens: GenerateConfig's 512. eos/pad ids are the tokenizer's, as
    chat() sets them itself; beam search and other options are refused rather than ignored."""
    if isinstance(generation_config, GenerateConfig):
        return generation_config
    gc = {k: v for k, v in (generation_config or {}).items() if v is not None}
    unknown = sorted(set(gc) - GENERATION_KEYS)
    if unknown or gc.get("num_beams", 1) != 1:
        raise ValueError(
            f"generation_config: {unknown or 'num_beams > 1'} not supported here "
            f"(supported: {', '.join(sorted(GENERATION_KEYS))}; num_beams 1 only)"
        )
    sample = bool(gc.get("do_sample", False))
    return GenerateConfig(
        max_new_tokens=gc.get("max_new_tokens", GenerateConfig.max_new_tokens),
        temperature=gc.get("temperature", 1.0) if sample else 0.0,
        top_k=gc.get("top_k", 50) if sample else 0,
        top_p=gc.get("top_p", 1.0) if sample else 1.0,
    )


def model_pixels(
    model: ParVL, pixel_values: torch.Tensor | None, num_patches_list: list[int]
) -> torch.Tensor | None:
    """pixel_values on the model's device and in its dtype, checked against num_patches_list."""
    if pixel_values is None:
        if any(num_patches_list):
            raise ValueError(
                f"num_patches_list {num_patches_list} lists tiles but pixel_values is None"
            )
        return None
    if model.cfg.vit is None:
        raise ValueError("a language-only model takes no pixel_values")
    if pixel_values.shape[0] != sum(num_patches_list):
        raise ValueError(
            f"pixel_values holds {pixel_values.shape[0]} tiles but num_patches_list {num_patches_list} "
            f"sums to {sum(num_patches_list)}"
        )
    weight = model.mlp1[1].weight
    return pixel_values.to(device=weight.device, dtype=weight.dtype)


def chat(
    model: ParVL,
    tokenizer: Tokenizer,
    pixel_values: torch.Tensor | None,
    question: str,
    generation_config: dict | GenerateConfig | None,
    history: list[tuple[str, str]] | None = None,
    return_history: bool = False,
    num_patches_list: list[int] | None = None,
    verbose: bool = False,
    system: str | None = None,
):
    """InternVLChatModel.chat: answer `question` about the tiles in pixel_values [N,3,448,448] (None:
    text only); num_patches_list gives the tiles of each image (default: one image of all N tiles),
    history the earlier (question, answer) turns. As the official code, a first question with images
    but no <image> gets "<image>\n" in front, and the history keeps the question so changed. Returns
    the response, or (response, history + [(question, response)]) with return_history (a new list;
    the official code also appends to the caller's). system: the system message (default InternVL's)."""
    if num_patches_list is None:
        num_patches_list = [pixel_values.shape[0]] if pixel_values is not None else []
    pixels = model_pixels(model, pixel_values, list(num_patches_list))
    history = list(history or [])
    # as the official chat(): one "<image>\n", stored in the history
    if not history and num_patches_list:
        question = place_images(question, 1)
    prompt = build_prompt(
        question,
        list(num_patches_list),
        history=history,
        system=system,
        tokens_per_tile=model.cfg.tokens_per_tile,
    )
    out = engine_of(model).generate(
        [tokenizer.encode(prompt)], pixels, to_generate_config(generation_config), tokenizer.eos_ids
    )
    response = tokenizer.answer(out.tokens[0])
    if verbose:  # the query as the official verbose print shows it: images as <image>
        print(
            re.sub(f"{IMG_START}(?:{IMG_CONTEXT})*{IMG_END}", IMAGE_PLACEHOLDER, prompt), response
        )
    return (response, history + [(question, response)]) if return_history else response


def batch_chat(
    model: ParVL,
    tokenizer: Tokenizer,
    pixel_values: torch.Tensor | None,
    questions: list[str],
    generation_config: dict | GenerateConfig | None,
    num_patches_list: list[int] | None = None,
    history=None,
    return_history: bool = False,
    verbose: bool = False,
    system: str | None = None,
) -> list[str]:
    """InternVLChatModel.batch_chat: one answer per question, generated as one left-padded batch.
    Question i sees the next num_patches_list[i] tiles of pixel_values (one image; 0 = text only; default
    none without pixel_values, all of them for a single question) and gets "<image>\n" in front when it
    has no placeholder. No history, as in the official code (chat() holds conversations)."""
    if history is not None or return_history:
        raise ValueError(
            "batch_chat takes no history (as InternVL's); use chat() for a conversation"
        )
    if num_patches_list is None:
        if pixel_values is not None and len(questions) != 1:
            raise ValueError(
                f"{len(questions)} questions share pixel_values: pass num_patches_list "
                f"(tiles per question)"
            )
        num_patches_list = [0 if pixel_values is None else pixel_values.shape[0]] * len(questions)
    if len(num_patches_list) != len(questions):
        raise ValueError(
            f"num_patches_list has {len(num_patches_list)} entries for {len(questions)} questions"
        )
    pixels = model_pixels(model, pixel_values, list(num_patches_list))
    prompts = []
    for question, n in zip(questions, num_patches_list):
        prompts.append(
            build_prompt(
                place_images(question, 1 if n else 0),
                [n] if n else [],
                system=system,
                tokens_per_tile=model.cfg.tokens_per_tile,
            )
        )
    if verbose and pixels is not None:
        print(f"dynamic ViT batch size: {pixels.shape[0]}")
    out = engine_of(model).generate(
        [tokenizer.encode(p) for p in prompts],
        pixels,
        to_generate_config(generation_config),
        tokenizer.eos_ids,
    )
    return [tokenizer.answer(t) for t in out.tokens]
