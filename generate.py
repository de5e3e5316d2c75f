"""Generation with ParVL / InternVL3.5: a gpt-fast style engine and the `generate.py` command.

    python generate.py image.png "Describe the image."    # OpenGVLab/InternVL3_5-1B, fetched once into the hub cache
    python generate.py image.png "Describe the image." --model path/to/InternVL3_5-1B   # or a hub id, or $PARVL_MODEL
    python generate.py a.png b.png $'Image-1: <image>\\nImage-2: <image>\\nWhat differs?'
    python generate.py "A text-only question"
    python generate.py image.png --chat                 # interactive multi-turn session (no image: text only)
    python generate.py --batch questions.jsonl --out answers.jsonl   # resumable; rows {"image", "question"}

In Python, InternVL's own convenience API works on ParVL: model.chat(tokenizer, pixel_values,
question, dict(max_new_tokens=256, do_sample=False)) and model.batch_chat(...), implemented here
(`chat`, `batch_chat`) on the engine.

The engine: the prompt is prefilled once into a static KV cache (allocated once, written in
place), then `decode_step` (`decode_one_token`, sampling and the stop check) runs one step at a
time, compiled with torch.compile into one graph: CUDA graphs on GPU (mode="reduce-overhead"), and
on CPU inductor with its linears of few rows as inductor's own reductions (`gemv`, 2-2.5x MKL's
rate here). Sampling runs on the device (no multinomial, no .item()), so the decode loop needs no
host synchronisation except where the caller streams tokens or every `check_every` steps to see
whether every sequence has stopped. Several prompts of different lengths and tile counts are
generated as one left-padded batch; each prompt's positions start at 0 and its padding is masked
out of every attention.

Shape legend: B batch, T prompt tokens (padded), S cache slots, V vocabulary.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from aggregate import Choice, Rows
from checkpoint import CheckpointError, check_not_run_folder, read_json
from llm import causal_mask
from parvl import ParVL, config_from_json
from processor import (IMAGE_PLACEHOLDER, IMG_CONTEXT, IMG_END, IMG_START, ImageError, Tokenizer,
                       build_multi_image_question, build_prompt, load_image)


@dataclass
class GenerateConfig:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    ignore_eos: bool = False  # force exactly max_new_tokens (the profiling protocol)
    check_every: int = 16  # decode steps between host checks for "all sequences stopped"
    bucket: int = 128  # decode attends over the written cache slots rounded up to this many (0 = all slots)


@dataclass
class Result:
    tokens: list[list[int]]  # generated ids per prompt, stop token excluded
    prefill_s: float = 0.0  # time to first token (ViT + connector + LLM prefill + first sample)
    decode_s: float = 0.0
    decode_steps: int = 0
    pairs: list[tuple[int | None, int]] | None = None  # routed: (vision, language) branch per prompt, vision None without image


# -- sampling ---------------------------------------------------------------------------------


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[B,V] fp32 logits -> [B] token ids, on the device, with no host synchronisation."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # [B,1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B,V]
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    # Gumbel-style draw: argmax(p / Exp(1)) samples from p without torch.multinomial's sync
    return (probs / torch.empty_like(probs).exponential_(1)).argmax(-1)


# -- prefill and one decode step --------------------------------------------------------------


@torch.no_grad()
def prefill(model: ParVL, input_ids: torch.Tensor, pixel_values: torch.Tensor | None, valid: torch.Tensor,
            padded: bool, vision_branch: Choice, rows: Rows, features: torch.Tensor | None = None) -> torch.Tensor:
    """Run the prompt ([B,T], left-padded where valid is False) into token slots 0..T-1 of the cache
    (the branch prefixes sit in front of them); return the fp32 logits of the last position [B,V].
    features: connector output [N,256,D] already computed (by a router), so the ViT does not rerun."""
    B, T = input_ids.shape
    x, _ = model.embed(input_ids, pixel_values, vision_branch, features)  # [B,T,C] with image features in place
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [B,T], 0 at each prompt's first token
    slots = torch.arange(T, device=x.device)
    mask = causal_mask(valid, slots) if padded else None  # None: fused causal kernels
    h, _ = model.hidden(x, positions, mask, slots, rows)  # [B,T,C] rows unfolded
    return model.language_model.lm_head(h[:, -1]).float()


def decode_one_token(model: ParVL, token: torch.Tensor, input_pos: torch.Tensor, positions: torch.Tensor,
                     key_valid: torch.Tensor, rows: Rows) -> torch.Tensor:
    """One step: token [B,1] at token slot input_pos [1], rotary positions [B,1]; key_valid [B,S]
    marks the token slots that are not padding. Returns fp32 logits [B,V]. Static shapes only."""
    x = model.language_model.model.embed_tokens(token)  # [B,1,C]
    mask = causal_mask(key_valid, input_pos)  # [B,1,1,S]
    h, _ = model.hidden(x, positions, mask, input_pos, rows)  # [B,1,C] rows unfolded
    return model.language_model.lm_head(h[:, -1]).float()


def decode_step(model: ParVL, token: torch.Tensor, input_pos: torch.Tensor, positions: torch.Tensor,
                key_valid: torch.Tensor, rows: Rows, done: torch.Tensor, stops: torch.Tensor, pad_id: int,
                temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One whole generation step on the device, the graph that is compiled: decode_one_token for the
    token [B] just chosen, sampling, and the stop check. Returns the next token [B], done [B] after it
    (a stop id seen; stops is empty with ignore_eos) and the token to record [B] (pad_id once stopped)."""
    logits = decode_one_token(model, token.view(-1, 1), input_pos, positions, key_valid, rows)
    nxt = sample(logits, temperature, top_k, top_p)
    return nxt, done | torch.isin(nxt, stops), torch.where(done, pad_id, nxt)


# -- compiling the decode step ------------------------------------------------------------------
# On CUDA the step runs as CUDA graphs (mode="reduce-overhead"). On CPU a decode step is a few
# matrix-vector products per layer over every weight, bandwidth-bound work that MKL's sgemm does
# poorly with few rows (measured, 2 cores: 22 GB/s for one row, as fast as on 1 thread; 10-13 GB/s
# for 2-16 rows, where torch.sum reads 45-47 GB/s). Inductor's own reduction kernel, parallel over
# the outputs and vectorised along K, reads the weights at 93-100 % of torch.sum's rate for one row,
# so the compiled CPU step turns each linear of few rows into multiply + sum (gemv) before inductor
# lowers it: every weight is still read once per row, and the sums accumulate in fp32 as the BLAS's do.
GEMV_ROWS = 4  # linears of at most this many rows (samples x branches) become gemv; measured decode
# ms per step at width 512, gemv vs MKL: 1 row 3.0 vs 7.5, 2 rows 5.6 vs 11.0, 4: 8.0 vs 11.7, 8: 14.5 vs 13.7


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for few rows as one fp32 reduction over K per output: x [...,K], weight [N,K] -> [...,N].
    Only for compiled code: inductor fuses the product into the sum, eager would materialise it."""
    rows = x.reshape(-1, 1, x.shape[-1])  # [M,1,K]
    out = (rows.float() * weight.float()).sum(-1)  # [M,N,K] -> [M,N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])  # [...,N]


def cpu_backend(gm: torch.fx.GraphModule, example_inputs):
    """The CPU decode backend: inductor, after turning every linear of at most GEMV_ROWS rows in
    dynamo's graph into gemv. The rewrite is in the graph inductor receives (not in its decomposition
    table, which its caches do not key on), so a cached plain graph is never handed back for it."""
    from torch._inductor.compile_fx import compile_fx

    for node in gm.graph.find_nodes(op="call_function", target=torch.nn.functional.linear):
        x = node.args[0].meta["example_value"]
        if x.numel() <= GEMV_ROWS * x.shape[-1]:
            node.target = gemv
    gm.recompile()
    # store small activations (the RMSNorm output) rather than let inductor recompute them in the gemv
    # loop for every weight row: 25 -> 19 ms per step at the benchmark's default size, when memory is fast
    return compile_fx(gm, example_inputs, config_patches={"realize_opcount_threshold": 4})


def compile_step(device: torch.device):
    """decode_step compiled as one graph (fullgraph): CUDA graphs on CUDA, inductor with gemv on CPU."""
    if device.type == "cuda":
        return torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    return torch.compile(decode_step, backend=cpu_backend if device.type == "cpu" else "inductor", fullgraph=True)


class Engine:
    """Holds the model, its static cache and the (compiled) decode step across generate calls.

    shared_kv: keep one mean-reduced token K/V per sample instead of one per language branch
    (ParVL Appendix C.2; an approximation that saves memory; dense language branches only).
    vision_branch / language_branch (aggregate.Choice): the default branch choice of every call,
    None = all branches fused, an int = one pair for every sample; `generate` can override it with
    a branch per sample.
    router (router.Router): pick (vision, language) per prompt by argmax and run only that pair, in
    calls that give no branches; it cannot be combined with default branches or shared KV."""

    def __init__(self, model: ParVL, compile: bool = False, shared_kv: bool = False,
                 vision_branch: Choice = None, language_branch: Choice = None, router=None):
        self.model = model
        self.device = model.language_model.lm_head.weight.device
        self.shared_kv, self.vision_branch, self.language_branch = shared_kv, vision_branch, language_branch
        if router is not None:
            if shared_kv or vision_branch is not None or language_branch is not None:
                raise ValueError("a router picks the branches per sample: no shared_kv, vision_branch or language_branch with it")
            router.check(model)
        self.router = router
        self.cache_shape: tuple[int, bool, int] | None = None  # (rows, shared, slots)
        self.step = decode_step
        self.graphs = compile and self.device.type == "cuda"  # CUDA graphs reuse their output buffers
        if compile:
            self.step = compile_step(self.device)

    def setup(self, rows: Rows, slots: int) -> int:
        """(Re)allocate the cache only when it is too small or its rows changed, else re-seed each
        row's prefixes (rows may run other branches, and the prefixes may have been trained since);
        sizes are rounded up to 256 slots so a chat session keeps one cache (and one compiled graph)."""
        slots = -(-slots // 256) * 256
        lm = self.model.language_model
        key = (len(rows.branch), rows.shared_kv)
        if self.cache_shape is None or self.cache_shape[:2] != key or self.cache_shape[2] < slots:
            lm.setup_cache(rows, slots)
            self.cache_shape = (*key, slots)
        else:
            lm.seed_prefixes(rows)
        return self.cache_shape[2]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], pixel_values: torch.Tensor | None, cfg: GenerateConfig,
                 stop_ids: list[int], pad_id: int = 0, callback=None, vision_branch: Choice = None,
                 language_branch: Choice = None) -> Result:
        """Generate for a batch of prompts (token id lists); pixel_values holds every prompt's tiles
        in order. callback(step, tokens [B] on host) streams tokens as they come (syncs each step).
        vision_branch / language_branch: a branch (or one per prompt) for this call; None keeps the
        engine's default."""
        model, dev = self.model, self.device
        B, T = len(prompts), max(len(p) for p in prompts)
        context_check(T, cfg.max_new_tokens, model.cfg.llm.max_position_embeddings)
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        for b, p in enumerate(prompts):  # left padding: every prompt ends at slot T-1
            ids[b, T - len(p):] = torch.tensor(p)
            valid[b, T - len(p):] = True
        ids, valid = ids.to(dev), valid.to(dev)
        features, pairs, route_s = None, None, 0.0
        if self.router is not None and vision_branch is None and language_branch is None:
            # routed: the vision gate, the chosen ViT branch per sample, the language gate; the
            # connector features are kept for the prefill (timed as part of the time to first token)
            sync(dev)
            t0 = time.perf_counter()
            if pixel_values is not None:
                pixel_values = pixel_values.to(dev)
            vision_branch, language_branch, features = self.router.route(model, ids, valid, pixel_values)
            has_image = (ids == model.cfg.image_token_id).any(1).tolist()
            pairs = [(v if img else None, lang) for v, lang, img in zip(vision_branch, language_branch, has_image)]
            sync(dev)
            route_s = time.perf_counter() - t0
        vision_branch = self.vision_branch if vision_branch is None else vision_branch
        language_branch = self.language_branch if language_branch is None else language_branch
        rows = model.language_rows(language_branch, B, dev, self.shared_kv)
        S = self.setup(rows, T + cfg.max_new_tokens)
        padded = any(len(p) < T for p in prompts)
        key_valid = torch.ones(B, S, dtype=torch.bool, device=dev)  # slots past T are valid once written
        key_valid[:, :T] = valid
        stops = torch.tensor([] if cfg.ignore_eos else stop_ids, dtype=torch.long, device=dev)
        sampling = (cfg.temperature, cfg.top_k, cfg.top_p)

        sync(dev)
        t0 = time.perf_counter()
        if pixel_values is not None:
            pixel_values = pixel_values.to(dev)
        logits = prefill(model, ids, pixel_values, valid, padded, vision_branch, rows, features)
        token = sample(logits, *sampling)  # [B]
        sync(dev)
        result = Result(tokens=[], prefill_s=time.perf_counter() - t0 + route_s, pairs=pairs)

        input_pos = torch.tensor([T], device=dev)  # cache slot of the token being fed
        positions = valid.long().sum(-1, keepdim=True)  # [B,1] its rotary position
        done = torch.isin(token, stops)
        recorded = [token]  # [B] per step, kept on the device
        t0 = time.perf_counter()
        if callback is not None:
            callback(0, token.tolist())
        for i in range(1, cfg.max_new_tokens):
            if not cfg.ignore_eos and i % cfg.check_every == 0 and bool(done.all()):
                break
            # attend over the slots written so far (T + i, the fed token included) rounded up to a
            # bucket, not the whole cache: fewer keys, and one graph per bucket
            n = min(S, -(-(T + i) // cfg.bucket) * cfg.bucket) if cfg.bucket else S
            token, done, rec = self.step(model, token, input_pos, positions, key_valid[:, :n], rows, done, stops, pad_id,
                                         *sampling)
            if self.graphs:  # the next replay overwrites its outputs
                token, done, rec = token.clone(), done.clone(), rec.clone()
            recorded.append(rec)
            input_pos += 1
            positions += 1
            if callback is not None:
                callback(i, rec.tolist())
        sync(dev)
        steps = len(recorded)
        result.decode_s, result.decode_steps = time.perf_counter() - t0, steps
        for row in torch.stack(recorded, 1).tolist():
            cut = next((j for j, t in enumerate(row) if t in stop_ids), len(row)) if not cfg.ignore_eos else len(row)
            result.tokens.append(row[:cut])
        return result


def engine_from_flags(model: ParVL, args: argparse.Namespace) -> Engine:
    """The Engine the branch flags ask for (generate.py and evaluate.py): --vision-branch and
    --language-branch checked against the checkpoint, --router loaded and checked, --compile on by
    default on CUDA."""
    par = model.cfg.par
    for name, value, count in (("--vision-branch", args.vision_branch, par.pv), ("--language-branch", args.language_branch, par.pl)):
        if value is not None and not 0 <= value < count:
            raise ValueError(f"{name} {value} out of range: the checkpoint has {count} branches")
    router = None
    if args.router:
        from router import load_router  # only needed with --router
        router = load_router(args.router, model)  # refuses a router trained for another checkpoint
        log(f"router {args.router}: one branch pair per prompt")
    cuda = model.language_model.lm_head.weight.device.type == "cuda"
    return Engine(model, compile=cuda if args.compile is None else args.compile, shared_kv=args.shared_kv,
                  vision_branch=args.vision_branch, language_branch=args.language_branch, router=router)


def context_check(prompt_len: int, max_new_tokens: int, limit: int) -> None:
    """Refuse a prompt whose tokens plus the token budget exceed the model context (positions)."""
    if prompt_len + max_new_tokens > limit:
        raise ValueError(f"prompt of {prompt_len} tokens (image tokens included) + {max_new_tokens} new tokens "
                         f"exceeds the model context of {limit}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


# -- InternVL's chat() and batch_chat() on the engine -------------------------------------------
# The convenience API of InternVLChatModel (the official remote code), re-implemented on Engine, so
# `model.chat(tokenizer, pixel_values, question, generation_config)` ports unchanged. ParVL.chat and
# ParVL.batch_chat delegate here; the model keeps one Engine (model.engine), made on first use.


def engine_of(model: ParVL) -> Engine:
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


def model_pixels(model: ParVL, pixel_values: torch.Tensor | None, num_patches_list: list[int]) -> torch.Tensor | None:
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


def chat(model: ParVL, tokenizer: Tokenizer, pixel_values: torch.Tensor | None, question: str,
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
    if not history and num_patches_list and IMAGE_PLACEHOLDER not in question:
        question = IMAGE_PLACEHOLDER + "\n" + question
    prompt = build_prompt(question, list(num_patches_list), history=history, system=system,
                          tokens_per_tile=model.cfg.tokens_per_tile)
    out = engine_of(model).generate([tokenizer.encode(prompt)], pixels, to_generate_config(generation_config),
                                    tokenizer.eos_ids)
    response = tokenizer.decode(out.tokens[0], skip_special_tokens=True).strip()
    if verbose:  # the query as the official verbose print shows it: images as <image>
        print(re.sub(f"{IMG_START}(?:{IMG_CONTEXT})*{IMG_END}", IMAGE_PLACEHOLDER, prompt), response)
    return (response, history + [(question, response)]) if return_history else response


def batch_chat(model: ParVL, tokenizer: Tokenizer, pixel_values: torch.Tensor | None, questions: list[str],
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
        if n and IMAGE_PLACEHOLDER not in question:
            question = IMAGE_PLACEHOLDER + "\n" + question
        prompts.append(build_prompt(question, [n] if n else [], system=system, tokens_per_tile=model.cfg.tokens_per_tile))
    if verbose and pixels is not None:
        print(f"dynamic ViT batch size: {pixels.shape[0]}")
    out = engine_of(model).generate([tokenizer.encode(p) for p in prompts], pixels,
                                    to_generate_config(generation_config), tokenizer.eos_ids)
    return [tokenizer.decode(t, skip_special_tokens=True).strip() for t in out.tokens]


# -- the command ------------------------------------------------------------------------------


DEFAULT_MODEL = "OpenGVLab/InternVL3_5-1B"  # the original layout, which parvl.py reads natively
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name, as the hub spells repo ids
HUB_FILES = ["*.json", "*.safetensors", "*.txt"]  # config, weights, tokenizer: not the remote code or example media


def resolve_model(name: str | None = None, revision: str | None = None) -> Path:
    """The checkpoint folder for --model: a local folder, else a hub repo id, fetched once into
    huggingface_hub's cache (HF_HUB_CACHE / HF_HOME) and read from there on later runs, offline too.
    No name: $PARVL_MODEL, else DEFAULT_MODEL. revision (a branch, tag or commit) pins a hub model."""
    name = name or os.environ.get("PARVL_MODEL") or DEFAULT_MODEL
    if Path(name).is_dir():
        if revision:
            raise ValueError(f"--revision {revision}: {name} is a local folder, not a hub model")
        check_not_run_folder(Path(name))  # runs/22 instead of runs/22/export: say so before anything fails
        return Path(name)
    if Path(name).exists() or not HUB_ID.fullmatch(name) or name.startswith("."):
        raise CheckpointError(f"{name}: not a checkpoint folder (nor a hub model id such as {DEFAULT_MODEL})")
    return hub_snapshot(name, revision)


def hub_snapshot(repo: str, revision: str | None) -> Path:
    """The cached snapshot of a hub model, downloaded (with huggingface_hub's progress bars) only if the
    cache lacks it or holds an incomplete copy. Every failure is one line naming the way out."""
    pin = f" --revision {revision}" if revision else ""
    local = repo.split("/")[-1]
    elsewhere = f"download it where the hub is reachable (hf download {repo}{pin} --local-dir {local}) and pass --model {local}"
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                           RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:
        raise CheckpointError(f"{repo}: not a local folder, and huggingface_hub is not installed to fetch it "
                              f"(pip install huggingface_hub); or {elsewhere}") from None
    kw = dict(revision=revision, allow_patterns=HUB_FILES)
    try:  # the cache first: no network round trip, and it works offline
        cached = Path(snapshot_download(repo, local_files_only=True, **kw))
    except LocalEntryNotFoundError:
        cached = None
    if cached is not None and weights_complete(cached):
        return cached
    if constants.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE=1: no download to attempt
        state = "incomplete in" if cached is not None else "not in"
        raise CheckpointError(f"{repo}{pin}: {state} the hub cache, and HF_HUB_OFFLINE is set; {elsewhere}")
    try:
        log(f"downloading {repo}{pin} into {constants.HF_HUB_CACHE} (once; later runs read it there)")
        folder = Path(snapshot_download(repo, **kw))
    except GatedRepoError:
        raise CheckpointError(f"{repo}: a gated model; accept its terms on the hub and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo}: not a local folder, and no hub model of that name "
                              f"(a private one needs hf auth login)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo}: the hub has no revision {revision!r}") from None
    except LocalEntryNotFoundError:  # not cached, and offline (HF_HUB_OFFLINE) or the hub is unreachable
        raise CheckpointError(f"{repo}{pin}: not in the hub cache and the hub cannot be reached; {elsewhere}") from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(f"{repo}: download failed ({type(e).__name__}: {e}); {elsewhere}") from None
    if not weights_complete(folder):
        raise CheckpointError(f"{folder}: the cached {repo} is incomplete (no config.json or weights); {elsewhere}")
    return folder


def weights_complete(folder: Path) -> bool:
    """config.json and every weight file there (an interrupted download leaves a partial snapshot)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text())["weight_map"].values())
        return (folder / "config.json").is_file() and all((folder / s).is_file() for s in shards)
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def resolve_device(name: str) -> torch.device:
    """--device as a torch.device, or one line on what is wrong with it (before any file is read,
    so a missing GPU is not reported as an unreadable checkpoint)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name!r}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"--device {name}: CUDA is not available ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (0 to "
                             f"{torch.cuda.device_count() - 1})")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: MPS is not available on this machine; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {name}: not supported here; use cpu or cuda")
    return device


class OneLineParser(argparse.ArgumentParser):
    """A flag error is one line, not the usage of every flag, and exits 2 (argparse's code); under
    torchrun only rank 0 prints it (every rank parses the same flags)."""

    def error(self, message: str):
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description="Answer a question about images (or text) with ParVL / InternVL3.5.")
    p.add_argument("inputs", nargs="*", help="zero or more image paths, then the question (with --chat: images only, "
                                              "or none for a text-only session; with --batch: nothing)")
    p.add_argument("--model", default=os.environ.get("PARVL_MODEL"),
                   help=f"checkpoint folder or hub repo id (default: $PARVL_MODEL, else {DEFAULT_MODEL}, downloaded "
                        f"once into the huggingface_hub cache)")
    p.add_argument("--revision", default=None, help="hub branch, tag or commit of --model (default: main)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="token budget per answer, in tokens (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, >= 0; 0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass in (0, 1], 1 = off (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens, 0 = off (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="weights and activations (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device: cpu, cuda or cuda:N (default cuda if available, else cpu)")
    p.add_argument("--max-tiles", type=int, default=0,
                   help="448 px tiles per image, thumbnail excluded (default 0: the checkpoint's max_dynamic_patch, 12 for InternVL3.5)")
    p.add_argument("--system", default=None, help="system message text (default: InternVL's own)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decode step (default: on for CUDA, off for CPU)")
    p.add_argument("--shared-kv", action="store_true",
                   help="ParVL: one mean-reduced token KV cache per sample instead of one per language branch "
                        "(less memory, an approximation; paper Appendix C.2)")
    p.add_argument("--vision-branch", type=int, default=None, help="ParVL: run only vision branch 0..Pv-1 (default: all, fused)")
    p.add_argument("--language-branch", type=int, default=None, help="ParVL: run only language branch 0..Pl-1 (default: all, fused)")
    p.add_argument("--router", default=None, help="ParVL: a router folder (router.py train); runs one (vision, language) "
                                                  "branch pair per prompt, chosen by the router (default: none)")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn session; images enter the first turn")
    p.add_argument("--json", action="store_true", help="print one JSON line with the answer and metrics instead of text")
    p.add_argument("--batch", metavar="QUESTIONS.jsonl", default=None,
                   help='answer every row {"image": path or list of paths (optional, relative to the file), '
                        '"question": ...} of a JSONL file; answers as JSONL in input order')
    p.add_argument("--batch-size", type=int, default=8, help="--batch: questions per generate call, left-padded together (default 8)")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="--batch: answers file, appended to; rows it already answers are skipped (resume) "
                        "(default: stdout, no resume)")
    args = p.parse_args(argv)
    for flag, used in (("--vision-branch", args.vision_branch is not None),
                       ("--language-branch", args.language_branch is not None), ("--shared-kv", args.shared_kv)):
        if args.router and used:
            p.exit(2, f"error: --router picks the branches per prompt; it cannot be combined with {flag}\n")
    for name, ok in [("--max-new-tokens", args.max_new_tokens >= 1), ("--temperature", args.temperature >= 0),
                     ("--top-p", 0 < args.top_p <= 1), ("--top-k", args.top_k >= 0), ("--max-tiles", args.max_tiles >= 0)]:
        if not ok:
            p.error(f"{name} out of range: {getattr(args, name[2:].replace('-', '_'))}")
    if args.batch is not None:
        if args.inputs or args.chat or args.json:
            p.error("--batch reads images and questions from its file: no inputs, --chat or --json with it")
        if args.batch_size < 1:
            p.error(f"--batch-size out of range: {args.batch_size}")
        return args
    if args.out is not None:
        p.error("--out goes with --batch")
    if not args.chat:  # the last input is the question; an image file there means it was left out
        if not args.inputs:
            p.error("no question: give zero or more images, then the question (or --chat for a session)")
        last = args.inputs[-1]
        if (last.lower().endswith(IMAGE_SUFFIXES) and not any(c.isspace() for c in last)) or (
                len(last) < 4096 and Path(last).is_file()):  # "What is in cat.jpg" stays a question
            p.error(f"no question after {last!r}: the last argument is the question (or use --chat)")
    return args


class Interrupted(Exception):
    """Ctrl-C during an answer: what was generated until then (already on stdout)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def main(argv=None) -> int:
    """Exit codes: 0 answered, 1 bad input or a failure (one line on stderr), 2 bad flags
    (argparse), 130 interrupted (Ctrl-C; in --chat it stops the answer, at the prompt the session;
    in --batch the answers written so far stay, and a rerun with the same --out resumes)."""
    args = parse_args(argv)
    images, question = (args.inputs, None) if args.chat or args.batch else (args.inputs[:-1], args.inputs[-1])
    try:
        device = resolve_device(args.device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
            args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
        rows = read_questions(Path(args.batch)) if args.batch else []  # bad rows fail before any model is fetched
        done = answered_lines(Path(args.out), rows, Path(args.batch)) if args.batch and args.out else set()
        folder = resolve_model(args.model, args.revision)
        mcfg = config_from_json(read_json(folder / "config.json"), folder)  # tiles and tokens as the model sees them
        if any(r["paths"] for r in rows) and mcfg.vit is None:
            raise ValueError(f"{folder}: a language-only model takes no images ({args.batch} has some)")
        if images and mcfg.vit is None:
            raise ValueError(f"{folder}: a language-only model takes no images")
        pixel_list = [load_image(path, max_tiles=args.max_tiles or mcfg.max_dynamic_patch, use_thumbnail=mcfg.use_thumbnail,
                                 image_size=mcfg.vit.image_size) for path in images]  # bad images fail before the weights load
        num_tiles = [pv.shape[0] for pv in pixel_list]
        t0 = time.perf_counter()
        tok = Tokenizer.from_pretrained(folder)
        prompt = None
        if not args.chat:
            if len(num_tiles) > 1 and "<image>" not in question:
                question = build_multi_image_question(question, len(num_tiles))
            prompt = build_prompt(question, num_tiles, system=args.system, tokens_per_tile=mcfg.tokens_per_tile)
            # a prompt that cannot fit is refused before the weights are read
            context_check(len(tok.encode(prompt)), args.max_new_tokens, mcfg.llm.max_position_embeddings)
        model = ParVL.from_pretrained(folder, dtype=dtype, device=device)
        load_s = time.perf_counter() - t0
        log(f"loaded {folder} in {load_s:.2f} s ({dtype}, {device}, Pv:Pl = {model.cfg.par.pv}:{model.cfg.par.pl})")
        engine = engine_from_flags(model, args)
        cfg = GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p)
        pixel_values = torch.cat(pixel_list).to(dtype) if pixel_list else None
        if args.chat:
            return chat_session(engine, tok, pixel_values, num_tiles, cfg, args)
        if args.batch:
            return answer_file(engine, tok, rows, done, cfg, args)
        answer(engine, tok, prompt, pixel_values, cfg, args, load_s)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:  # `generate.py ... | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
    except (ImageError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Interrupted):  # Ctrl-C while loading, or during the one answer
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def answer(engine: Engine, tok: Tokenizer, prompt: str, pixel_values, cfg: GenerateConfig,
           args: argparse.Namespace, load_s: float = 0.0) -> str:
    """Generate one answer, streaming text to stdout (unless --json); metrics to stderr."""
    torch.manual_seed(args.seed)
    ids = tok.encode(prompt)
    streamed = Streamer(tok, enabled=not args.json)
    try:
        res = engine.generate([ids], pixel_values, cfg, stop_ids=tok.eos_ids, callback=streamed)
    except KeyboardInterrupt:  # Ctrl-C: end the answer where it is, cleanly, and say so
        text = tok.decode(streamed.ids).strip()
        streamed.finish()
        if args.json:
            print(json.dumps({"answer": text, "interrupted": True, "new_tokens": len(streamed.ids)}, ensure_ascii=False))
        raise Interrupted(text) from None
    text = tok.decode(res.tokens[0]).strip()
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
        if not history and num_tiles and "<image>" not in question:  # as the official chat() stores it
            question = build_multi_image_question(question, len(num_tiles)) if len(num_tiles) > 1 else "<image>\n" + question
        try:
            # the whole history is re-sent each turn; its image tokens stay in the first turn
            prompt = build_prompt(question, num_tiles, history=history, system=args.system,
                                  tokens_per_tile=engine.model.cfg.tokens_per_tile)
            history.append((question, answer(engine, tok, prompt, pixel_values, cfg, args)))
        except ValueError as e:  # this turn only; the session and its history go on
            print(f"error: {' '.join(str(e).split())} (turn dropped; the conversation goes on)", file=sys.stderr)
        except Interrupted as e:
            print("interrupted: answer stopped (the conversation goes on)", file=sys.stderr)
            history.append((question, e.text))


# -- --batch: a JSONL file of questions -----------------------------------------------------------


def read_questions(path: Path) -> list[dict]:
    """The rows of a --batch file: {"line", "image" (as written), "question", "paths"}; every image path
    (relative to the file) must exist. A bad row is one line naming it, before any weights load."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--batch {path}: cannot read ({e})") from None
    rows = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip():
            raise ValueError(f'{path} line {n}: needs a "question" string')
        image = row.get("image")
        names = [] if image is None else [image] if isinstance(image, str) else image
        if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
            raise ValueError(f'{path} line {n}: "image" must be a path or a list of paths')
        paths = [path.parent / x for x in names]  # an absolute x stays itself
        for f in paths:
            if not f.is_file():
                raise ImageError(f"{path} line {n}: no image file {f}")
        rows.append({"line": n, "image": image, "question": row["question"], "paths": paths})
    if not rows:
        raise ValueError(f"--batch {path}: no questions")
    return rows


def answered_lines(out: Path, rows: list[dict], questions: Path) -> set[int]:
    """Question lines the answers file `out` already holds. A last line without its newline (the run
    was killed while writing it) is cut off; an answer to another file's question is refused."""
    if not out.is_file():
        return set()
    by_line, done, keep = {r["line"]: r["question"] for r in rows}, set(), 0
    data = out.read_bytes()
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        try:
            rec = json.loads(raw)
            line = rec["line"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{out}: not an answers file of generate.py --batch; pass another --out") from None
        if by_line.get(line) != rec.get("question"):
            raise ValueError(f"{out}: answers another file (line {line} is not that question of {questions}); "
                             f"pass another --out")
        done.add(line)
        keep += len(raw)
    if keep < len(data):
        with open(out, "r+b") as f:
            f.truncate(keep)
    return done


def answer_file(engine: Engine, tok: Tokenizer, rows: list[dict], done: set[int], cfg: GenerateConfig, args) -> int:
    """--batch: answer the rows not in `done` --batch-size at a time, in input order, each answer written
    and flushed as its batch ends ({"line", "image", "question", "answer"}), progress on stderr."""
    questions, out = Path(args.batch), Path(args.out) if args.out else None
    todo = [r for r in rows if r["line"] not in done]
    if done:
        log(f"{out}: {len(done)} of {len(rows)} questions already answered; {len(todo)} to go")
    mcfg, limit = engine.model.cfg, engine.model.cfg.llm.max_position_embeddings
    dtype = engine.model.language_model.lm_head.weight.dtype
    torch.manual_seed(args.seed)
    sink = open(out, "a", encoding="utf-8") if out else sys.stdout
    t0, tty = time.perf_counter(), sys.stderr.isatty()
    try:
        for start in range(0, len(todo), args.batch_size):
            batch, prompts, pixels = todo[start:start + args.batch_size], [], []
            for r in batch:
                tiles = [load_image(f, max_tiles=args.max_tiles or mcfg.max_dynamic_patch, use_thumbnail=mcfg.use_thumbnail,
                                    image_size=mcfg.vit.image_size) for f in r["paths"]]
                question = r["question"]
                if len(tiles) > 1 and IMAGE_PLACEHOLDER not in question:
                    question = build_multi_image_question(question, len(tiles))
                try:  # the command's own prompt for one question, so each answer is the one-by-one answer
                    prompts.append(tok.encode(build_prompt(question, [t.shape[0] for t in tiles], system=args.system,
                                                           tokens_per_tile=mcfg.tokens_per_tile)))
                    context_check(len(prompts[-1]), cfg.max_new_tokens, limit)
                except ValueError as e:
                    raise ValueError(f"{questions} line {r['line']}: {e}") from None
                pixels += tiles
            res = engine.generate(prompts, torch.cat(pixels).to(dtype) if pixels else None, cfg, tok.eos_ids)
            for r, ids in zip(batch, res.tokens):
                row = {"line": r["line"], **({"image": r["image"]} if r["image"] is not None else {}),
                       "question": r["question"], "answer": tok.decode(ids).strip()}
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            sink.flush()
            n, dt = start + len(batch), time.perf_counter() - t0
            eta = dt / n * (len(todo) - n)
            print(f"{chr(13) if tty else ''}answered {n}/{len(todo)}, {n / dt:.2f} samples/s, elapsed {hms(dt)}, "
                  f"eta {hms(eta)}", end="" if tty and n < len(todo) else "\n", file=sys.stderr, flush=True)
    finally:
        if out:
            sink.close()
    if out and done and todo and min(r["line"] for r in todo) < max(done):  # the old file was no prefix
        ordered = sorted(out.read_text(encoding="utf-8").splitlines(keepends=True), key=lambda x: json.loads(x)["line"])
        out.write_text("".join(ordered), encoding="utf-8")
    return 0


def hms(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


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
        text = self.tok.decode(self.ids).strip()
        if self.enabled and not text.endswith("\ufffd") and len(text) > len(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text
            sys.stdout.flush()

    def finish(self) -> None:
        if self.enabled:  # whatever was held back (a dangling partial character) goes out now
            text = self.tok.decode(self.ids).strip()
            self.write(text[len(self.shown):] + "\n")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
