"""The router (paper Appendix E; gates.py, and router.py its command): Eq. E1/E2 by hand, labels against
plain single-pair forwards (and world-size / resume invariance), learning a planted preference with the model
frozen, routed generation against single-pair generation, and bad input refused with one line."""

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cluster_fakes import two_nodes
from commands import tree
from inputs import write_dataset
from PIL import Image
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import gates
import generate
import loading.router
import router
from config import PRESETS, ParConfig
from data.processor import Tokenizer, build_prompt, load_image
from data.sft import SFTData
from gates import Router, RouterConfig, RouterError, path_teacher, router_loss
from inference.engine import Engine, GenerateConfig
from loading.config_json import open_checkpoint
from loading.pretrained import load_pretrained, save_pretrained
from loading.router import load_router, save_router
from loss import token_nll
from parvl import ParVL
from training import router_labels

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for this module: on the shared 2-core machine two OpenMP threads per
    process oversubscribe the cores, and these tiny models ran 3-4x slower (94 s vs 26 s measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- Eq. E1, E2 by hand -------------------------------------------------------------------------


def test_teacher_and_loss_equal_hand_computation():
    tau = 0.1
    nll = torch.tensor(
        [
            [[2.0, 2.1, 2.5], [2.0, 3.0, 2.2]],  # a tie for the best pair: (0,0) and (1,0)
            [
                [1000.0, 1000.05, 1001.0],
                [1000.2, 1000.0, 1000.3],
            ],  # large NLLs: exp(-c/tau) underflows unshifted
            [[5.0, 5.0, 5.0], [5.0, 5.0, 5.0]],  # all equal: uniform
        ]
    )
    q = path_teacher(nll, tau)
    for b in range(3):
        c = nll[b].double()
        m = c.min()
        e = [[math.exp(-(c[v, l] - m) / tau) for l in range(3)] for v in range(2)]
        z = sum(map(sum, e))
        for v in range(2):
            for l in range(3):
                assert q[b, v, l].item() == pytest.approx(e[v][l] / z, rel=1e-6, abs=1e-12)
    assert q[0, 0, 0] == q[0, 1, 0] and torch.allclose(q[2], torch.full((2, 3), 1 / 6))
    assert torch.isfinite(q).all() and torch.allclose(q.flatten(1).sum(-1), torch.ones(3))

    logits_v = torch.tensor([[0.3, -0.2], [1.0, 2.0], [0.0, 0.0]])
    logits_l = torch.tensor([[0.1, 0.5, -1.0], [2.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    v_hat = torch.tensor([1, 1, 0])
    has_image = torch.tensor([True, True, False])
    got = router_loss(logits_v, logits_l, nll, v_hat, has_image, tau)
    for b in range(3):
        c = nll[b].double()
        qv = [sum(math.exp(-(c[v, l] - c.min()) / tau) for l in range(3)) for v in range(2)]
        qv = [x / sum(qv) for x in qv]
        row = c[v_hat[b]]
        # q_l(l | v_hat) ∝ exp(-c[v_hat,l]/tau)
        ql = [math.exp(-(row[l] - row.min()) / tau) for l in range(3)]
        ql = [x / sum(ql) for x in ql]
        lpv = torch.log_softmax(logits_v[b].double(), -1)
        lpl = torch.log_softmax(logits_l[b].double(), -1)
        ce_v = -sum(qv[v] * lpv[v].item() for v in range(2))
        ce_l = -sum(ql[l] * lpl[l].item() for l in range(3))
        want = 0.5 * ce_v * bool(has_image[b]) + 0.5 * ce_l  # text-only: no vision term
        assert got[b].item() == pytest.approx(want, rel=1e-6)
    # the language target given v_hat is the pair teacher's conditional q(v_hat, l) / q_v(v_hat)
    cond = q[1, 1] / q[1, 1].sum()
    row = nll[1, 1].double()
    torch.testing.assert_close(
        cond.double(), torch.softmax(-(row - row.min()) / tau, -1), rtol=1e-6, atol=1e-9
    )


# -- labels -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model23(checkpoint, tmp_path_factory) -> Path:
    """A 2:3 ParVL checkpoint with large random prefixes, so branches differ visibly."""
    model = load_pretrained(checkpoint("qwen3", "original"), pv=2, pl=3)
    torch.manual_seed(0)
    model.init_branches(std=0.5)
    folder = tmp_path_factory.mktemp("m23") / "ckpt"
    save_pretrained(model, folder)
    return folder


def run_router(*args) -> int:
    return router.main([str(a) for a in args])


LABEL = ["--num-workers", "0", "--max-tiles", "2", "--max-bad-frac", "0.5", "--batch-size", "2"]


@pytest.fixture(scope="module")
def labelled(model23, tmp_path_factory):
    """4 good rows (an image of 3 tiles, one of 1, two images with two answers, text only) and a missing
    image: 5 rows, 3 chunks of 2, labelled in one process."""
    root = tmp_path_factory.mktemp("labels")
    meta = write_dataset(root / "data", rows=4, bad=1)
    rng = np.random.default_rng(1)  # a 2:1 first image: 2 tiles + thumbnail at --max-tiles 2
    Image.fromarray(rng.integers(0, 255, (90, 180, 3), dtype=np.uint8)).save(
        root / "data" / "img0.png"
    )
    assert (
        run_router("label", "--model", model23, "--data", meta, "--out", root / "one", *LABEL) == 0
    )
    return meta, root / "one"


def test_labels_equal_single_pair_forwards(model23, labelled):
    meta, out = labelled
    info, t = router_labels.load_labels(out)
    assert info["samples"] == 4 and info["bad_rows"]["missing_image"] == 1 and info["rows"] == 5
    assert info["pairs"] == [[v, l] for v in range(2) for l in range(3)] and t["nll"].shape == (
        4,
        2,
        3,
    )
    model = load_pretrained(model23)
    tok = Tokenizer.from_pretrained(model23)
    data = SFTData(meta, tok, max_tiles=2)
    kinds = set()
    # one image / two images, two answers / text only (write_dataset's row pattern)
    for k in (0, 2, 3):
        s = data[int(t["rows"][k])]
        pix = s.pixel_values if s.pixel_values.shape[0] else None
        kinds.add(len(s.num_tiles))
        n = int((s.labels[1:] != -100).sum())
        with torch.no_grad():
            for v in range(2):
                for l in range(3):
                    logits = model(s.input_ids[None], pix, vision_branch=v, language_branch=l)
                    want = token_nll(logits, s.labels[None]).sum() / n
                    torch.testing.assert_close(t["nll"][k, v, l], want, rtol=1e-5, atol=1e-5)
            # the gate inputs are what inference computes from the prompt alone (ids before the answer)
            if pix is not None:
                for v in range(2):
                    feats = model.extract_features(pix, v)
                    torch.testing.assert_close(
                        t["connector"][k, v], feats.float().mean((0, 1)), rtol=1e-5, atol=1e-6
                    )
            first = int((s.labels != -100).nonzero()[0])
            ids = s.input_ids[None, :first]
            span = gates.question_span(
                ids,
                torch.ones_like(ids, dtype=torch.bool),
                info["im_start_id"],
                model.cfg.image_token_id,
            )
            assert tok.decode(ids[span].tolist()).startswith("user\n<img></img>") or pix is None
            torch.testing.assert_close(t["text"][k], gates.text_feature(model, ids, span)[0])
        assert bool(t["has_image"][k]) == (pix is not None)
    assert kinds == {0, 1, 2} and data[int(t["rows"][0])].num_tiles == [3]  # 2 tiles + thumbnail
    text_only = ~t["has_image"]
    # no ViT: same NLL
    assert text_only.any() and torch.equal(t["nll"][text_only, 0], t["nll"][text_only, 1])
    # the vision branches matter
    assert (t["nll"][t["has_image"], 0] != t["nll"][t["has_image"], 1]).all()


def test_labels_do_not_depend_on_world_size_and_resume(model23, labelled, tmp_path, monkeypatch):
    meta, one = labelled
    # two ranks as 2 nodes x 1 process (conftest.two_nodes, docs/training.md's multi-node torchrun on 127.0.0.1)
    codes, err = two_nodes(
        [
            ROOT / "router.py",
            "label",
            "--model",
            model23,
            "--data",
            meta,
            "--out",
            tmp_path / "two",
            *LABEL,
        ]
    )
    assert codes == [0, 0], err[-3000:]
    assert "label: chunk" in err  # progress on stderr
    # interrupted during the second chunk (Ctrl-C), then resumed
    label_batch, calls = router_labels.label_batch, []

    def label_then_interrupt(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return label_batch(*args)

    monkeypatch.setattr(router_labels, "label_batch", label_then_interrupt)
    assert (
        run_router("label", "--model", model23, "--data", meta, "--out", tmp_path / "cut", *LABEL)
        == 130
    )
    monkeypatch.undo()
    assert (
        not (tmp_path / "cut" / "labels.json").exists()
        and len(list((tmp_path / "cut" / "parts").glob("chunk_*"))) == 1
    )
    assert (
        run_router("label", "--model", model23, "--data", meta, "--out", tmp_path / "cut", *LABEL)
        == 0
    )
    ref = load_file(str(one / "labels.safetensors"))
    for other in ("two", "cut"):
        got = load_file(str(tmp_path / other / "labels.safetensors"))
        assert torch.equal(got["rows"], ref["rows"]) and torch.equal(
            got["has_image"], ref["has_image"]
        )
        for k in ("nll", "image", "text", "connector"):  # CPU threads may differ; the chunks do not
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-6)
        assert json.loads((tmp_path / other / "labels.json").read_text()) == json.loads(
            (one / "labels.json").read_text()
        )


def test_router_training_does_not_depend_on_world_size(model23, labelled, tmp_path):
    _, labels = labelled
    args = [
        "train",
        "--model",
        str(model23),
        "--labels",
        str(labels),
        "--steps",
        "12",
        "--global-batch",
        "4",
        "--log-every",
        "4",
        "--lr",
        "1e-2",
        "--check-samples",
        "1",
    ]
    assert run_router(*args, "--out", tmp_path / "one") == 0
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",
        str(ROOT / "router.py"),
        *args,
        "--out",
        str(tmp_path / "two"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    one, two = (load_file(str(tmp_path / d / "router.safetensors")) for d in ("one", "two"))
    for (
        k
    ) in one:  # the same global batches, the order of the gradient sums differs: Adam's g / sqrt(v)
        # turns that rounding into up to ~1e-4 on weights whose gradient is ~0; the updates are ~1e-1
        torch.testing.assert_close(one[k], two[k], rtol=0, atol=1e-3)
        assert (one[k] - two[k]).abs().mean() < 1e-5
    m1, m2 = (
        [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in ("one", "two")
    )
    assert [m["step"] for m in m1] == [4, 8, 12] and [m["loss"] for m in m1] == pytest.approx(
        [m["loss"] for m in m2], rel=1e-5
    )
    assert [m["pair_histogram"] for m in m1] == [m["pair_histogram"] for m in m2]


# -- learning a planted preference --------------------------------------------------------------

QUESTIONS = [
    ["What colour dominates", "Which colour is most common", "Name the main colour"],
    ["Count the shapes", "How many objects are there", "Count what you see"],
    ["Describe it", "Describe the picture", "Tell me what this is"],
]
TAILS = ["", " here", " please", " now", " in this image", " briefly", " quickly", " for me"]


def planted_data(folder: Path, n: int, seed: int) -> tuple[Path, list[tuple[int, int]]]:
    """n one-tile rows; image class k (red or blue, noisy) and question class j (3 phrasings x tails)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    lines, classes = [], []
    for i in range(n):
        k, j = i % 2, (i // 2) % 3
        base = np.array([[200, 40, 40], [40, 40, 200]][k], dtype=np.float64)
        img = np.clip(base + rng.normal(0, 30, (64, 64, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(folder / f"{i}.png")
        q = QUESTIONS[j][rng.integers(3)] + TAILS[rng.integers(len(TAILS))] + "?"
        lines.append(
            {
                "image": f"{i}.png",
                "conversations": [
                    {"from": "human", "value": f"<image>\n{q}"},
                    {"from": "gpt", "value": "Fine."},
                ],
            }
        )
        classes.append((k, j))
    (folder / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    meta = {
        "planted": {
            "root": str(folder),
            "annotation": str(folder / "a.jsonl"),
            "repeat_time": 1,
            "length": n,
        }
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / "meta.json", classes


def plant(labels: Path, classes: list[tuple[int, int]], seed: int) -> None:
    """Replace the NLLs: the best vision branch is the image class, the best language branch the question class."""
    t = load_file(str(labels / "labels.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for b, row in enumerate(t["rows"].tolist()):
        k, j = classes[row]
        v, l = torch.arange(2)[:, None], torch.arange(3)[None, :]
        t["nll"][b] = 3.0 + 1.0 * (v != k) + 0.8 * (l != j) + 0.1 * torch.rand(2, 3, generator=g)
    save_file(t, str(labels / "labels.safetensors"))


def sha(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model23_shallow(model23, tmp_path_factory) -> Path:
    """model23's widths and tokenizer with one ViT and one LLM block (the planted NLLs replace its own)."""
    cfg = load_pretrained(model23).cfg
    cfg = replace(cfg, vit=replace(cfg.vit, num_layers=1), llm=replace(cfg.llm, num_layers=1))
    folder = tmp_path_factory.mktemp("shallow") / "ckpt"
    save_pretrained(ParVL.from_config(cfg, seed=1), folder, tokenizer_from=model23)
    return folder


def test_router_learns_planted_preference(model23_shallow, tmp_path, capsys):
    model23 = model23_shallow
    train_meta, train_cls = planted_data(tmp_path / "train", 30, seed=1)
    held_meta, held_cls = planted_data(tmp_path / "held", 20, seed=2)  # >= 95 %: at most one miss
    common = ["--num-workers", "0", "--max-tiles", "1", "--batch-size", "10"]
    assert (
        run_router(
            "label", "--model", model23, "--data", train_meta, "--out", tmp_path / "L", *common
        )
        == 0
    )
    assert (
        run_router(
            "label", "--model", model23, "--data", held_meta, "--out", tmp_path / "H", *common
        )
        == 0
    )
    plant(tmp_path / "L", train_cls, 0)
    plant(tmp_path / "H", held_cls, 1)
    before, state = sha(model23), load_pretrained(model23).state_dict()
    capsys.readouterr()
    assert (
        run_router(
            "train",
            "--model",
            model23,
            "--labels",
            tmp_path / "L",
            "--data",
            train_meta,
            "--out",
            tmp_path / "R",
            "--steps",
            "300",
            "--global-batch",
            "32",
            "--lr",
            "3e-3",
            "--log-every",
            "100",
            "--check-samples",
            "0",
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "frozen model unchanged" in err
    logs = [json.loads(x) for x in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logs] == [100, 200, 300] and logs[-1]["loss"] < logs[0]["loss"]
    assert sum(logs[-1]["pair_histogram"]) == 32 and 0 <= logs[-1]["entropy_vision"] <= math.log(2)
    # frozen: the checkpoint file and every tensor of the model are bit-identical
    after = load_pretrained(model23).state_dict()
    assert sha(model23) == before and all(torch.equal(state[k], after[k]) for k in state)
    assert set(load_file(str(tmp_path / "R" / "router.safetensors"))) == {
        f"{g}_gate.{fc}.{p}"
        for g in ("vision", "language")
        for fc in ("fc1", "fc2")
        for p in ("weight", "bias")
    }

    assert (
        run_router(
            "eval", "--model", model23, "--router", tmp_path / "R", "--labels", tmp_path / "H"
        )
        == 0
    )
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "R" / "eval.json").read_text())
    rows = res["rows"]
    assert rows["router"]["pair_acc"] >= 0.95, rows
    assert rows["oracle"]["pair_acc"] == 1.0 and rows["random pair"]["pair_acc"] < 0.5
    assert rows["oracle"]["nll"] <= rows["router"]["nll"] < rows["random pair"]["nll"]
    matrix = torch.tensor(res["pair_nll"])
    assert matrix.shape == (2, 3) and res["vision_marginal"] == pytest.approx(
        matrix.mean(1).tolist()
    )
    assert res["language_marginal"] == pytest.approx(matrix.mean(0).tolist())
    assert "router" in out and "ViT 1" in out
    # dense aggregation is computed with the full model (router.dense_nll): check it on two samples by hand
    model, tok = load_pretrained(model23), Tokenizer.from_pretrained(model23)
    data = SFTData(held_meta, tok, max_tiles=1)
    with torch.no_grad():
        dense = [
            float(
                token_nll(
                    model(data[r].input_ids[None], data[r].pixel_values), data[r].labels[None]
                ).sum()
                / int((data[r].labels[1:] != -100).sum())
            )
            for r in (0, 1)
        ]
        got = router.dense_nll(model, data, torch.tensor([0, 1]), 2, 16384)
    assert got.tolist() == pytest.approx(dense, rel=1e-5) and math.isfinite(rows["dense"]["nll"])
    # the same choices in eval (from the stored gate inputs) as at inference (from the prompt)
    r = load_router(tmp_path / "R", model)
    s = data[0]
    prompt = s.input_ids[None, : int((s.labels != -100).nonzero()[0])]
    v, l, _ = r.route(model, prompt, torch.ones_like(prompt, dtype=torch.bool), s.pixel_values)
    assert (v[0], l[0]) == held_cls[0]


# -- routed generation --------------------------------------------------------------------------


def tiny23(seed=0) -> ParVL:
    cfg = replace(PRESETS["tiny"], par=ParConfig(pv=2, pl=3, vit_prefix_len=5, llm_prefix_len=4))
    model = ParVL.from_config(cfg, seed=seed).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("prefix_k", "prefix_v")):
                p.normal_(std=1.0)  # branches that differ: different pairs give different tokens
    return model


def prompt(tiles: int, seed: int, text: int = 12, img: int = 300):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, img, (text,), generator=g)
    if tiles:
        ids = torch.cat([ids[:3], torch.full((256 * tiles,), img), ids[3:]])
    return ids.tolist(), (torch.randn(tiles, 3, 448, 448, generator=g) if tiles else None)


def test_routed_generation_equals_single_pair_generation():
    model = tiny23()
    torch.manual_seed(3)
    r = Router(
        RouterConfig(pv=2, pl=3, vision_width=64, text_width=64, hidden=32, im_start_id=301)
    ).eval()
    with torch.no_grad():
        for p in r.parameters():
            p.normal_(std=1.0)  # a random router whose choice varies from prompt to prompt
    batch = [
        prompt(1, 0),
        prompt(0, 1, text=20),
        prompt(3, 2),
        prompt(2, 3),
        prompt(1, 4, text=7),
        prompt(0, 5),
    ]
    prompts, pix = [p for p, _ in batch], torch.cat([x for _, x in batch if x is not None])
    calls = []
    vit0 = model.vision_model.encoder.layers[0]
    hooks = [
        r.vision_gate.register_forward_hook(lambda *a: calls.append(("gate", None))),
        vit0.register_forward_hook(lambda m, args, out: calls.append(("vit", args[1]))),
    ]
    cfg = GenerateConfig(max_new_tokens=6, ignore_eos=True)
    res = Engine(model, router=r).generate(prompts, pix, cfg, [])
    for h in hooks:
        h.remove()
    pairs = res.pairs
    # text-only: no vision choice
    assert [p[0] is None for p in pairs] == [False, True, False, False, False, True]
    assert len(set(pairs)) >= 3, pairs  # the router really picks different pairs in one batch
    # the vision gate runs first; then one ViT pass with each tile running its sample's branch only
    assert [c[0] for c in calls] == ["gate", "vit"]
    tiles = [0 if x is None else x.shape[0] for _, x in batch]
    want = [v if v is not None else 0 for v, _ in pairs]
    assert calls[1][1].per_item == 1 and calls[1][1].branch.tolist() == [
        v for v, n in zip(want, tiles) for _ in range(n)
    ]
    # B rows, not Pl*B
    assert model.language_model.model.layers[0].self_attn.kv_cache.k.shape[0] == len(prompts)
    for (ids, x), (v, l), got in zip(batch, pairs, res.tokens):
        # the pair by hand, sample alone: the gates' argmax on the thumbnail (last tile) patch embedding,
        # the mean text embedding (no <|im_start|> here: the whole prompt but its image tokens)
        with torch.no_grad():
            t = torch.tensor(ids)
            text = model.language_model.model.embed_tokens(t[t != 300]).mean(0, keepdim=True)
            image = (
                torch.zeros(1, 64)
                if x is None
                else model.vision_model.embeddings(x[-1:])[:, 1:].mean(1)
            )
            want_v = int(r.vision_gate(image, text).argmax()) if x is not None else None
            conn = (
                torch.zeros(1, 64)
                if x is None
                else model.extract_features(x, want_v).mean((0, 1))[None]
            )
            assert (v, l) == (want_v, int(r.language_gate(conn, text).argmax()))
        alone = (
            Engine(model, vision_branch=v or 0, language_branch=l)
            .generate([ids], x, cfg, [])
            .tokens[0]
        )
        assert got == alone, (v, l)


def test_generate_cli_router_and_bad_routers(model23, tmp_path, capsys):
    model, tok = load_pretrained(model23), Tokenizer.from_pretrained(model23)
    torch.manual_seed(0)
    cfg = RouterConfig(
        pv=2,
        pl=3,
        vision_width=64,
        text_width=64,
        hidden=16,
        im_start_id=tok.token_to_id("<|im_start|>"),
        fingerprint=gates.fingerprint(model),
    )
    save_router(Router(cfg), tmp_path / "R", {})
    png = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 300, 3), dtype=np.uint8)).save(
        png
    )
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "generate.py"),
            str(png),
            "What is this?",
            "--model",
            str(model23),
            "--router",
            str(tmp_path / "R"),
            "--max-new-tokens",
            "5",
            "--max-tiles",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    pv = load_image(png, max_tiles=2)
    ids = tok.encode(build_prompt("What is this?", [pv.shape[0]]))
    want = Engine(model, router=load_router(tmp_path / "R", model)).generate(
        [ids], pv, GenerateConfig(max_new_tokens=5), tok.eos_ids
    )
    assert tuple(out["pair"]) == want.pairs[0] and out["answer"] == tok.answer(want.tokens[0])

    # bad routers: another Pv x Pl, another width, tensors that do not match the config: one line, exit 1
    save_router(Router(replace(cfg, pv=3)), tmp_path / "R33", {})
    save_router(Router(replace(cfg, text_width=96)), tmp_path / "Rw", {})
    save_router(Router(replace(cfg, hidden=8)), tmp_path / "Rt", {})
    (tmp_path / "Rt" / "config.json").write_text(json.dumps({"router": vars(cfg) | {"hidden": 16}}))
    for folder, needle in (("R33", "Pv:Pl = 3:3"), ("Rw", "width"), ("Rt", "do not match")):
        rc = generate.main(
            [
                str(png),
                "Hi?",
                "--model",
                str(model23),
                "--router",
                str(tmp_path / folder),
                "--max-new-tokens",
                "2",
            ]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and err[-1].startswith("error: ") and needle in err[-1], err
    with pytest.raises(RouterError, match="checkpoint"):
        other = load_pretrained(model23)
        with torch.no_grad():
            other.language_aggregator.mlp[2].bias.add_(1.0)
        load_router(tmp_path / "R", other)
    for flag in (["--vision-branch", "0"], ["--language-branch", "1"], ["--shared-kv"]):
        with pytest.raises(SystemExit) as e:
            generate.main(
                [str(png), "Hi?", "--model", str(model23), "--router", str(tmp_path / "R"), *flag]
            )
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and flag[0] in err[0], err


# -- bad input for router.py ----------------------------------------------------------------------


def test_bad_input_refused_with_one_line(model23, labelled, checkpoint, tmp_path, capsys):
    meta, labels = labelled
    other_meta = write_dataset(tmp_path / "other", rows=5)
    other_model = load_pretrained(model23)
    with torch.no_grad():
        other_model.language_model.model.norm.weight.mul_(1.5)
    save_pretrained(other_model, tmp_path / "other_model")
    bad_labels = tmp_path / "bad_labels"
    bad_labels.mkdir()
    t = load_file(str(labels / "labels.safetensors"))
    save_file(t | {"nll": t["nll"][:, :1].contiguous()}, str(bad_labels / "labels.safetensors"))
    (bad_labels / "labels.json").write_text((labels / "labels.json").read_text())
    stale = tmp_path / "stale"  # the right shapes and fingerprints, other numbers
    stale.mkdir()
    save_file(t | {"nll": t["nll"] + 0.5}, str(stale / "labels.safetensors"))
    (stale / "labels.json").write_text((labels / "labels.json").read_text())
    cut = tmp_path / "cut"  # a copy cut short, as an interrupted copy leaves it
    cut.mkdir()
    whole = (labels / "labels.safetensors").read_bytes()
    (cut / "labels.safetensors").write_bytes(whole[: len(whole) // 2])
    (cut / "labels.json").write_text((labels / "labels.json").read_text())
    a_file = tmp_path / "a_file"  # an --out that cannot be a folder: an OSError, named in one line
    a_file.write_text("not a folder")
    cases = [
        (
            [
                "train",
                "--model",
                model23,
                "--labels",
                labels,
                "--data",
                other_meta,
                "--out",
                tmp_path / "x",
            ],
            "labelled on data",
        ),
        (
            [
                "train",
                "--model",
                tmp_path / "other_model",
                "--labels",
                labels,
                "--out",
                tmp_path / "x",
            ],
            "labelled with checkpoint",
        ),
        (
            ["train", "--model", model23, "--labels", bad_labels, "--out", tmp_path / "x"],
            "nll has shape",
        ),
        (
            ["train", "--model", model23, "--labels", tmp_path, "--out", tmp_path / "x"],
            "not a complete labels folder",
        ),
        (["train", "--model", model23, "--labels", stale, "--out", tmp_path / "x"], "stale labels"),
        (
            ["label", "--model", model23, "--data", other_meta, "--out", labels, *LABEL],
            "another checkpoint, data set",
        ),
        (
            [
                "label",
                "--model",
                checkpoint("qwen3", "original"),
                "--data",
                meta,
                "--out",
                tmp_path / "y",
                *LABEL,
            ],
            "Pv:Pl = 1:1",
        ),
        (
            ["eval", "--model", model23, "--router", tmp_path / "none", "--labels", labels],
            "--router",
        ),
        (
            ["train", "--model", model23, "--labels", cut, "--out", tmp_path / "x"],
            "labels.safetensors: unreadable safetensors",
        ),
        (
            ["label", "--model", model23, "--data", meta, "--out", a_file, *LABEL],
            f"{a_file}/parts: a parent is a file, not a folder",
        ),
        (
            ["train", "--model", model23, "--labels", labels, "--out", a_file / "r"],
            f"{a_file} is a file, not a folder",
        ),
        (
            [
                "eval",
                "--model",
                model23,
                "--router",
                labels,
                "--labels",
                labels,
                "--out",
                a_file / "e.json",
            ],
            f"--out {a_file}: {a_file} is a file, not a folder",
        ),  # before the model and the router (not one here) load
    ]
    for args, needle in cases:
        assert run_router(*args) == 1, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (args, err)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y" / "labels.json").exists()
    assert a_file.read_text() == "not a folder"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_label_interrupted_keeps_its_chunks_and_resumes(
    model23, labelled, tmp_path, capsys, monkeypatch, sig
):
    """SIGINT (Ctrl-C) or SIGTERM in router.py label, here sent during the second chunk: exit 128 + the
    signal, one line, the first chunk kept whole, and the same command finishes the labels, equal to
    a run never interrupted."""
    meta, one = labelled
    out, calls = tmp_path / "labels", []

    def label_batch(*args):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), sig)  # the real signal, through the handler router.py installs
        return real(*args)

    real = router_labels.label_batch
    monkeypatch.setattr(router_labels, "label_batch", label_batch)
    args = ["label", "--model", model23, "--data", meta, "--out", out, *LABEL]
    assert run_router(*args) == 128 + sig
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"interrupted by {sig.name}: the chunks labelled so far stay; the same command resumes"
    ), err
    # no .tmp left
    assert sorted(p.name for p in (out / "parts").iterdir()) == [
        "chunk_000000.safetensors",
        "job.json",
    ]
    assert not (out / "labels.json").exists()
    monkeypatch.setattr(router_labels, "label_batch", real)
    assert (
        run_router(*args) == 0 and "resumes with 1 of its 3 chunks done" in capsys.readouterr().err
    )
    a, b = load_file(str(out / "labels.safetensors")), load_file(str(one / "labels.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


MEMORY_PROBE = """
import resource, sys, torch
from training import router_labels
from data.batches import collate
from data.sft import SFTData
from loading.config_json import open_checkpoint
from loading.pretrained import load_pretrained
torch.set_num_threads(1)
folder, meta, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = load_pretrained(folder)
from pathlib import Path
_, tok = open_checkpoint(Path(folder))
data = SFTData(meta, tok, max_tiles=1, image_token_id=model.cfg.image_token_id)
samples = [data[i] for i in range(len(data))]
label = lambda b: router_labels.label_batch(model, b, tok.token_to_id("<|im_start|>"))
router_labels.by_length(samples[1:], max_tokens, 4, label)  # warm-up: the short rows alone
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
got = router_labels.by_length(samples, max_tokens, 4, label) if max_tokens else label(collate(samples, pad_id=0))
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(max(len(s.input_ids) for s in samples), grown, *got["nll"].flatten().tolist())
"""


def test_a_long_row_is_labelled_alone_within_a_memory_bound(model23_shallow, tmp_path):
    """One 2,552-token row among three short ones (router.py label's default chunk of 4). Padded to the
    longest, the 2:3 model's attention mask alone would be [3 x 4 rows, 1, T, 48 + T] booleans (80 MB),
    and that batch grew the peak by 593 MB (measured: MEMORY_PROBE with max_tokens 0). Split by length
    (router_labels.length_groups), the long row runs alone and unpadded, with no padding mask: its own
    attention grew the peak by 45 MB. Bound: at most the padded batch's mask, measured as ru_maxrss
    over a short-row warm-up in a fresh process."""
    root = tmp_path / "data"
    meta = write_dataset(root, rows=4)
    lines = (root / "train.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    rows[0]["conversations"][0]["value"] += " a" * 2200
    (root / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))

    def probe(budget):
        return subprocess.run(
            [sys.executable, "-c", MEMORY_PROBE, str(model23_shallow), str(meta), str(budget)],
            cwd=ROOT,
            env=dict(ENV, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()

    got = probe(16384)
    T, grown = int(got[0]), int(got[1])
    mask = 3 * 4 * T * (48 + T)
    assert T > 2200, T
    assert grown <= mask, (grown, mask)


def test_label_out_of_memory_is_one_line(model23, tmp_path, capsys, monkeypatch):
    """An allocation failure while labelling: one line naming --batch-size, the longest row and
    --max-tokens, exit 1, the chunks labelled before it kept (a rerun resumes)."""
    meta = write_dataset(tmp_path / "data", rows=4)
    real = router_labels.label_batch

    def label_batch(*args):
        if set(args[1].rows) & {2, 3}:  # the second chunk
            raise RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 37591663152 bytes."
            )
        return real(*args)

    monkeypatch.setattr(router_labels, "label_batch", label_batch)
    assert (
        run_router("label", "--model", model23, "--data", meta, "--out", tmp_path / "l", *LABEL)
        == 1
    )
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    cfg, tok = open_checkpoint(model23)
    data = SFTData(meta, tok, max_tiles=2, image_token_id=cfg.image_token_id)
    longest = max(len(data[i].input_ids) for i in (2, 3))
    assert lines[0] == (
        f"error: out of memory at --batch-size 2 (longest row {longest} tokens, --max-tokens 16384); "
        "lower --batch-size or --max-tokens, or use a device with more memory"
    ), lines[0]
    assert sorted(p.name for p in (tmp_path / "l" / "parts").glob("chunk_*")) == [
        "chunk_000000.safetensors"
    ]


FULL = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


def test_a_full_disk_or_memory_is_one_line(model23, labelled, tmp_path, capsys, monkeypatch):
    """A full disk while `label` writes a chunk or `train` its router was safetensors' SafetensorError traceback
    (its words, injected here): one line naming the file, exit 1 (issue 38, item 15). `train --hidden 10000000`
    could not allocate its gates: the allocator's RuntimeError, now one line naming --hidden."""
    meta, labels = labelled

    def full(*args, **kwargs):
        raise SafetensorError(FULL)

    monkeypatch.setattr(router_labels, "save_file", full)
    out = tmp_path / "l"
    assert run_router("label", "--model", model23, "--data", meta, "--out", out, *LABEL) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == f"error: {out / 'parts' / 'chunk_000000.safetensors.tmp'}: no space left on the device"
    ), err
    monkeypatch.setattr(loading.router, "save_file", full)
    train = [
        "train",
        "--model",
        model23,
        "--labels",
        labels,
        "--steps",
        1,
        "--global-batch",
        4,
        "--check-samples",
        0,
    ]
    assert run_router(*train, "--out", tmp_path / "R") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1] == f"error: {tmp_path / 'R' / 'router.safetensors'}: no space left on the device"
    ), err

    def router_that_cannot_allocate(cfg):
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 10240000000 bytes."
        )

    monkeypatch.setattr(router, "Router", router_that_cannot_allocate)
    # the range's top (issue 46: 10**7 is a flag error now), with an allocator that cannot serve it
    assert run_router(*train, "--hidden", 65536, "--out", tmp_path / "H") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "error: out of memory at --hidden 65536 (two gates of 65536 x 128 weights); lower --hidden"
    ), err


def test_train_into_a_router_folder_needs_overwrite(model23, labelled, tmp_path, capsys):
    """One folder, one router: a second `train` into it is refused (every file as it was), and
    --overwrite replaces the router and drops the old eval.json, which described the old one."""
    _, labels = labelled
    args = [
        "train",
        "--model",
        model23,
        "--labels",
        labels,
        "--steps",
        2,
        "--global-batch",
        4,
        "--check-samples",
        0,
        "--out",
        tmp_path / "R",
    ]
    assert run_router(*args) == 0
    (tmp_path / "R" / "eval.json").write_text("{}")
    before = {p.name: p.read_bytes() for p in (tmp_path / "R").iterdir()}
    capsys.readouterr()
    assert run_router(*args, "--seed", 1) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: --out {tmp_path / 'R'} already holds a router (router.safetensors, config.json, "
        f"metrics.jsonl, "
        "eval.json): pass --overwrite to replace it, or pick another --out"
    ], err
    assert {p.name: p.read_bytes() for p in (tmp_path / "R").iterdir()} == before
    assert run_router(*args, "--seed", 1, "--overwrite") == 0
    assert not (tmp_path / "R" / "eval.json").exists()
    assert (tmp_path / "R" / "router.safetensors").read_bytes() != before["router.safetensors"]


def test_router_tensorboard_curves_equal_metrics(model23, labelled, tmp_path):
    """`router.py train --tracker tensorboard`: the events TensorBoard reads back equal metrics.jsonl, every
    number at its step (the pair histogram as pair_histogram/k); a router trained anew with --overwrite
    replaces the old router's curves rather than adding to them."""
    pytest.importorskip("tensorboard")
    from commands import event_scalars, expected_scalars

    _, labels = labelled
    args = [
        "train",
        "--model",
        model23,
        "--labels",
        labels,
        "--steps",
        3,
        "--log-every",
        1,
        "--global-batch",
        4,
        "--check-samples",
        0,
        "--tracker",
        "tensorboard",
        "--out",
        tmp_path / "R",
    ]
    assert run_router(*args) == 0
    assert run_router(*args, "--seed", 1, "--overwrite") == 0
    lines = [json.loads(x) for x in (tmp_path / "R" / "metrics.jsonl").read_text().splitlines()]
    want = expected_scalars(lines)
    assert [s for s, _ in want["loss"]] == [1, 2, 3] and {
        "lr",
        "pair_acc",
        "pair_histogram/5",
    } <= want.keys()
    assert event_scalars(tmp_path / "R" / "tensorboard") == want


def test_train_keeps_the_tracker_files_it_did_not_write(model23, labelled, tmp_path, capsys):
    """Issue 38, item 3: `router.py train` into a folder holding a tensorboard/, wandb/ or wandb_id it did not
    write deleted them, and turned a user's file named tensorboard into its event folder. As train.py, a new
    router keeps what the folder holds (only --overwrite of a router takes that router's curves with it), and a
    file where a tracker keeps its folder is one line, before any work, every file as it was."""
    _, labels = labelled
    out = tmp_path / "R"
    for name, text in (
        ("tensorboard/events.mine", "mine"),
        ("wandb/run-mine/x", "mine"),
        ("wandb_id", "mine42"),
    ):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    theirs = tree(out)
    args = [
        "train",
        "--model",
        model23,
        "--labels",
        labels,
        "--steps",
        2,
        "--global-batch",
        4,
        "--check-samples",
        0,
    ]
    assert run_router(*args, "--out", out) == 0
    assert {k: v for k, v in tree(out).items() if k in theirs} == theirs
    mine = tmp_path / "S"
    mine.mkdir()
    (mine / "tensorboard").write_text("a file of mine")
    capsys.readouterr()
    assert run_router(*args, "--out", mine, "--tracker", "tensorboard") == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --tracker tensorboard: {mine / 'tensorboard'} is a file, where tensorboard keeps its folder"
    ]
    assert tree(mine) == {"tensorboard": hashlib.sha256(b"a file of mine").hexdigest()}


def test_train_stops_on_a_non_finite_loss_and_saves_no_router(model23, labelled, tmp_path, capsys):
    """Issue 38, item 8: `router.py train --lr 1e30` wrote "loss": NaN (not JSON) from step 3 on and saved an
    all-NaN router, with which generate.py --router always picked [0,0]. It stops as train.py does: one line
    naming the step, exit 1, before the update; no router saved, and metrics.jsonl holds finite JSON only."""
    _, labels = labelled
    out = tmp_path / "R"
    assert (
        run_router(
            "train",
            "--model",
            model23,
            "--labels",
            labels,
            "--steps",
            8,
            "--global-batch",
            4,
            "--log-every",
            1,
            "--check-samples",
            0,
            "--lr",
            "1e30",
            "--warmup-ratio",
            0,
            "--out",
            out,
        )
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    lines = [x for x in err if x.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err
    assert re.fullmatch(
        r"error: step \d: non-finite loss \S+ or gradient at --lr 1e\+30; stopped before the update, "
        r"nothing saved as the router",
        lines[0],
    ), lines[0]
    assert not (out / "router.safetensors").exists()
    for line in (out / "metrics.jsonl").read_text().splitlines():  # strict JSON: NaN refused
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))


def test_train_saves_nothing_that_is_not_finite(model23, labelled, tmp_path, capsys):
    """Issue 46, rule 5: `--lr 1e30 --steps 2` saved weights near 1e30 (here one step does) that always picked
    pair [0, 0] (the check ran before each update, never after the last), and `--weight-decay 1e300` an all-inf
    router: the first is one line after the last update, exit 1, no router saved; the second and `--hidden
    10**7` (24 GB until the kernel killed it) are flag errors, exit 2. A rerun is told the run saved no router."""
    _, labels = labelled
    out = tmp_path / "R"
    base = [
        "train",
        "--model",
        model23,
        "--labels",
        labels,
        "--global-batch",
        4,
        "--check-samples",
        0,
    ]
    base += ["--warmup-ratio", 0, "--out", out]
    assert run_router(*base, "--steps", 1, "--lr", "1e30") == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")]
    assert err == [
        "error: step 1: after the last update the router's logits are not finite (--lr 1e+30, --weight-decay "
        "0); nothing saved as the router: lower --lr"
    ], err
    assert not (out / "router.safetensors").exists()
    assert run_router(*base, "--steps", 1) == 1
    assert "already holds a router run that saved no router" in capsys.readouterr().err
    for flags, line in (
        (
            ["--weight-decay", "1e300"],
            "--weight-decay 1e+300 at --lr 0.0003: AdamW scales each weight",
        ),
        (["--hidden", 10**7], "--hidden must be in [1, 65536], got 10000000"),
    ):
        with pytest.raises(SystemExit) as e:
            run_router(*base, *flags)
        assert e.value.code == 2 and line in capsys.readouterr().err


@pytest.mark.parametrize("pv, pl", [(2, 1), (1, 2)])
def test_every_allocation_of_two_pairs_or_more_labels_trains_and_evaluates(
    checkpoint, tmp_path, pv, pl
):
    """Issue 38, item 10: `router.py label` on a 2:1 checkpoint (Pv > 1, one language branch) died with
    `AssertionError: per_branch reads dense rows`. Every allocation with more than one branch pair labels (each
    pair's NLL the plain single-pair forward's), trains a few steps and evaluates: 2:1 and 1:2."""
    model = load_pretrained(checkpoint("qwen3", "original"), pv=pv, pl=pl)
    torch.manual_seed(0)
    model.init_branches(std=0.5)
    save_pretrained(model, tmp_path / "ckpt")
    meta = write_dataset(tmp_path / "data", rows=2)
    labels, gates_ = tmp_path / "labels", tmp_path / "gates"
    assert (
        run_router("label", "--model", tmp_path / "ckpt", "--data", meta, "--out", labels, *LABEL)
        == 0
    )
    info, t = router_labels.load_labels(labels)
    assert t["nll"].shape == (2, pv, pl) and info["pairs"] == [
        [v, l] for v in range(pv) for l in range(pl)
    ]
    s = SFTData(meta, Tokenizer.from_pretrained(tmp_path / "ckpt"), max_tiles=2)[int(t["rows"][0])]
    with torch.no_grad():
        for v in range(pv):
            for l in range(pl):
                logits = model(
                    s.input_ids[None], s.pixel_values, vision_branch=v, language_branch=l
                )
                want = token_nll(logits, s.labels[None]).sum() / int((s.labels[1:] != -100).sum())
                torch.testing.assert_close(t["nll"][0, v, l], want, rtol=1e-5, atol=1e-5)
    assert (
        run_router(
            "train",
            "--model",
            tmp_path / "ckpt",
            "--labels",
            labels,
            "--steps",
            2,
            "--global-batch",
            2,
            "--out",
            gates_,
        )
        == 0
    )
    assert (
        run_router("eval", "--model", tmp_path / "ckpt", "--router", gates_, "--labels", labels)
        == 0
    )
    result = json.loads((gates_ / "eval.json").read_text())
    assert (result["pv"], result["pl"]) == (pv, pl) and sum(map(sum, result["router_pairs"])) == 2


def test_length_groups_bucket_by_length_within_the_token_budget():
    """Longest first; a sample joins a group while it is at least half the group's longest and the
    padded size stays within max_tokens; a longer sample goes alone."""
    assert router_labels.length_groups([10, 27000, 12, 11, 30], 16384) == [[1], [4], [2, 3, 0]]
    # ties keep their order
    assert router_labels.length_groups([100] * 5, 250) == [[0, 1], [2, 3], [4]]
    assert router_labels.length_groups([60, 40, 31, 29], 10**6) == [[0, 1, 2], [3]]  # 29 < 60 / 2
    assert router_labels.length_groups([], 8) == []


def test_every_router_job_uses_the_papers_seed():
    """Issue 37, item 7: A.2, "All SFT and router-training jobs use random seed 42"; `router.py label`
    augmented its data with seed 0. label's augmentation, train's sample order and gates, eval's random pair:
    42 by default, as train.py's."""
    from commands import parse_flags

    argv = {
        "label": ["--model", "M", "--data", "d.json", "--out", "L"],
        "train": ["--model", "M", "--labels", "L", "--out", "R"],
        "eval": ["--model", "M", "--router", "R", "--labels", "L"],
    }
    assert {sub: parse_flags(router, [sub, *a]).seed for sub, a in argv.items()} == dict.fromkeys(
        argv, 42
    )
