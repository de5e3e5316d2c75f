"""The sparse router's command (paper Appendix E; Table 3; Table S9 for the evaluation layout):
label the offline path teacher, train the two gates, evaluate them. The router itself (gates, their
inputs, Eq. E1 / E2, the choices where Appendix E is silent) is gates.py.

    python router.py label --model CKPT --data META.json --out LABELS        # offline path teacher
    torchrun --nproc-per-node 8 router.py label --model CKPT --data META.json --out LABELS
    torchrun --nproc-per-node 8 router.py train --model CKPT --labels LABELS --data META.json --out DIR
    python router.py eval --model CKPT --router DIR --labels HELDOUT          # Table 3 / S9 layout
    python generate.py image.png "Question?" --model CKPT --router DIR --json

`label` stores, for every row, the answer NLL c[v,l] of every pair: the mean token cross-entropy over
the supervised tokens of Eq. 6 (assistant turns, unweighted), pairs row-major (v outer), and the gate
inputs (image and text features, and every vision branch's connector feature). The model is frozen,
so they are fixed; `train` reads them instead of running the model for every step, and rechecks a few
samples against the model first. Cost: (Cv + (Pv+1) C) fp32 values a sample, 24 KB for
InternVL3.5-1B at Pv = 4. Pair accuracy: the chosen pair attains the sample's minimum NLL (ties count
as correct).

Shape legend: aggregate.py's (B samples, Cv ViT width, C LLM width).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from aggregate import fold, per_branch
from checkpoint import CheckpointError, check_not_run_folder, read_json, read_safetensors
from cli import (SEED, Interrupted, OneLineParser, allocation, barrier, check_folder, check_shared, command, end_processes,
                 error, interruptible, log, one_line, os_error, rank, resolve_dtype, start_processes, world_size)
from batches import collate
from config import open_checkpoint
from data import BAD_REASONS, BadRow, SFTData, check_bad_fraction
from gates import (Router, RouterConfig, RouterError, fingerprint, image_tiles, load_router, path_teacher, pool_tiles,
                   question_span, router_loss, save_router, text_feature, thumbnail_feature)
from llm import prompt_positions
from loss import IGNORE, answer_nll
from parvl import ParVL
from processor import IM_START
from schedule import lr_lambda


def data_fingerprint(data: SFTData) -> str:
    """The annotation files' bytes, names, repeats, tile budgets and row count of a data set."""
    h = hashlib.sha256(f"{len(data)};{data.max_seq_len};{data.seed};".encode())
    for d in data.datasets:
        h.update(f"{d['name']};{d['kept']};{d['repeat']};{d['max_tiles']};{d['augment']};".encode())
        with open(d["path"], "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:16]


@torch.no_grad()
def label_batch(model: ParVL, batch, im_start_id: int) -> dict[str, torch.Tensor]:
    """The Pv x Pl answer NLLs and the gate inputs of a collated batch (batches.collate, good rows only).
    Each vision branch's features are computed once; all language branches of it run folded in one pass."""
    dev = model.language_model.lm_head.weight.device
    ids, labels, valid = batch.input_ids.to(dev), batch.labels.to(dev), batch.attention_mask.to(dev)
    pix = batch.pixel_values.to(dev, model.language_model.lm_head.weight.dtype)
    B, T = ids.shape
    par, image_id = model.cfg.par, model.cfg.image_token_id
    first = (labels != IGNORE).long().argmax(1)  # [B] the first answer token: the prompt ends before it
    prompt = valid & (torch.arange(T, device=dev) < first[:, None])
    text = text_feature(model, ids, question_span(ids, prompt, im_start_id, image_id))
    tiles = image_tiles(ids, image_id, model.cfg.tokens_per_tile)
    num_tiles = torch.tensor([sum(t) for t in tiles], device=dev)
    image = thumbnail_feature(model, pix, tiles) if pix.shape[0] else text.new_zeros(B, model.cfg.vit.hidden_size)
    positions, mask = prompt_positions(valid)
    rows = model.language_rows(None, B, dev)  # every language branch, folded branch-major
    head = model.language_model.lm_head.weight
    nll = torch.zeros(B, par.pv, par.pl, device=dev)
    connector = torch.zeros(B, par.pv, text.shape[-1], device=dev)
    for v in range(par.pv):
        if not pix.shape[0] and v:  # no image in the batch: the vision branch changes nothing
            nll[:, v] = nll[:, 0]
            continue
        features = model.extract_features(pix, v) if pix.shape[0] else None  # [N,256,C] branch v, once
        if features is not None:
            connector[:, v] = pool_tiles(features, num_tiles)
        x, _ = model.embed(ids, None, features=features)
        h = model.language_model(x, positions, mask, rows=rows)  # [Pl*B,T,C] every language branch
        nll[:, v] = per_branch(answer_nll(h, head, fold(labels, rows)), rows)  # [Pl*B] rows -> [B,Pl]
    return {"rows": torch.tensor(batch.rows), "nll": nll.cpu(), "image": image.cpu(), "text": text.cpu(),
            "connector": connector.cpu(), "has_image": (num_tiles > 0).cpu()}


LABEL_KEYS = ("rows", "nll", "image", "text", "connector", "has_image")


def length_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Samples grouped for padded forwards, longest first: a group takes the next sample while it is
    at least half the group's longest and samples x longest stays within max_tokens; a longer one goes
    alone, unpadded and maskless (a padding mask grows with T^2: 11.7 GB for 16 rows of 27,000 tokens)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep their order
        longest = lengths[groups[-1][0]] if groups else 0
        if groups and 2 * lengths[i] >= longest and (len(groups[-1]) + 1) * longest <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def by_length(samples: list, max_tokens: int, batch_size: int, forward) -> dict[str, torch.Tensor]:
    """forward(collated batch) -> {name: [b,...]} over samples split by length (length_groups)
    rather than padded to the longest, put back in the samples' order. An allocation failure is one
    line naming the batch size and the longest row."""
    groups = length_groups([len(s.input_ids) for s in samples], max_tokens)
    longest = max(len(s.input_ids) for s in samples)
    with allocation(f"--batch-size {batch_size} (longest row {longest} tokens, --max-tokens {max_tokens})",
                    "--batch-size or --max-tokens, or use a device with more memory"):
        parts = [forward(collate([samples[i] for i in g], pad_id=0)) for g in groups]
    order = torch.tensor([i for g in groups for i in g]).argsort()  # group order -> sample order
    return {k: torch.cat([p[k] for p in parts])[order] for k in parts[0]}


def _items(items: list) -> list:
    return items  # a DataLoader collate_fn that keeps the samples (module level: picklable for workers)


def label(cfg: LabelConfig) -> int:
    """Label every row of cfg.data in chunks of cfg.batch_size rows; rank r of W takes chunks r, r+W, ...
    Each chunk is written to OUT/parts as it completes (so a rerun resumes) and rank 0 merges them in
    chunk order, so the result does not depend on the world size."""
    device = start_processes(torch.cuda.is_available())
    world = world_size()
    out, parts = Path(cfg.out), Path(cfg.out) / "parts"
    check_shared(out, "--out")  # more than one machine: every rank writes its chunks there
    dtype = cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")
    check_not_run_folder(Path(cfg.model))  # runs/44 for runs/44/export: say which folder is meant
    _, tok = open_checkpoint(Path(cfg.model))  # checked before the weights load
    model = load_model(cfg.model, dtype, device)
    if model.cfg.vit is None or model.cfg.par.pv * model.cfg.par.pl == 1:
        raise RouterError(f"{cfg.model}: a router needs a multimodal checkpoint with more than one branch pair, "
                          f"it has Pv:Pl = {model.cfg.par.pv}:{model.cfg.par.pl}")
    data = SFTData(cfg.data, tok, max_tiles=cfg.max_tiles, max_seq_len=cfg.max_seq_len,
                   image_token_id=model.cfg.image_token_id, seed=cfg.seed,
                   max_positions=model.cfg.llm.max_position_embeddings)
    job = {"checkpoint": str(cfg.model), "fingerprint": fingerprint(model), "data": str(cfg.data),
           "data_fingerprint": data_fingerprint(data), "rows": len(data), "batch_size": cfg.batch_size,
           "max_tiles": cfg.max_tiles, "max_seq_len": cfg.max_seq_len, "seed": cfg.seed,
           "pv": model.cfg.par.pv, "pl": model.cfg.par.pl, "pairs": [[v, l] for v in range(model.cfg.par.pv) for l in range(model.cfg.par.pl)],
           "vision_width": model.cfg.vit.hidden_size, "text_width": model.cfg.llm.hidden_size,
           "im_start_id": tok.token_to_id(IM_START), "dtype": dtype, "nll": "mean token CE over the supervised (Eq. 6) tokens"}
    same = lambda other: all(other.get(k) == v for k, v in job.items() if k not in ("checkpoint", "data"))  # noqa: E731
    if (out / "labels.json").exists():
        if not same(read_json(out / "labels.json")):
            raise RouterError(f"{out}: holds labels of another checkpoint, data set or setting; remove it or pick another --out")
        log(f"{out}: already complete")
        return 0
    if (parts / "job.json").exists() and not same(read_json(parts / "job.json")):  # every rank checks
        raise RouterError(f"{parts}: partial labels of another checkpoint, data set or setting; remove it or pick another --out")
    barrier()
    if rank() == 0:
        parts.mkdir(parents=True, exist_ok=True)
        (parts / "job.json").write_text(json.dumps(job, indent=2))
    barrier()
    chunks = math.ceil(len(data) / cfg.batch_size)
    name = lambda k: parts / f"chunk_{k:06d}.safetensors"  # noqa: E731
    mine = [k for k in range(rank(), chunks, world)]
    todo = [k for k in mine if not name(k).exists()]
    log(f"label: {len(data)} rows in {chunks} chunks of {cfg.batch_size} on {world} ranks, Pv x Pl = "
        f"{job['pv']} x {job['pl']}; rank 0 resumes with {len(mine) - len(todo)} of its {len(mine)} chunks done")
    sampler = [list(range(k * cfg.batch_size, min((k + 1) * cfg.batch_size, len(data)))) for k in todo]
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, num_workers=cfg.num_workers, collate_fn=_items)
    t0, samples = time.perf_counter(), 0
    for i, (k, items) in enumerate(zip(todo, loader, strict=True)):
        good = [s for s in items if not isinstance(s, BadRow)]
        bad = {r: sum(isinstance(s, BadRow) and s.reason == r for s in items) for r in BAD_REASONS}
        if good:
            result = by_length(good, cfg.max_tokens, cfg.batch_size, lambda b: label_batch(model, b, job["im_start_id"]))
        else:  # a chunk of bad rows only
            result = {k_: torch.zeros(0, *shape) for k_, shape in (("nll", (job["pv"], job["pl"])), ("image", (job["vision_width"],)),
                      ("text", (job["text_width"],)), ("connector", (job["pv"], job["text_width"])))}
            result |= {"rows": torch.zeros(0, dtype=torch.long), "has_image": torch.zeros(0, dtype=torch.bool)}
        save_file(result, str(name(k)) + ".tmp", metadata={"bad": json.dumps(bad)})
        os.replace(str(name(k)) + ".tmp", name(k))  # a chunk file is always complete
        samples += len(good)
        dt = time.perf_counter() - t0
        if rank() == 0 and (i + 1 == len(todo) or (i + 1) % cfg.log_every == 0):
            print(f"label: chunk {i + 1}/{len(todo)} of rank 0, {samples / dt:.2f} samples/s, "
                  f"ETA {dt / (i + 1) * (len(todo) - i - 1):.0f} s", file=sys.stderr, flush=True)
    barrier()
    bad = dict.fromkeys(BAD_REASONS, 0)  # every rank reads the counts, so every rank stops on too many
    for k in range(chunks):
        if not name(k).exists():
            raise RouterError(f"{name(k)}: missing; rerun the same command to finish labelling")
        with safe_open(str(name(k)), framework="pt") as f:
            for r, n in json.loads(f.metadata()["bad"]).items():
                bad[r] += n
    check_bad_fraction(bad, job["rows"], cfg.max_bad_frac)
    barrier()  # every rank has read the parts before rank 0 merges and removes them
    if rank() == 0:
        merge(parts, out, job | {"bad_rows": bad}, chunks)
    barrier()
    return 0


def merge(parts: Path, out: Path, job: dict, chunks: int) -> None:
    """Concatenate the chunk files in chunk order into OUT/labels.safetensors + OUT/labels.json."""
    tensors = {k: [] for k in LABEL_KEYS}
    for k in range(chunks):
        with safe_open(str(parts / f"chunk_{k:06d}.safetensors"), framework="pt") as f:
            for key in LABEL_KEYS:
                tensors[key].append(f.get_tensor(key))
    merged = {k: torch.cat(v) for k, v in tensors.items()}
    meta = job | {"samples": len(merged["rows"])}
    bad = job["bad_rows"]
    save_file(merged, str(out / "labels.safetensors"), metadata={"format": "pt"})
    (out / "labels.json").write_text(json.dumps(meta, indent=2))  # written last: marks the labels complete
    shutil.rmtree(parts)
    log(f"labels: {meta['samples']} samples, bad rows {bad} -> {out}")


def load_labels(path: str | Path, model: ParVL | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of a labels folder, checked for completeness and, given a model, against it."""
    folder = Path(path)
    if not (folder / "labels.json").is_file() or not (folder / "labels.safetensors").is_file():
        raise RouterError(f"{folder}: not a complete labels folder (labels.json + labels.safetensors; see router.py label)")
    meta, t = read_json(folder / "labels.json"), read_safetensors(folder / "labels.safetensors")
    S, pv, pl = meta.get("samples"), meta.get("pv"), meta.get("pl")
    want = {"rows": (S,), "nll": (S, pv, pl), "image": (S, meta.get("vision_width")), "text": (S, meta.get("text_width")),
            "connector": (S, pv, meta.get("text_width")), "has_image": (S,)}
    for k, shape in want.items():
        if k not in t or tuple(t[k].shape) != shape:
            raise RouterError(f"{folder}: labels.safetensors {k} has shape {tuple(t[k].shape) if k in t else None}, expected {shape}")
    if not S:
        raise RouterError(f"{folder}: holds no labelled samples (every row was bad?)")
    if not bool(torch.isfinite(t["nll"]).all()):
        raise RouterError(f"{folder}: non-finite NLLs in the labels")
    if model is not None and meta["fingerprint"] != fingerprint(model):
        raise RouterError(f"{folder}: labelled with checkpoint {meta['fingerprint']} ({meta['checkpoint']}), "
                          f"the model is {fingerprint(model)}")
    return meta, t


def open_data(meta: dict, data_path: str | None, model: ParVL, where: str) -> SFTData:
    """The data set a labels file was computed on (data_path, or the one it names), checked to be the same."""
    path = data_path or meta["data"]
    _, tok = open_checkpoint(model.source_dir)
    data = SFTData(path, tok, max_tiles=meta["max_tiles"], max_seq_len=meta["max_seq_len"],
                   image_token_id=model.cfg.image_token_id, seed=meta["seed"],
                   max_positions=model.cfg.llm.max_position_embeddings)
    if data_fingerprint(data) != meta["data_fingerprint"]:
        raise RouterError(f"{where}: labelled on data {meta['data_fingerprint']} ({meta['data']}), "
                          f"{path} is {data_fingerprint(data)} (other rows or annotation files)")
    return data


# -- training the gates -----------------------------------------------------------------------


def train(cfg: TrainRouterConfig) -> int:
    """Fit the two gates to the labels (Eq. E2, AdamW, 3 % warm-up then cosine); everything else frozen.
    Global step s reads samples s*G..(s+1)*G of a stream of seeded epoch permutations; rank r takes its
    G/W slice, and the gradients are summed over ranks, so the run does not depend on the world size."""
    out = Path(cfg.out)
    held = [name for name in ROUTER_FILES if (out / name).exists()]
    check_folder(out, "--out")
    if held and not cfg.overwrite:  # one folder, one run (as train.py's run folders)
        raise RouterError(f"--out {out} already holds a router ({', '.join(held)}): pass --overwrite to replace it, "
                          f"or pick another --out")
    device = start_processes(torch.cuda.is_available())
    world = world_size()
    meta, _ = load_labels(cfg.labels)
    model = load_model(cfg.model, meta["dtype"], device)  # the labels' dtype, so check_labels compares like with like
    meta, t = load_labels(cfg.labels, model)
    data = open_data(meta, cfg.data, model, cfg.labels)
    if cfg.global_batch % world:
        raise RouterError(f"--global-batch {cfg.global_batch} does not split into {world} ranks")
    frozen = state_hash(model)
    for p in model.parameters():
        p.requires_grad_(False)
    check_labels(model, data, meta, t, cfg.check_samples)
    torch.manual_seed(cfg.seed)
    rcfg = RouterConfig(pv=meta["pv"], pl=meta["pl"], vision_width=meta["vision_width"], text_width=meta["text_width"],
                        hidden=cfg.hidden, im_start_id=meta["im_start_id"], fingerprint=meta["fingerprint"])
    router = Router(rcfg).to(device)
    log(f"router config {json.dumps(asdict(rcfg))}, train config {json.dumps(asdict(cfg))}")
    optim = torch.optim.AdamW(router.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(cfg.steps, cfg.warmup_ratio))
    t = {k: v.to(device) for k, v in t.items()}
    S, G, local = len(t["rows"]), cfg.global_batch, cfg.global_batch // world
    stream = torch.cat([torch.randperm(S, generator=torch.Generator().manual_seed(cfg.seed + e))
                        for e in range(math.ceil(cfg.steps * G / S))])
    if rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        for name in held:  # --overwrite: the old router's files go, its eval.json too (it would be stale)
            (out / name).unlink()
        (out / "metrics.jsonl").write_text("")
    for step in range(cfg.steps):
        idx = stream[step * G + rank() * local: step * G + (rank() + 1) * local].to(device)
        logits_v, logits_l, v = router(t["image"][idx], t["text"][idx], t["connector"][idx], t["has_image"][idx])
        loss = router_loss(logits_v, logits_l, t["nll"][idx], v, t["has_image"][idx], cfg.tau).sum() / G
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:  # sum the ranks' shares of the global-batch mean: one flat all-reduce
            grads = torch.cat([p.grad.flatten() for p in router.parameters()])
            dist.all_reduce(grads)
            for p, g in zip(router.parameters(), grads.split([p.numel() for p in router.parameters()])):
                p.grad.copy_(g.view_as(p))
        lr = sched.get_last_lr()[0]
        optim.step()
        sched.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            m = gate_metrics(logits_v.detach(), logits_l.detach(), v, t["nll"][idx], t["has_image"][idx], loss.detach() * G, cfg.tau)
            line = {"step": step + 1, "lr": lr, **summarize(m, device, rcfg)}
            log(json.dumps(line))
            if rank() == 0:
                with open(out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(line) + "\n")
    if state_hash(model) != frozen:
        raise AssertionError("the frozen model changed during router training")
    log(f"frozen model unchanged (sha256 {frozen[:16]}): only the gates trained")
    if rank() == 0:
        save_router(router, out, {"train": asdict(cfg), "labels": {k: meta[k] for k in ("checkpoint", "data", "samples")}})
        log(f"saved {out / 'router.safetensors'}")
    barrier()
    return 0


def gate_metrics(logits_v, logits_l, v, nll, has_image, loss_sum, tau: float) -> dict[str, torch.Tensor]:
    """Sums over a batch: loss, gate and pair accuracy against the teacher's argmax, entropies, histogram."""
    B, Pv, Pl = nll.shape
    l_hat = logits_l.argmax(-1)
    q_v = path_teacher(nll, tau).sum(-1)
    c = nll[torch.arange(B, device=v.device), v]  # [B,Pl] given the chosen vision branch
    chosen = c[torch.arange(B, device=v.device), l_hat]
    ent = lambda z: -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)  # noqa: E731
    img = has_image.float()
    return {"n": torch.tensor(float(B), device=v.device), "n_image": img.sum(), "loss": loss_sum,
            "vision_acc": ((logits_v.argmax(-1) == q_v.argmax(-1)).float() * img).sum(),
            "language_acc": (l_hat == c.argmin(-1)).float().sum(),
            "pair_acc": (chosen <= nll.flatten(1).min(-1).values).float().sum(),
            "entropy_vision": (ent(logits_v.float()) * img).sum(), "entropy_language": ent(logits_l.float()).sum(),
            "pairs": torch.bincount(v * Pl + l_hat, minlength=Pv * Pl).float()}


def summarize(m: dict[str, torch.Tensor], device, rcfg: RouterConfig) -> dict:
    """All-reduce the sums of gate_metrics over ranks and turn them into means and a histogram."""
    flat = torch.cat([x.flatten().float() for x in m.values()]).to(device)
    if dist.is_initialized():
        dist.all_reduce(flat)
    keys, vals = list(m), flat[:-rcfg.pv * rcfg.pl].tolist()
    s = dict(zip(keys[:-1], vals))
    n, ni = s["n"], max(s["n_image"], 1)
    return {"loss": s["loss"] / n, "vision_acc": s["vision_acc"] / ni, "language_acc": s["language_acc"] / n,
            "pair_acc": s["pair_acc"] / n, "entropy_vision": s["entropy_vision"] / ni,
            "entropy_language": s["entropy_language"] / n,
            "pair_histogram": [int(x) for x in flat[-rcfg.pv * rcfg.pl:].tolist()]}


def check_labels(model: ParVL, data: SFTData, meta: dict, t: dict, n: int) -> None:
    """Recompute the NLLs and gate inputs of the first n labelled samples and compare them to the file."""
    if not n or not len(t["rows"]):
        return
    got = label_batch(model, collate([data[int(r)] for r in t["rows"][:n]], pad_id=0), meta["im_start_id"])
    tol = 1e-3 if meta["dtype"] == "fp32" else 5e-2  # other batch composition, other padding: rounding differs
    for k in ("nll", "image", "text", "connector"):
        if not torch.allclose(got[k], t[k][:n].to(got[k].device), rtol=tol, atol=tol / 10):
            raise RouterError(f"labels {k} of rows {t['rows'][:n].tolist()} differ from what the model gives: stale labels?")


def state_hash(model: nn.Module) -> str:
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
        raise RouterError(f"{cfg.labels}: labelled with another tokenizer than the router was trained with")
    nll, has_image = t["nll"].to(device), t["has_image"].to(device)
    S, Pv, Pl = nll.shape
    logits_v, logits_l, v = router(t["image"].to(device), t["text"].to(device), t["connector"].to(device), has_image)
    ar = torch.arange(S, device=device)
    best = nll.flatten(1).min(-1).values
    g = torch.Generator().manual_seed(cfg.seed)
    rand = torch.randint(0, Pv * Pl, (S,), generator=g).to(device)
    choices = {"random pair": (rand // Pl, rand % Pl), "router": (v, logits_l.argmax(-1)),
               "oracle": (nll.flatten(1).argmin(-1) // Pl, nll.flatten(1).argmin(-1) % Pl)}
    rows = {}
    for name, (cv, cl) in choices.items():
        c = nll[ar, cv, cl]
        rows[name] = {"nll": c.mean().item(), "pair_acc": (c <= best).double().mean().item()}
    rows["dense"] = {"nll": dense_nll(model, open_data(meta, cfg.data, model, cfg.labels), t["rows"], cfg.batch_size, cfg.max_tokens).mean().item(),
                     "pair_acc": None}
    matrix = nll.mean(0)  # [Pv,Pl]
    result = {"samples": S, "pv": Pv, "pl": Pl, "rows": rows, "pair_nll": matrix.tolist(),
              "pair_acc": (nll <= best[:, None, None]).double().mean(0).tolist(),
              "vision_marginal": matrix.mean(1).tolist(), "language_marginal": matrix.mean(0).tolist(),
              "router_pairs": torch.bincount(v * Pl + logits_l.argmax(-1), minlength=Pv * Pl).view(Pv, Pl).tolist()}
    print(f"{S} held-out samples, mean answer NLL (lower is better), pair accuracy = chosen pair is the best")
    for name, r in rows.items():
        acc = "-" if r["pair_acc"] is None else f"{r['pair_acc']:.3f}"
        print(f"  {name:<12} nll {r['nll']:.4f}  pair acc {acc}")
    print("  fixed pairs: nll [pair acc], rows = vision branch, columns = language branch; last column/row: marginal")
    for i in range(Pv):
        cells = "  ".join(f"{matrix[i, j].item():.4f} [{result['pair_acc'][i][j]:.2f}]" for j in range(Pl))
        print(f"  ViT {i}:  {cells}  | {result['vision_marginal'][i]:.4f}")
    print("  LLM   :  " + "  ".join(f"{x:.4f}       " for x in result["language_marginal"]))
    print(f"  router's choices (rows v, columns l): {result['router_pairs']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    log(f"wrote {out}")
    return 0


def dense_nll(model: ParVL, data: SFTData, rows: torch.Tensor, batch_size: int, max_tokens: int) -> torch.Tensor:
    """Answer NLL [S] of every labelled row under dense aggregation (all branches, fused)."""
    dev, out = model.language_model.lm_head.weight.device, []

    def forward(batch) -> dict[str, torch.Tensor]:
        ids, valid = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        pix = batch.pixel_values.to(dev, model.language_model.lm_head.weight.dtype)
        x, _ = model.embed(ids, pix if pix.shape[0] else None)
        h, _ = model.hidden_from_embeds(x, *prompt_positions(valid))  # [B,T,C] fused
        return {"nll": answer_nll(h, model.language_model.lm_head.weight, batch.labels.to(dev)).cpu()}

    for i in range(0, len(rows), batch_size):
        out.append(by_length([data[int(r)] for r in rows[i:i + batch_size]], max_tokens, batch_size, forward)["nll"])
    return torch.cat(out) if out else torch.zeros(0)


# -- commands ---------------------------------------------------------------------------------


RANGES = {"batch_size": "[1, inf)", "max_tokens": "[1, inf)", "max_tiles": "[1, inf)", "max_seq_len": "[1, inf)",
          "max_bad_frac": "[0, 1]", "global_batch": "[1, inf)", "steps": "[1, inf)", "hidden": "[1, inf)", "tau": "(0, inf)",
          "lr": "(0, inf)", "weight_decay": "[0, inf)", "warmup_ratio": "[0, 1)", "log_every": "[1, inf)",
          "num_workers": "[0, inf)"}


@dataclass
class LabelConfig:
    model: str = ""  # ParVL checkpoint folder (Pv:Pl > 1:1)
    data: str = ""  # meta JSON in the official InternVL format (data.py)
    out: str = ""  # labels folder: labels.safetensors + labels.json
    batch_size: int = 4  # rows per chunk and forward
    max_tokens: int = 16384  # padded tokens per forward: a chunk is split by length to stay within it
    max_tiles: int = 12
    max_seq_len: int = 32768
    seed: int = 0  # data augmentation seed (data.SFTData)
    dtype: str = ""  # fp32 / bf16; default bf16 on CUDA, fp32 on CPU
    num_workers: int = 2
    max_bad_frac: float = 0.01
    log_every: int = 10  # chunks between progress lines


@dataclass
class TrainRouterConfig:
    model: str = ""
    labels: str = ""
    data: str = ""  # the labels' data set, checked; default: the path stored in the labels
    out: str = ""  # router folder: router.safetensors + config.json + metrics.jsonl
    hidden: int = 256
    tau: float = 0.1  # teacher temperature of Eq. E1
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    global_batch: int = 128
    steps: int = 1200
    seed: int = SEED
    log_every: int = 50
    check_samples: int = 2  # labelled samples recomputed with the model before training
    overwrite: bool = False  # replace the router already in --out (and drop its stale eval.json)


ROUTER_FILES = ("router.safetensors", "config.json", "metrics.jsonl", "eval.json")  # what train and eval write in --out


@dataclass
class EvalConfig:
    model: str = ""
    router: str = ""
    labels: str = ""  # held-out labels
    data: str = ""  # default: the path stored in the labels
    out: str = ""  # JSON result; default ROUTER/eval.json
    seed: int = SEED  # of the random-pair baseline
    batch_size: int = 4  # dense forward
    max_tokens: int = 16384  # padded tokens per forward: a batch is split by length to stay within it
    dtype: str = ""


HELP = {"model": "ParVL checkpoint folder", "data": "meta JSON in the official InternVL format (train, eval: default the labels' own)",
        "labels": "labels folder written by `label`", "router": "router folder written by `train`",
        "out": "output folder (label: labels; train: router) or, for eval, the JSON file (default ROUTER/eval.json)",
        "lr": "peak AdamW learning rate", "weight_decay": "AdamW weight decay", "warmup_ratio": "linear warm-up fraction, then cosine",
        "log_every": "steps (label: chunks) between log lines", "seed": "seed (train: order and init; label: augmentation; eval: random pairs)",
        "batch_size": "rows per forward",
        "max_tokens": "padded tokens per forward (rows x longest); a batch over it is split by length, a longer row runs alone", "max_tiles": "448 px tiles per row", "max_seq_len": "tokens; longer rows are skipped",
        "num_workers": "data loading processes", "max_bad_frac": "abort when more than this fraction of the data set's rows are bad, in [0, 1]",
        "hidden": "gate hidden width", "tau": "teacher temperature (Eq. E1)", "global_batch": "samples per step, any world size",
        "steps": "optimizer steps", "check_samples": "samples rechecked against the model",
        "overwrite": "train: replace the router already in --out (its stale eval.json goes too)", "dtype": "fp32 or bf16 (default: bf16 on CUDA, fp32 on CPU)"}


REQUIRED = {"label": ("model", "data", "out"), "train": ("model", "labels", "out"), "eval": ("model", "router", "labels")}


def add_flags(p: argparse.ArgumentParser, cls, required: tuple[str, ...]) -> None:
    """One flag per dataclass field, with its type and default."""
    for f in fields(cls):
        help_ = f"{HELP.get(f.name, f.name.replace('_', ' '))} (default {f.default!r})"
        if isinstance(f.default, bool):  # a switch
            p.add_argument("--" + f.name.replace("_", "-"), action="store_true", help=HELP.get(f.name, f.name))
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, help=help_,
                       required=f.name in required)


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, cls in (("label", LabelConfig), ("train", TrainRouterConfig), ("eval", EvalConfig)):
        add_flags(sub.add_parser(name, help=f"{name} (see the module docstring)"), cls, REQUIRED[name])
    args = vars(p.parse_args(argv))
    command = args.pop("command")
    cfg = {"label": LabelConfig, "train": TrainRouterConfig, "eval": EvalConfig}[command](**args)
    p.check_ranges(cfg, RANGES)
    interrupted = False
    try:
        with interruptible():
            for name in ("model", "router", "labels"):
                if getattr(cfg, name, None) and not Path(getattr(cfg, name)).is_dir():
                    raise RouterError(f"--{name} {getattr(cfg, name)}: not a folder")
            if getattr(cfg, "data", "") and not Path(cfg.data).is_file():
                raise RouterError(f"--data {cfg.data}: no such meta JSON file")
            return {"label": label, "train": train, "eval": evaluate}[command](cfg)
    except (ValueError, CheckpointError, OSError) as e:  # RouterError, bad data, checkpoints or --out: one line, exit 1
        line = os_error(e) if isinstance(e, OSError) else one_line(e)
        error(f"error: {line}", wait=not dist.is_initialized())  # else end_processes' barrier holds the others
        return 1
    except Interrupted as e:
        interrupted = True  # the other ranks may be gone already: no last barrier
        log(f"interrupted by {e}" + (": the chunks labelled so far stay; the same command resumes" if command == "label" else ""))
        return e.code
    finally:
        if not interrupted:
            end_processes()


def load_model(path: str, dtype: str, device) -> ParVL:
    if dtype not in ("", "fp32", "bf16"):
        raise RouterError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    return ParVL.from_pretrained(path, dtype=resolve_dtype(dtype, device), device=device)


if __name__ == "__main__":
    command(main)
