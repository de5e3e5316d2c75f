"""A training run's folder: one run per --out, --resume with fallback past broken checkpoints, metrics
continued without duplicate steps, the final export. The checkpoints themselves (DCP, atomic, verified,
read without running anything) are dcp.py's; no training here.

    OUT/checkpoints/step_N/   a DCP checkpoint (dcp.py)           OUT/metrics.jsonl  one JSON line per log step
    OUT/export/               the final ParVL checkpoint          OUT/config.json    the run's flags
    OUT/export_step_N/        a kept step's ParVL checkpoint (`train.py export OUT --step N`)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from data.sft import SFTData
from loading.config_json import record_step
from loading.pretrained import save_pretrained
from parvl import ParVL
from shell.cli import log, rank, start_processes
from shell.files import os_cause, same_file
from shell.flags import overlap
from shell.outputs import check_folder, check_shared
from training.dcp import (
    Unsafe,
    all_sum,
    check_shapes,
    checkpoint_dirs,
    load_checkpoint,
    read_dcp_metadata,
    verify_checkpoint,
)
from training.metrics import TRACKER_FILES

RUN_FILES = ("checkpoints", "export", "metrics.jsonl")  # what makes a folder someone's run


def check_out(out: Path, resume: bool, overwrite: bool) -> None:
    """A run folder belongs to one run. Refuse, before any process group starts, a new run into an
    --out that holds another run's checkpoints, export or metrics (it would overwrite the export,
    mix the metrics and let --keep-last delete the new checkpoints), and an --out that cannot be
    written. Reads and one temporary file only; --overwrite discards later, on rank 0."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a folder")
    if out.is_symlink() and not out.exists():
        raise ValueError(
            f"--out {out}: a symbolic link to {os.readlink(out)}, which does not exist"
        )
    for name, folder in (
        ("checkpoints", True),
        ("export", True),
        ("metrics.jsonl", False),
        ("config.json", False),
    ):
        if (out / name).exists() and (out / name).is_dir() != folder:
            raise ValueError(
                f"--out {out}: {out / name} is a {'file' if folder else 'folder'}, where the run keeps "
                f"its {name} {'folder' if folder else 'file'}"
            )
    held = [
        name
        for name in RUN_FILES
        if (out / name).exists() and (not (out / name).is_dir() or any((out / name).iterdir()))
    ]
    if held and not resume and not overwrite:
        raise ValueError(
            f"--out {out} already holds a run ({', '.join(held)}): pass --resume to continue it, "
            f"a new --out, or --overwrite to discard it"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({os_cause(e)})") from None


def discard_run(out: Path) -> None:
    """--overwrite: remove the previous run's files, its step exports and tracker files too (rank 0, before
    anything new is written)."""
    for path in [
        *(out / name for name in (*RUN_FILES, "config.json", *TRACKER_FILES)),
        *out.glob("export_step_*"),
    ]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def trim_metrics(out: Path, step: int) -> None:
    """On resume, drop metrics lines past the resumed step (and a line torn by a crash), so the file
    holds each step once. Written to a temporary file and renamed: never half a file."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (
            ValueError,
            KeyError,
            TypeError,
            RecursionError,
        ):  # a line nested past the JSON reader: dropped
            pass
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def recorded_run(out: Path) -> Path | None:
    """The newest checkpoint of the run in `out` that verifies (the one --resume tries first), or None."""
    return next((d for d in reversed(checkpoint_dirs(out)) if verify_checkpoint(d) is None), None)


# Flags a resumed run must share with the run it continues: they fix the data order, the loss and the
# update rule (LoRA's dropout too), so a change would silently make a different run. --max-steps may change
# (the schedule is rebuilt for the new total); the others (logging, saving, workers, compile) do not change
# the maths.
# The branch parameterisation (Pv:Pl, prefix lengths, ...) fixes the run too: flags.resolve_branch_flags.
RESUME_FIXED = (
    "data",
    "seed",
    "global_batch",
    "max_seq_len",
    "max_tiles",
    "lr_new",
    "lr_pretrained",
    "weight_decay",
    "warmup_ratio",
    "clip",
    "lora_dropout",
    "dtype",
    "freeze_vit",
    "freeze_connector",
    "freeze_llm",
    "freeze_backbone",
)


def check_resumed_flags(meta: dict, config: dict, folder: Path) -> None:
    """The RESUME_FIXED flags of the checkpoint's run and of this one agree; --data by the file it names
    (the run records its absolute path; the same file by another path, from another folder, agrees)."""
    saved = meta.get("config", {})
    for name in RESUME_FIXED:
        if (
            name in saved
            and saved[name] != config[name]
            and not (name == "data" and same_file(saved[name], config[name]))
        ):
            raise ValueError(
                f"--resume: {folder} was trained with --{name.replace('_', '-')} {saved[name]}, this "
                f"run asks for {config[name]}; resume with the same value, or start a new run in another "
                f"--out"
            )


def resume(model, optim, sched, out: Path, config: dict) -> tuple[int, dict]:
    """--resume: load the newest checkpoint that verifies and loads, falling back past broken ones,
    and say in one line which one and what was skipped and why. Broken ones newer than the one
    loaded are renamed step_N.broken (kept for a look, out of --keep-last's way). No usable
    checkpoint: start at step 0 and say so. Every rank decides alike from the same files. Refused in
    one line, with nothing in the folder changed: a checkpoint of a run with other RESUME_FIXED flags,
    one whose tensors are not this model's (check_shapes: not broken, another model), one that would
    run code (Unsafe). Returns the step and train.json."""
    skipped, step, chosen, meta = [], 0, None, {}
    for folder in reversed(checkpoint_dirs(out)):
        why = verify_checkpoint(folder)
        if why is None:
            check_resumed_flags(json.loads((folder / "train.json").read_text()), config, folder)
            metadata = read_dcp_metadata(folder)
            # another model: refused, not broken
            check_shapes(metadata, get_model_state_dict(model), folder)
            try:
                meta, chosen = load_checkpoint(model, optim, sched, folder, metadata), folder
                step = meta["step"]
                break
            except Unsafe:
                raise
            except (OSError, RuntimeError, ValueError, KeyError, CheckpointException) as e:
                why = f"cannot be loaded ({os_cause(e)})"
        skipped.append((folder, why))
    dist.barrier()
    if rank() == 0:
        for folder, _ in skipped:
            aside = folder.with_name(folder.name + ".broken")
            for k in range(1, 1000):  # an earlier fallback may have set one aside under that name
                if not aside.exists():
                    break
                aside = folder.with_name(f"{folder.name}.broken{k}")
            folder.rename(aside)
    dist.barrier()
    what = "; ".join(f"{f.name}: {why}" for f, why in skipped)
    if chosen is None:
        log(
            f"--resume: no usable checkpoint in {out / 'checkpoints'}"
            f"{f' (skipped {what}; renamed .broken)' if skipped else ''}: starting from step 0"
        )
    else:
        now = config["max_steps"]
        was = meta.get("config", {}).get("max_steps", now)
        schedule = (
            f"; --max-steps {was} -> {now}: the new schedule from step {step}" if was != now else ""
        )
        skips = f" (skipped {what}; renamed .broken)" if skipped else ""
        log(f"resuming from {chosen} at step {step}{schedule}{skips}")
    return step, meta


def export(
    model: ParVL,
    folder: Path,
    tokenizer_from: Path,
    step: int | None = None,
    named: Path | None = None,
) -> None:
    """The model as a ParVL safetensors checkpoint (InternVL layout + branch tensors) in `folder` (OUT/export, or
    OUT/export_step_N of `train.py export OUT --step N`), its training step in config.json (record_step); a
    failure names `named`, the folder the user asked for, where `folder` is a place beside it (OUT.tmp)."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    failure = None
    if rank() == 0:
        with torch.device("meta"):
            plain = ParVL(model.cfg)
        plain.load_state_dict(full, assign=True)
        plain.language_model.model.init_rope("cpu")
        try:
            save_pretrained(plain, folder, tokenizer_from=tokenizer_from)
            record_step(folder, step)
        except (
            OSError,
            SafetensorError,
        ) as e:  # the checkpoints stay; a half-written weights file does not
            (folder / "model.safetensors.tmp").unlink(missing_ok=True)
            failure = f"cannot write the export {named or folder}: {os_cause(e, folder.parent)}"
    if all_sum(float(failure is not None), device=next(model.parameters()).device)[0]:
        raise ValueError(failure or "the export failed on rank 0")


def check_export_out(out: Path, overwrite: bool, base: Path) -> None:
    """An export goes to a new or empty folder, as a run goes to a new --out; --overwrite replaces what is there,
    but never the run's base model, whose config and tokenizer the export reads. One line, before anything loads."""
    check_folder(out, "--out")  # a file in the way
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        raise ValueError(
            f"--out {out} already holds {', '.join(held[:4])}{', ...' * (len(held) > 4)}: an export goes "
            f"to a new or empty folder; pick another --out, or pass --overwrite to replace what is there"
        )
    if overlap((out.resolve(), None), (base.resolve(), None)) is not None:
        where = (
            f"lies inside the run's base model {base}"
            if base.resolve() in out.resolve().parents
            else f"is the run's base model {base}"
            if out.resolve() == base.resolve()
            else f"holds the run's base model {base}"
        )
        raise ValueError(
            f"--out {out}: {where}, which the export reads; an output is never an input: pick another "
            f"--out"
        )


def start_run(cfg, data: SFTData) -> tuple:
    """The start of a run of train.py's TrainConfig `cfg` on `data`: the process group (FSDP2 wants one,
    even a world of one), the dtype resolved, the run's number of steps (one epoch, as the paper trains,
    Appendix A.1, or --max-steps of it), and the run folder, which every rank must see."""
    device = start_processes(torch.cuda.is_available(), always=True)
    # resolved before config.json is written, so the run records what it used
    if cfg.dtype == "auto":
        cfg = replace(cfg, dtype="bf16" if device.type == "cuda" else "fp32")
    world = dist.get_world_size()
    if cfg.global_batch % (world * (1 if cfg.packing else cfg.micro_batch)):
        raise ValueError(
            f"--global-batch {cfg.global_batch} must divide into {world} ranks"
            + ("" if cfg.packing else f" x --micro-batch {cfg.micro_batch}")
        )
    steps_per_epoch = len(data) // cfg.global_batch
    if steps_per_epoch == 0:
        raise ValueError(
            f"{cfg.data}: {len(data)} rows, fewer than one global batch of {cfg.global_batch}"
        )
    if cfg.max_steps > steps_per_epoch:
        raise ValueError(
            f"--max-steps {cfg.max_steps}: {cfg.data} gives {steps_per_epoch} steps of "
            f"{cfg.global_batch} samples in its one epoch (train.py trains one epoch, as the paper "
            f"does); pass at most {steps_per_epoch}, or raise repeat_time in the meta file"
        )
    out = Path(cfg.out)
    check_shared(out, "--out")  # more than one machine: every rank writes its shards there
    if rank() == 0:
        if cfg.overwrite:
            discard_run(out)
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    log(f"config {json.dumps(asdict(cfg))}", sys.stdout)
    return cfg, device, cfg.max_steps or steps_per_epoch
