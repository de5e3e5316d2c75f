"""InternVL's chat API on the engine: `chat` and `batch_chat` as InternVLChatModel (the official
remote code) has them, and the interactive session and streamed answer of `generate.py --chat`.

    response, history = model.chat(tokenizer, pixel_values, "Describe the image.",
                                   dict(max_new_tokens=256, do_sample=False), return_history=True)

How the house is arranged: ParVL.chat and ParVL.batch_chat (parvl.py) are two delegates that call
`chat` and `batch_chat` here, handing over the model object itself; this module and the engine below
it (engine.py) read only that object (its config, towers and caches) and import no name of parvl.py.
So the model sits above the engine and reaches it for InternVL's API without an import circle, and
the command that loads models (generate.py) sits above all three. The model keeps one Engine
(model.engine), made on first use.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

import torch

from cli import log, one_line, peak_memory_gib
from engine import Engine, GenerateConfig
from processor import IMAGE_PLACEHOLDER, IMG_CONTEXT, IMG_END, IMG_START, Tokenizer, build_prompt, place_images


def engine_of(model) -> Engine:
    """The model's Engine, created on the first chat: compiled on CUDA, as the command's default.
    Assign model.engine = Engine(model, ...) first for other settings (branches, shared KV)."""
    if model.engine is None:
        model.engine = Engine(model, compile=model.language_model.lm_head.weight.device.type == "cuda")
    return model.engine


GENERATION_KEYS = {"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "num_beams", "eos_token_id",
                   "pad_token_id"}


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
        raise ValueError(f"generation_config: {unknown or 'num_beams > 1'} not supported here "
                         f"(supported: {', '.join(sorted(GENERATION_KEYS))}; num_beams 1 only)")
    sample = bool(gc.get("do_sample", False))
    return GenerateConfig(max_new_tokens=gc.get("max_new_tokens", GenerateConfig.max_new_tokens),
                          temperature=gc.get("temperature", 1.0) if sample else 0.0,
                          top_k=gc.get("top_k", 50) if sample else 0, top_p=gc.get("top_p", 1.0) if sample else 1.0)


def model_pixels(model, pixel_values: torch.Tensor | None, num_patches_list: list[int]) -> torch.Tensor | None:
    """pixel_values on the model's device and in its dtype, checked against num_patches_list."""
    if pixel_values is None:
        if any(num_patches_list):
            raise ValueError(f"num_patches_list {num_patches_list} lists tiles but pixel_values is None")
        return None
    if model.cfg.vit is None:
        raise ValueError("a language-only model takes no pixel_values")
    if pixel_values.shape[0] != sum(num_patches_list):
        raise ValueError(f"pixel_values holds {pixel_values.shape[0]} tiles but num_patches_list {num_patches_list} "
                         f"sums to {sum(num_patches_list)}")
    weight = model.mlp1[1].weight
    return pixel_values.to(device=weight.device, dtype=weight.dtype)


def chat(model, tokenizer: Tokenizer, pixel_values: torch.Tensor | None, question: str,
         generation_config: dict | GenerateConfig | None, history: list[tuple[str, str]] | None = None,
         return_history: bool = False, num_patches_list: list[int] | None = None, verbose: bool = False,
         system: str | None = None):
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
    if not history and num_patches_list:  # as the official chat(): one "<image>\n", stored in the history
        question = place_images(question, 1)
    prompt = build_prompt(question, list(num_patches_list), history=history, system=system,
                          tokens_per_tile=model.cfg.tokens_per_tile)
    out = engine_of(model).generate([tokenizer.encode(prompt)], pixels, to_generate_config(generation_config),
                                    tokenizer.eos_ids)
    response = tokenizer.answer(out.tokens[0])
    if verbose:  # the query as the official verbose print shows it: images as <image>
        print(re.sub(f"{IMG_START}(?:{IMG_CONTEXT})*{IMG_END}", IMAGE_PLACEHOLDER, prompt), response)
    return (response, history + [(question, response)]) if return_history else response


def batch_chat(model, tokenizer: Tokenizer, pixel_values: torch.Tensor | None, questions: list[str],
               generation_config: dict | GenerateConfig | None, num_patches_list: list[int] | None = None,
               history=None, return_history: bool = False, verbose: bool = False,
               system: str | None = None) -> list[str]:
    """InternVLChatModel.batch_chat: one answer per question, generated as one left-padded batch.
    Question i sees the next num_patches_list[i] tiles of pixel_values (one image; 0 = text only; default
    none without pixel_values, all of them for a single question) and gets "<image>\n" in front when it
    has no placeholder. No history, as in the official code (chat() holds conversations)."""
    if history is not None or return_history:
        raise ValueError("batch_chat takes no history (as InternVL's); use chat() for a conversation")
    if num_patches_list is None:
        if pixel_values is not None and len(questions) != 1:
            raise ValueError(f"{len(questions)} questions share pixel_values: pass num_patches_list (tiles per question)")
        num_patches_list = [0 if pixel_values is None else pixel_values.shape[0]] * len(questions)
    if len(num_patches_list) != len(questions):
        raise ValueError(f"num_patches_list has {len(num_patches_list)} entries for {len(questions)} questions")
    pixels = model_pixels(model, pixel_values, list(num_patches_list))
    prompts = []
    for question, n in zip(questions, num_patches_list):
        prompts.append(build_prompt(place_images(question, 1 if n else 0), [n] if n else [], system=system,
                                    tokens_per_tile=model.cfg.tokens_per_tile))
    if verbose and pixels is not None:
        print(f"dynamic ViT batch size: {pixels.shape[0]}")
    out = engine_of(model).generate([tokenizer.encode(p) for p in prompts], pixels,
                                    to_generate_config(generation_config), tokenizer.eos_ids)
    return [tokenizer.answer(t) for t in out.tokens]



# -- the streamed answer and the interactive session of generate.py ------------------------------


class Interrupted(Exception):
    """Ctrl-C during an answer: what was generated until then (already on stdout)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text



class Streamer:
    """Streams the answer as tokens arrive: decodes everything so far and writes what is new, holding
    back an incomplete UTF-8 character (decoded as U+FFFD) and trailing white space (the answer is
    stripped), so the pieces written concatenate to exactly the final answer."""

    def __init__(self, tok: Tokenizer, enabled: bool = True, write=None):
        self.tok, self.enabled, self.write = tok, enabled, write or sys.stdout.write
        self.ids: list[int] = []
        self.shown, self.stopped = "", False

    def __call__(self, step: int, tokens: list[int]) -> None:
        if self.stopped or tokens[0] in self.tok.eos_ids:
            self.stopped = True
            return
        self.ids.append(tokens[0])
        text = self.tok.answer(self.ids)
        if self.enabled and not text.endswith("\ufffd") and len(text) > len(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text
            sys.stdout.flush()

    def finish(self) -> None:
        if self.enabled:  # whatever was held back (a dangling partial character) goes out now
            text = self.tok.answer(self.ids)
            self.write(text[len(self.shown):] + "\n")


def answer(engine: Engine, tok: Tokenizer, prompt: str, pixel_values, cfg: GenerateConfig,
           args: argparse.Namespace, load_s: float = 0.0) -> str:
    """Generate one answer, streaming text to stdout (unless --json); metrics to stderr."""
    torch.manual_seed(args.seed)
    ids = tok.encode(prompt)
    streamed = Streamer(tok, enabled=not args.json)
    try:
        res = engine.generate([ids], pixel_values, cfg, stop_ids=tok.eos_ids, callback=streamed)
    except KeyboardInterrupt:  # Ctrl-C: end the answer where it is, cleanly, and say so
        text = tok.answer(streamed.ids)
        streamed.finish()
        if args.json:
            print(json.dumps({"answer": text, "interrupted": True, "new_tokens": len(streamed.ids)}, ensure_ascii=False))
        raise Interrupted(text) from None
    text = tok.answer(res.tokens[0])
    streamed.finish()
    n = len(res.tokens[0])
    metrics = {
        "load_s": round(load_s, 3), "ttft_s": round(res.prefill_s, 4), "new_tokens": n,
        "decode_tok_s": round((res.decode_steps - 1) / res.decode_s, 2) if res.decode_steps > 1 else None,
        "peak_gib": round(peak_memory_gib(engine.device), 3), "prompt_tokens": len(ids),
    }
    if res.pairs is not None:  # routed: the (vision, language) branch pair that ran
        metrics["pair"] = list(res.pairs[0])
    if args.json:
        print(json.dumps({"answer": text, **metrics}, ensure_ascii=False))
    else:
        log(" ".join(f"{k}={v}" for k, v in metrics.items()))
    return text


def chat_session(engine, tok, pixel_values, num_tiles, cfg, args) -> int:
    """Read questions until end of input (0) or Ctrl-C at the prompt (130). A turn that is refused
    (too long, a stray <image>) prints one line and is dropped; Ctrl-C during an answer stops it,
    and the part shown stays in the history, as it does in chat interfaces."""
    history: list[tuple[str, str]] = []
    while True:
        try:
            question = input("> " if sys.stdin.isatty() else "").strip()
        except EOFError:
            return 0
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        if not question:
            continue
        if not history:  # the first turn carries the images, as the official chat() stores it
            question = place_images(question, len(num_tiles))
        try:
            # the whole history is re-sent each turn; its image tokens stay in the first turn
            prompt = build_prompt(question, num_tiles, history=history, system=args.system,
                                  tokens_per_tile=engine.model.cfg.tokens_per_tile)
            history.append((question, answer(engine, tok, prompt, pixel_values, cfg, args)))
        except ValueError as e:  # this turn only; the session and its history go on
            print(f"error: {one_line(e)} (turn dropped; the conversation goes on)", file=sys.stderr)
        except Interrupted as e:
            print("interrupted: answer stopped (the conversation goes on)", file=sys.stderr)
            history.append((question, e.text))

