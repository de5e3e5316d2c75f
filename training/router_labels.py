"""The router's teacher labels (paper Appendix E), `router.py label`: for every row of an SFT data set
the answer NLL c[v,l] of every (vision, language) branch pair, the mean token cross-entropy over the
supervised tokens of Eq. 6 (assistant turns, unweighted), pairs row-major (v outer), and the gate
inputs (image and text features, and every vision branch's connector feature). The model is frozen,
so they are fixed: `router.py train` reads them instead of running the model for every step, and
rechecks a few samples against the model first (check_labels). Cost: (Cv + (Pv+1) C) fp32 values a
sample, 24 KB for InternVL3.5-1B at Pv = 4.

Labelling is one resumable job the ranks share (shell/shards.py): rank r of W labels the chunks r, r + W,
... of --batch-size rows, each written to OUT/parts as it completes (a rerun labels only the missing
ones), and rank 0 merges them in chunk order into OUT/labels.safetensors + OUT/labels.json, so the
labels depend neither on the world size nor on interrupts. OUT/parts/job.json, and labels.json once
complete, record the checkpoint, data and settings: a rerun of another job into OUT is refused.

    python router.py label --model CKPT --data META.json --out LABELS
    torchrun --nproc-per-node 8 router.py label --model CKPT --data META.json --out LABELS

Shape legend: aggregate.py's (B samples, Cv ViT width, C LLM width).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from data.bad_rows import check_bad_fraction
from data.batches import collate
from data.processor import IM_START, MAX_TILES
from data.sft import BAD_REASONS, BadRow, SFTData
from gates import (
    RouterError,
    fingerprint,
    image_tiles,
    pool_tiles,
    question_span,
    text_feature,
    thumbnail_feature,
)
from inference.flags import DeviceFlags
from llm import prompt_positions
from loading.checkpoint import check_not_run_folder, read_json
from loading.config_json import open_checkpoint
from loading.pretrained import load_pretrained
from loading.weights import read_safetensors
from loss import IGNORE, answer_nll
from parvl import ParVL
from shell.cli import SEED, SEEDS, allocation, barrier, log, rank, start_processes, world_size
from shell.devices import resolve_dtype
from shell.files import regular_file, write_text, writing
from shell.flags import flag, reuse_flag
from shell.outputs import check_shared
from shell.shards import FileParts, merged, resumed, share

LABEL_KEYS = ("rows", "nll", "image", "text", "connector", "has_image")
# a labels folder: merge writes them, load_labels reads them
LABEL_FILES = ("labels.safetensors", "labels.json")
CHUNK = "chunk_{:06d}.safetensors"  # OUT/parts/CHUNK: chunk k, as an interrupted run of any version left it
LABELLED = "the chunks labelled so far stay; the same command resumes"  # what an interrupt leaves


class RouterInputs:
    """The folders and the meta JSON a router.py subcommand's flags name, checked before it writes anything
    (flags.dispatch calls check_files): one line each."""

    def check_files(self) -> None:
        for name in ("model", "router", "labels"):
            if getattr(self, name, None) and not Path(getattr(self, name)).is_dir():
                raise RouterError(f"--{name} {getattr(self, name)}: not a folder")
        if getattr(self, "data", ""):
            regular_file(self.data, "--data")  # a FIFO would block the read
        if getattr(self, "data", "") and not Path(self.data).is_file():
            raise RouterError(f"--data {self.data}: no such meta JSON file")


@dataclass
class LabelConfig(RouterInputs):
    """`router.py label`'s flags."""

    model: str = flag("", "ParVL checkpoint folder (Pv:Pl > 1:1)", required=True, reads=True)
    data: str = flag(
        "", "meta JSON in the official InternVL format (data/sft.py)", required=True, reads=True
    )
    out: str = flag(
        "",
        "labels folder: labels.safetensors + labels.json (parts/ while labelling)",
        required=True,
        writes=(*LABEL_FILES, "parts"),
    )
    batch_size: int = flag(4, "rows per chunk and forward", range="[1, inf)")
    max_tokens: int = flag(
        16384,
        "padded tokens per forward (rows x longest): a chunk over it is split by length, "
        "a longer row runs alone",
        unit="tokens",
        range="[1, inf)",
    )
    max_tiles: int = flag(12, "448 px tiles per row", range=f"[1, {MAX_TILES}]")
    max_seq_len: int = flag(32768, "longer rows are skipped", unit="tokens", range="[1, inf)")
    seed: int = flag(
        SEED,
        'data augmentation seed (data.SFTData); A.2: "All SFT and router-training jobs use random '
        'seed 42"',
        shown=f"{SEED}, the paper's",
        range=SEEDS,
    )
    dtype: str | None = reuse_flag(DeviceFlags, "dtype")
    max_bad_frac: float = flag(
        0.01, "abort when more than this fraction of the data set's rows are bad", range="[0, 1]"
    )
    log_every: int = flag(10, "chunks between progress lines", range="[1, inf)")
    num_workers: int = flag(2, "data loading processes", range="[0, inf)")


def load_model(path: str, dtype: str | None, device) -> ParVL:
    """The checkpoint in --dtype (None or "": bf16 on CUDA, fp32 on CPU), for label, train and eval."""
    return load_pretrained(path, dtype=resolve_dtype(dtype, device), device=device)


# -- one batch's labels ---------------------------------------------------------------------


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
    # [B] the first answer token: the prompt ends before it
    first = (labels != IGNORE).long().argmax(1)
    prompt = valid & (torch.arange(T, device=dev) < first[:, None])
    text = text_feature(model, ids, question_span(ids, prompt, im_start_id, image_id))
    tiles = image_tiles(ids, image_id, model.cfg.tokens_per_tile)
    num_tiles = torch.tensor([sum(t) for t in tiles], device=dev)
    image = (
        thumbnail_feature(model, pix, tiles)
        if pix.shape[0]
        else text.new_zeros(B, model.cfg.vit.hidden_size)
    )
    positions, mask = prompt_positions(valid)
    head = model.language_model.lm_head.weight
    nll = torch.zeros(B, par.pv, par.pl, device=dev)
    connector = torch.zeros(B, par.pv, text.shape[-1], device=dev)
    for v in range(par.pv):
        if not pix.shape[0] and v:  # no image in the batch: the vision branch changes nothing
            nll[:, v] = nll[:, 0]
            continue
        # [N,256,C] branch v, once
        features = model.extract_features(pix, v) if pix.shape[0] else None
        if features is not None:
            connector[:, v] = pool_tiles(features, num_tiles)
        x, _ = model.embed(ids, None, features=features)
        # [B,Pl,T,C] every language branch in one pass
        h = model.language_branch_states(x, positions, mask)
        nll[:, v] = answer_nll(h.flatten(0, 1), head, labels.repeat_interleave(par.pl, 0)).view(
            B, par.pl
        )
    return {
        "rows": torch.tensor(batch.rows),
        "nll": nll.cpu(),
        "image": image.cpu(),
        "text": text.cpu(),
        "connector": connector.cpu(),
        "has_image": (num_tiles > 0).cpu(),
    }


def length_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Samples grouped for padded forwards, longest first: a group takes the next sample while it is
    at least half the group's longest and samples x longest stays within max_tokens; a longer one goes
    alone, unpadded and maskless (a padding mask grows with T^2: 11.7 GB for 16 rows of 27,000 tokens)."""
    groups: list[list[int]] = []
    # stable: ties keep their order
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
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
    with allocation(
        f"--batch-size {batch_size} (longest row {longest} tokens, --max-tokens {max_tokens})",
        "--batch-size or --max-tokens, or use a device with more memory",
    ):
        parts = [forward(collate([samples[i] for i in g], pad_id=0)) for g in groups]
    order = torch.tensor([i for g in groups for i in g]).argsort()  # group order -> sample order
    return {k: torch.cat([p[k] for p in parts])[order] for k in parts[0]}


def _items(items: list) -> list:
    return items  # a DataLoader collate_fn that keeps the samples (module level: picklable for workers)


# -- the job: chunks shared by the ranks, resumable (shell/shards.py) ------------------------------------


def label(cfg: LabelConfig) -> int:
    """`router.py label`: every row of cfg.data labelled in chunks of cfg.batch_size rows (see the module
    docstring)."""
    device = start_processes(torch.cuda.is_available())
    out = Path(cfg.out)
    check_shared(out, "--out")  # more than one machine: every rank writes its chunks there
    dtype = cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")
    check_not_run_folder(Path(cfg.model))  # runs/44 for runs/44/export: say which folder is meant
    _, tok = open_checkpoint(Path(cfg.model))  # checked before the weights load
    model = load_model(cfg.model, dtype, device)
    if model.cfg.vit is None or model.cfg.par.pv * model.cfg.par.pl == 1:
        raise RouterError(
            f"{cfg.model}: a router needs a multimodal checkpoint with more than one branch pair, "
            f"it has Pv:Pl = {model.cfg.par.pv}:{model.cfg.par.pl}"
        )
    data = SFTData(
        cfg.data,
        tok,
        max_tiles=cfg.max_tiles,
        max_seq_len=cfg.max_seq_len,
        image_token_id=model.cfg.image_token_id,
        seed=cfg.seed,
        max_positions=model.cfg.llm.max_position_embeddings,
    )
    job = label_job(cfg, model, data, tok.token_to_id(IM_START), dtype)
    if (out / "labels.json").exists():
        if not same_job(read_json(out / "labels.json"), job):
            raise RouterError(
                f"{out}: holds labels of another checkpoint, data set or setting; remove it or pick "
                f"another --out"
            )
        log(f"{out}: already complete")
        return 0
    parts = FileParts(out / "parts", CHUNK)
    resumed(lambda: check_parts(parts, job))  # every rank reads job.json before rank 0 rewrites it
    if rank() == 0:
        parts.folder.mkdir(parents=True, exist_ok=True)
        write_text(parts.folder / "job.json", json.dumps(job, indent=2))
    barrier()  # the parts folder is there before any rank writes into it
    chunks = math.ceil(len(data) / cfg.batch_size)
    # a chunk's rows are fixed by its number: a rank owns the same chunks on a rerun
    mine = share(range(chunks))
    todo = [k for k in mine if not parts.done(k)]
    log(
        f"label: {len(data)} rows in {chunks} chunks of {cfg.batch_size} on {world_size()} ranks, Pv x Pl = "
        f"{job['pv']} x {job['pl']}; rank 0 resumes with {len(mine) - len(todo)} of its {len(mine)} chunks done"
    )
    label_chunks(cfg, model, data, job, parts, todo)
    barrier()  # every chunk is written
    bad = bad_rows(parts, chunks)  # every rank reads the counts, so every rank stops on too many
    check_bad_fraction(bad, job["rows"], cfg.max_bad_frac)
    merged(lambda: merge(parts, out, job | {"bad_rows": bad}, chunks))
    return 0


def label_job(cfg: LabelConfig, model: ParVL, data: SFTData, im_start_id: int, dtype: str) -> dict:
    """What the labels are of: checkpoint, data, settings and the widths of the stored tensors."""
    par = model.cfg.par
    return {
        "checkpoint": str(cfg.model),
        "fingerprint": fingerprint(model),
        "data": str(cfg.data),
        "data_fingerprint": data_fingerprint(data),
        "rows": len(data),
        "batch_size": cfg.batch_size,
        "max_tiles": cfg.max_tiles,
        "max_seq_len": cfg.max_seq_len,
        "seed": cfg.seed,
        "pv": par.pv,
        "pl": par.pl,
        "pairs": [[v, l] for v in range(par.pv) for l in range(par.pl)],
        "vision_width": model.cfg.vit.hidden_size,
        "text_width": model.cfg.llm.hidden_size,
        "im_start_id": im_start_id,
        "dtype": dtype,
        "nll": "mean token CE over the supervised (Eq. 6) tokens",
    }


def same_job(other: dict, job: dict) -> bool:
    """The same labels, wherever the checkpoint and the data now lie."""
    return all(other.get(k) == v for k, v in job.items() if k not in ("checkpoint", "data"))


def check_parts(parts: FileParts, job: dict) -> None:
    """A rerun resumes only the partial labels of the same job."""
    if (parts.folder / "job.json").exists() and not same_job(
        read_json(parts.folder / "job.json"), job
    ):
        raise RouterError(
            f"{parts.folder}: partial labels of another checkpoint, data set or setting; remove it or "
            f"pick another --out"
        )


def label_chunks(
    cfg: LabelConfig, model: ParVL, data: SFTData, job: dict, parts: FileParts, todo: list[int]
) -> None:
    """Label the chunks todo, each kept in its file the moment it is done, with its bad rows counted by
    reason in the file's metadata; rank 0 reports its progress."""
    sampler = [
        list(range(k * cfg.batch_size, min((k + 1) * cfg.batch_size, len(data)))) for k in todo
    ]
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=sampler, num_workers=cfg.num_workers, collate_fn=_items
    )
    t0, samples = time.perf_counter(), 0
    for i, (k, items) in enumerate(zip(todo, loader, strict=True)):
        good = [s for s in items if not isinstance(s, BadRow)]
        bad = {r: sum(isinstance(s, BadRow) and s.reason == r for s in items) for r in BAD_REASONS}
        if good:
            result = by_length(
                good,
                cfg.max_tokens,
                cfg.batch_size,
                lambda b: label_batch(model, b, job["im_start_id"]),
            )
        else:  # a chunk of bad rows only
            result = empty_chunk(job)
        # save_file(result, path)
        parts.keep(k, partial(save_file, result, metadata={"bad": json.dumps(bad)}))
        samples += len(good)
        dt = time.perf_counter() - t0
        if i + 1 == len(todo) or (i + 1) % cfg.log_every == 0:
            log(
                f"label: chunk {i + 1}/{len(todo)} of rank 0, {samples / dt:.2f} samples/s, "
                f"ETA {dt / (i + 1) * (len(todo) - i - 1):.0f} s"
            )


def empty_chunk(job: dict) -> dict[str, torch.Tensor]:
    """The tensors of a chunk with no good row: every key, no sample."""
    shapes = (
        ("nll", (job["pv"], job["pl"])),
        ("image", (job["vision_width"],)),
        ("text", (job["text_width"],)),
        ("connector", (job["pv"], job["text_width"])),
    )
    return {k: torch.zeros(0, *shape) for k, shape in shapes} | {
        "rows": torch.zeros(0, dtype=torch.long),
        "has_image": torch.zeros(0, dtype=torch.bool),
    }


def bad_rows(parts: FileParts, chunks: int) -> dict[str, int]:
    """The bad rows of every chunk, by reason; a chunk missing is one line saying how to finish."""
    bad = dict.fromkeys(BAD_REASONS, 0)
    for k in range(chunks):
        if not parts.done(k):
            raise RouterError(
                f"{parts.path(k)}: missing; rerun the same command to finish labelling"
            )
        with safe_open(str(parts.path(k)), framework="pt") as f:
            for r, n in json.loads(f.metadata()["bad"]).items():
                bad[r] += n
    return bad


def merge(parts: FileParts, out: Path, job: dict, chunks: int) -> None:
    """Concatenate the chunk files in chunk order into OUT/labels.safetensors + OUT/labels.json."""
    tensors = {k: [] for k in LABEL_KEYS}
    for k in range(chunks):
        with safe_open(str(parts.path(k)), framework="pt") as f:
            for key in LABEL_KEYS:
                tensors[key].append(f.get_tensor(key))
    labels = {k: torch.cat(v) for k, v in tensors.items()}
    meta = job | {"samples": len(labels["rows"])}
    bad = job["bad_rows"]
    # a full disk names the file, not safetensors' own error
    with writing(out / "labels.safetensors"):
        save_file(labels, str(out / "labels.safetensors"), metadata={"format": "pt"})
    # written last: marks the labels complete
    write_text(out / "labels.json", json.dumps(meta, indent=2))
    parts.remove()
    log(f"labels: {meta['samples']} samples, bad rows {bad} -> {out}")


# -- reading them back (router.py train, eval) ----------------------------------------------------


def load_labels(
    path: str | Path, model: ParVL | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of a labels folder, checked for completeness and, given a model, against it."""
    folder = Path(path)
    if not (folder / "labels.json").is_file() or not (folder / "labels.safetensors").is_file():
        raise RouterError(
            f"{folder}: not a complete labels folder (labels.json + labels.safetensors; "
            f"see router.py label)"
        )
    meta, t = read_json(folder / "labels.json"), read_safetensors(folder / "labels.safetensors")
    S, pv, pl = meta.get("samples"), meta.get("pv"), meta.get("pl")
    want = {
        "rows": (S,),
        "nll": (S, pv, pl),
        "image": (S, meta.get("vision_width")),
        "text": (S, meta.get("text_width")),
        "connector": (S, pv, meta.get("text_width")),
        "has_image": (S,),
    }
    for k, shape in want.items():
        if k not in t or tuple(t[k].shape) != shape:
            got = tuple(t[k].shape) if k in t else None
            raise RouterError(f"{folder}: labels.safetensors {k} has shape {got}, expected {shape}")
    if not S:
        raise RouterError(f"{folder}: holds no labelled samples (every row was bad?)")
    if not bool(torch.isfinite(t["nll"]).all()):
        raise RouterError(f"{folder}: non-finite NLLs in the labels")
    if model is not None and meta["fingerprint"] != fingerprint(model):
        raise RouterError(
            f"{folder}: labelled with checkpoint {meta['fingerprint']} ({meta['checkpoint']}), "
            f"the model is {fingerprint(model)}"
        )
    return meta, t


def open_data(meta: dict, data_path: str | None, model: ParVL, where: str) -> SFTData:
    """The data set a labels file was computed on (data_path, or the one it names), checked to be the same."""
    path = data_path or meta["data"]
    _, tok = open_checkpoint(model.source_dir)
    data = SFTData(
        path,
        tok,
        max_tiles=meta["max_tiles"],
        max_seq_len=meta["max_seq_len"],
        image_token_id=model.cfg.image_token_id,
        seed=meta["seed"],
        max_positions=model.cfg.llm.max_position_embeddings,
    )
    if data_fingerprint(data) != meta["data_fingerprint"]:
        raise RouterError(
            f"{where}: labelled on data {meta['data_fingerprint']} ({meta['data']}), "
            f"{path} is {data_fingerprint(data)} (other rows or annotation files)"
        )
    return data


def check_labels(model: ParVL, data: SFTData, meta: dict, t: dict, n: int) -> None:
    """Recompute the NLLs and gate inputs of the first n labelled samples and compare them to the file."""
    if not n or not len(t["rows"]):
        return
    got = label_batch(
        model, collate([data[int(r)] for r in t["rows"][:n]], pad_id=0), meta["im_start_id"]
    )
    # other batch composition, other padding: rounding differs
    tol = 1e-3 if meta["dtype"] == "fp32" else 5e-2
    for k in ("nll", "image", "text", "connector"):
        if not torch.allclose(got[k], t[k][:n].to(got[k].device), rtol=tol, atol=tol / 10):
            raise RouterError(
                f"labels {k} of rows {t['rows'][:n].tolist()} differ from what the model gives: "
                f"stale labels?"
            )
