"""A router folder (gates.py's Router, written by `router.py train`): router.safetensors and its
config.json, written and read back, checked against the model it routes."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import save_file

from gates import Router, RouterConfig, RouterError
from loading.checkpoint import read_json
from loading.weights import read_safetensors
from parvl import ParVL
from shell.files import write_text, writing

# what save_router writes and load_router reads of a folder
ROUTER_SAVED = ("router.safetensors", "config.json")


def save_router(router: Router, folder: Path, extra: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # a full disk names the file, not safetensors' own error
    with writing(folder / "router.safetensors"):
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in router.state_dict().items()},
            str(folder / "router.safetensors"),
        )
    write_text(
        folder / "config.json", json.dumps({"router": asdict(router.cfg), **extra}, indent=2)
    )


def load_router(path: str | Path, model: ParVL | None = None) -> Router:
    """A router folder (config.json + router.safetensors), checked against `model` when given."""
    folder = Path(path)
    if not folder.is_dir():
        raise RouterError(f"{folder}: no such router folder")
    # read_json's line would ask whether it is a checkpoint
    if not (folder / "config.json").is_file():
        held = ", ".join(sorted(p.name for p in folder.iterdir())[:5]) or "nothing"
        raise RouterError(
            f"{folder}: not a router folder (it holds {held}; router.py train writes config.json and "
            f"router.safetensors)"
        )
    raw = read_json(folder / "config.json")
    try:
        cfg = RouterConfig(**raw["router"])
    except (KeyError, TypeError) as e:
        raise RouterError(
            f"{folder}/config.json: not a router config ({type(e).__name__}: {e})"
        ) from None
    if not (folder / "router.safetensors").is_file():
        raise RouterError(f"{folder}: no router.safetensors")
    state = read_safetensors(folder / "router.safetensors")
    router = Router(cfg)
    want = {k: tuple(v.shape) for k, v in router.state_dict().items()}
    if {k: tuple(v.shape) for k, v in state.items()} != want:
        raise RouterError(f"{folder}/router.safetensors: tensors do not match its config.json")
    router.load_state_dict(state)
    if model is not None:
        router.check(model, str(folder))
        router.to(model.language_model.lm_head.weight.device)
    return router.eval()
