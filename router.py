"""The sparse router's command (paper Appendix E; Table 3; Table S9 for the evaluation layout):
label the offline path teacher, train the two gates, evaluate them. The router itself (gates, their
inputs, Eq. E1 / E2, the choices where Appendix E is silent) is gates.py.

    python router.py label --model CKPT --data META.json --out LABELS        # offline path teacher
    torchrun --nproc-per-node 8 router.py label --model CKPT --data META.json --out LABELS
    torchrun --nproc-per-node 8 router.py train --model CKPT --labels LABELS --data META.json --out DIR
    python router.py eval --model CKPT --router DIR --labels HELDOUT          # Table 3 / S9 layout
    python generate.py image.png "Question?" --model CKPT --router DIR --json

`label` (training/router_labels.py) stores, for every row, the answer NLL c[v,l] of every pair and the gate
inputs, one resumable job the ranks share; `train` reads them instead of running the model for every
step, and rechecks a few samples against the model first; `eval` compares the router's choices with a
random pair, the oracle pair, dense aggregation and every fixed pair. Pair accuracy: the chosen pair
attains the sample's minimum NLL (ties count as correct).

Shape legend: aggregate.py's (B samples, Cv ViT width, C LLM width).
"""

from __future__ import annotations

import shell.early  # noqa: F401  first: a Ctrl-C during the imports below is one line, exit 130

# isort: split

import hashlib
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from data.sft import SFTData
from gates import Router, RouterConfig, RouterError, path_teacher, router_loss
from inference.flags import DeviceFlags
from loading.router import ROUTER_SAVED, load_router, save_router
from loss import answer_nll
from parvl import ParVL
from shell.cli import (
    SEED,
    SEEDS,
    allocation,
    barrier,
    command,
    log,
    rank,
    start_processes,
    world_size,
)
from shell.flags import Command, dispatch, flag, reuse_flag
from shell.outputs import check_folder
from training.metrics import TRACKER_FILES, TRACKERS, Tracker
from training.router_labels import (
    LABEL_FILES,
    LABELLED,
    LabelConfig,
    RouterInputs,
    by_length,
    check_labels,
    label,
    load_labels,
    load_model,
    open_data,
)
from training.schedule import lr_lambda

# what train and eval write in --out
ROUTER_FILES = ("router.safetensors", "config.json", "metrics.jsonl", "eval.json")


@dataclass
class TrainRouterConfig(RouterInputs):
    """`router.py train`'s flags (saved with the router, in this order)."""

    model: str = flag("", "ParVL checkpoint folder", required=True, reads=True)
    labels: str = flag("", "labels folder written by `label`", required=True, reads=LABEL_FILES)
    data: str = flag(
        "",
        "the labels' data set (meta JSON), checked",
        shown="the path stored in the labels",
        reads=True,
    )
    out: str = flag(
        "",
        "router folder: router.safetensors + config.json + metrics.jsonl",
        required=True,
        writes=(*ROUTER_FILES, *TRACKER_FILES),
    )
    # bounded: the gates' memory grows with it, and 10**7 took 24 GB until the kernel killed the process
    hidden: int = flag(256, "gate hidden width", range="[1, 65536]")
    tau: float = flag(0.1, "teacher temperature of Eq. E1", range="(0, inf)")
    lr: float = flag(3e-4, "peak AdamW learning rate", range="(0, inf)")
    weight_decay: float = flag(0.0, "AdamW weight decay", range="[0, inf)", shown="0.0")
    warmup_ratio: float = flag(0.03, "linear warm-up fraction, then cosine", range="[0, 1)")
    global_batch: int = flag(128, "samples per step, any world size", range="[1, inf)")
    steps: int = flag(1200, "optimizer steps", range="[1, inf)")
    seed: int = flag(SEED, "seed of the sample order and the gates' initialisation", range=SEEDS)
    log_every: int = flag(50, "steps between log lines", range="[1, inf)")
    check_samples: int = flag(
        2, "labelled samples recomputed with the model before training", range="[0, inf)"
    )
    tracker: str | None = flag(
        None,
        "also log every metrics.jsonl line to TensorBoard (OUT/tensorboard) or W&B "
        "(OUT/wandb; WANDB_MODE=offline needs no network); optional packages (training/metrics.py)",
        choices=list(TRACKERS),
        shown="none",
    )
    overwrite: bool = flag(
        False, "replace the router already in --out (its stale eval.json goes too)"
    )

    def check(self) -> None:
        """AdamW scales every weight by 1 - lr x weight decay a step: above 1 it flips and grows them."""
        if self.lr * self.weight_decay > 1:
            raise ValueError(
                f"--weight-decay {self.weight_decay:g} at --lr {self.lr:g}: AdamW scales each weight by "
                f"1 - lr x weight decay = {1 - self.lr * self.weight_decay:.3g} a step; keep lr x weight "
                f"decay at most 1"
            )


@dataclass
class EvalConfig(RouterInputs):
    """`router.py eval`'s flags."""

    model: str = flag("", "ParVL checkpoint folder", required=True, reads=True)
    router: str = flag("", "router folder written by `train`", required=True, reads=ROUTER_SAVED)
    labels: str = flag(
        "", "held-out labels folder written by `label`", required=True, reads=LABEL_FILES
    )
    data: str = flag(
        "", "the labels' data set (meta JSON)", shown="the path stored in the labels", reads=True
    )
    out: str = flag("", "JSON result", shown="ROUTER/eval.json", writes=True)
    seed: int = flag(SEED, "seed of the random-pair baseline", range=SEEDS)
    batch_size: int = flag(4, "rows per dense forward", range="[1, inf)")
    max_tokens: int = flag(
        16384,
        "padded tokens per forward (rows x longest): a batch over it is split by length, "
        "a longer row runs alone",
        unit="tokens",
        range="[1, inf)",
    )
    dtype: str | None = reuse_flag(DeviceFlags, "dtype")


# -- training the gates -----------------------------------------------------------------------


def train(cfg: TrainRouterConfig) -> int:
    """Fit the two gates to the labels (Eq. E2, AdamW, 3 % warm-up then cosine); everything else frozen.
    Global step s reads samples s*G..(s+1)*G of a stream of seeded epoch permutations; rank r takes its
    G/W slice, and the gradients are summed over ranks, so the run does not depend on the world size."""
    out = Path(cfg.out)
    held = [name for name in ROUTER_FILES if (out / name).exists()]
    check_folder(out, "--out")
    if held and not cfg.overwrite:  # one folder, one run (as train.py's run folders)
        what = "a router" if "router.safetensors" in held else "a router run that saved no router"
        raise RouterError(
            f"--out {out} already holds {what} ({', '.join(held)}): pass --overwrite to replace it, "
            f"or pick another --out"
        )
    tracker = Tracker(cfg.tracker, out)  # a missing package is one line before the model loads
    device = start_processes(torch.cuda.is_available())
    world = world_size()
    meta, _ = load_labels(cfg.labels)
    # the labels' dtype, so check_labels compares like with like
    model = load_model(cfg.model, meta["dtype"], device)
    meta, t = load_labels(cfg.labels, model)
    data = open_data(meta, cfg.data, model, cfg.labels)
    if cfg.global_batch % world:
        raise RouterError(f"--global-batch {cfg.global_batch} does not split into {world} ranks")
    frozen = state_hash(model)
    for p in model.parameters():
        p.requires_grad_(False)
    check_labels(model, data, meta, t, cfg.check_samples)
    torch.manual_seed(cfg.seed)
    rcfg = RouterConfig(
        pv=meta["pv"],
        pl=meta["pl"],
        vision_width=meta["vision_width"],
        text_width=meta["text_width"],
        hidden=cfg.hidden,
        im_start_id=meta["im_start_id"],
        fingerprint=meta["fingerprint"],
    )
    sizes = f"--hidden {cfg.hidden} (two gates of {cfg.hidden} x {rcfg.vision_width + rcfg.text_width} weights)"
    with allocation(sizes, "--hidden"):  # the gates and AdamW's two states of each weight
        router = Router(rcfg).to(device)
    log(f"router config {json.dumps(asdict(rcfg))}, train config {json.dumps(asdict(cfg))}")
    optim = torch.optim.AdamW(router.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(cfg.steps, cfg.warmup_ratio))
    t = {k: v.to(device) for k, v in t.items()}
    S, G = len(t["rows"]), cfg.global_batch
    stream = torch.cat(
        [
            torch.randperm(S, generator=torch.Generator().manual_seed(cfg.seed + e))
            for e in range(math.ceil(cfg.steps * G / S))
        ]
    )
    if rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        # --overwrite: the old router's files go, its eval.json too (it would be stale)
        for name in held:
            (out / name).unlink()
        # and its curves; a folder that held no router
        for old in (out / name for name in TRACKER_FILES if held):
            # keeps them (train.py's rule)
            shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
        (out / "metrics.jsonl").write_text("")
    tracker.start(0, asdict(cfg))
    with (
        tracker,
        allocation(sizes + f", --global-batch {cfg.global_batch}", "--hidden or --global-batch"),
    ):
        fit(router, optim, sched, t, stream, cfg, rcfg, tracker)
    check_finite(router, t, cfg)
    return save(router, model, frozen, meta, cfg)


def check_finite(router: Router, t: dict, cfg: TrainRouterConfig) -> None:
    """Nothing saved that is not finite: the gates' logits on the first samples after the last update (`fit`
    checks before each update); weights near 1e30 are finite, their logits not, and always picked pair [0, 0]."""
    k = min(len(t["rows"]), cfg.global_batch)
    with torch.no_grad():
        logits = router(t["image"][:k], t["text"][:k], t["connector"][:k], t["has_image"][:k])[:2]
    if not all(bool(torch.isfinite(x).all()) for x in logits):
        raise ValueError(
            f"step {cfg.steps}: after the last update the router's logits are not finite (--lr {cfg.lr:g}, "
            f"--weight-decay {cfg.weight_decay:g}); nothing saved as the router: lower --lr"
        )


def fit(
    router: Router,
    optim,
    sched,
    t: dict,
    stream: torch.Tensor,
    cfg: TrainRouterConfig,
    rcfg: RouterConfig,
    tracker: Tracker,
) -> None:
    """The steps of `train`: each rank's slice of global step s's samples, gradients summed over ranks."""
    world, out, G = world_size(), Path(cfg.out), cfg.global_batch
    local, device = G // world, t["nll"].device
    for step in range(cfg.steps):
        idx = stream[step * G + rank() * local : step * G + (rank() + 1) * local].to(device)
        logits_v, logits_l, v = router(
            t["image"][idx], t["text"][idx], t["connector"][idx], t["has_image"][idx]
        )
        loss = (
            router_loss(logits_v, logits_l, t["nll"][idx], v, t["has_image"][idx], cfg.tau).sum()
            / G
        )
        optim.zero_grad(set_to_none=True)
        loss.backward()
        flat = torch.cat(
            [p.grad.flatten() for p in router.parameters()] + [loss.detach().reshape(1)]
        )
        # sum the ranks' shares of the global-batch mean (and of its loss): one flat all-reduce
        if world > 1:
            dist.all_reduce(flat)
            for p, g in zip(
                router.parameters(), flat[:-1].split([p.numel() for p in router.parameters()])
            ):
                p.grad.copy_(g.view_as(p))
        # alike on every rank; a host sync a step, the gates are small
        if not bool(torch.isfinite(flat).all()):
            raise ValueError(
                f"step {step + 1}: non-finite loss {flat[-1].item()} or gradient at --lr {cfg.lr}; "
                f"stopped before the update, nothing saved as the router"
            )
        lr = sched.get_last_lr()[0]
        optim.step()
        sched.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            m = gate_metrics(
                logits_v.detach(),
                logits_l.detach(),
                v,
                t["nll"][idx],
                t["has_image"][idx],
                loss.detach() * G,
                cfg.tau,
            )
            line = {"step": step + 1, "lr": lr, **summarize(m, device, rcfg)}
            log(json.dumps(line))
            if rank() == 0:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
                tracker.log(line)  # the same line, at the same step (--tracker)


def save(router: Router, model: ParVL, frozen: str, meta: dict, cfg: TrainRouterConfig) -> int:
    """The end of `train`: the frozen model checked unchanged, the router saved (rank 0)."""
    out = Path(cfg.out)
    if state_hash(model) != frozen:
        raise AssertionError("the frozen model changed during router training")
    log(f"frozen model unchanged (sha256 {frozen[:16]}): only the gates trained")
    if rank() == 0:
        save_router(
            router,
            out,
            {
                "train": asdict(cfg),
                "labels": {k: meta[k] for k in ("checkpoint", "data", "samples")},
            },
        )
        log(f"saved {out / 'router.safetensors'}")
    barrier()
    return 0


def gate_metrics(
    logits_v, logits_l, v, nll, has_image, loss_sum, tau: float
) -> dict[str, torch.Tensor]:
    """Sums over a batch: loss, gate and pair accuracy against the teacher's argmax, entropies, histogram."""
    B, Pv, Pl = nll.shape
    l_hat = logits_l.argmax(-1)
    q_v = path_teacher(nll, tau).sum(-1)
    c = nll[torch.arange(B, device=v.device), v]  # [B,Pl] given the chosen vision branch
    chosen = c[torch.arange(B, device=v.device), l_hat]
    ent = lambda z: -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)  # noqa: E731
    img = has_image.float()
    return {
        "n": torch.tensor(float(B), device=v.device),
        "n_image": img.sum(),
        "loss": loss_sum,
        "vision_acc": ((logits_v.argmax(-1) == q_v.argmax(-1)).float() * img).sum(),
        "language_acc": (l_hat == c.argmin(-1)).float().sum(),
        "pair_acc": (chosen <= nll.flatten(1).min(-1).values).float().sum(),
        "entropy_vision": (ent(logits_v.float()) * img).sum(),
        "entropy_language": ent(logits_l.float()).sum(),
        "pairs": torch.bincount(v * Pl + l_hat, minlength=Pv * Pl).float(),
    }


def summarize(m: dict[str, torch.Tensor], device, rcfg: RouterConfig) -> dict:
    """All-reduce the sums of gate_metrics over ranks and turn them into means and a histogram."""
    flat = torch.cat([x.flatten().float() for x in m.values()]).to(device)
    if dist.is_initialized():
        dist.all_reduce(flat)
    keys, vals = list(m), flat[: -rcfg.pv * rcfg.pl].tolist()
    s = dict(zip(keys[:-1], vals))
    n, ni = s["n"], max(s["n_image"], 1)
    return {
        "loss": s["loss"] / n,
        "vision_acc": s["vision_acc"] / ni,
        "language_acc": s["language_acc"] / n,
        "pair_acc": s["pair_acc"] / n,
        "entropy_vision": s["entropy_vision"] / ni,
        "entropy_language": s["entropy_language"] / n,
        "pair_histogram": [int(x) for x in flat[-rcfg.pv * rcfg.pl :].tolist()],
    }


def state_hash(model: nn.Module) -> str:
    """sha256 of every tensor of the model, by name: the frozen model must not change."""
    h = hashlib.sha256()
    for name, x in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(x.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- evaluation (Table 3 rows, Table S9 matrix) -----------------------------------------------


@torch.no_grad()
def evaluate(cfg: EvalConfig) -> int:
    out = Path(cfg.out or Path(cfg.router) / "eval.json")
    check_folder(out.parent, "--out")  # before the model loads
    device = start_processes(torch.cuda.is_available())
    model = load_model(cfg.model, cfg.dtype, device)
    router = load_router(cfg.router, model)
    meta, t = load_labels(cfg.labels, model)
    if meta["im_start_id"] != router.cfg.im_start_id:
        raise RouterError(
            f"{cfg.labels}: labelled with another tokenizer than the router was trained with"
        )
    nll, has_image = t["nll"].to(device), t["has_image"].to(device)
    S, Pv, Pl = nll.shape
    logits_v, logits_l, v = router(
        t["image"].to(device), t["text"].to(device), t["connector"].to(device), has_image
    )
    ar = torch.arange(S, device=device)
    best = nll.flatten(1).min(-1).values
    g = torch.Generator().manual_seed(cfg.seed)
    rand = torch.randint(0, Pv * Pl, (S,), generator=g).to(device)
    choices = {
        "random pair": (rand // Pl, rand % Pl),
        "router": (v, logits_l.argmax(-1)),
        "oracle": (nll.flatten(1).argmin(-1) // Pl, nll.flatten(1).argmin(-1) % Pl),
    }
    rows = {}
    for name, (cv, cl) in choices.items():
        c = nll[ar, cv, cl]
        rows[name] = {"nll": c.mean().item(), "pair_acc": (c <= best).double().mean().item()}
    data = open_data(meta, cfg.data, model, cfg.labels)
    rows["dense"] = {
        "nll": dense_nll(model, data, t["rows"], cfg.batch_size, cfg.max_tokens).mean().item(),
        "pair_acc": None,
    }
    matrix = nll.mean(0)  # [Pv,Pl]
    result = {
        "samples": S,
        "pv": Pv,
        "pl": Pl,
        "rows": rows,
        "pair_nll": matrix.tolist(),
        "pair_acc": (nll <= best[:, None, None]).double().mean(0).tolist(),
        "vision_marginal": matrix.mean(1).tolist(),
        "language_marginal": matrix.mean(0).tolist(),
        "router_pairs": torch.bincount(v * Pl + logits_l.argmax(-1), minlength=Pv * Pl)
        .view(Pv, Pl)
        .tolist(),
    }
    print(
        f"{S} held-out samples, mean answer NLL (lower is better), pair accuracy = chosen pair is the best"
    )
    for name, r in rows.items():
        acc = "-" if r["pair_acc"] is None else f"{r['pair_acc']:.3f}"
        print(f"  {name:<12} nll {r['nll']:.4f}  pair acc {acc}")
    print(
        "  fixed pairs: nll [pair acc], rows = vision branch, columns = language branch; last column/row: marginal"
    )
    for i in range(Pv):
        cells = "  ".join(
            f"{matrix[i, j].item():.4f} [{result['pair_acc'][i][j]:.2f}]" for j in range(Pl)
        )
        print(f"  ViT {i}:  {cells}  | {result['vision_marginal'][i]:.4f}")
    print("  LLM   :  " + "  ".join(f"{x:.4f}       " for x in result["language_marginal"]))
    print(f"  router's choices (rows v, columns l): {result['router_pairs']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    log(f"wrote {out}")
    return 0


def dense_nll(
    model: ParVL, data: SFTData, rows: torch.Tensor, batch_size: int, max_tokens: int
) -> torch.Tensor:
    """Answer NLL [S] of every labelled row under dense aggregation (all branches, fused)."""
    dev, out = model.language_model.lm_head.weight.device, []

    def forward(batch) -> dict[str, torch.Tensor]:
        ids, valid = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        pix = batch.pixel_values.to(dev, model.language_model.lm_head.weight.dtype)
        h, _, _ = model.hidden_from_ids(ids, pix if pix.shape[0] else None, valid)  # [B,T,C] fused
        return {
            "nll": answer_nll(h, model.language_model.lm_head.weight, batch.labels.to(dev)).cpu()
        }

    for i in range(0, len(rows), batch_size):
        out.append(
            by_length(
                [data[int(r)] for r in rows[i : i + batch_size]], max_tokens, batch_size, forward
            )["nll"]
        )
    return torch.cat(out) if out else torch.zeros(0)


# -- the command ------------------------------------------------------------------------------


DESCRIPTION = __doc__.split("\n\n")[0]
COMMANDS = {
    "label": Command(
        LabelConfig,
        label,
        "label every row with every branch pair's answer NLL (training/router_labels.py)",
        writes=lambda cfg: Path(cfg.out),
        interrupted=lambda cfg: LABELLED,
    ),
    "train": Command(
        TrainRouterConfig,
        train,
        "train the two gates on the labels (Eq. E2)",
        writes=lambda cfg: Path(cfg.out),
    ),
    "eval": Command(
        EvalConfig, evaluate, "evaluate the router on held-out labels (Table 3 / S9 layout)"
    ),
}


def main(argv=None) -> int:
    return dispatch(DESCRIPTION, COMMANDS, argv)


if __name__ == "__main__":
    command(main)
