"""Generation with ParVL / InternVL3.5: a gpt-fast style engine and the `generate.py` command.

    python generate.py image.png "Describe the image." --model path/to/InternVL3_5-1B
    python generate.py a.png b.png "Image-1: <image>\\nImage-2: <image>\\nWhat differs?" --model DIR
    python generate.py "A text-only question" --model DIR
    python generate.py image.png --chat --model DIR   # interactive multi-turn session

The engine: the prompt is prefilled once into a static KV cache (allocated once, written in
place), then `decode_one_token` runs one step at a time, compiled with torch.compile
(mode="reduce-overhead", so CUDA graphs on GPU). Sampling runs on the device (no multinomial,
no .item()), so the decode loop needs no host synchronisation except where the caller streams
tokens or every `check_every` steps to see whether every sequence has stopped. Several prompts
of different lengths and tile counts are generated as one left-padded batch; each prompt's
positions start at 0 and its padding is masked out of every attention.

Shape legend: B batch, T prompt tokens (padded), S cache slots, V vocabulary.
"""
from __future__ import annotations

import argparse
import json
import os
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
from processor import ImageError, Tokenizer, build_multi_image_question, build_prompt, load_image


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
            self.step = torch.compile(decode_step, mode="reduce-overhead" if self.graphs else None, fullgraph=True)

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


# -- the command ------------------------------------------------------------------------------


def resolve_model(name: str | None) -> Path:
    """A local folder, or a hub name fetched with huggingface_hub when it is installed."""
    if not name:
        raise ValueError("no model: pass --model DIR or set $PARVL_MODEL")
    if Path(name).is_dir():
        check_not_run_folder(Path(name))  # runs/22 instead of runs/22/export: say so before anything fails
        return Path(name)
    if Path(name).exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointError(f"{name}: not a checkpoint folder")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(
            f"{name}: not a local folder; download it first (pip install huggingface_hub; "
            f"huggingface-cli download {name} --local-dir DIR) and pass --model DIR"
        ) from None
    return Path(snapshot_download(name))


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
                                              "or none for a text-only session)")
    p.add_argument("--model", default=os.environ.get("PARVL_MODEL"), help="checkpoint folder (default: $PARVL_MODEL)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="token budget for the answer (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens, 0 = off (default 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="weights and activations (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device (default cuda if available, else cpu)")
    p.add_argument("--max-tiles", type=int, default=0,
                   help="image tiles per image, thumbnail excluded (default 0: the checkpoint's max_dynamic_patch, 12 for InternVL3.5)")
    p.add_argument("--system", default=None, help="system message (default: InternVL's own)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the decode step (default: on for CUDA, off for CPU)")
    p.add_argument("--shared-kv", action="store_true",
                   help="ParVL: one mean-reduced token KV cache per sample instead of one per language branch "
                        "(less memory, an approximation; paper Appendix C.2)")
    p.add_argument("--vision-branch", type=int, default=None, help="ParVL: run only this vision branch (default: all, fused)")
    p.add_argument("--language-branch", type=int, default=None, help="ParVL: run only this language branch (default: all, fused)")
    p.add_argument("--router", default=None, help="ParVL: a router folder (router.py train); runs one (vision, language) "
                                                  "branch pair per prompt, chosen by the router (default: none)")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn session; images enter the first turn")
    p.add_argument("--json", action="store_true", help="print one JSON line with the answer and metrics instead of text")
    args = p.parse_args(argv)
    for flag, used in (("--vision-branch", args.vision_branch is not None),
                       ("--language-branch", args.language_branch is not None), ("--shared-kv", args.shared_kv)):
        if args.router and used:
            p.exit(2, f"error: --router picks the branches per prompt; it cannot be combined with {flag}\n")
    for name, ok in [("--max-new-tokens", args.max_new_tokens >= 1), ("--temperature", args.temperature >= 0),
                     ("--top-p", 0 < args.top_p <= 1), ("--top-k", args.top_k >= 0), ("--max-tiles", args.max_tiles >= 0)]:
        if not ok:
            p.error(f"{name} out of range: {getattr(args, name[2:].replace('-', '_'))}")
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
    (argparse), 130 interrupted (Ctrl-C; in --chat it stops the answer, at the prompt the session)."""
    args = parse_args(argv)
    images, question = (args.inputs, None) if args.chat else (args.inputs[:-1], args.inputs[-1])
    try:
        device = resolve_device(args.device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
            args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
        folder = resolve_model(args.model)
        mcfg = config_from_json(read_json(folder / "config.json"), folder)  # tiles and tokens as the model sees them
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
            return chat(engine, tok, pixel_values, num_tiles, cfg, args)
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


def chat(engine, tok, pixel_values, num_tiles, cfg, args) -> int:
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
