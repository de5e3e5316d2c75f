"""A training run's folder: one run per --out, DCP checkpoints saved atomically and verified, --resume with
fallback past broken checkpoints, metrics continued without duplicate steps, the final export, one line for a
failed save (files.os_cause), and `train.py plot`'s picture of a run's metrics (plot_run). No training here.

A run folder may come from someone else, so a checkpoint is read without running anything it holds:
DCP's .metadata (a pickle) through an unpickler that admits only the classes DCP's metadata is made
of (read_dcp_metadata), and DCP's non-tensor entries (the optimizer's param groups) with torch.load's
weights_only (PlainBytesPlanner); tensors DCP reads with weights_only itself.

    OUT/checkpoints/step_N/   DCP shards + .metadata, train.json (step, scheduler, config, bad-row
                              counts, every file's size), done   (step_N.tmp while being written;
                              step_N.broken once set aside by a fallback)
    OUT/metrics.jsonl         one JSON line per log step      OUT/export/  the final ParVL checkpoint
    OUT/export_step_N/        a kept step's ParVL checkpoint (`train.py export OUT --step N`)
"""
from __future__ import annotations

import io
import json
import math
import os
import pathlib
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from checkpoint import record_step
from cli import check_file_out, log, one_line, pyplot, rank
from files import os_cause, same_file, writing
from parvl import ParVL
from trackers import TRACKER_FILES


def all_sum(*values: float, device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


# -- reading a checkpoint without running it ------------------------------------------------------


class Unsafe(ValueError):
    """A checkpoint file that would run code (or reach outside its folder) if loaded: refused, never
    set aside as broken."""


# What the .metadata of torch 2.11-2.13's FileSystemWriter pickles: the dataclasses of
# torch.distributed.checkpoint.metadata, filesystem._StorageInfo, torch.Size, dtypes (as torch.float32
# and so on), layouts (torch.serialization._get_layout, a lookup by name), and the checkpoint_id path.
DCP_CLASSES = {("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n)
               for n in (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo, ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("pathlib", n): getattr(pathlib, n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath",
                                                     "PureWindowsPath")}}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in DCP_CLASSES:
            return DCP_CLASSES[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise Unsafe(f"{module}.{name}")


def read_dcp_metadata(folder: Path) -> dcp_metadata.Metadata:
    """folder/.metadata through MetadataUnpickler. Unsafe (one line naming the file) for a pickle that
    names anything else or a storage entry outside the folder; ValueError for one that is not DCP
    metadata (a broken checkpoint); OSError as it comes."""
    path = folder / ".metadata"
    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f).load()
        except Unsafe as e:
            raise Unsafe(f"{path}: refused to load: its pickle names {e}, which DCP's checkpoint metadata never "
                         f"holds (loading it could run code); nothing was loaded") from None
        except Exception as e:  # noqa: BLE001 -- anything a damaged pickle raises: the file is broken
            raise ValueError(f"not DCP metadata ({type(e).__name__}: {one_line(e)[:80]})") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
        raise ValueError(f"not DCP metadata (a pickled {type(metadata).__name__})")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name != Path(name).name or name in ("", ".", ".."):
            raise Unsafe(f"{path}: refused to load: it points at {name!r}, not a file of {folder}")
    return metadata


class VerifiedReader(FileSystemReader):
    """DCP's file reader with its metadata already read by read_dcp_metadata: DCP never unpickles it."""

    def __init__(self, folder: Path, metadata: dcp_metadata.Metadata):
        super().__init__(str(folder))
        self.metadata = metadata

    def read_metadata(self) -> dcp_metadata.Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = dcp_metadata.StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class PlainBytesPlanner(DefaultLoadPlanner):
    """DCP's planner, but a non-tensor entry (the optimizer's param groups: numbers, strings, tuples) is
    first read with torch.load(weights_only=True), which refuses anything that could run code; only
    then does DCP load it as it always does."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        except pickle.UnpicklingError as e:
            raise Unsafe(f"refused to load {read_item.dest_index.fqn}: not plain data ({one_line(e)[:160]})") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def unsafe_failure(e: CheckpointException) -> Unsafe | None:
    """The Unsafe refusal inside a failed dcp.load, if that is what failed."""
    return next((f[0] for f in e.failures.values() if isinstance(f, tuple) and isinstance(f[0], Unsafe)), None)


# -- the run folder and its checkpoints ---------------------------------------------------------


RUN_FILES = ("checkpoints", "export", "metrics.jsonl")  # what makes a folder someone's run


def check_out(out: Path, resume: bool, overwrite: bool) -> None:
    """A run folder belongs to one run. Refuse, before any process group starts, a new run into an
    --out that holds another run's checkpoints, export or metrics (it would overwrite the export,
    mix the metrics and let --keep-last delete the new checkpoints), and an --out that cannot be
    written. Reads and one temporary file only; --overwrite discards later, on rank 0."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file, not a folder")
    if out.is_symlink() and not out.exists():
        raise ValueError(f"--out {out}: a symbolic link to {os.readlink(out)}, which does not exist")
    for name, folder in (("checkpoints", True), ("export", True), ("metrics.jsonl", False), ("config.json", False)):
        if (out / name).exists() and (out / name).is_dir() != folder:
            raise ValueError(f"--out {out}: {out / name} is a {'file' if folder else 'folder'}, where the run keeps "
                             f"its {name} {'folder' if folder else 'file'}")
    held = [name for name in RUN_FILES if (out / name).exists() and (
        not (out / name).is_dir() or any((out / name).iterdir()))]
    if held and not resume and not overwrite:
        raise ValueError(f"--out {out} already holds a run ({', '.join(held)}): pass --resume to continue it, "
                         f"a new --out, or --overwrite to discard it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({os_cause(e)})") from None


def discard_run(out: Path) -> None:
    """--overwrite: remove the previous run's files, its step exports and tracker files too (rank 0, before
    anything new is written)."""
    for path in [*(out / name for name in (*RUN_FILES, "config.json", *TRACKER_FILES)), *out.glob("export_step_*")]:
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
        except (ValueError, KeyError, TypeError, RecursionError):  # a line nested past the JSON reader: dropped
            pass
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def finite(x):
    """NaN and inf as None, so that metrics lines are JSON (json.dumps writes NaN otherwise)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    return x


STEP_DIR = re.compile(r"step_(\d+)")  # step_N.tmp (a save under way) and step_N.broken do not match


def checkpoint_dirs(out: Path) -> list[Path]:
    """Every step_N folder, oldest first, whether or not it verifies."""
    found = [d for d in (out / "checkpoints").glob("step_*") if d.is_dir() and STEP_DIR.fullmatch(d.name)]
    return sorted(found, key=lambda d: int(d.name.split("_")[1]))


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first; step_N.tmp folders (interrupted saves) do not count."""
    return [d for d in checkpoint_dirs(out) if (d / "done").exists()]


def verify_checkpoint(folder: Path) -> str | None:
    """Why `folder` cannot be resumed from, or None. Checks the done marker, train.json, that every
    file the save wrote (train.json lists them with their sizes) is there with that size (a
    checkpoint from before that list needs at least DCP's .metadata), and that .metadata reads as DCP
    metadata (read_dcp_metadata: a pickle naming anything else raises Unsafe, a refusal, not a "why")."""
    if not (folder / "done").is_file():
        return "no done marker (an interrupted save)"
    try:
        meta = json.loads((folder / "train.json").read_text())
    except FileNotFoundError:
        return "train.json is missing"
    except (OSError, ValueError, RecursionError) as e:
        return f"train.json is unreadable ({type(e).__name__}: {one_line(e)})"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "scheduler" not in meta:
        return "train.json has no step or scheduler"
    if meta["step"] != int(folder.name.split("_")[1]):
        return f"train.json says step {meta['step']}"
    files = {".metadata": None, **meta.get("files", {})}
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if size is not None and path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, the save wrote {size}"
    try:
        read_dcp_metadata(folder)
    except Unsafe:
        raise
    except (OSError, ValueError) as e:
        return f".metadata is unreadable ({os_cause(e)})"
    return None


def recorded_run(out: Path) -> Path | None:
    """The newest checkpoint of the run in `out` that verifies (the one --resume tries first), or None."""
    return next((d for d in reversed(checkpoint_dirs(out)) if verify_checkpoint(d) is None), None)


def save_checkpoint(model, optim, sched, step: int, out: Path, config: dict, counts: dict, keep_last: int) -> None:
    """DCP save into step_N.tmp, then train.json (with the size of every file), the done marker and
    one rename, so a folder named step_N is complete. A failed save (full disk, read-only file
    system, permissions) removes its step_N.tmp, keeps every complete checkpoint and raises one
    line; every rank learns of a failure on rank 0, so none waits for the others. config (the run's
    flags) goes into train.json, for --resume to compare."""
    run, out = out, out / "checkpoints"
    final, tmp = out / f"step_{step}", out / f"step_{step}.tmp"
    failure: BaseException | None = None
    try:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
        dcp.save(state, checkpoint_id=str(tmp))
        dist.barrier()
        if rank() == 0:
            try:
                files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
                (tmp / "train.json").write_text(json.dumps(
                    {"step": step, "scheduler": sched.state_dict(), "config": config, "counts": counts,
                     "files": files}, indent=2))
                (tmp / "done").write_text("")
                tmp.rename(final)  # atomic: a folder named step_N is always complete
            except OSError as e:
                failure = e
        if all_sum(float(failure is not None), device=next(model.parameters()).device)[0]:
            failure = failure or OSError("the save failed on rank 0")
    except (OSError, RuntimeError, CheckpointException) as e:  # dcp.save fails on every rank alike
        failure = e
    except BaseException:  # interrupted mid-save: the partial folder goes, the complete ones stay
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if failure is not None:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = checkpoints(run)
        raise ValueError(f"cannot save checkpoint {tmp}: {os_cause(failure, out)}; removed the partial save, "
                         f"kept {kept[-1] if kept else 'no earlier checkpoint'}") from None
    if rank() == 0:
        for old in checkpoints(run)[: -keep_last]:
            shutil.rmtree(old)
    dist.barrier()


def check_shapes(metadata: dcp_metadata.Metadata, model_state: dict, folder: Path) -> None:
    """The checkpoint holds exactly this model's tensors, at its shapes: otherwise the run was trained
    as another model (another --model or branch parameterisation), which is refused in one line; the
    checkpoint is not broken and stays as it is."""
    saved = {k.removeprefix("model."): tuple(v.size) for k, v in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, dcp_metadata.TensorStorageMetadata)}
    want = {k: tuple(v.shape) for k, v in model_state.items()}
    differ = sorted(saved.keys() ^ want.keys()) or [k for k in sorted(want) if want[k] != saved[k]]
    if differ:
        key = differ[0]
        what = (f"holds {key} as {list(saved[key])}, this run's model has {list(want[key])}" if key in saved and key
                in want else f"holds {key}, which this run's model lacks" if key in saved else f"lacks {key}")
        raise ValueError(f"--resume: {folder} {what}: the run was trained as another model (--model or branch "
                         f"flags); resume with the run's, or start a new run in another --out")


def read_state(state: dict, folder: Path, metadata: dcp_metadata.Metadata) -> None:
    """dcp.load of `state` from `folder`, running nothing it holds: its .metadata as read_dcp_metadata read
    it (VerifiedReader), non-tensor entries as plain data (PlainBytesPlanner); a refusal is one Unsafe line."""
    try:
        dcp.load(state, storage_reader=VerifiedReader(folder, metadata), planner=PlainBytesPlanner())
    except CheckpointException as e:
        if (refused := unsafe_failure(e)) is not None:
            raise Unsafe(f"{folder}: {refused}") from None
        raise


def load_checkpoint(model, optim, sched, folder: Path, metadata: dcp_metadata.Metadata) -> dict:
    """Model, optimizer and scheduler state from `folder` (its .metadata read by read_dcp_metadata);
    returns its train.json. The scheduler goes on from the saved step on *this* run's schedule
    (lr_lambda of this run's total): each group's rate is set to base_lr * lambda(step) now, so a run
    whose --max-steps changed does not take its first step at the old schedule's last rate. With the
    same flags this is the value the scheduler had."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    read_state(state, folder, metadata)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    meta = json.loads((folder / "train.json").read_text())
    sched.load_state_dict(meta["scheduler"])
    for group, base, f in zip(optim.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * f(meta["step"])
    sched._last_lr = [group["lr"] for group in optim.param_groups]
    return meta


# Flags a resumed run must share with the run it continues: they fix the data order, the loss and the
# update rule, so a change would silently make a different run. --max-steps may change (the schedule
# is rebuilt for the new total); the others (logging, saving, workers, compile) do not change the maths.
# The branch parameterisation (Pv:Pl, prefix lengths, ...) fixes the run too: flags.resolve_branch_flags.
RESUME_FIXED = ("data", "seed", "global_batch", "max_seq_len", "max_tiles", "lr_new", "lr_pretrained", "weight_decay",
                "warmup_ratio", "clip", "dtype", "freeze_vit", "freeze_connector", "freeze_llm", "freeze_backbone")


def check_resumed_flags(meta: dict, config: dict, folder: Path) -> None:
    """The RESUME_FIXED flags of the checkpoint's run and of this one agree; --data by the file it names
    (the run records its absolute path; the same file by another path, from another folder, agrees)."""
    saved = meta.get("config", {})
    for name in RESUME_FIXED:
        if name in saved and saved[name] != config[name] and not (name == "data" and same_file(saved[name],
                                                                                              config[name])):
            raise ValueError(f"--resume: {folder} was trained with --{name.replace('_', '-')} {saved[name]}, this "
                             f"run asks for {config[name]}; resume with the same value, or start a new run in another "
                             f"--out")


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
            check_shapes(metadata, get_model_state_dict(model), folder)  # another model: refused, not broken
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
        log(f"--resume: no usable checkpoint in {out / 'checkpoints'}"
             f"{f' (skipped {what}; renamed .broken)' if skipped else ''}: starting from step 0")
    else:
        now = config["max_steps"]
        was = meta.get("config", {}).get("max_steps", now)
        schedule = f"; --max-steps {was} -> {now}: the new schedule from step {step}" if was != now else ""
        skips = f" (skipped {what}; renamed .broken)" if skipped else ""
        log(f"resuming from {chosen} at step {step}{schedule}{skips}")
    return step, meta


def load_model_state(model, folder: Path) -> None:
    """The model's part of a DCP checkpoint, alone (`train.py export`: no optimizer is built), read as
    --resume reads one (read_state): nothing in it run."""
    state = {"model": get_model_state_dict(model)}
    read_state(state, folder, read_dcp_metadata(folder))
    set_model_state_dict(model, state["model"])


def export(model: ParVL, folder: Path, tokenizer_from: Path, step: int | None = None,
           named: Path | None = None) -> None:
    """The model as a ParVL safetensors checkpoint (InternVL layout + branch tensors) in `folder` (OUT/export, or
    OUT/export_step_N of `train.py export OUT --step N`), its training step in config.json (record_step); a
    failure names `named`, the folder the user asked for, where `folder` is a place beside it (OUT.tmp)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    failure = None
    if rank() == 0:
        with torch.device("meta"):
            plain = ParVL(model.cfg)
        plain.load_state_dict(full, assign=True)
        plain.language_model.model.init_rope("cpu")
        try:
            plain.save(folder, tokenizer_from=tokenizer_from)
            record_step(folder, step)
        except (OSError, SafetensorError) as e:  # the checkpoints stay; a half-written weights file does not
            (folder / "model.safetensors.tmp").unlink(missing_ok=True)
            failure = f"cannot write the export {named or folder}: {os_cause(e, folder.parent)}"
    if all_sum(float(failure is not None), device=next(model.parameters()).device)[0]:
        raise ValueError(failure or "the export failed on rank 0")


# -- train.py plot RUN: the metrics as one PNG ----------------------------------------------------

PANELS = (("loss", ("loss",)), ("grad norm", ("grad_norm",)), ("learning rate", ("lr",)),
          ("branch-weight entropy (nats)", ("entropy_vision", "entropy_language")))


def plot_run(run: Path, png: Path | None = None) -> Path:
    """One PNG of a run's metrics.jsonl against step: loss, grad norm, lr per group (log scale), and
    the entropies of the vision and language branch weights (collapse shows as a drop)."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{metrics}: no such file (RUN is a train.py --out folder)")
    if png is not None:
        check_file_out(png, "--out")  # a folder would get FOLDER.png beside it
    rows, lines = [], [x for x in metrics.read_text(errors="replace").splitlines() if x.strip()]
    for raw in lines:
        try:
            rows.append(json.loads(raw))
        except (json.JSONDecodeError, RecursionError):  # the last line of a run that is writing it, or not JSON
            continue
        if not isinstance(rows[-1], dict) or type(rows[-1].get("step")) is not int:  # not a log step of train.py
            rows.pop()
    if not rows:
        torn = len(lines) == 1 and lines[0].startswith('{"step"')  # the first line, being written
        raise ValueError(f"{metrics}: no log steps yet" if not lines or torn else
                         f"{metrics}: none of its {len(lines)} lines is JSON; train.py writes one JSON line a log step")
    plt = pyplot()  # matplotlib is optional: imported only here, one line when missing
    steps = [r["step"] for r in rows]
    number = lambda v: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan  # noqa: E731
    lrs = [r["lr"] if isinstance(r.get("lr"), dict) else {} for r in rows]  # a null is a gap in the line
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            series = ({f"lr {g}": [number(lr.get(g)) for lr in lrs] for g in dict.fromkeys(g for lr in lrs for g in lr)}
                      if key == "lr" else {key.replace("entropy_", ""): [number(r.get(key)) for r in rows]})
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
    with writing(png):  # a full disk names the file
        fig.savefig(png, dpi=100, format="png")  # the file named, even without a .png suffix
    plt.close(fig)
    return png
