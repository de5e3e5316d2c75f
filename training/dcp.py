"""A run's checkpoints, DCP the torchtitan way: saved atomically (step_N.tmp, then train.json with every
file's size, a done marker and one rename), verified before a resume trusts them, and read without running
anything they hold. A failed save (full disk, read-only file system, permissions) is one line naming its
cause (files.os_cause) and keeps every complete checkpoint.

A run folder may come from someone else, so a checkpoint is read without running anything it holds:
DCP's .metadata (a pickle) through an unpickler that admits only the classes DCP's metadata is made
of (read_dcp_metadata), and DCP's non-tensor entries (the optimizer's param groups) with torch.load's
weights_only (PlainBytesPlanner); tensors DCP reads with weights_only itself.

    OUT/checkpoints/step_N/   DCP shards + .metadata, train.json (step, scheduler, config, bad-row
                              counts, every file's size), done   (step_N.tmp while being written;
                              step_N.broken once set aside by a fallback)
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shell.cli import one_line, rank
from shell.files import os_cause


def all_sum(*values: float, device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


class Unsafe(ValueError):
    """A checkpoint file that would run code (or reach outside its folder) if loaded: refused, never
    set aside as broken."""


# What the .metadata of torch 2.11-2.13's FileSystemWriter pickles: the dataclasses of
# torch.distributed.checkpoint.metadata, filesystem._StorageInfo, torch.Size, dtypes (as torch.float32
# and so on), layouts (torch.serialization._get_layout, a lookup by name), and the checkpoint_id path.
DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n): getattr(dcp_metadata, n)
    for n in (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{
        ("pathlib", n): getattr(pathlib, n)
        for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    },
}


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
            raise Unsafe(
                f"{path}: refused to load: its pickle names {e}, which DCP's checkpoint metadata never "
                f"holds (loading it could run code); nothing was loaded"
            ) from None
        except Exception as e:  # noqa: BLE001 -- anything a damaged pickle raises: the file is broken
            raise ValueError(f"not DCP metadata ({type(e).__name__}: {one_line(e)[:80]})") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(
        metadata.storage_data, dict
    ):
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
            raise Unsafe(
                f"refused to load {read_item.dest_index.fqn}: not plain data ({one_line(e)[:160]})"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


def unsafe_failure(e: CheckpointException) -> Unsafe | None:
    """The Unsafe refusal inside a failed dcp.load, if that is what failed."""
    return next(
        (f[0] for f in e.failures.values() if isinstance(f, tuple) and isinstance(f[0], Unsafe)),
        None,
    )


STEP_DIR = re.compile(r"step_(\d+)")  # step_N.tmp (a save under way) and step_N.broken do not match


def checkpoint_dirs(out: Path) -> list[Path]:
    """Every step_N folder, oldest first, whether or not it verifies."""
    found = [
        d for d in (out / "checkpoints").glob("step_*") if d.is_dir() and STEP_DIR.fullmatch(d.name)
    ]
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
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get("step"), int)
        or "scheduler" not in meta
    ):
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


def stale(saved: list[Path], keep_last: int, keep_steps: list[int]) -> list[Path]:
    """The checkpoints a save deletes: all but the newest keep_last of `saved` (oldest first), less the
    steps named in keep_steps (train.py --keep-step: the study keeps Table 3's step this way, whatever
    --keep-last is)."""
    return [d for d in saved[:-keep_last] if int(d.name.split("_")[1]) not in keep_steps]


def save_checkpoint(
    model,
    optim,
    sched,
    step: int,
    out: Path,
    config: dict,
    counts: dict,
    keep_last: int,
    keep_steps: list[int] = (),
) -> None:
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
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optim),
        }
        dcp.save(state, checkpoint_id=str(tmp))
        dist.barrier()
        if rank() == 0:
            try:
                files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
                (tmp / "train.json").write_text(
                    json.dumps(
                        {
                            "step": step,
                            "scheduler": sched.state_dict(),
                            "config": config,
                            "counts": counts,
                            "files": files,
                        },
                        indent=2,
                    )
                )
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
        raise ValueError(
            f"cannot save checkpoint {tmp}: {os_cause(failure, out)}; removed the partial save, "
            f"kept {kept[-1] if kept else 'no earlier checkpoint'}"
        ) from None
    if rank() == 0:
        for old in stale(checkpoints(run), keep_last, keep_steps):
            shutil.rmtree(old)
    dist.barrier()


def check_shapes(metadata: dcp_metadata.Metadata, model_state: dict, folder: Path) -> None:
    """The checkpoint holds exactly this model's tensors, at its shapes: otherwise the run was trained
    as another model (another --model or branch parameterisation), which is refused in one line; the
    checkpoint is not broken and stays as it is."""
    saved = {
        k.removeprefix("model."): tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, dcp_metadata.TensorStorageMetadata)
    }
    want = {k: tuple(v.shape) for k, v in model_state.items()}
    differ = sorted(saved.keys() ^ want.keys()) or [k for k in sorted(want) if want[k] != saved[k]]
    if differ:
        key = differ[0]
        what = (
            f"holds {key} as {list(saved[key])}, this run's model has {list(want[key])}"
            if key in saved and key in want
            else f"holds {key}, which this run's model lacks"
            if key in saved
            else f"lacks {key}"
        )
        raise ValueError(
            f"--resume: {folder} {what}: the run was trained as another model (--model or branch "
            f"flags); resume with the run's, or start a new run in another --out"
        )


def read_state(state: dict, folder: Path, metadata: dcp_metadata.Metadata) -> None:
    """dcp.load of `state` from `folder`, running nothing it holds: its .metadata as read_dcp_metadata read
    it (VerifiedReader), non-tensor entries as plain data (PlainBytesPlanner); a refusal is one Unsafe line."""
    try:
        dcp.load(
            state, storage_reader=VerifiedReader(folder, metadata), planner=PlainBytesPlanner()
        )
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


def load_model_state(model, folder: Path) -> None:
    """The model's part of a DCP checkpoint, alone (`train.py export`: no optimizer is built), read as
    --resume reads one (read_state): nothing in it run."""
    state = {"model": get_model_state_dict(model)}
    read_state(state, folder, read_dcp_metadata(folder))
    set_model_state_dict(model, state["model"])
