"""The generation engine, gpt-fast style: prefill, one compiled decode step, on-device sampling,
static KV caches, batched left padding and the branch caches of ParVL.

    engine = Engine(model, compile=True)          # model: a ParVL (loading/pretrained.py)
    out = engine.generate([ids], pixel_values, GenerateConfig(max_new_tokens=256), tokenizer.eos_ids)

The prompt is prefilled once into a static KV cache (allocated once, written in place), then
`decode_step` (`decode_one_token`, sampling and the stop check) runs one step at a time, compiled
with torch.compile into one graph: CUDA graphs on GPU (mode="reduce-overhead"), and on CPU inductor
with its linears of few rows as inductor's own reductions (cpu_decode.py). Sampling runs on the
device (no multinomial, no .item()), so the decode loop needs no host synchronisation except where
the caller streams tokens or every `check_every` steps to see whether every sequence has stopped.
Several prompts of different lengths and tile counts are generated as one left-padded batch; each
prompt's positions start at 0 and its padding is masked out of every attention.

InternVL's chat API is in chat.py, the command in generate.py.

Shape legend: aggregate.py's (here T is the padded prompt, S the cache slots).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from aggregate import Choice, Rows
from inference.cpu_decode import cpu_backend
from llm import causal_mask, prompt_positions
from parvl import ParVL


@dataclass
class GenerateConfig:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    ignore_eos: bool = False  # force exactly max_new_tokens (the profiling protocol)
    check_every: int = 16  # decode steps between host checks for "all sequences stopped"
    bucket: int = (
        128  # decode attends over the written cache slots rounded up to this many (0 = all slots)
    )


@dataclass
class Result:
    tokens: list[list[int]]  # generated ids per prompt, stop token excluded
    prefill_s: float = 0.0  # time to first token (ViT + connector + LLM prefill + first sample)
    decode_s: float = 0.0
    decode_steps: int = 0
    # routed: the (vision, language) branch pair of each prompt, vision None without an image
    pairs: list[tuple[int | None, int]] | None = None


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
def prefill(
    model: ParVL,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None,
    valid: torch.Tensor,
    padded: bool,
    vision_branch: Choice,
    rows: Rows,
    features: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the prompt ([B,T], left-padded where valid is False) into token slots 0..T-1 of the cache
    (the branch prefixes sit in front of them); return the fp32 logits of the last position [B,V].
    features: connector output [N,256,C] already computed (by a router), so the ViT does not rerun."""
    B, T = input_ids.shape
    # [B,T,C] with image features in place
    x, _ = model.embed(input_ids, pixel_values, vision_branch, features)
    positions, mask = prompt_positions(valid, padded)  # mask None: fused causal kernels
    slots = torch.arange(T, device=x.device)
    h, _ = model.hidden_from_embeds(x, positions, mask, slots, rows)  # [B,T,C] rows unfolded
    return model.language_model.lm_head(h[:, -1]).float()


def decode_one_token(
    model: ParVL,
    token: torch.Tensor,
    input_pos: torch.Tensor,
    positions: torch.Tensor,
    key_valid: torch.Tensor,
    rows: Rows,
) -> torch.Tensor:
    """One step: token [B,1] at token slot input_pos [1], rotary positions [B,1]; key_valid [B,S]
    marks the token slots that are not padding. Returns fp32 logits [B,V]. Static shapes only."""
    x = model.language_model.model.embed_tokens(token)  # [B,1,C]
    mask = causal_mask(key_valid, input_pos)  # [B,1,1,S]
    h, _ = model.hidden_from_embeds(x, positions, mask, input_pos, rows)  # [B,1,C] rows unfolded
    return model.language_model.lm_head(h[:, -1]).float()


def decode_step(
    model: ParVL,
    token: torch.Tensor,
    input_pos: torch.Tensor,
    positions: torch.Tensor,
    key_valid: torch.Tensor,
    rows: Rows,
    done: torch.Tensor,
    stops: torch.Tensor,
    pad_id: int,
    temperature: float,
    top_k: int,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One whole generation step on the device, the graph that is compiled: decode_one_token for the
    token [B] just chosen, sampling, and the stop check. Returns the next token [B], done [B] after it
    (a stop id seen; stops is empty with ignore_eos) and the token to record [B] (pad_id once stopped)."""
    logits = decode_one_token(model, token.view(-1, 1), input_pos, positions, key_valid, rows)
    nxt = sample(logits, temperature, top_k, top_p)
    return nxt, done | torch.isin(nxt, stops), torch.where(done, pad_id, nxt)


# -- compiling the decode step ------------------------------------------------------------------
# On CUDA the step runs as CUDA graphs (mode="reduce-overhead"); on CPU as inductor with its linears
# of few rows as inductor's own reductions (cpu_decode.py).


def compile_step(device: torch.device):
    """decode_step compiled as one graph (fullgraph): CUDA graphs on CUDA, inductor with gemv on CPU."""
    if device.type == "cuda":
        return torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    return torch.compile(
        decode_step, backend=cpu_backend if device.type == "cpu" else "inductor", fullgraph=True
    )


class Engine:
    """Holds the model, its static cache and the (compiled) decode step across generate calls.

    shared_kv: keep one mean-reduced token K/V per sample instead of one per language branch
    (ParVL Appendix C.2; an approximation that saves memory; dense language branches only).
    vision_branch / language_branch (aggregate.Choice): the default branch choice of every call,
    None = all branches fused, an int = one pair for every sample; `generate` can override it with
    a branch per sample.
    router (gates.Router): pick (vision, language) per prompt by argmax and run only that pair, in
    calls that give no branches; it cannot be combined with default branches or shared KV.
    compile: torch.compile the decode step; None compiles on CUDA only (the commands' default)."""

    def __init__(
        self,
        model: ParVL,
        compile: bool | None = False,
        shared_kv: bool = False,
        vision_branch: Choice = None,
        language_branch: Choice = None,
        router=None,
    ):
        self.model = model
        # the LM head's may be quantized (quant.py)
        table = model.language_model.model.embed_tokens.weight
        self.device, self.dtype = table.device, table.dtype
        compile = self.device.type == "cuda" if compile is None else compile
        self.shared_kv, self.vision_branch, self.language_branch = (
            shared_kv,
            vision_branch,
            language_branch,
        )
        if router is not None:
            if shared_kv or vision_branch is not None or language_branch is not None:
                raise ValueError(
                    "a router picks the branches per sample: no shared_kv, vision_branch or "
                    "language_branch with it"
                )
            router.check(model)
        self.router = router
        self.cache_shape: tuple[int, bool, int] | None = None  # (rows, shared, slots)
        self.step = decode_step
        self.compiled = (
            compile  # resolved: profiling.py reports a compile time only when something compiled
        )
        # CUDA graphs reuse their output buffers
        self.graphs = compile and self.device.type == "cuda"
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
    def generate(
        self,
        prompts: list[list[int]],
        pixel_values: torch.Tensor | None,
        cfg: GenerateConfig,
        stop_ids: list[int],
        pad_id: int = 0,
        callback=None,
        vision_branch: Choice = None,
        language_branch: Choice = None,
    ) -> Result:
        """Generate for a batch of prompts (token id lists); pixel_values holds every prompt's tiles
        in order. callback(step, tokens [B] on host) streams tokens as they come (syncs each step).
        vision_branch / language_branch: a branch (or one per prompt) for this call; None keeps the
        engine's default. The steps: left padding, the router's choice (if any), the cache, prefill and
        the first token (time to first token), then decode_n_tokens."""
        model, dev = self.model, self.device
        ids, valid = left_pad(prompts, pad_id)  # [B,T], every prompt ends at slot T-1
        B, T = ids.shape
        context_check(T, cfg.max_new_tokens, model.cfg.llm.max_position_embeddings)
        ids, valid = ids.to(dev), valid.to(dev)
        features, pairs, route_s = None, None, 0.0
        if self.router is not None and vision_branch is None and language_branch is None:
            vision_branch, language_branch, features, pairs, route_s = self.route(
                ids, valid, pixel_values
            )
        vision_branch = self.vision_branch if vision_branch is None else vision_branch
        language_branch = self.language_branch if language_branch is None else language_branch
        rows = model.language_rows(language_branch, B, dev, self.shared_kv)
        S = self.setup(rows, T + cfg.max_new_tokens)
        # slots past T are valid once written
        key_valid = torch.ones(B, S, dtype=torch.bool, device=dev)
        key_valid[:, :T] = valid
        stops = torch.tensor([] if cfg.ignore_eos else stop_ids, dtype=torch.long, device=dev)

        sync(dev)
        t0 = time.perf_counter()
        if pixel_values is not None:
            pixel_values = pixel_values.to(dev)
        padded = any(len(p) < T for p in prompts)
        logits = prefill(model, ids, pixel_values, valid, padded, vision_branch, rows, features)
        token = sample(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # [B]
        sync(dev)
        prefill_s = time.perf_counter() - t0 + route_s

        t0 = time.perf_counter()
        recorded = self.decode_n_tokens(
            token,
            T,
            valid.long().sum(-1, keepdim=True),
            key_valid,
            rows,
            stops,
            pad_id,
            cfg,
            callback,
        )
        sync(dev)
        result = Result(
            tokens=[],
            prefill_s=prefill_s,
            decode_s=time.perf_counter() - t0,
            decode_steps=len(recorded),
            pairs=pairs,
        )
        for row in torch.stack(recorded, 1).tolist():
            cut = (
                next((j for j, t in enumerate(row) if t in stop_ids), len(row))
                if not cfg.ignore_eos
                else len(row)
            )
            result.tokens.append(row[:cut])
        return result

    def route(self, ids: torch.Tensor, valid: torch.Tensor, pixel_values: torch.Tensor | None):
        """The router's pair per prompt: the vision gate, the chosen ViT branch per sample, the language gate.
        Returns (vision branch [B], language branch [B], the chosen branches' connector features, kept for the
        prefill, the (vision, language) pairs, vision None without an image, and the seconds it took, which
        count as part of the time to first token)."""
        model, dev = self.model, self.device
        sync(dev)
        t0 = time.perf_counter()
        if pixel_values is not None:
            pixel_values = pixel_values.to(dev)
        vision_branch, language_branch, features = self.router.route(
            model, ids, valid, pixel_values
        )
        has_image = (ids == model.cfg.image_token_id).any(1).tolist()
        pairs = [
            (v if img else None, lang)
            for v, lang, img in zip(vision_branch, language_branch, has_image)
        ]
        sync(dev)
        return vision_branch, language_branch, features, pairs, time.perf_counter() - t0

    def decode_n_tokens(
        self,
        token: torch.Tensor,
        T: int,
        positions: torch.Tensor,
        key_valid: torch.Tensor,
        rows: Rows,
        stops: torch.Tensor,
        pad_id: int,
        cfg: GenerateConfig,
        callback=None,
    ) -> list[torch.Tensor]:
        """The decode loop after the first token [B] (gpt-fast's decode_n_tokens): the compiled decode_step fed
        its own output, one token slot at a time from T, until max_new_tokens or, checked every check_every
        steps, every sequence has stopped. positions [B,1]: the rotary position of the token fed. Returns the
        recorded token of every step [B] (pad_id once a sequence stopped), kept on the device."""
        model, S = self.model, key_valid.shape[1]
        input_pos = torch.tensor([T], device=self.device)  # cache slot of the token being fed
        done = torch.isin(token, stops)
        recorded = [token]
        if callback is not None:
            callback(0, token.tolist())
        for i in range(1, cfg.max_new_tokens):
            if not cfg.ignore_eos and i % cfg.check_every == 0 and bool(done.all()):
                break
            # attend over the slots written so far (T + i, the fed token included) rounded up to a
            # bucket, not the whole cache: fewer keys, and one graph per bucket
            n = min(S, -(-(T + i) // cfg.bucket) * cfg.bucket) if cfg.bucket else S
            token, done, rec = self.step(
                model,
                token,
                input_pos,
                positions,
                key_valid[:, :n],
                rows,
                done,
                stops,
                pad_id,
                cfg.temperature,
                cfg.top_k,
                cfg.top_p,
            )
            if self.graphs:  # the next replay overwrites its outputs
                token, done, rec = token.clone(), done.clone(), rec.clone()
            recorded.append(rec)
            input_pos += 1
            positions += 1
            if callback is not None:
                callback(i, rec.tolist())
        return recorded


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one left-padded batch: ids [B,T] and valid [B,T] (False on padding), every
    prompt ending at slot T-1."""
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.tensor(p)
        valid[b, T - len(p) :] = True
    return ids, valid


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA) before reading the clock; nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def context_check(prompt_len: int, max_new_tokens: int, limit: int) -> None:
    """Refuse a prompt whose tokens plus the token budget exceed the model context (positions)."""
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens (image tokens included) + {max_new_tokens} new tokens "
            f"exceeds the model context of {limit}"
        )
