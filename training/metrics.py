"""A training run's metrics, one job in three outputs: the metrics line of every log step (stdout,
OUT/metrics.jsonl, rank 0) with its human line (stderr), the optional experiment tracker that receives the
same lines, and `train.py plot`'s picture of a run's metrics.jsonl.

The metrics line: loss, grad norm, lr per group, throughput, MFU against the device's bf16 peak (the
training FLOPs per token are counted here, from the model's parameters), peak memory, ETA, the branch-weight
entropies, the bad-row counts; NaN (no MFU on CPU, no branch weights) is written as null.

Trackers (`--tracker tensorboard|wandb` of train.py and `router.py train`): `loss`, `grad_norm`, a group's rate as
`lr/branches`, a bad-row count as `bad_rows/missing_image`, a router pair's count as
`pair_histogram/3`; a null (a value that was not finite, such as MFU on CPU) is left out, as JSON
left it out. The packages are imported only when asked for, one line when missing.

A resumed run continues the same curves: TensorBoard writes into the same OUT/tensorboard with a
purge step (the reader then drops the events the interrupted run logged past the checkpoint, which
the resumed run logs again), W&B resumes the run id kept in OUT/wandb_id (W&B keeps a step it
already has; resume is bit-identical, so the loss it keeps is the one logged again).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parvl import ParVL
from shell.cli import RankError, hms, log, pyplot, rank
from shell.devices import peak_memory_gib
from shell.files import writing
from shell.outputs import check_file_out

# -- the metrics line -------------------------------------------------------------------------------


def finite(x):
    """NaN and inf as None, so that metrics lines are JSON (json.dumps writes NaN otherwise)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    return x


def train_flops_per_token(model: ParVL) -> tuple[float, float]:
    """Model FLOPs per ViT token and per LLM token for forward + backward (6 x matmul parameters x
    branches; attention scores left out, as MFU conventions do). Activation recomputation is not
    counted: MFU measures useful work."""
    par = model.cfg.par
    matmuls = [(n, p.numel()) for n, p in model.named_parameters() if p.ndim == 2]
    vit = sum(k for n, k in matmuls if n.startswith("vision_model.encoder"))
    llm = sum(k for n, k in matmuls if n.startswith("language_model.model.layers"))
    head = model.language_model.lm_head.weight.numel()
    return 6.0 * vit * par.pv, 6.0 * (llm * par.pl + head)


def progress_line(m: dict, total: int, elapsed: float) -> str:
    """The human line of a log step, for stderr, from its metrics line (null MFU: no peak known)."""
    lr = " ".join(f"{name} {v:.2e}" for name, v in m["lr"].items())
    mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
    return (
        f"step {m['step']}/{total} | loss {m['loss']:.4f} | grad norm {m['grad_norm']:.3f} | lr {lr} | "
        f"{m['tokens_per_s']:,.0f} tokens/s | MFU {mfu} | peak {m['peak_gib']:.1f} GiB | elapsed {hms(elapsed)} | "
        f"eta {hms(m['eta_s'])}"
    )


class Meter:
    """A log step's figures, for train.py's TrainConfig `cfg` (its out and peak_tflops): see the module."""

    def __init__(self, model: ParVL, cfg, device, total: int, first_step: int, tracker: Tracker):
        self.model, self.device, self.total, self.first_step, self.tracker = (
            model,
            device,
            total,
            first_step,
            tracker,
        )
        self.out = Path(cfg.out)
        self.vit_flops, self.llm_flops = train_flops_per_token(model)
        hopper = device.type == "cuda" and any(
            h in torch.cuda.get_device_name(device) for h in ("H100", "H200")
        )
        self.peak = cfg.peak_tflops or (989.0 if hopper else 0.0)
        self.t_start = time.perf_counter()

    def log(self, step: int, stats: dict, dt: float, bad_total: dict) -> None:
        world = dist.get_world_size()
        vit_tokens = (
            stats["tiles"] * (self.model.cfg.vit.grid**2 + 1)
            if self.model.cfg.vit is not None
            else 0
        )
        flops = self.vit_flops * vit_tokens + self.llm_flops * stats["text_tokens"]
        mfu = flops / dt / world / (self.peak * 1e12) if self.peak else float("nan")
        # nan: no weights
        ent_v, ent_l = (
            torch.stack(stats["ents"]).nanmean(0).tolist() if stats["ents"] else (math.nan,) * 2
        )
        elapsed = time.perf_counter() - self.t_start
        line = {
            "step": step,
            "loss": stats["loss"],
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],
            "tokens_per_s": (stats["text_tokens"] + vit_tokens) / dt,
            "samples_per_s": stats["good"] / dt,
            "mfu": mfu,
            "step_flops": flops,
            "pad_frac": 1 - stats["text_tokens"] / stats["slots"],
            "peak_gib": peak_memory_gib(self.device),
            "eta_s": elapsed / (step - self.first_step) * (self.total - step),
            "entropy_vision": ent_v,
            "entropy_language": ent_l,
            "bad_rows": bad_total,
        }
        line = finite(line)  # NaN (no MFU on CPU, no branch weights) as null: JSON has no NaN
        log(json.dumps(line), sys.stdout)
        log(progress_line(line, self.total, elapsed))
        if rank() == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            self.tracker.log(line)  # the same line, at the same step (--tracker)


# -- the tracker: every metrics line to TensorBoard or W&B --------------------------------------------


TRACKERS = ("tensorboard", "wandb")
# what a tracker leaves in OUT (--overwrite removes it)
TRACKER_FILES = ("tensorboard", "wandb", "wandb_id")


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
        # a file of the user's
        if kind is not None and (folder / kind).exists() and not (folder / kind).is_dir():
            raise ValueError(
                f"--tracker {kind}: {folder / kind} is a file, where {kind} keeps its folder"
            )
        try:
            # torch's writer needs the tensorboard package for its protobufs
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self.module = SummaryWriter
            elif kind == "wandb":
                import wandb

                self.module = wandb
        except ImportError:
            raise ValueError(
                f"--tracker {kind}: the {kind} package is not installed (pip install {kind})"
            ) from None
        except (
            Exception
        ) as e:  # a broken install (a wrong protobuf, a half-removed package) fails in its import
            raise ValueError(
                f"--tracker {kind}: importing the {kind} package failed ({failure(e)}); reinstall it "
                f"(pip install --force-reinstall {kind}) or run without --tracker"
            ) from None

    def start(self, first_step: int, config: dict) -> None:
        """Open the tracker on rank 0 for a run that goes on from `first_step` (0: a new run); W&B records
        the run's flags (`config`)."""
        if self.kind is None or rank() != 0:
            return
        if self.kind == "wandb":
            id_file = self.folder / "wandb_id"
            # W&B: [a-z0-9]
            run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
            id_file.write_text(run_id)
        try:  # the packages' own errors (W&B: no login, a bad WANDB_MODE or project, no network) are their classes
            # the purge step hides what an interrupted run logged past first_step
            if self.kind == "tensorboard":
                self.sink = self.module(
                    log_dir=str(self.folder / "tensorboard"), purge_step=first_step + 1
                )
            else:
                self.sink = self.module.init(
                    project=os.environ.get("WANDB_PROJECT", "parvl"),
                    name=str(self.folder),
                    id=run_id,
                    resume="allow",
                    dir=str(self.folder),
                    config=config,
                )
        except OSError:  # a file it could not write: the shell's line names it
            raise
        except Exception as e:
            init = "SummaryWriter" if self.kind == "tensorboard" else "wandb.init"
            raise RankError(
                f"--tracker {self.kind}: {init} failed ({failure(e)})"
                + (
                    "; see WANDB_MODE=offline, or run without --tracker"
                    if self.kind == "wandb"
                    else "; run without --tracker"
                )
            ) from None

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


# -- train.py plot RUN: the metrics as one PNG ----------------------------------------------------


PANELS = (
    ("loss", ("loss",)),
    ("grad norm", ("grad_norm",)),
    ("learning rate", ("lr",)),
    ("branch-weight entropy (nats)", ("entropy_vision", "entropy_language")),
)


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
        except (
            json.JSONDecodeError,
            RecursionError,
        ):  # the last line of a run that is writing it, or not JSON
            continue
        # not a log step of train.py
        if not isinstance(rows[-1], dict) or type(rows[-1].get("step")) is not int:
            rows.pop()
    if not rows:
        torn = len(lines) == 1 and lines[0].startswith('{"step"')  # the first line, being written
        raise ValueError(
            f"{metrics}: no log steps yet"
            if not lines or torn
            else f"{metrics}: none of its {len(lines)} lines is JSON; train.py writes one JSON line a log step"
        )
    plt = pyplot()  # matplotlib is optional: imported only here, one line when missing
    steps = [r["step"] for r in rows]

    def number(v) -> float:  # a null or a string is a gap in the line
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan

    # a null is a gap in the line
    lrs = [r["lr"] if isinstance(r.get("lr"), dict) else {} for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            series = (
                {
                    f"lr {g}": [number(lr.get(g)) for lr in lrs]
                    for g in dict.fromkeys(g for lr in lrs for g in lr)
                }
                if key == "lr"
                else {key.replace("entropy_", ""): [number(r.get(key)) for r in rows]}
            )
            for label, ys in series.items():
                ax.plot(steps, ys, label=label, marker="." if len(steps) < 50 else None)
        if key == "lr":
            ax.set_yscale("log")
        # a legend only of what is drawn: a run whose lines carry no lr groups drew none there, and matplotlib
        # warned in its own words
        if (len(keys) > 1 or key == "lr") and ax.get_legend_handles_labels()[0]:
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
