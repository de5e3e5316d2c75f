"""A training log step's figures (train.py): the metrics line (stdout, OUT/metrics.jsonl and the --tracker, rank 0)
and the human line (stderr), with throughput, MFU against the device's bf16 peak, ETA and the branch-weight
entropies."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cli import hms, log, peak_memory_gib, rank
from fsdp import train_flops_per_token
from parvl import ParVL
from runs import finite
from trackers import Tracker


def progress_line(m: dict, total: int, elapsed: float) -> str:
    """The human line of a log step, for stderr, from its metrics line (null MFU: no peak known)."""
    lr = " ".join(f"{name} {v:.2e}" for name, v in m["lr"].items())
    mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
    return (f"step {m['step']}/{total} | loss {m['loss']:.4f} | grad norm {m['grad_norm']:.3f} | lr {lr} | "
            f"{m['tokens_per_s']:,.0f} tokens/s | MFU {mfu} | peak {m['peak_gib']:.1f} GiB | elapsed {hms(elapsed)} | "
            f"eta {hms(m['eta_s'])}")


class Meter:
    """A log step's figures, for train.py's TrainConfig `cfg` (its out and peak_tflops): see the module."""

    def __init__(self, model: ParVL, cfg, device, total: int, first_step: int, tracker: Tracker):
        self.model, self.device, self.total, self.first_step, self.tracker = model, device, total, first_step, tracker
        self.out = Path(cfg.out)
        self.vit_flops, self.llm_flops = train_flops_per_token(model)
        hopper = device.type == "cuda" and any(h in torch.cuda.get_device_name(device) for h in ("H100", "H200"))
        self.peak = cfg.peak_tflops or (989.0 if hopper else 0.0)
        self.t_start = time.perf_counter()

    def log(self, step: int, r: dict, dt: float, bad_total: dict) -> None:
        world = dist.get_world_size()
        vit_tokens = r["tiles"] * (self.model.cfg.vit.grid**2 + 1) if self.model.cfg.vit is not None else 0
        flops = self.vit_flops * vit_tokens + self.llm_flops * r["text_tokens"]
        mfu = flops / dt / world / (self.peak * 1e12) if self.peak else float("nan")
        ent_v, ent_l = torch.stack(r["ents"]).nanmean(0).tolist() if r["ents"] else (math.nan,) * 2  # nan: no weights
        elapsed = time.perf_counter() - self.t_start
        line = {"step": step, "loss": r["loss"], "grad_norm": r["grad_norm"], "lr": r["lr"],
                "tokens_per_s": (r["text_tokens"] + vit_tokens) / dt, "samples_per_s": r["good"] / dt,
                "mfu": mfu, "step_flops": flops, "pad_frac": 1 - r["text_tokens"] / r["slots"],
                "peak_gib": peak_memory_gib(self.device),
                "eta_s": elapsed / (step - self.first_step) * (self.total - step),
                "entropy_vision": ent_v, "entropy_language": ent_l, "bad_rows": bad_total}
        line = finite(line)  # NaN (no MFU on CPU, no branch weights) as null: JSON has no NaN
        log(json.dumps(line), sys.stdout)
        log(progress_line(line, self.total, elapsed))
        if rank() == 0:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            self.tracker.log(line)  # the same line, at the same step (--tracker)
