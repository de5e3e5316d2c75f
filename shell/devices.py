"""Devices and dtypes by name (--device, --dtype): resolved once, one line for a device this machine does not
have; the peak memory a job's figures report."""

from __future__ import annotations

import resource

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    """--device as a torch.device, or one line on what is wrong with it (before any file is read,
    so a missing GPU is not reported as an unreadable checkpoint)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name!r}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA GPU is visible"
            )
            raise ValueError(f"--device {name}: CUDA is not available ({why}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (0 to "
                f"{torch.cuda.device_count() - 1})"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: MPS is not available on this machine; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {name}: not supported here; use cpu or cuda")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """--dtype (bf16, fp16, fp32), by default bf16 on CUDA and fp32 elsewhere."""
    return DTYPES[name or ("bf16" if device.type == "cuda" else "fp32")]


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
