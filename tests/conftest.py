"""The tests' fixtures, session- or module-cached: tiny random InternVL checkpoints in every official layout
and their reference, a loaded model, bad inputs, a benchmark and its predictions, a training run.

Fixtures: `checkpoint(...) -> Path`, `reference(family, seed) -> model` and `parvl(family, layout) -> ParVL`,
all session-cached; `model_dir` (the tiny qwen3 checkpoint, original layout) and `meta` (16 SFT rows), both
per module; and, session-cached because several files read them: `png` (a small photo), `input_files` (bad
input for the commands), `bench` / `full_run` (an MMMU-style TSV and its predictions) and `run3` (a 2:2
training run with a kept step and TensorBoard events). The fixtures are checked on their own by the
`test_fixture_*` tests in `test_equivalence.py`.

The plain helpers live in modules by what they build, imported by name (tests/ is on sys.path):
official.py (the reference model and checkpoints in its layouts), inputs.py (prompts, tiles, data sets,
TSVs), commands.py (running a command and reading what it leaves and says), cluster_fakes.py (two nodes,
a faked Slurm), judge_fakes.py (a VLMEvalKit checkout and an answer extractor on 127.0.0.1).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from commands import COMMON, train_here  # noqa: E402
from inputs import png_b64, write_dataset, write_tsv  # noqa: E402
from official import build_reference, make_checkpoint  # noqa: E402
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import parvl`


# ----------------------------------------------------------------------------- checkpoint files


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """`checkpoint(family="qwen3", layout="original", shards=1, dtype=torch.float32, seed=0) -> Path`.

    Session-cached: one folder per argument set. Treat it as read-only (copy it to break it).
    """
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[tuple, Path] = {}

    def get(family="qwen3", layout="original", shards=1, dtype=torch.float32, seed=0) -> Path:
        key = (family, layout, shards, dtype, seed)
        if key not in cache:
            cache[key] = make_checkpoint(root, family, layout, shards, dtype, seed)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def reference():
    """`reference(family="qwen3", seed=0) -> InternVLForConditionalGeneration` (eval, fp32)."""
    return build_reference


# ----------------------------------------------------------------------------- inputs


# Under pytest-xdist every worker is one process on a machine of few cores (CI: 2 workers on 2): one
# intra-op thread each, and for the processes they start (torchrun workers, commands), so that no
# OpenMP team waits on a core another worker holds.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


# Compiled graphs are shared across the tests of a session: a model of the same config and shapes
# reuses the decode step compiled for an earlier one (its weights are graph inputs), which is most
# of what the compiled tests cost. The recompile limit per code object is raised to cover the
# suite's distinct configs, and reaching it is an error rather than a silent fall back to eager
# (which would make every compiled-equals-eager test vacuous).
for name, value in (
    ("recompile_limit", 256),
    ("accumulated_recompile_limit", 4096),
    (
        "automatic_dynamic_shapes",
        False,
    ),  # a new shape compiles a static graph, as a fresh process would
    ("fail_on_recompile_limit_hit", True),
):
    if hasattr(torch._dynamo.config, name):  # the names of torch 2.11 and newer
        setattr(torch._dynamo.config, name, value)


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    """The tiny Qwen3 checkpoint in the original layout: the model of the training, command and
    robustness tests."""
    return checkpoint("qwen3", "original")


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    """16 SFT rows in the official InternVL format (write_dataset), made once per module."""
    return write_dataset(tmp_path_factory.mktemp("data"), rows=16)


# ----------------------------------------------------------------------------- the model, loaded


@pytest.fixture(scope="session")
def parvl(checkpoint):
    """`parvl(family, layout) -> ParVL` loaded in fp32 from that checkpoint folder (session-cached; don't modify)."""
    from loading.pretrained import load_pretrained
    from parvl import ParVL

    models: dict[tuple[str, str], ParVL] = {}

    def get(family: str = "qwen3", layout: str = "original") -> ParVL:
        if (family, layout) not in models:
            models[family, layout] = load_pretrained(
                checkpoint(family, layout), dtype=torch.float32, device="cpu"
            )
        return models[family, layout]

    return get


# ----------------------------------------------------------------------------- commands in this process


NOT_UTF8 = "character {k} is a lone surrogate U+DCFF (the byte 0xff of text that is not UTF-8?)"


@pytest.fixture(scope="session")
def png(tmp_path_factory):
    """A 90 x 60 random photo.png: the image of the command tests."""
    path = tmp_path_factory.mktemp("img") / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8)).save(
        path
    )
    return path


@pytest.fixture(scope="session")
def input_files(tmp_path_factory):
    """Small files of bad (or odd) input the commands are handed: a TSV with a header and no rows, one
    with a short row, predictions, score files (a NaN, a string), law CSVs (six equal points, a byte order
    mark, 200,004 rows), a file where a folder goes, an empty folder, a run with foreign metrics lines."""
    d = tmp_path_factory.mktemp("inputs")
    img = png_b64(16, 16, 5)
    f = {
        "header_tsv": write_tsv(
            d / "header_tsv", [{"index": "0", "question": "q", "answer": "a", "image": img}]
        ),
        "short_tsv": d / "short_tsv",
        "preds": d / "preds.jsonl",
        "score": d / "score.json",
        "nan": d / "nan.json",
        "text": d / "text.json",
        "six_csv": d / "six_csv",
        "bom_csv": d / "bom_csv",
        "big_csv": d / "big_csv",
        "a file": d / "a file",
        "folder": d / "folder",
        "run": d / "run",
    }
    f["header_tsv"].write_text(f["header_tsv"].read_text().splitlines()[0] + "\n")
    # row 0 has no answer cell
    f["short_tsv"].write_text("index\tquestion\tanswer\n0\tWhat?\n1\tWhat?\tyes\n")
    f["preds"].write_text(
        '{"index": "0", "prediction": "yes"}\n{"index": "1", "prediction": "yes"}\n'
    )
    f["score"].write_text('{"benchmark": "OCRBench", "score": 50.0, "pv": 1, "pl": 1}\n')
    f["nan"].write_text('{"benchmark": "OCRBench", "score": NaN, "pv": 1, "pl": 1}\n')
    f["text"].write_text('{"benchmark": "OCRBench", "score": "high", "pv": 1, "pl": 1}\n')
    f["six_csv"].write_text("params,p,loss\n" + "1000000,2,2.5\n" * 6)
    rows = [
        (n, p, 1.5 + (3e8 / (n * (0.4 * math.log(p) + 1))) ** 0.3)
        for n in (1e8, 1e9)
        for p in (1, 2, 4)
    ]
    f["bom_csv"].write_text(
        "\ufeffparams,p,loss\n" + "".join(f"{n},{p},{loss}\n" for n, p, loss in rows),
        encoding="utf-8",
    )
    f["big_csv"].write_text(
        "params,p,loss\n" + "".join(f"{n},{p},{loss}\n" for n, p, loss in rows) * 33334
    )
    f["a file"].write_text("x")
    f["folder"].mkdir()
    f["run"].mkdir()
    (f["run"] / "metrics.jsonl").write_text(
        '{"step": 1, "loss": null, "grad_norm": 1.0, "lr": {"pretrained": 0.001}}\n{"loss": 3}\nnull\n[1, 2]\n'
        '{"step": 2, "loss": 2.0, "grad_norm": null, "lr": null}\n"text"\n'
        '{"step": 3, "loss": 1.5, "grad_norm": 0.5, "lr": {"pretrained": 0.002, "branches": 0.01}}\n'
    )
    return f


# ----------------------------------------------------------------------------- a benchmark and its predictions

BENCH_NEW = 6  # new tokens of the bench runs: enough for a short answer, cheap on CPU


@pytest.fixture(scope="session")
def bench(checkpoint, tmp_path_factory):
    """An MMMU-style TSV: options, a hint, an open question, two images, a shared image, a 2:1 image
    (two tiles + thumbnail) and one corrupt image."""
    folder = checkpoint("qwen3", "original")
    d = tmp_path_factory.mktemp("bench")
    imgs = [png_b64(24, 24, 1), png_b64(20, 20, 2), png_b64(64, 32, 3)]
    rows = [
        {
            "index": "10",
            "question": "What is shown?",
            "A": "cat",
            "B": "dog",
            "answer": "A",
            "split": "validation",
            "image": imgs[0],
        },
        {
            "index": "11",
            "question": "Compare <image 1> and <image 2>.",
            "A": "same",
            "B": "different",
            "answer": "B",
            "split": "validation",
            "image": str([imgs[1], imgs[0]]),
        },
        {
            "index": "12",
            "question": "How many?",
            "hint": "Count them.",
            "answer": "3",
            "split": "dev",
            "image": "10",
        },
        {
            "index": "13",
            "question": "Broken",
            "A": "x",
            "B": "y",
            "answer": "A",
            "split": "dev",
            "image": "!!notbase64" * 10,
        },
        {
            "index": "14",
            "question": "Wide picture?",
            "A": "yes",
            "B": "no",
            "answer": "A",
            "split": "validation",
            "image": imgs[2],
        },
    ]
    return folder, write_tsv(d / "MMMU_DEV_VAL.tsv", rows), rows, imgs


@pytest.fixture(scope="session")
def full_run(bench, tmp_path_factory):
    """`evaluate.py run` of the bench TSV on its checkpoint, in batches of 3: the predictions every
    score, lengths and descriptors test reads."""
    import evaluate

    folder, tsv, rows, _ = bench
    out = tmp_path_factory.mktemp("run") / "pred.jsonl"
    rc = evaluate.main(
        [
            "run",
            "--benchmark",
            "MMMU_DEV_VAL",
            "--data",
            str(tsv),
            "--model",
            str(folder),
            "--out",
            str(out),
            "--batch-size",
            "3",
            "--max-new-tokens",
            str(BENCH_NEW),
        ]
    )
    assert rc == 0
    return out


# ----------------------------------------------------------------------------- a training run several files read


@pytest.fixture(scope="session")
def run3(checkpoint, tmp_path_factory):
    """A 2:2 run of 3 steps saving every step and keeping the last 2, logged to TensorBoard; the model it
    held in memory after step 2 is exported by the run itself (the end-of-run export's function, through a
    patched save) into a folder beside it. On the tiny checkpoint and 16 rows written as `meta` writes them.
    Returns the run folder, that export and the meta file."""
    import train
    from training import runs

    model_dir = checkpoint("qwen3", "original")
    root = tmp_path_factory.mktemp("run3")
    meta = write_dataset(root / "data", rows=16)
    out, at_two = root / "run", root / "in_memory_step_2"
    save = train.save_checkpoint

    def save_and_export(model, optim, sched, step, *args):
        save(model, optim, sched, step, *args)
        if step == 2:
            runs.export(model, at_two, Path(model_dir), step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "save_checkpoint", save_and_export)
        train_here(
            "--model",
            model_dir,
            "--data",
            meta,
            "--pv",
            "2",
            "--pl",
            "2",
            "--max-steps",
            "3",
            "--save-every",
            "1",
            "--keep-last",
            "2",
            "--tracker",
            "tensorboard",
            "--out",
            out,
            *COMMON,
        )
    return out, at_two, meta
