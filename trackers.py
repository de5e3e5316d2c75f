"""Experiment tracking, optional (`--tracker tensorboard|wandb` of train.py and `router.py train`): the
metrics lines a run writes to OUT/metrics.jsonl, sent as they are written, from rank 0, to TensorBoard
event files or a Weights & Biases run, as torchtitan, nanoGPT and InternVL's trainer log theirs.

    torchrun --nproc-per-node 8 train.py ... --out runs/22 --tracker tensorboard   # tensorboard --logdir runs
    WANDB_MODE=offline python train.py ... --out runs/22 --tracker wandb          # wandb sync runs/22/wandb/...

Every number of a line becomes one scalar at the line's step: `loss`, `grad_norm`, a group's rate as
`lr/branches`, a bad-row count as `bad_rows/missing_image`, a router pair's count as
`pair_histogram/3`; a null (a value that was not finite, such as MFU on CPU) is left out, as JSON
left it out. The packages are imported only when asked for, one line when missing.

A resumed run continues the same curves: TensorBoard writes into the same OUT/tensorboard with a
purge step (the reader then drops the events the interrupted run logged past the checkpoint, which
the resumed run logs again), W&B resumes the run id kept in OUT/wandb_id (W&B keeps a step it
already has; resume is bit-identical, so the loss it keeps is the one logged again).
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

from cli import RankError, rank

TRACKERS = ("tensorboard", "wandb")
TRACKER_FILES = ("tensorboard", "wandb", "wandb_id")  # what a tracker leaves in OUT (--overwrite removes it)


def scalars(line: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics line by name, nested ones as `outer/inner`; the step and nulls left out."""
    found = {}
    for key, value in line.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found |= scalars(value, f"{name}/")
        elif isinstance(value, list):
            found |= scalars(dict(enumerate(value)), f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            found[name] = float(value)
    return found


def failure(e: BaseException) -> str:
    """A third-party exception in a few words: its class and its message's first 200 characters, on one line."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


class Tracker:
    """The run's tracker, or nothing (kind None): made before any work, so that a missing package is
    one line before the model loads; `start` opens it on rank 0 at the run's first step; `log` takes
    each metrics line; leaving the `with` closes it."""

    def __init__(self, kind: str | None, folder: Path):
        self.kind, self.folder, self.sink = kind, folder, None
        if kind is not None and (folder / kind).exists() and not (folder / kind).is_dir():  # a file of the user's
            raise ValueError(f"--tracker {kind}: {folder / kind} is a file, where {kind} keeps its folder")
        try:
            if kind == "tensorboard":  # torch's writer needs the tensorboard package for its protobufs
                from torch.utils.tensorboard import SummaryWriter
                self.module = SummaryWriter
            elif kind == "wandb":
                import wandb
                self.module = wandb
        except ImportError:
            raise ValueError(f"--tracker {kind}: the {kind} package is not installed (pip install {kind})") from None
        except Exception as e:  # a broken install (a wrong protobuf, a half-removed package) fails in its import
            raise ValueError(f"--tracker {kind}: importing the {kind} package failed ({failure(e)}); reinstall it "
                             f"(pip install --force-reinstall {kind}) or run without --tracker") from None

    def start(self, first_step: int, config: dict) -> None:
        """Open the tracker on rank 0 for a run that goes on from `first_step` (0: a new run); W&B records
        the run's flags (`config`)."""
        if self.kind is None or rank() != 0:
            return
        if self.kind == "wandb":
            id_file = self.folder / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)  # W&B: [a-z0-9]
            id_file.write_text(run_id)
        try:  # the packages' own errors (W&B: no login, a bad WANDB_MODE or project, no network) are their classes
            if self.kind == "tensorboard":  # the purge step hides what an interrupted run logged past first_step
                self.sink = self.module(log_dir=str(self.folder / "tensorboard"), purge_step=first_step + 1)
            else:
                self.sink = self.module.init(project=os.environ.get("WANDB_PROJECT", "parvl"), name=str(self.folder),
                                             id=run_id, resume="allow", dir=str(self.folder), config=config)
        except OSError:  # a file it could not write: the shell's line names it
            raise
        except Exception as e:
            init = "SummaryWriter" if self.kind == "tensorboard" else "wandb.init"
            raise RankError(f"--tracker {self.kind}: {init} failed ({failure(e)})"
                             + ("; see WANDB_MODE=offline, or run without --tracker" if self.kind == "wandb" else
                                "; run without --tracker")) from None

    def log(self, line: dict) -> None:
        """One metrics line, at its step."""
        if self.sink is None:
            return
        if self.kind == "tensorboard":
            for name, value in scalars(line).items():
                self.sink.add_scalar(name, value, line["step"])
            self.sink.flush()  # a killed run keeps every line it logged, as metrics.jsonl does
        else:
            self.sink.log(scalars(line), step=line["step"])

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, kind, error, tb) -> None:
        if self.sink is not None:
            if self.kind == "tensorboard":
                self.sink.close()
            else:  # finish() can return before W&B's service has written the run's records; teardown waits for
                # it (its atexit hook would too, but a torchrun rank leaves by os._exit: cli.exit_process)
                self.sink.finish(exit_code=int(error is not None))
                self.module.teardown()
            self.sink = None
