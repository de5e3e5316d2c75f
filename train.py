"""Supervised fine-tuning of ParVL with FSDP2 (ParVL paper, Appendix A.1; InternVL3.5 SFT recipe).

    torchrun --nproc-per-node 8 train.py --pv 2 --pl 2 --model InternVL3_5-1B --data meta.json --out runs/22
    python train.py --validate-data --model InternVL3_5-1B --data meta.json   # count bad rows, no training
    python train.py plot runs/22                                                # runs/22/metrics.png (matplotlib)

Full-parameter SFT for one epoch from an InternVL3.5 (or ParVL) checkpoint on data in the official
InternVL format (data.py). The loss is Eq. 6: every supervised token of sample b weighs 1/sqrt(n_b),
normalised by the sum of the weights over the whole global batch (all micro-batches, all ranks), so
the value does not depend on how the batch is split, nor on packing: by default each rank packs its
samples of a step into rows of at most --max-seq-len tokens (data.py), every sample attending only
to itself and its branch prefixes (aggregate.packed_mask: flex_attention on CUDA, a dense mask on
CPU). AdamW with two learning rates (new branch tensors / pretrained weights), 3 % linear warm-up
then cosine to zero, gradient clipping.

Parallelism follows torchtitan: activation checkpointing per block, optional torch.compile per
block, fully_shard on every ViT and LLM block and then the root, MixedPrecisionPolicy (bf16
parameters, fp32 gradient reduction). Checkpoints are torch.distributed.checkpoint folders written
atomically (step_N.tmp renamed to step_N when complete); --resume continues from the newest one
that verifies, falling back past broken ones, bit-identically: the data order is a function of
(seed, step) and the RNG is reseeded from (seed, step, rank) at every step. Runs on GPUs with NCCL
and on CPU with gloo (the tests).

An --out folder belongs to one run (a new run into a used one is refused; --overwrite discards it);
runs.py keeps the folder: checkpoints, resume, metrics, export.
Failures are one line on stderr, from rank 0; exit codes 0 done, 1 failure, 2 bad flags, 130 / 143
SIGINT / SIGTERM (the current step is abandoned, complete checkpoints stay).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from aggregate import entropy
from checkpoint import CheckpointReader, check_not_run_folder, is_branch_tensor, read_json
from cli import (SEED, OneLineParser, OutOfMemory, allocation, check_shared, command, end_processes, error, hms,
                 interruptible, log, one_line, os_cause, os_error, out_of_range, peak_memory_gib, pyplot, rank,
                 start_processes, wait_for_torchrun)
from config import ParConfig, config_from_json, open_checkpoint
from data import BAD_REASONS, BadRow, SFTData, check_bad_fraction, filler_batch, make_loader, validate
from loss import chunked_sft_loss, loss_weights
from parvl import ParVL
from processor import Tokenizer
from runs import check_out, checkpoints, discard_run, export, finite, resume, save_checkpoint, trim_metrics
from schedule import lr_lambda


BRANCH_FLAGS = ("vit_prefix_len", "llm_prefix_len", "aggregation", "lambda_v", "lambda_l", "vision_branches",
                "lora_rank")  # parvl.ParConfig's fields


def default_workers() -> int:
    """Data loading processes per rank: 4, or fewer when this process may use fewer CPUs per local rank."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


RANGES = {"lr_new": "(0, inf)", "lr_pretrained": "(0, inf)", "weight_decay": "[0, inf)", "warmup_ratio": "[0, 1)",
          "clip": "(0, inf)", "global_batch": "[1, inf)", "micro_batch": "[1, inf)", "max_seq_len": "[1, inf)",
          "max_tiles": "[0, inf)", "max_steps": "[0, inf)", "pv": "[1, inf)", "pl": "[1, inf)", "save_every": "[1, inf)",
          "keep_last": "[1, inf)", "log_every": "[1, inf)", "max_bad_frac": "[0, 1]", "num_workers": "[0, inf)"}


@dataclass
class TrainConfig:
    model: str = ""  # InternVL3.5 or ParVL checkpoint folder
    data: str = ""  # meta JSON in the official InternVL SFT format
    out: str = "runs/parvl"  # checkpoints, config, metrics and the final export
    pv: int | None = None  # vision branches (default: the checkpoint's)
    pl: int | None = None  # language branches (default: the checkpoint's)
    lr_new: float = 8e-5  # peak lr of the branch tensors (prefixes, aggregators)
    lr_pretrained: float = 8e-6  # peak lr of the pretrained weights
    weight_decay: float = 0.05
    warmup_ratio: float = 0.03
    clip: float = 1.0  # max gradient norm
    global_batch: int = 512  # samples per optimizer step, whatever the world size
    micro_batch: int = 1  # rows per forward on one rank: a sample each, or several packed (--packing)
    packing: bool = True  # pack the samples of a step into rows of at most --max-seq-len tokens (data.py)
    max_seq_len: int = 32768
    max_tiles: int = 0  # tiles per row, shared by its images; 0 = the checkpoint's max_dynamic_patch (12)
    max_steps: int = 0  # 0 = one epoch
    seed: int = SEED
    dtype: str = "auto"  # parameter dtype inside FSDP's mixed precision: bf16, fp32, or auto (bf16 on CUDA, fp32 on CPU)
    compile: bool = False  # torch.compile every block
    activation_checkpointing: bool = True
    freeze_vit: bool = False
    freeze_connector: bool = False
    freeze_llm: bool = False
    freeze_backbone: bool = False  # only prefixes and aggregators train (ParScale's efficient mode)
    save_every: int = 500  # steps between checkpoints (and at the end)
    keep_last: int = 2
    resume: bool = False  # continue from the newest checkpoint in --out that verifies (none: start fresh)
    overwrite: bool = False  # discard what --out holds (checkpoints, export, metrics) and start a new run
    log_every: int = 1
    num_workers: int = default_workers()  # data loading processes per rank
    max_bad_frac: float = 0.01
    peak_tflops: float = 0.0  # per-device bf16 peak for MFU; 0 = from the device name (H100/H200: 989)
    vit_prefix_len: int | None = None  # the branch parameterisation (Figure 3, Table S8), BRANCH_FLAGS;
    llm_prefix_len: int | None = None  # None = the checkpoint's, or parvl.ParConfig's defaults
    aggregation: str | None = None
    lambda_v: float | None = None
    lambda_l: float | None = None
    vision_branches: str | None = None
    lora_rank: int | None = None
    validate_data: bool = False

    def check_files(self) -> None:
        """Bad input (exit 1): the model and data paths, before any process group starts."""
        if not self.model or not Path(self.model).is_dir():
            raise ValueError(f"--model {self.model!r}: not a checkpoint folder")
        check_not_run_folder(Path(self.model))  # runs/11 for runs/11/export: say which folder is meant
        if not self.data or not Path(self.data).is_file():
            raise ValueError(f"--data {self.data!r}: no such meta JSON file")

    def check_flags(self) -> None:
        """Bad flags (exit 2, as argparse's own): values out of range and flags that exclude each other."""
        if why := out_of_range(self, RANGES):
            raise ValueError(why)
        try:  # the branch flags' ranges are ParConfig's
            ParConfig(**{k: getattr(self, k) for k in BRANCH_FLAGS if getattr(self, k) is not None})
        except ValueError as e:
            raise ValueError(f"--{str(e).replace('_', '-')}") from None
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"--dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out, --overwrite discards it: pass one of them")


def parse_args(argv=None) -> TrainConfig:
    p = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                      epilog="train.py plot RUN [--out FILE.png]: one PNG of a run's metrics.jsonl (train.py plot --help)")
    helps = {
        "model": "InternVL3.5 or ParVL checkpoint folder", "data": "meta JSON in the official InternVL SFT format",
        "out": "run folder: config, metrics.jsonl, checkpoints, export", "pv": "vision branches Pv; None = the checkpoint's",
        "pl": "language branches Pl; None = the checkpoint's", "lr_new": "peak learning rate of prefixes and aggregators",
        "lr_pretrained": "peak learning rate of the pretrained weights", "weight_decay": "AdamW weight decay",
        "warmup_ratio": "fraction of the steps in linear warm-up, in [0, 1)", "clip": "max gradient norm (L2)",
        "global_batch": "samples per optimizer step, any world size",
        "micro_batch": "rows per forward per rank; a row is one sample, or with --packing as many as fit in --max-seq-len",
        "packing": "pack each rank's samples of a step into rows of at most --max-seq-len tokens (first fit, in order), "
                   "each sample attending only to itself; --no-packing: one right-padded row per sample",
        "max_seq_len": "tokens per sample, image tokens included (longer samples are skipped as too_long), and "
                       "with --packing the length of a packed row",
        "max_tiles": "448 px image tiles per sample, shared by its images (0 = the checkpoint's max_dynamic_patch, 12 for InternVL3.5)",
        "max_steps": "optimizer steps, 0 = one epoch", "seed": "data order and RNG seed",
        "dtype": "parameter dtype inside FSDP mixed precision (gradients reduce in fp32); auto = bf16 on CUDA, fp32 on CPU",
        "compile": "torch.compile every ViT and LLM block", "activation_checkpointing": "recompute each block in backward",
        "freeze_vit": "do not train the ViT", "freeze_connector": "do not train mlp1", "freeze_llm": "do not train the LLM",
        "freeze_backbone": "train only prefixes and aggregators", "save_every": "steps between checkpoints",
        "keep_last": "checkpoints kept", "log_every": "steps between log lines",
        "num_workers": "data loading processes per rank; the default is 4, or the CPUs per local rank if fewer",
        "max_bad_frac": "abort once more than this fraction of the data set's rows are bad, in [0, 1] (--validate-data's rule)",
        "peak_tflops": "per-device bf16 peak in TFLOP/s for MFU, 0 = from the device name (H100/H200: 989)",
        "validate_data": "count and name bad rows, then exit without training",
        "vit_prefix_len": "key/value prefix tokens per ViT layer and vision branch (the paper: 96; Figure 3 sweeps 72, 96, 128)",
        "llm_prefix_len": "key/value prefix tokens per LLM layer and language branch (the paper: 48)",
        "aggregation": "how branches fuse: mlp (Eq. 2, the paper's) or mean (Table S8's ablation)",
        "lambda_v": "smoothing of the vision branch weights toward uniform, in [0, 1] (the paper: 0)",
        "lambda_l": "smoothing of the language branch weights toward uniform, in [0, 1] (the paper: 0.1)",
        "vision_branches": "prefix (the paper's) or lora: a low-rank update of the ViT's qkv, proj, fc1, fc2 per vision "
                           "branch (Figure 3; B starts at zero, alpha = 2 x rank)", "lora_rank": "rank of lora (default 16)",
        "resume": "continue from the newest checkpoint in --out that verifies (none: start fresh)",
        "overwrite": "discard the run --out holds (checkpoints, export, metrics) and start a new one"}
    for f in fields(TrainConfig):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        help_ = helps.get(f.name, f.name.replace("_", " "))
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            kind = ({"pv": int, "pl": int} | {k: type(getattr(ParConfig(), k)) for k in BRANCH_FLAGS}).get(f.name, type(default))
            choices = {"dtype": ["auto", "bf16", "fp32"], "aggregation": ["mlp", "mean"],
                       "vision_branches": ["prefix", "lora"]}.get(f.name)
            p.add_argument(flag, type=kind, default=default, choices=choices, help=help_)
    cfg = TrainConfig(**vars(p.parse_args(argv)))
    try:
        cfg.check_flags()
    except ValueError as e:
        p.error(str(e))
    return cfg


# -- model -------------------------------------------------------------------------------------


def build_model(cfg: TrainConfig, device, mesh) -> ParVL:
    """Build on the meta device, freeze, wrap blocks with activation checkpointing and compile,
    fully_shard blocks and root, then let every rank materialise its own rows only (load_shards):
    no rank ever holds the whole model, in any dtype."""
    folder = Path(cfg.model)
    raw = read_json(folder / "config.json")
    reader = CheckpointReader(folder, parscale_branches=int(raw.get("parscale_n", 0)))
    with torch.device("meta"):
        given = {k: getattr(cfg, k) for k in BRANCH_FLAGS if getattr(cfg, k) is not None}  # into the export's config.json
        par = replace(config_from_json(raw, folder).par, **given) if given else None  # config_for refuses to change a ParVL's
        model = ParVL(ParVL.config_for(folder, raw, reader.keys(), cfg.pv, cfg.pl, par)).train()
    new = model.check_checkpoint(reader, folder)
    torch.manual_seed(cfg.seed)  # every rank draws the same new branch tensors, as ParVL.from_pretrained does
    fresh = {k: v for k, v in model.branch_init().items() if k in new}
    for name, p in model.named_parameters():
        frozen = (cfg.freeze_backbone and not is_branch_tensor(name)) or (
            not is_branch_tensor(name) and (
                (cfg.freeze_vit and name.startswith("vision_model."))
                or (cfg.freeze_connector and name.startswith("mlp1."))
                or (cfg.freeze_llm and name.startswith("language_model."))))
        p.requires_grad_(not frozen)
    blocks = [model.language_model.model.layers]
    if model.cfg.vit is not None:
        blocks.append(model.vision_model.encoder.layers)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if cfg.dtype == "bf16" else None, reduce_dtype=torch.float32)
    for layers in blocks:
        for i, block in enumerate(layers):
            if cfg.activation_checkpointing:
                block = checkpoint_wrapper(block, preserve_rng_state=False)
            if cfg.compile:
                block.compile(fullgraph=True)
            layers[i] = block
            fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    register_fsdp_forward_method(model, "hidden_from_ids")  # the root all-gathers for this entry point too; as the
    # root it is not resharded after forward, so lm_head's weight is still whole for the chunked loss after it
    model.to_empty(device=device)
    load_shards(model, reader, fresh)
    model.language_model.model.init_rope(device)
    return model


@torch.no_grad()
def load_shards(model: ParVL, reader: CheckpointReader, fresh: dict[str, torch.Tensor]) -> None:
    """Fill each rank's shard of every parameter: FSDP2 splits dim 0 as torch.chunk does (ceil(n /
    world) rows each), so this rank reads rows [r*c, (r+1)*c) of each tensor from the safetensors
    files, cast to fp32 one slice at a time; new branch tensors come from `fresh` (drawn alike on
    every rank). The host holds this rank's shards and one slice in flight, never the checkpoint."""
    world, r = dist.get_world_size(), rank()
    for key, t in model.state_dict().items():  # tied lm_head: the same tensor as embed_tokens, filled once
        if key not in reader.keys() and key not in fresh:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        n = t.shape[0]
        c = -(-n // world)
        a, b = min(r * c, n), min((r + 1) * c, n)
        assert local.shape[0] == b - a, (key, tuple(local.shape), a, b)  # FSDP2's even-chunk layout
        if b > a:
            src = reader.rows(key, a, b) if key in reader.keys() else fresh[key][a:b]
            local.copy_(src.to(local.dtype))
def param_groups(model: ParVL, cfg: TrainConfig) -> list[dict]:
    """New branch tensors at lr_new, pretrained weights at lr_pretrained; weight decay on everything,
    as the official DeepSpeed recipe applies it (one group, biases and norms included)."""
    new = [p for n, p in model.named_parameters() if p.requires_grad and is_branch_tensor(n)]
    old = [p for n, p in model.named_parameters() if p.requires_grad and not is_branch_tensor(n)]
    return [g for g in ({"params": new, "lr": cfg.lr_new, "name": "branches"},
                        {"params": old, "lr": cfg.lr_pretrained, "name": "pretrained"}) if g["params"]]


def train_flops_per_token(model: ParVL) -> tuple[float, float]:
    """Model FLOPs per ViT token and per LLM token for forward + backward (6 x matmul parameters x
    branches; attention scores left out, as MFU conventions do). Activation recomputation is not
    counted: MFU measures useful work."""
    par = model.cfg.par
    vit = sum(p.numel() for n, p in model.named_parameters() if n.startswith("vision_model.encoder") and p.ndim == 2)
    llm = sum(p.numel() for n, p in model.named_parameters() if n.startswith("language_model.model.layers") and p.ndim == 2)
    head = model.language_model.lm_head.weight.numel()
    return 6.0 * vit * par.pv, 6.0 * (llm * par.pl + head)


MAX_NAMED = 20  # bad rows named one by one (per rank in training, in all for --validate-data)


def name_bad_rows(data: SFTData, batches, named: int) -> int:
    """Name this rank's bad rows on stderr (file, line, why), the first MAX_NAMED of them. A Batch
    keeps only their indices, so a bad row is read again for its reason: rare, and cheap next to a
    training step."""
    for row in (row for b in batches for row in b.bad_rows):
        if named >= MAX_NAMED:
            break
        item = data[row]
        if isinstance(item, BadRow):
            named += 1
            print(f"warning: skipped bad row {item.detail} [{item.reason}]"
                  + (f" (naming no more on rank {rank()})" if named == MAX_NAMED else ""), file=sys.stderr, flush=True)
    return named


def even_out(batches: list, group, pad_id: int, image_size: int) -> list:
    """Packed steps: give every rank as many micro-batches as the one with the most (filler batches,
    data.filler_batch), so that all ranks run the same FSDP collectives. The count is all-reduced on
    the host (a gloo group): no device sync."""
    n = torch.tensor([len(batches)])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    return batches + [filler_batch(pad_id, image_size) for _ in range(max(1, int(n)) - len(batches))]


# -- the step ----------------------------------------------------------------------------------


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor to `device` without waiting for it: pinned and non-blocking on CUDA."""
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)


def micro_loss(model: ParVL, batch, weight_sum: float | torch.Tensor, world: int, device):
    """This micro-batch's share of the Eq. 6 loss (loss.sft_loss over the global weight sum, scored chunk
    by chunk from the final states: loss.chunked_sft_loss), times the world size since FSDP averages
    gradients over ranks. Also returns the branch weights' entropies (nan if none)."""
    ids, labels = to_device(batch.input_ids, device), to_device(batch.labels, device)
    segments = None if batch.segment_ids is None else to_device(batch.segment_ids, device)  # packed rows
    pixels = to_device(batch.pixel_values, device)
    tiles = pixels.shape[0]
    if tiles == 0 and model.cfg.vit is not None:
        size = model.cfg.vit.image_size
        pixels = torch.zeros(1, 3, size, size, device=device)  # text only: a dummy tile, see ParVL.embed
    # no padding (e.g. one sample per micro-batch): no mask, so attention keeps the causal fast path
    mask = None if segments is not None or bool(batch.attention_mask.all()) else to_device(batch.attention_mask, device)
    h, w_vision, w_language = model.hidden_from_ids(ids, pixels if pixels.shape[0] else None, mask, segment_ids=segments)
    loss = chunked_sft_loss(h, model.language_model.lm_head.weight, labels, weight_sum, segments) * world
    nan = torch.full((), float("nan"), device=device)  # a fill, not a host-to-device copy
    w_vision = w_vision if tiles else None  # a dummy tile's weights say nothing
    ent = torch.stack([entropy(w.detach()) if w is not None else nan for w in (w_vision, w_language)])  # no host sync
    return loss, ent


def progress_line(m: dict, total: int, elapsed: float) -> str:
    """The human line of a log step, for stderr, from its metrics line (null MFU: no peak known)."""
    lr = " ".join(f"{name} {v:.2e}" for name, v in m["lr"].items())
    mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
    return (f"step {m['step']}/{total} | loss {m['loss']:.4f} | grad norm {m['grad_norm']:.3f} | lr {lr} | "
            f"{m['tokens_per_s']:,.0f} tokens/s | MFU {mfu} | peak {m['peak_gib']:.1f} GiB | elapsed {hms(elapsed)} | "
            f"eta {hms(m['eta_s'])}")


# -- train.py plot RUN --------------------------------------------------------------------------

PANELS = (("loss", ("loss",)), ("grad norm", ("grad_norm",)), ("learning rate", ("lr",)),
          ("branch-weight entropy (nats)", ("entropy_vision", "entropy_language")))


def plot_run(run: Path, png: Path | None = None) -> Path:
    """One PNG of a run's metrics.jsonl against step: loss, grad norm, lr per group (log scale), and
    the entropies of the vision and language branch weights (collapse shows as a drop)."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{metrics}: no such file (RUN is a train.py --out folder)")
    rows = []
    for raw in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(raw))
        except json.JSONDecodeError:  # the last line of a run that is writing it
            continue
    if not rows:
        raise ValueError(f"{metrics}: no log steps yet")
    plt = pyplot()  # matplotlib is optional: imported only here, one line when missing
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            series = ({f"lr {g}": [r["lr"][g] for r in rows] for g in rows[0]["lr"]} if key == "lr"
                      else {key.replace("entropy_", ""): [math.nan if r.get(key) is None else r[key] for r in rows]})
            for label, ys in series.items():
                ax.plot(steps, ys, label=label, marker="." if len(steps) < 50 else None)
        if key == "lr":
            ax.set_yscale("log")
        if len(keys) > 1 or key == "lr":
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(str(run), fontsize=10)
    fig.tight_layout()
    png = png or run / "metrics.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def plot_main(argv: list[str]) -> int:
    p = OneLineParser(prog="train.py plot", description="Plot RUN/metrics.jsonl (loss, grad norm, lr, branch-weight "
                                                          "entropies against step) as one PNG; needs matplotlib.")
    p.add_argument("run", help="run folder (train.py --out) holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG file to write (default RUN/metrics.png)")
    args = p.parse_args(argv)
    try:
        print(plot_run(Path(args.run), Path(args.out) if args.out else None))
    except (ValueError, OSError) as e:
        error(f"error: {one_line(e)}")
        return 1
    return 0


def main(argv=None) -> int:
    """`train.py plot RUN` plots a run; anything else trains. Exit codes (README): 0 done, 1 bad input or a failure,
    2 bad flags, 130 / 143 interrupted by SIGINT / SIGTERM; an error is one line on stderr (cli.error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plot"]:  # before the training parser: its flags stay as they are
        return plot_main(argv[1:])
    with interruptible() as received:  # SIGINT / SIGTERM abandon the step wherever it is (complete checkpoints stay)
        return train_main(argv, received)


def train_main(argv: list[str], received: list[int]) -> int:
    """main's training path; `received`: the signals interruptible has caught so far."""
    code, quiet_exit, lost, out = 0, False, False, None
    try:
        cfg = parse_args(argv)
        cfg.check_files()
        out = Path(cfg.out)
        if not cfg.validate_data:
            check_out(Path(cfg.out), cfg.resume, cfg.overwrite)
        mcfg, tok = open_checkpoint(Path(cfg.model))  # tiles as the model sees them, and its own tokenizer
        if mcfg.vit is None:
            raise ValueError(f"--model {cfg.model}: a language-only checkpoint; train.py trains vision-language models")
        data = SFTData(cfg.data, tok, max_tiles=cfg.max_tiles or mcfg.max_dynamic_patch, max_seq_len=cfg.max_seq_len,
                       image_token_id=mcfg.image_token_id, num_image_token=mcfg.tokens_per_tile,
                       image_size=mcfg.vit.image_size, seed=cfg.seed, max_positions=mcfg.llm.max_position_embeddings)
        if cfg.validate_data:
            bad: list[BadRow] = []
            counts = validate(data, bad_rows=bad, max_listed=MAX_NAMED)
            for b in bad:  # file:line, reason, detail: one line each, at most MAX_NAMED
                print(f"bad row: {b.detail} [{b.reason}]")
            if sum(counts[r] for r in BAD_REASONS) > len(bad):
                print(f"... and {sum(counts[r] for r in BAD_REASONS) - len(bad)} more bad rows")
            print(json.dumps(counts))
            check_bad_fraction(counts, len(data), cfg.max_bad_frac)
            return 0
        return train(cfg, tok, data)
    except (KeyboardInterrupt, CheckpointException, Exception) as e:
        who = f"rank {rank()}: " if dist.is_initialized() and dist.get_world_size() > 1 else ""  # this rank's own errors
        if received or isinstance(e, KeyboardInterrupt):  # whatever a peer's exit then caused here
            signum = received[0] if received else signal.SIGINT
            code, quiet_exit = 128 + signum, dist.is_initialized() and dist.get_world_size() > 1
            kept = checkpoints(out) if out is not None and out.is_dir() else []
            log(f"interrupted by {signal.Signals(signum).name}: the current step was abandoned; "
                 + (f"last complete checkpoint {kept[-1]} (continue with --resume)" if kept else "no checkpoint was saved"))
        elif isinstance(e, OutOfMemory):  # this rank's batch: the others may be mid-collective
            code, quiet_exit = 1, dist.is_initialized() and dist.get_world_size() > 1
            error(f"error: {who}{e}", every_rank=True)
        elif isinstance(e, (ValueError, CheckpointException)):  # bad flags, data, saves: alike on every rank
            code = 1
            error(f"error: {one_line(e) if isinstance(e, ValueError) else os_cause(e)}",
                  wait=not dist.is_initialized())  # else end_processes' barrier holds the others
        elif isinstance(e, OSError):  # a file this rank could not read or write: maybe this rank's alone
            code, quiet_exit = 1, dist.is_initialized() and dist.get_world_size() > 1  # the others may be mid-collective
            error(f"error: {who}{os_error(e)}", every_rank=True)
        elif isinstance(e, dist.DistBackendError) or "by peer" in str(e):  # another rank left: it says why
            code, quiet_exit, lost = 1, True, True  # a consequence, not the cause: no error file, torchrun reports the cause
            log(f"error: lost contact with another rank ({one_line(e)[:200]})", every_rank=True)
        else:
            raise  # a bug: the traceback is the useful report
        return code
    finally:
        if dist.is_initialized():
            if quiet_exit:  # peers may be gone: no barrier to wait on, no teardown that can abort
                sys.stdout.flush(), sys.stderr.flush()
                if lost:
                    wait_for_torchrun()
                os._exit(code)
            end_processes()  # its barrier: rank 0 has reported before any rank leaves


def train(cfg: TrainConfig, tok: Tokenizer, data: SFTData) -> int:
    device = start_processes(torch.cuda.is_available(), always=True)  # FSDP2 wants a group, even a world of one
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if cfg.dtype == "auto":  # resolved before config.json is written, so the run records what it used
        cfg = replace(cfg, dtype="bf16" if device.type == "cuda" else "fp32")
    world = dist.get_world_size()
    if cfg.global_batch % (world * (1 if cfg.packing else cfg.micro_batch)):
        raise ValueError(f"--global-batch {cfg.global_batch} must divide into {world} ranks"
                         + ("" if cfg.packing else f" x --micro-batch {cfg.micro_batch}"))
    steps_per_epoch = len(data) // cfg.global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"{cfg.data}: {len(data)} rows, fewer than one global batch of {cfg.global_batch}")
    if cfg.max_steps > steps_per_epoch:  # one epoch, as the paper trains (Appendix A.1)
        raise ValueError(f"--max-steps {cfg.max_steps}: {cfg.data} gives {steps_per_epoch} steps of {cfg.global_batch} "
                         f"samples in its one epoch (train.py trains one epoch, as the paper does); pass at most "
                         f"{steps_per_epoch}, or raise repeat_time in the meta file")
    total = cfg.max_steps or steps_per_epoch
    out = Path(cfg.out)
    check_shared(out, "--out")  # more than one machine: every rank writes its shards there
    if rank() == 0:
        if cfg.overwrite:
            discard_run(out)
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    log(f"config {json.dumps(asdict(cfg))}", sys.stdout)

    model = build_model(cfg, device, mesh)
    optim = torch.optim.AdamW(param_groups(model, cfg), weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(total, cfg.warmup_ratio))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # DTensor numel is the global size
    log(f"Pv:Pl = {model.cfg.par.pv}:{model.cfg.par.pl}, trainable parameters {trainable:,} of "
        f"{sum(p.numel() for p in model.parameters()):,}, {total} steps of {cfg.global_batch} samples on {world} ranks",
        sys.stdout)
    step, meta = resume(model, optim, sched, out, asdict(cfg)) if cfg.resume else (0, {})
    if rank() == 0:  # the resume is accepted: only now does the folder's config describe this run
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        if cfg.resume:
            trim_metrics(out, step)  # metrics.jsonl then continues with step + 1

    vit_flops, llm_flops = train_flops_per_token(model)
    peak = cfg.peak_tflops or (989.0 if device.type == "cuda" and any(h in torch.cuda.get_device_name(device) for h in ("H100", "H200")) else 0.0)
    order = data.epoch_order(cfg.seed)
    loader = make_loader(data, order, rank(), world, cfg.global_batch, cfg.micro_batch, step, cfg.num_workers, pad_id=0,
                         pin_memory=device.type == "cuda", packing=cfg.packing)  # pinned: copies without a host wait
    host_group = dist.new_group(backend="gloo") if cfg.packing and world > 1 and device.type == "cuda" else None
    counts = meta.get("counts", {"seen": 0, "bad": {}})  # bad-row counts go on from the checkpoint
    bad_total, seen_total, t_start, first_step = dict(counts["bad"]), counts["seen"], time.perf_counter(), step
    named = 0  # bad rows this rank has named on stderr
    for s, batches in loader:
        if s >= total:
            break
        if cfg.packing:
            batches = even_out(batches, host_group, 0, data.image_size)
        torch.manual_seed(cfg.seed + 1_000_003 * (s + 1) + rank())  # the RNG stream is a function of (step, rank)
        t0 = time.perf_counter()
        named = name_bad_rows(data, batches, named)
        # one all-reduce for everything known before the forward (Eq. 6 weight sum, counts, bad rows by
        # reason); it stays on the device, where the loss divides by the weight sum, and the host reads
        # it together with the loss and the gradient norm: one host sync per step
        local = torch.tensor([sum(float(loss_weights(b.labels, b.segment_ids).sum()) for b in batches),
                              sum(b.num_samples for b in batches), sum(int(b.attention_mask.sum()) for b in batches),
                              sum(b.input_ids.numel() for b in batches), sum(b.pixel_values.shape[0] for b in batches),
                              *(sum(b.bad.get(r, 0) for b in batches) for r in BAD_REASONS)], dtype=torch.float64)
        counts = to_device(local, device)
        dist.all_reduce(counts)
        loss_sum, ents = torch.zeros((), device=device), []
        for i, batch in enumerate(batches):
            model.set_requires_gradient_sync(i == len(batches) - 1)  # reduce-scatter once per step
            with allocation(f"--micro-batch {cfg.micro_batch} (this one {batch.input_ids.shape[0]} rows of "
                            f"{batch.input_ids.shape[1]} tokens)", "--micro-batch or --max-seq-len"):
                loss, ent = micro_loss(model, batch, counts[0].clamp_min(1e-12), world, device)
                loss.backward()
            loss_sum = loss_sum + loss.detach()
            if batch.num_samples:  # a filler or all-bad micro-batch's weights say nothing
                ents.append(ent)
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        dist.all_reduce(loss_sum)  # the global loss is the ranks' sum over the world size (see micro_loss)
        _, good, text_tokens, slots, tiles, *bad, loss_value, grad_value = torch.cat(  # the step's one host sync
            [counts, torch.stack([loss_sum / world, grad_norm]).double()]).tolist()
        if not (math.isfinite(loss_value) and math.isfinite(grad_value)):
            raise ValueError(f"step {s + 1}: non-finite loss {loss_value} or grad norm {grad_value}; "
                             f"stopped before the update, last checkpoint kept")
        lrs = {g["name"]: g["lr"] for g in optim.param_groups}  # the rates this update uses
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        step = s + 1
        for reason, n in zip(BAD_REASONS, bad):  # global counts, all ranks
            if n:
                bad_total[reason] = bad_total.get(reason, 0) + int(n)
        seen_total += int(good + sum(bad))
        check_bad_fraction(bad_total, len(data), cfg.max_bad_frac)
        dt = time.perf_counter() - t0
        if step % cfg.log_every == 0 or step == total:
            vit_tokens = tiles * (model.cfg.vit.grid**2 + 1) if model.cfg.vit is not None else 0
            flops = vit_flops * vit_tokens + llm_flops * text_tokens
            mfu = flops / dt / world / (peak * 1e12) if peak else float("nan")
            ent_v, ent_l = torch.stack(ents).nanmean(0).tolist() if ents else (math.nan,) * 2  # nan: no branch weights
            eta = (time.perf_counter() - t_start) / (step - first_step) * (total - step)
            line = {"step": step, "loss": loss_value, "grad_norm": grad_value, "lr": lrs,
                    "tokens_per_s": (text_tokens + vit_tokens) / dt, "samples_per_s": good / dt,
                    "mfu": mfu, "step_flops": flops, "pad_frac": 1 - text_tokens / slots, "peak_gib": peak_memory_gib(device), "eta_s": eta,
                    "entropy_vision": ent_v, "entropy_language": ent_l, "bad_rows": bad_total}
            line = finite(line)  # NaN (no MFU on CPU, no branch weights) as null: JSON has no NaN
            log(json.dumps(line), sys.stdout)
            log(progress_line(line, total, time.perf_counter() - t_start))
            if rank() == 0:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
        if step % cfg.save_every == 0 or step == total:
            save_checkpoint(model, optim, sched, step, out, asdict(cfg), {"seen": seen_total, "bad": bad_total},
                            cfg.keep_last)
        if step >= total:
            break
    export(model, out, Path(cfg.model))
    log(f"exported {out / 'export'}", sys.stdout)
    return 0


if __name__ == "__main__":
    command(main)
