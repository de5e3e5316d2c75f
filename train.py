"""Supervised fine-tuning of ParVL with FSDP2 (ParVL paper, Appendix A.1; InternVL3.5 SFT recipe).

    torchrun --nproc-per-node 8 train.py --pv 2 --pl 2 --model InternVL3_5-1B --data meta.json --out runs/22
    python train.py --validate-data --model InternVL3_5-1B --data meta.json   # count bad rows, no training
    python train.py plot runs/22                                                # runs/22/metrics.png (matplotlib)
    python train.py export runs/22 --step 7000                      # runs/22/export_step_7000, a kept checkpoint

Full-parameter SFT for one epoch from an InternVL3.5 (or ParVL) checkpoint on data in the official
InternVL format (data/sft.py). The loss is Eq. 6: every supervised token of sample b weighs 1/sqrt(n_b),
normalised by the sum of the weights over the whole global batch (all micro-batches, all ranks), so
the value does not depend on how the batch is split, nor on packing: by default each rank packs its
samples of a step into rows of at most --max-seq-len tokens (data/sft.py), every sample attending only
to itself and its branch prefixes (packing.packed_mask: flex_attention on CUDA, a dense mask on
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
training/runs.py keeps the folder: checkpoints, resume, metrics, export.
Failures are one line on stderr, from rank 0; exit codes 0 done, 1 failure, 2 bad flags, 130 / 143
SIGINT / SIGTERM (the current step is abandoned, complete checkpoints stay).
"""

from __future__ import annotations

import shell.early  # noqa: F401  first: a Ctrl-C during the imports below is one line, exit 130

# isort: split

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from config import ParConfig
from data.bad_rows import check_bad_fraction, data_change, data_files, report_bad_rows
from data.batches import default_workers, make_loader
from data.processor import MAX_TILES
from data.sft import SFTData
from inference.flags import branch_conflict, branch_flags, resolve_branch_flags
from loading.checkpoint import check_not_run_folder
from loading.config_json import open_checkpoint
from shell.cli import SEED, SEEDS, command, log, rank, start_processes
from shell.files import regular_file
from shell.flags import Command, dispatch, flag
from training.dcp import checkpoints, load_model_state, save_checkpoint, verify_checkpoint
from training.fsdp import build_model, param_groups
from training.metrics import TRACKER_FILES, TRACKERS, Meter, Tracker, plot_run
from training.runs import (
    RUN_FILES,
    check_export_out,
    check_out,
    export,
    recorded_run,
    resume,
    start_run,
    trim_metrics,
)
from training.schedule import lr_lambda
from training.step import match_micro_batch_counts, name_bad_rows, train_step

# ParConfig's fields as flags (flags.branch_flags): None takes the run's on --resume, else --model's. They fix
# the branch parameterisation (Figure 3, Table S8), saved in the export's config.json.
BranchFlags = branch_flags("BranchFlags", lambda f: f"the checkpoint's, else {f.default}")


@dataclass
class TrainConfig(BranchFlags):
    """train.py's flags, one field each (flags.flag: help, range, default), the branch flags first; saved as the
    run's config.json."""

    model: str = flag("", "InternVL3.5 or ParVL checkpoint folder", reads=True)
    data: str = flag("", "meta JSON in the official InternVL SFT format", reads=True)
    out: str = flag(
        "runs/parvl",
        "run folder: config, metrics.jsonl, checkpoints, export",
        writes=("config.json", *RUN_FILES, *TRACKER_FILES),
    )
    lr_new: float = flag(8e-5, "peak learning rate of prefixes and aggregators", range="(0, inf)")
    lr_pretrained: float = flag(
        8e-6, "peak learning rate of the pretrained weights", range="(0, inf)"
    )
    weight_decay: float = flag(0.05, "AdamW weight decay", range="[0, inf)")
    warmup_ratio: float = flag(0.03, "fraction of the steps in linear warm-up", range="[0, 1)")
    clip: float = flag(1.0, "max gradient norm (L2)", range="(0, inf)")
    global_batch: int = flag(512, "samples per optimizer step, any world size", range="[1, inf)")
    micro_batch: int = flag(
        1,
        "rows per forward per rank; a row is one sample, or with --packing as many as fit "
        "in --max-seq-len",
        range="[1, inf)",
    )
    packing: bool = flag(
        True,
        "pack each rank's samples of a step into rows of at most --max-seq-len tokens (first "
        "fit, in order), each sample attending only to itself; --no-packing: one right-padded row "
        "per sample",
    )
    max_seq_len: int = flag(
        32768,
        "tokens per sample, image tokens included (longer samples are skipped as "
        "too_long), and with --packing the length of a packed row",
        unit="tokens",
        range="[1, inf)",
    )
    max_tiles: int = flag(
        0,
        "448 px image tiles per sample, shared by its images; 0 = the checkpoint's "
        "max_dynamic_patch, 12 for InternVL3.5",
        range=f"[0, {MAX_TILES}]",
    )
    max_steps: int = flag(0, "optimizer steps, 0 = one epoch", range="[0, inf)")
    seed: int = flag(SEED, "data order and RNG seed", range=SEEDS)
    dtype: str = flag(
        "auto",
        "parameter dtype inside FSDP mixed precision (gradients reduce in fp32); auto = bf16 "
        "on CUDA, fp32 on CPU",
        choices=["auto", "bf16", "fp32"],
    )
    compile: bool = flag(False, "torch.compile every ViT and LLM block")
    activation_checkpointing: bool = flag(True, "recompute each block in backward")
    freeze_vit: bool = flag(False, "do not train the ViT")
    freeze_connector: bool = flag(False, "do not train mlp1")
    freeze_llm: bool = flag(False, "do not train the LLM")
    freeze_backbone: bool = flag(
        False, "train only prefixes and aggregators (ParScale's efficient mode)"
    )
    lora_dropout: float = flag(
        0.05,
        "dropout on the input of each LoRA vision branch's update while training (InternVL's "
        "wrap_backbone_lora: 0.05); prefix branches have none",
        range="[0, 1)",
    )
    save_every: int = flag(500, "steps between checkpoints (and at the end)", range="[1, inf)")
    keep_last: int = flag(2, "checkpoints kept", range="[1, inf)")
    keep_step: list[int] = flag(
        help="steps whose checkpoints --keep-last never deletes (each a multiple of --save-every, "
        "or the last step)",
        factory=list,
        range="[1, inf)",
        shown="none",
    )
    resume: bool = flag(
        False, "continue from the newest checkpoint in --out that verifies (none: start fresh)"
    )
    overwrite: bool = flag(
        False, "discard the run --out holds (checkpoints, export, metrics) and start a new one"
    )
    log_every: int = flag(1, "steps between log lines", range="[1, inf)")
    tracker: str | None = flag(
        None,
        "also log every metrics.jsonl line to TensorBoard (OUT/tensorboard) or W&B "
        "(OUT/wandb; WANDB_MODE=offline needs no network), from rank 0; optional packages "
        "(training/metrics.py)",
        choices=list(TRACKERS),
        shown="none",
    )
    num_workers: int = flag(
        help="data loading processes per rank",
        range="[0, inf)",
        factory=default_workers,
        shown="4, or the CPUs per local rank if fewer",
    )
    max_bad_frac: float = flag(
        0.01,
        "abort once more than this fraction of the data set's rows are bad "
        "(--validate-data's rule)",
        range="[0, 1]",
    )
    peak_tflops: float = flag(
        0.0,
        "per-device bf16 peak in TFLOP/s for MFU, 0 = from the device name (H100/H200: 989)",
        range="[0, inf)",
    )
    validate_data: bool = flag(False, "count and name bad rows, then exit without training")

    def check(self) -> None:
        """Flags that exclude each other (exit 2); branch flags against the checkpoint: resolve_branches."""
        if self.resume and self.overwrite:
            raise ValueError(
                "--resume continues the run in --out, --overwrite discards it: pass one of them"
            )
        if why := branch_conflict({f.name: getattr(self, f.name) for f in fields(ParConfig)}):
            raise ValueError(why)

    def branches(self) -> dict:
        """The branch flags as given (None: the checkpoint's), by ParConfig's field names."""
        return {
            f.name: getattr(self, f.name) for f in fields(ParConfig) if f.name not in ("pv", "pl")
        }

    def check_files(self) -> None:
        """Bad input (exit 1): the model and data paths, before any process group starts."""
        if not self.model or not Path(self.model).is_dir():
            raise ValueError(f"--model {self.model!r}: not a checkpoint folder")
        # runs/11 for runs/11/export: say which folder is meant
        check_not_run_folder(Path(self.model))
        if self.data:
            regular_file(self.data, "--data")  # a FIFO would block the read
        if not self.data or not Path(self.data).is_file():
            raise ValueError(f"--data {self.data!r}: no such meta JSON file")


@dataclass
class PlotConfig:
    run: str = flag(
        help="run folder (train.py --out) holding metrics.jsonl",
        positional=True,
        reads=("metrics.jsonl",),
    )
    out: str | None = flag(None, "PNG file to write", shown="RUN/metrics.png", writes=True)


@dataclass
class ExportConfig:
    run: str = flag(help="run folder (train.py --out)", positional=True, reads=("checkpoints",))
    step: int = flag(
        None,
        "the step to export: a checkpoint RUN/checkpoints/step_N the run still keeps (--keep-last)",
        range="[1, inf)",
        required=True,
    )
    out: str | None = flag(
        None,
        "a new or empty folder to write the ParVL checkpoint into",
        shown="RUN/export_step_N",
        writes=True,
    )
    overwrite: bool = flag(False, "replace what --out holds (never the run's base model)")
    model: str | None = flag(
        None,
        "the run's base model folder (its config.json and tokenizer), where the --model "
        "the run recorded is not (moved, or a relative path of a run before they were absolute)",
        shown="the --model the run recorded",
        reads=True,
    )


def prepare(cfg: TrainConfig) -> int:
    """train.py's job (its files checked first, TrainConfig.check_files): the branch flags resolved against
    the checkpoint (and the run, on --resume), the data opened, then training, or with --validate-data the
    count of its bad rows."""
    tracker = Tracker(cfg.tracker, Path(cfg.out))  # a missing package is one line before any work
    # tiles as the model sees them, and its own tokenizer
    mcfg, tok = open_checkpoint(Path(cfg.model))
    if mcfg.vit is None:
        raise ValueError(
            f"--model {cfg.model}: a language-only checkpoint; train.py trains vision-language models"
        )
    # what the run records: its model and data by absolute path, every branch flag resolved
    if not cfg.validate_data:
        # a resume keeps the run's branch flags
        newest = recorded_run(Path(cfg.out)) if cfg.resume else None
        was = json.loads((newest / "train.json").read_text()).get("config", {}) if newest else None
        branches = resolve_branch_flags(
            {f.name: getattr(cfg, f.name) for f in fields(ParConfig)},
            mcfg.par,
            mcfg.vit.hidden_size,
            cfg.model,
            was,
            f"--resume: {newest}",
        )
        cfg = replace(
            cfg,
            data=str(Path(cfg.data).resolve()),
            model=str(Path(cfg.model).resolve()),
            **branches,
        )
        check_out(Path(cfg.out), cfg.resume, cfg.overwrite)
    data = SFTData(
        cfg.data,
        tok,
        max_tiles=cfg.max_tiles or mcfg.max_dynamic_patch,
        max_seq_len=cfg.max_seq_len,
        image_token_id=mcfg.image_token_id,
        num_image_token=mcfg.tokens_per_tile,
        image_size=mcfg.vit.image_size,
        seed=cfg.seed,
        max_positions=mcfg.llm.max_position_embeddings,
    )
    if cfg.validate_data:
        report_bad_rows(data, cfg.max_bad_frac)
        return 0
    # hashed by the rank that records them in the run
    files = data_files(data) if rank() == 0 else {}
    if was and rank() == 0 and (why := data_change(was.get("data_files", files), files, data)):
        raise ValueError(
            f"--resume: {newest} was trained on {why}; resume on the data the run was trained on, or "
            f"start a new run in another --out"
        )
    with tracker:
        return train(cfg, data, tracker, files)


def interrupt_message(out: Path) -> str:
    """What an interrupted run says it kept."""
    kept = checkpoints(out) if out.is_dir() else []
    return "the current step was abandoned; " + (
        f"last complete checkpoint {kept[-1]} (continue with --resume)"
        if kept
        else "no checkpoint was saved"
    )


def export_step(e: ExportConfig) -> int:
    """`train.py export RUN --step N`: the model of checkpoint step_N, built as the run built it (its flags
    from the checkpoint's train.json, the weights of --model, then the checkpoint's), written by the
    function that writes the end-of-run export. A step the run no longer keeps, or one that does not
    verify, is refused before anything loads."""
    run = Path(e.run)
    folder = run / "checkpoints" / f"step_{e.step}"
    if not (run / "checkpoints").is_dir():
        raise ValueError(f"{run}: not a train.py run folder (no checkpoints/)")
    if not folder.is_dir():
        kept = ", ".join(d.name for d in checkpoints(run)) or "none"
        raise ValueError(
            f"{folder}: no such checkpoint (kept: {kept}); a run keeps its newest --keep-last saves, "
            f"see docs/training.md to keep a step"
        )
    if why := verify_checkpoint(folder):
        raise ValueError(f"{folder}: does not verify ({why})")
    saved = json.loads((folder / "train.json").read_text()).get("config", {})
    known = {f.name for f in fields(TrainConfig)}
    # how the weights were computed does not change them
    cfg = replace(
        TrainConfig(**{k: v for k, v in saved.items() if k in known}),
        compile=False,
        activation_checkpointing=False,
    )
    if e.model is not None:
        if not Path(e.model).is_dir():
            raise ValueError(f"--model {e.model!r}: not a checkpoint folder")
        cfg = replace(cfg, model=e.model)
    elif not Path(cfg.model).is_dir():
        raise ValueError(
            f"{folder}: trained from --model {cfg.model!r}, which is not a folder "
            f"{'any more' if Path(cfg.model).is_absolute() else 'from here'} (the export takes its config "
            f"and tokenizer); pass train.py export --model with that base model's folder"
        )
    out = Path(e.out) if e.out else run / f"export_step_{e.step}"
    check_export_out(out, e.overwrite, Path(cfg.model))
    device = start_processes(torch.cuda.is_available(), always=True)
    model = build_model(cfg, device, init_device_mesh(device.type, (dist.get_world_size(),)))
    load_model_state(model, folder)
    tmp = out.with_name(out.name + ".tmp")  # written whole beside --out, then put in its place
    try:
        export(model, tmp, Path(cfg.model), e.step, named=out)
        if rank() == 0:
            shutil.rmtree(out, ignore_errors=True)  # empty, or --overwrite's
            tmp.rename(out)
    finally:  # an export cut short leaves nothing half written, and --out as it was
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"exported step {e.step} of {run} to {out}", sys.stdout)
    return 0


# -- the step ----------------------------------------------------------------------------------


def train(cfg: TrainConfig, data: SFTData, tracker: Tracker, files: dict[str, str]) -> int:
    """The run: --out's config.json and every checkpoint record its flags and its data files (data_files)."""
    cfg, device, total = start_run(cfg, data)
    record = asdict(cfg) | {"data_files": files}
    world, out = dist.get_world_size(), Path(cfg.out)
    model = build_model(cfg, device, init_device_mesh(device.type, (world,)))
    optim = torch.optim.AdamW(
        param_groups(model, cfg), weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8
    )
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(total, cfg.warmup_ratio))
    # DTensor numel is the global size
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(
        f"Pv:Pl = {model.cfg.par.pv}:{model.cfg.par.pl}, trainable parameters {trainable:,} of "
        f"{sum(p.numel() for p in model.parameters()):,}, {total} steps of {cfg.global_batch} samples on {world} ranks",
        sys.stdout,
    )
    step, meta = resume(model, optim, sched, out, asdict(cfg)) if cfg.resume else (0, {})
    if rank() == 0:  # the resume is accepted: only now does the folder's config describe this run
        (out / "config.json").write_text(json.dumps(record, indent=2))
        if cfg.resume:
            trim_metrics(out, step)  # metrics.jsonl then continues with step + 1
    tracker.start(step, asdict(cfg))  # rank 0; a resumed run's curves go on from its step

    meter = Meter(model, cfg, device, total, step, tracker)
    loader = make_loader(
        data,
        data.epoch_order(cfg.seed),
        rank(),
        world,
        cfg.global_batch,
        cfg.micro_batch,
        step,
        cfg.num_workers,
        pad_id=0,
        pin_memory=device.type == "cuda",  # pinned: no host wait
        packing=cfg.packing,
    )
    host_group = (
        dist.new_group(backend="gloo")
        if cfg.packing and world > 1 and device.type == "cuda"
        else None
    )
    counts = meta.get("counts", {"seen": 0, "bad": {}})  # bad-row counts go on from the checkpoint
    bad_total, seen_total = dict(counts["bad"]), counts["seen"]
    named = 0  # bad rows this rank has named on stderr
    for s, batches in loader:
        if s >= total:
            break
        if cfg.packing:
            batches = match_micro_batch_counts(batches, host_group, 0, data.image_size)
        # the RNG stream is a function of (step, rank)
        torch.manual_seed(cfg.seed + 1_000_003 * (s + 1) + rank())
        t0 = time.perf_counter()
        named = name_bad_rows(data, batches, named)
        stats = train_step(model, optim, sched, batches, cfg, device, s)
        step = s + 1
        for reason, n in stats["bad"].items():  # global counts, all ranks
            if n:
                bad_total[reason] = bad_total.get(reason, 0) + int(n)
        seen_total += int(stats["good"] + sum(stats["bad"].values()))
        check_bad_fraction(bad_total, len(data), cfg.max_bad_frac)
        if step % cfg.log_every == 0 or step == total:
            meter.log(step, stats, time.perf_counter() - t0, bad_total)
        if step % cfg.save_every == 0 or step == total:
            save_checkpoint(
                model,
                optim,
                sched,
                step,
                out,
                record,
                {"seen": seen_total, "bad": bad_total},
                cfg.keep_last,
                cfg.keep_step,
            )
        if step >= total:
            break
    export(model, out / "export", Path(cfg.model), step)
    log(f"exported {out / 'export'}", sys.stdout)
    return 0


# -- the command -------------------------------------------------------------------------------------------


def plot(p: PlotConfig) -> None:
    print(plot_run(Path(p.run), Path(p.out) if p.out else None))


DESCRIPTION, PROG = __doc__.split("\n\n")[0], "train.py"
COMMANDS = {
    None: Command(
        TrainConfig,
        prepare,
        writes=lambda cfg: None if cfg.validate_data else Path(cfg.out),
        interrupted=lambda cfg: interrupt_message(Path(cfg.out)),
    ),
    "plot": Command(
        PlotConfig,
        plot,
        "one PNG of a run's metrics.jsonl (loss, grad norm, lr, branch-weight "
        "entropies against step); needs matplotlib",
    ),
    "export": Command(
        ExportConfig,
        export_step,
        "write the ParVL checkpoint of a kept training step, in the layout "
        "of the run's final export (RUN/export), for generate.py, evaluate.py and router.py",
        # one writer: two exports into one new folder both passed its empty-folder check
        writes=lambda e: Path(e.out or Path(e.run) / f"export_step_{e.step}"),
        interrupted=lambda e: "the export was abandoned; run it again",
    ),
}


def main(argv=None) -> int:
    """`train.py plot RUN` plots a run, `train.py export RUN --step N` exports a kept step; anything else
    trains (or, --validate-data, counts the bad rows). Exit codes and lines: cli.shell."""
    return dispatch(DESCRIPTION, COMMANDS, argv, PROG)


if __name__ == "__main__":
    command(main)
