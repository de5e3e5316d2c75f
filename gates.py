"""The factorized sparse router of ParVL (paper Appendix E; Table 3): two small gates pick one
(vision, language) branch pair per sample, and only that pair runs, so a checkpoint trained with
Pv:Pl branches is executed at 1:1 cost. This module is the router itself (gates, their inputs, Eq.
E1 / E2, loading); router.py is the command that labels, trains and evaluates it.

    router = load_router("DIR", model)                  # a folder written by `router.py train`
    engine = Engine(model, router=router)               # one routed pair per prompt (inference/engine.py)

Sequential routing (E): the vision gate reads a pooled thumbnail feature and the frozen text
embeddings and picks v; only branch v of the ViT runs; the language gate reads its pooled connector
output and the text embeddings and picks l; generation runs (v, l) only (engine.Engine(router=)).
Offline path teacher: `router.py label` stores the answer NLL c[v,l] of every pair for every sample. Training
fits the gates to the soft teacher of Eq. E1 with the loss of Eq. E2 (`path_teacher`, `router_loss`).

Choices where Appendix E is silent (all cheap):
- Vision-gate image feature: the mean over patches of the ViT *patch embedding* (conv + position
  embedding) of each image's thumbnail, the last tile of the image (its only tile when it has one),
  averaged over the sample's images. It comes before any ViT block, and the branches differ only in
  their block prefixes, so no branch runs before the choice; it costs one conv over one tile and,
  unlike pixel statistics, is the representation the ViT itself starts from.
- Text feature: the mean frozen LLM token embedding of the last user turn (the tokens between the
  last two <|im_start|> of the prompt, <IMG_CONTEXT> excluded; the whole prompt if it has fewer).
  The system message is left out: it is the same for every sample and would dilute the question.
  In training data the prompt is everything before the first supervised token.
- Language-gate image feature: the mean connector output of the chosen vision branch over all image
  tokens of the sample.
- Each gate: both inputs through a parameter-free LayerNorm (image and text features differ in scale),
  concatenated, Linear -> GELU -> Linear to P logits; hidden 256 as in the paper.
- Text-only samples: no ViT runs. The vision gate is skipped (its loss term is masked; the sample
  executes vision index 0, which nothing reads, and reports None); the language gate reads a zero
  image feature (LayerNorm maps it to zero).
- The teacher's labels (the answer NLL of every pair, the stored gate inputs) and pair accuracy:
  see router.py, which computes them.

Shape legend: aggregate.py's (B samples, Cv ViT width, C LLM width).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from parvl import ParVL, is_branch_tensor


class RouterError(ValueError):
    """A router, labels file or data set that does not fit; the message is one line naming it."""


@dataclass
class RouterConfig:
    pv: int = 4  # vision branches of the checkpoint it routes
    pl: int = 4  # language branches
    vision_width: int = 1024  # Cv: ViT width (the patch embedding)
    text_width: int = 1024  # C: LLM width (token embeddings and connector output)
    hidden: int = 256  # gate hidden width (Appendix E)
    im_start_id: int = 151644  # <|im_start|>, bounds the question (Qwen tokenizer)
    fingerprint: str = ""  # of the checkpoint it was trained for (see `fingerprint`)


class Gate(nn.Module):
    """Two features [B,X], [B,Y] -> branch logits [B,P]: parameter-free LayerNorm on each, concat, MLP."""

    def __init__(self, widths: tuple[int, int], hidden: int, branches: int):
        super().__init__()
        self.fc1 = nn.Linear(sum(widths), hidden)
        self.fc2 = nn.Linear(hidden, branches)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.to(self.fc1.weight.dtype), b.to(self.fc1.weight.dtype)
        # [B,X+Y]
        x = torch.cat([F.layer_norm(a, a.shape[-1:]), F.layer_norm(b, b.shape[-1:])], dim=-1)
        return self.fc2(F.gelu(self.fc1(x)))


class Router(nn.Module):
    def __init__(self, cfg: RouterConfig):
        super().__init__()
        self.cfg = cfg
        self.vision_gate = Gate((cfg.vision_width, cfg.text_width), cfg.hidden, cfg.pv)
        self.language_gate = Gate((cfg.text_width, cfg.text_width), cfg.hidden, cfg.pl)

    def forward(
        self,
        image: torch.Tensor,  # [B,Cv] pooled thumbnail patch embedding (zero for text-only)
        text: torch.Tensor,  # [B,C] pooled question embedding
        connector: torch.Tensor,  # [B,Pv,C] pooled connector output of every vision branch (training)
        has_image: torch.Tensor,  # [B] bool
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor
    ]:  # vision logits [B,Pv], language logits [B,Pl], v [B]
        """The training path: the language gate reads the branch the vision gate currently picks."""
        logits_v = self.vision_gate(image, text)
        v = torch.where(has_image, logits_v.argmax(-1), 0)  # text-only: no vision choice
        chosen = connector[torch.arange(len(v), device=v.device), v] * has_image[:, None]  # [B,C]
        return logits_v, self.language_gate(chosen, text), v

    @torch.no_grad()
    def route(
        self,
        model: ParVL,
        input_ids: torch.Tensor,
        valid: torch.Tensor,
        pixel_values: torch.Tensor | None,
    ) -> tuple[list[int], list[int], torch.Tensor | None]:
        """Inference: (vision branch [B], language branch [B], the chosen branches' connector output
        [N,256,C] or None) for a batch of prompts ([B,T], valid False on padding). The vision gate
        runs before any ViT block; then each sample's tiles run its own branch once."""
        image_id, per_tile = model.cfg.image_token_id, model.cfg.tokens_per_tile
        text = text_feature(
            model, input_ids, question_span(input_ids, valid, self.cfg.im_start_id, image_id)
        )
        tiles = image_tiles(input_ids, image_id, per_tile)
        num_tiles = torch.tensor([sum(t) for t in tiles], device=input_ids.device)  # [B]
        v = torch.zeros(len(tiles), dtype=torch.long, device=input_ids.device)
        connector, features = torch.zeros_like(text), None
        if pixel_values is not None and pixel_values.shape[0]:
            v = torch.where(
                num_tiles > 0,
                self.vision_gate(thumbnail_feature(model, pixel_values, tiles), text).argmax(-1),
                0,
            )
            features = model.extract_features(pixel_values, v, num_tiles=num_tiles)  # [N,256,C]
            connector = pool_tiles(features, num_tiles)
        return v.tolist(), self.language_gate(connector, text).argmax(-1).tolist(), features

    def check(self, model: ParVL, where: str = "router") -> None:
        """Refuse a model this router was not trained for."""
        c, par = self.cfg, model.cfg.par
        if model.cfg.vit is None:
            raise RouterError(f"{where}: routes multimodal checkpoints; this one is language-only")
        if (c.pv, c.pl) != (par.pv, par.pl):
            raise RouterError(
                f"{where}: trained for Pv:Pl = {c.pv}:{c.pl}, the model has {par.pv}:{par.pl}"
            )
        widths = (model.cfg.vit.hidden_size, model.cfg.llm.hidden_size)
        if (c.vision_width, c.text_width) != widths:
            raise RouterError(
                f"{where}: trained for ViT / LLM width {c.vision_width} / {c.text_width}, "
                f"the model has {widths[0]} / {widths[1]}"
            )
        if c.fingerprint and c.fingerprint != fingerprint(model):
            raise RouterError(
                f"{where}: trained for checkpoint {c.fingerprint}, the model is {fingerprint(model)}"
            )


# -- gate inputs ------------------------------------------------------------------------------


def question_span(
    input_ids: torch.Tensor, prompt: torch.Tensor, im_start_id: int, image_id: int
) -> torch.Tensor:
    """[B,T] bool: the last user turn of each prompt (prompt [B,T] marks its tokens), see module docstring."""
    starts = (input_ids == im_start_id) & prompt  # [B,T]
    after = starts.flip(-1).cumsum(-1).flip(-1)  # [B,T] <|im_start|> at or after each position
    span = (after == 1) & ~starts
    # fewer than two turns: all of it
    span = torch.where(starts.sum(-1, keepdim=True) >= 2, span, True)
    return span & prompt & (input_ids != image_id)


def text_feature(model: ParVL, input_ids: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Mean frozen token embedding over span [B,T] -> [B,C] fp32."""
    x = model.language_model.model.embed_tokens(input_ids).float()  # [B,T,C]
    return (x * span[..., None]).sum(1) / span.sum(1, keepdim=True).clamp(min=1)


def image_tiles(input_ids: torch.Tensor, image_id: int, per_tile: int) -> list[list[int]]:
    """Tiles of each image of each sample, read off the runs of <IMG_CONTEXT> tokens ([B] lists)."""
    out = []
    for row in (input_ids == image_id).long():
        # +1 run start, -1 run end
        edges = torch.diff(row, prepend=row.new_zeros(1), append=row.new_zeros(1))
        starts, ends = (edges == 1).nonzero()[:, 0], (edges == -1).nonzero()[:, 0]
        out.append([(int(e - s)) // per_tile for s, e in zip(starts, ends)])
    return out


def thumbnail_feature(
    model: ParVL, pixel_values: torch.Tensor, tiles: list[list[int]]
) -> torch.Tensor:
    """Mean patch embedding of each image's last tile (its thumbnail), averaged per sample -> [B,Cv] fp32."""
    # [M] index of every image's last tile
    last = torch.tensor([n for t in tiles for n in t]).cumsum(0) - 1
    sample = torch.tensor([b for b, t in enumerate(tiles) for _ in t])  # [M]
    # [M,Cv]
    emb = (
        model.vision_model.embeddings(pixel_values[last.to(pixel_values.device)])[:, 1:]
        .float()
        .mean(1)
    )
    out = emb.new_zeros(len(tiles), emb.shape[-1]).index_add_(0, sample.to(emb.device), emb)
    return out / torch.tensor([max(len(t), 1) for t in tiles], device=emb.device)[:, None]


def pool_tiles(features: torch.Tensor, num_tiles: torch.Tensor) -> torch.Tensor:
    """Connector output [N,256,C] -> mean per sample [B,C] fp32 (num_tiles [B]; zero without tiles)."""
    per_tile = features.float().mean(1)  # [N,C]; every tile has the same token count
    sample = torch.repeat_interleave(
        torch.arange(len(num_tiles), device=features.device), num_tiles.to(features.device)
    )
    out = per_tile.new_zeros(len(num_tiles), per_tile.shape[-1]).index_add_(0, sample, per_tile)
    return out / num_tiles.to(out.device).clamp(min=1)[:, None]


# -- Eq. E1, E2 -------------------------------------------------------------------------------


def path_teacher(nll: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. E1: q(v,l|x) = softmax over all Pv*Pl pairs of -(c[v,l] - min c) / tau, for nll c [B,Pv,Pl]."""
    c = nll.float().flatten(1)  # [B,Pv*Pl]
    return (-(c - c.min(-1, keepdim=True).values) / tau).softmax(-1).view_as(nll)


def router_loss(
    logits_v: torch.Tensor,
    logits_l: torch.Tensor,
    nll: torch.Tensor,
    v: torch.Tensor,
    has_image: torch.Tensor,
    tau: float,
) -> torch.Tensor:
    """Eq. E2 per sample [B]: 1/2 CE(q_v, p_v) + 1/2 CE(q_l, p_l), with q_v(v) = sum_l q(v,l) the vision
    target and q_l(l) ∝ exp(-c[v_hat,l] / tau) the language target given the gate's current choice v
    [B]. Text-only samples (has_image False) carry no vision term."""
    q_v = path_teacher(nll, tau).sum(-1)  # [B,Pv]
    c = nll.float()[torch.arange(len(v), device=v.device), v]  # [B,Pl]
    q_l = (-(c - c.min(-1, keepdim=True).values) / tau).softmax(-1)
    ce_v = -(q_v * logits_v.float().log_softmax(-1)).sum(-1)
    ce_l = -(q_l * logits_l.float().log_softmax(-1)).sum(-1)
    return 0.5 * ce_v * has_image + 0.5 * ce_l


# -- loading and saving ----------------------------------------------------------------------


def fingerprint(model: ParVL) -> str:
    """A short id of a checkpoint: every tensor's name and shape, and the values of the branch tensors
    and every 1-D tensor (norms, biases) rounded to bf16, so fp32 and bf16 loads agree, and --quant's too."""
    h = hashlib.sha256()
    # a weight-only quantized linear (inference/quant.py, --quant) counts as the nn.Linear it replaced: its
    # weight's name and [out, in] shape, its bias; not its packed layout or scales: the checkpoint is the same
    quantized = {f"{n}.": m for n, m in model.named_modules() if getattr(m, "QUANTIZED", False)}
    for name, t in sorted(model.state_dict().items()):
        owner = quantized.get(name[: name.rfind(".") + 1])
        if owner is not None and not name.endswith((".weight", ".bias")):
            continue
        shape = (
            (owner.out_features, owner.in_features)
            if owner is not None and name.endswith(".weight")
            else t.shape
        )
        h.update(f"{name}{tuple(shape)};".encode())
        if is_branch_tensor(name) or t.ndim <= 1:
            h.update(
                t.detach().to("cpu", torch.bfloat16).reshape(-1).view(torch.int16).numpy().tobytes()
            )
    return h.hexdigest()[:16]
