"""ParVL: InternVL3.5 assembled from vit.py and llm.py (paper, "Method"). The architecture only: its
configuration and presets are config.py's, reading and writing a checkpoint folder is
loading/pretrained.py's, generation is inference/engine.py's.

The model is InternViT -> drop CLS -> pixel shuffle (v2, ratio 0.5) -> mlp1 connector
(LayerNorm -> Linear -> GELU -> Linear) -> features written into the <IMG_CONTEXT> positions of
the prompt -> Qwen3 decoder -> lm_head (Eq. 3-5 in `ParVL.vision`, the branches fused by Eq. 2 of
aggregate.py). With Pv = Pl = 1 this is exactly InternVL3.5: the same state-dict keys (the original
InternVLChatModel layout: `vision_model.*`, `mlp1.*`, `language_model.*`) and the same outputs as the
official implementation.

Usage:
    from loading.pretrained import load_pretrained
    from data.processor import load_image
    model = load_pretrained("path/to/InternVL3_5-1B", dtype=torch.bfloat16, device="cuda")
    pixel_values = load_image("image.png", max_tiles=12)  # [N,3,448,448] fp32
    logits = model(input_ids, pixel_values)  # [B,T,V]

InternVL's `model.chat(tokenizer, pixel_values, question, generation_config)` is one import away, with
the model as its first argument: `from inference.chat import chat; chat(model, tokenizer, ...)`
(and `batch_chat`): the model stands below its engine and imports none of it.

Shape legend: aggregate.py's (Cv the ViT width, C the LLM's).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from aggregate import Aggregator, Choice, Rows, per_branch, to_items
from config import ParVLConfig
from llm import LLM, prompt_positions
from packing import segment_positions
from vit import ViT


def pixel_shuffle(x: torch.Tensor, ratio: float = 0.5, version: str = "v2") -> torch.Tensor:
    """Eq. 4, InternVL's pixel shuffle Pi_r: [N,h,w,C] patch grid -> [N,h*w*ratio^2, C/ratio^2] tokens.
    Each output token concatenates an r x r block of patches in row-major order: [(2i,2j), (2i,2j+1),
    (2i+1,2j), (2i+1,2j+1)] for r=2. v2 orders output tokens row-major; v1 (the original bug kept for
    old checkpoints) column-major."""
    N, h, w, C = x.shape
    r = round(1 / ratio)
    x = x.view(N, h // r, r, w // r, r, C)  # [N,h/r,dr,w/r,dc,C]
    order = (0, 1, 3, 2, 4, 5) if version == "v2" else (0, 3, 1, 2, 4, 5)
    return x.permute(order).reshape(N, (h // r) * (w // r), r * r * C)  # [N,h*w/r^2,r^2*C]


def is_branch_tensor(key: str) -> bool:
    """The ParVL tensors on top of InternVL: per-layer prefixes (or LoRA updates) and the two aggregators."""
    return key.endswith((".prefix_k", ".prefix_v", ".lora_A", ".lora_B")) or key.startswith(
        ("vision_aggregator.", "language_aggregator.")
    )


class ParVL(nn.Module):
    """InternVL3.5 with Pv prefix-conditioned ViT branches and Pl prefix-conditioned LLM branches.
    Vision branches are fused (vision_aggregator) before CLS removal and pixel shuffle; the fused
    image features enter every language branch; language branches are fused (language_aggregator)
    after the final norm, before the shared lm_head. `vision_branch` / `language_branch` run one
    chosen branch per sample instead (no aggregation), skipping the other branches' compute."""

    def __init__(self, cfg: ParVLConfig):
        super().__init__()
        self.cfg = cfg
        par, C = cfg.par, cfg.llm.hidden_size
        if cfg.vit is not None:
            Cv = cfg.vit.hidden_size
            Cs = Cv * round(1 / cfg.downsample_ratio) ** 2  # width after pixel shuffle
            # LoRA replaces the vision prefixes
            lora_rank = par.lora_rank if par.vision_branches == "lora" else 0
            self.vision_model = ViT(cfg.vit, par.pv, par.vit_prefix_len, lora_rank)
            # `mlp1`, the connector of Eq. 5, with the checkpoint's Sequential indices (2 is the parameter-free GELU)
            self.mlp1 = nn.Sequential(
                nn.LayerNorm(Cs), nn.Linear(Cs, C), nn.GELU(), nn.Linear(C, C)
            )
        self.language_model = LLM(cfg.llm, par.pl, par.llm_prefix_len)
        self.vision_aggregator = (
            Aggregator(par.pv, Cv, par.lambda_v, par.aggregation) if par.pv > 1 else None
        )
        self.language_aggregator = (
            Aggregator(par.pl, C, par.lambda_l, par.aggregation) if par.pl > 1 else None
        )
        self.source_dir = None  # the checkpoint folder it was loaded from (loading/pretrained.py)

    # -- forward -------------------------------------------------------------------------------
    # vision_branch / language_branch (aggregate.Choice): None runs all branches of the tower and
    # fuses them; an int runs that one branch for every sample; a sequence (or [B] tensor) runs one
    # branch per sample. Only the chosen branches run: B rows through the blocks, not P*B.

    def vision_rows(
        self, vision_branch: Choice, num_tiles: torch.Tensor | list[int] | None, tiles: int, device
    ) -> Rows:
        """ViT rows for `tiles` tiles; a branch per sample needs num_tiles [B] (tiles of each sample)."""
        if vision_branch is None or isinstance(vision_branch, int):
            return Rows.choose(vision_branch, self.cfg.par.pv, tiles, device)
        if num_tiles is None:
            raise ValueError(
                "a vision branch per sample needs the tiles of each sample (num_tiles)"
            )
        num_tiles = torch.as_tensor(num_tiles, dtype=torch.long)
        if int(num_tiles.sum()) != tiles:
            raise ValueError(
                f"num_tiles {num_tiles.tolist()} sums to {int(num_tiles.sum())}, pixel_values has "
                f"{tiles} tiles"
            )
        return Rows.choose(vision_branch, self.cfg.par.pv, len(num_tiles), device).per_tile(
            num_tiles
        )

    def language_rows(
        self, language_branch: Choice, batch: int, device, shared_kv: bool = False
    ) -> Rows:
        """LLM rows for `batch` samples (shared_kv: one mean-reduced token cache for dense rows, C.2)."""
        return Rows.choose(language_branch, self.cfg.par.pl, batch, device, shared_kv)

    def vision(
        self, pixel_values: torch.Tensor, rows: Rows
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Connector output for a batch of tiles, [N,3,px,px] -> [N,tokens_per_tile,C], and the vision
        branch weights [N,1+h*w,Pv] (None when each tile runs one branch). After the branches are fused
        (Eq. 2): Eq. 3 removes the class token, Eq. 4 is pixel_shuffle, and Eq. 5 is the connector
        mlp1, H_v = W_2 GELU(W_1 LN(Z)), with the checkpoint's Sequential of those four layers."""
        x = self.vision_model(pixel_values, rows, num_layers=self.cfg.vit_layers)  # [R,1+h*w,Cv]
        # [N,1+h*w,Cv], fused before CLS removal
        x, weights = to_items(x, rows, self.vision_aggregator)
        x = x[:, 1:]  # drop CLS (Eq. 3)
        N, L, Cv = x.shape
        g = int(L**0.5)
        # [N,L/4,4*Cv]
        x = pixel_shuffle(x.reshape(N, g, g, Cv), self.cfg.downsample_ratio, self.cfg.ps_version)
        return self.mlp1(x), weights  # [N,256,C]

    def extract_features(
        self,
        pixel_values: torch.Tensor,
        vision_branch: Choice = None,
        num_tiles: list[int] | None = None,
    ) -> torch.Tensor:
        """Connector output for a batch of tiles: [N,3,px,px] -> [N,tokens_per_tile,C]. A vision branch
        per sample needs num_tiles, the tiles of each sample (in order, summing to N)."""
        rows = self.vision_rows(
            vision_branch, num_tiles, pixel_values.shape[0], pixel_values.device
        )
        return self.vision(pixel_values, rows)[0]

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        vision_branch: Choice = None,
        features: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token embeddings [B,T,C] with the image features written, in order, into the <IMG_CONTEXT>
        slots, and the vision branch weights (None without images or without fusion). A sample's
        tiles are told by its <IMG_CONTEXT> count (tokens_per_tile each). features: the connector
        output [N,tokens_per_tile,C] of these tiles when it is already computed (router.py runs the
        chosen vision branch before picking the language branch); then no ViT runs here."""
        x = self.language_model.model.embed_tokens(input_ids)  # [B,T,C]
        is_img = input_ids == self.cfg.image_token_id  # [B,T]
        if features is not None:
            if int(is_img.sum()) != features.shape[0] * features.shape[1]:
                raise ValueError(
                    f"prompt has {int(is_img.sum())} <IMG_CONTEXT> tokens but the features give "
                    f"{features.shape[0] * features.shape[1]}"
                )
            return x.masked_scatter(is_img[..., None], features.to(x.dtype)), None
        if pixel_values is None:
            if is_img.any():
                raise ValueError(
                    "input_ids hold <IMG_CONTEXT> tokens but no pixel_values were given"
                )
            return x, None
        if self.cfg.vit is None:
            raise ValueError("this language-only model takes no pixel_values")
        N, per_tile, device = pixel_values.shape[0], self.cfg.tokens_per_tile, pixel_values.device
        # every tile alike: no per-sample count needed
        if vision_branch is None or isinstance(vision_branch, int):
            rows = self.vision_rows(vision_branch, None, N, device)
            if not self.training:  # training skips the host sync: data/sft.py checked every row
                self.image_slots(is_img, N)
        else:
            rows = self.vision_rows(
                vision_branch, [n // per_tile for n in self.image_slots(is_img, N)], N, device
            )
        feats, weights = self.vision(pixel_values, rows)  # [N,256,C]
        # A text-only training batch carries a dummy tile (InternVL's image_flags = 0): it fills no slot,
        # but the ViT still runs, so every FSDP rank issues the same collectives (its gradient is zero).
        return x.masked_scatter(is_img[..., None], feats.to(x.dtype)), weights

    def image_slots(self, is_img: torch.Tensor, tiles: int) -> list[int]:
        """<IMG_CONTEXT> slots of each sample (one host sync), checked against the tiles given."""
        per_tile, slots = self.cfg.tokens_per_tile, is_img.sum(1).tolist()
        if sum(slots) != tiles * per_tile or any(n % per_tile for n in slots):
            raise ValueError(
                f"prompt has {sum(slots)} <IMG_CONTEXT> tokens (per sample {slots}) but "
                f"{tiles} tiles give {tiles * per_tile} features, {per_tile} per tile"
            )
        return slots

    def hidden_from_embeds(
        self,
        x: torch.Tensor,  # [B,T,C] input embeddings
        positions: torch.Tensor,  # [B,T] rotary positions
        mask: torch.Tensor
        | None = None,  # [B,1,T,S] bool over token slots, None = causal without padding
        input_pos: torch.Tensor | None = None,  # [T] KV-cache token slots, None = no cache
        rows: Rows
        | None = None,  # which language branch each LLM row runs (language_rows); None: all, fused
        segments: torch.Tensor
        | None = None,  # [B,T] packed rows: the sample of each token, see aggregate.py
    ) -> tuple[
        torch.Tensor, torch.Tensor | None
    ]:  # [B,T,C] final-normed states, weights [B,T,Pl] or None
        """The language branches over input embeddings x (image features already in place), fused: the
        final-normed states lm_head reads. The engine calls it for prefill and every decode step."""
        if rows is None:
            rows = self.language_rows(None, x.shape[0], x.device)
        h = self.language_model(x, positions, mask, input_pos, rows, segments)  # [R,T,C]
        return to_items(h, rows, self.language_aggregator)

    def language_branch_states(
        self,
        x: torch.Tensor,  # [B,T,C] input embeddings (embed)
        positions: torch.Tensor,  # [B,T] rotary positions
        mask: torch.Tensor
        | None = None,  # [B,1,T,T] bool over token slots, None = causal without padding
    ) -> torch.Tensor:  # [B,Pl,T,C] final-normed states of every language branch, not fused
        """What hidden_from_embeds fuses, branch by branch: the states of language branch l of sample b are
        [b, l]. The router's teacher scores every branch pair by its answer NLL (Eq. E1, router.py label)."""
        # every language branch, folded branch-major
        rows = self.language_rows(None, x.shape[0], x.device)
        h = self.language_model(x, positions, mask, rows=rows)  # [Pl*B,T,C]
        return per_branch(h, rows, self.cfg.par.pl)  # [B,Pl,T,C]

    def hidden_from_ids(
        self,
        input_ids: torch.Tensor,  # [B,T]
        pixel_values: torch.Tensor | None = None,  # [N,3,448,448], tiles of all samples in order
        attention_mask: torch.Tensor | None = None,  # [B,T], 1 = token, 0 = (left or right) padding
        vision_branch: Choice = None,
        language_branch: Choice = None,
        segment_ids: torch.Tensor
        | None = None,  # [B,T] packed rows: sample 0, 1, ... of each token, then the padding
    ) -> tuple[
        torch.Tensor, torch.Tensor | None, torch.Tensor | None
    ]:  # h [B,T,C], weights [N,1+h*w,Pv], [B,T,Pl]
        """The whole model from token ids and tiles up to lm_head, and the branch weights (None where nothing
        is fused): embed, then hidden_from_embeds with the positions and mask of attention_mask, or of
        segment_ids for several samples packed into each row (training): positions restart at 0 per
        sample, which attends only to itself and its branch prefixes (packing.packed_mask). Training scores
        these states chunk by chunk (loss.chunked_sft_loss) rather than hold [B,T,V] logits."""
        x, w_vision = self.embed(input_ids, pixel_values, vision_branch)
        B, T = input_ids.shape
        rows = self.language_rows(language_branch, B, x.device)
        if segment_ids is not None:
            # the mask is built per row (LLM.forward)
            positions, mask = (segment_positions(segment_ids), None)
        elif attention_mask is None:
            positions = torch.arange(T, device=x.device).expand(B, T)
            mask = None  # plain causal: SDPA's fused kernels
        else:
            # every prompt starts at position 0
            positions, mask = prompt_positions(attention_mask.bool(), padded=True)
        h, w_language = self.hidden_from_embeds(x, positions, mask, rows=rows, segments=segment_ids)
        return h, w_vision, w_language

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        vision_branch: Choice = None,
        language_branch: Choice = None,
    ) -> torch.Tensor:  # [B,T,V] logits
        """InternVL's forward: the logits of a batch (hidden_from_ids, then the shared lm_head)."""
        h, _, _ = self.hidden_from_ids(
            input_ids, pixel_values, attention_mask, vision_branch, language_branch
        )
        return self.language_model.lm_head(h)

    def branch_init(self, std: float = 0.02) -> dict[str, torch.Tensor]:
        """Initial values (fp32, on the CPU) of the ParVL tensors of a model started from an InternVL3.5
        checkpoint, drawn in a fixed order from the CPU generator. Prefixes ~ N(0, std^2), as ParScale
        does: random prefixes are enough to make the branches diverge, and small ones start every
        branch close to the pretrained model. LoRA branches start as PEFT starts them, random A and
        zero B: exactly the pretrained ViT, diverging from the first update. The aggregators start
        uniform (zero last layer), so the first step sees the mean of the branches. Works on a meta
        model (train.py's sharded loading)."""
        values = {}
        for name, p in self.named_parameters():
            if name.endswith(("prefix_k", "prefix_v")):
                values[name] = torch.empty(p.shape).normal_(std=std)
            # PEFT's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
            elif name.endswith("lora_A"):
                values[name] = torch.empty(p.shape).uniform_(
                    -(p.shape[-1] ** -0.5), p.shape[-1] ** -0.5
                )
            elif name.endswith("lora_B"):  # zero: a fresh LoRA branch is the shared ViT
                values[name] = torch.zeros(p.shape)
        for name in ("vision_aggregator", "language_aggregator"):
            agg = getattr(self, name)
            if agg is not None:
                values |= {f"{name}.{k}": v for k, v in agg.initial_values().items()}
        return values

    @torch.no_grad()
    def init_branches(self, std: float = 0.02) -> None:
        """Set the ParVL tensors to branch_init's values."""
        params = dict(self.named_parameters())
        for name, value in self.branch_init(std).items():
            params[name].copy_(value)

    @classmethod
    def from_config(
        cls, cfg: ParVLConfig, dtype=torch.float32, device="cpu", seed: int = 0
    ) -> ParVL:
        """A randomly initialised model (benchmarks and tests), built directly on `device`."""
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(cfg)
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith(("ls1", "ls2")):
                nn.init.constant_(p, 0.1)
        return model.to(dtype)
