"""Running the commands from the tests and reading what they leave and say: train.py as a subprocess or in
this process, a command's main under capsys, a folder's files, a run's metrics, score files, tracker events."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import parvl`


ROOT = Path(__file__).resolve().parents[1]


def parse_flags(command, argv: list):
    """The config a command module's flags give (flags.parse_command over its COMMANDS), without running it."""
    from shell.flags import parse_command

    return parse_command(
        command.DESCRIPTION, command.COMMANDS, argv, getattr(command, "PROG", None)
    )[1]


def run_train(*args, nproc: int = 1, check: bool = True, fault: str | None = None):
    """train.py with these flags (under torchrun with nproc > 1); fault: one of tests/faults.py's."""
    script = [str(ROOT / "tests" / "faults.py"), fault] if fault else [str(ROOT / "train.py")]
    # --standalone: a free port, so runs side by side never clash
    cmd = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--standalone",
        ]
        if nproc > 1
        else [sys.executable]
    ) + [*script, *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if check:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def train_here(*args, check: bool = True) -> subprocess.CompletedProcess:
    """train.py's main in this process, for the runs of one process with no fault: what run_train
    gives, less the 3.6 s of imports a new interpreter spends. One intra-op thread, as run_train's
    OMP_NUM_THREADS=1; stdout and stderr captured; a flag error's SystemExit is its exit code."""
    import train

    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = train.main([str(a) for a in args])
            except SystemExit as e:
                code = e.code
    finally:
        torch.set_num_threads(threads)
    res = subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
    if check:
        assert code == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


COMMON = [
    "--dtype",
    "fp32",
    "--global-batch",
    "4",
    "--num-workers",
    "0",
    "--max-tiles",
    "2",
    "--log-every",
    "1",
    "--no-activation-checkpointing",
]


def tree(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under folder: "intact" means this does not change."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# train.py's human line per log step (stderr), not a note
PROGRESS = re.compile(r"step \d+/\d+ \| ")


def notes(text: str) -> list[str]:
    """The lines of stderr that are not training progress lines."""
    return [x for x in text.strip().splitlines() if not PROGRESS.match(x)]


def one_line(text: str) -> str:
    lines = notes(text)
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    return lines[0]


def worker_lines(stderr: str) -> list[str]:
    """What the workers printed under torchrun: the launcher appends its own failure report (an
    "E... failed (exitcode: 1)" log line and a ChildFailedError traceback) that no worker controls."""
    lines = notes(stderr)
    cut = next(
        (
            i
            for i, x in enumerate(lines)
            if "torch/distributed/elastic" in x or x.startswith("Traceback")
        ),
        len(lines),
    )
    return lines[:cut]


def root_cause(stderr: str) -> str:
    """The traceback field of the root cause in torchrun's failure report (the worker's error file)."""
    section = stderr.split("Root Cause (first observed failure):", 1)[1]
    return (
        next(x for x in section.splitlines() if x.strip().startswith("traceback :"))
        .split(":", 1)[1]
        .strip()
    )


def run_main(capsys, main, argv) -> tuple[int, list[str]]:
    """A command's main in this process: its exit code (a flag error's too) and its stderr lines."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


def gen_main(capsys, *args) -> tuple[int, str, str]:
    """generate.py's main in this process: its exit code, stdout and stderr."""
    import generate

    code = generate.main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def main_out(capsys, *argv) -> tuple[int, str, str]:
    """evaluate.py's main in this process: its exit code, stdout and stderr."""
    import evaluate

    rc = evaluate.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def png_ok(path, size) -> None:
    img = Image.open(path)
    assert img.format == "PNG" and img.size == size
    assert np.asarray(img.convert("L")).std() > 5  # something is drawn


def read_preds(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_scores(folder: Path, name: str, values: list, **record) -> list[Path]:
    """One score file per benchmark, as `evaluate.py score --out` writes them (its config fields); name
    is the checkpoint's."""
    from evaluation import scoring as S

    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for bench, v in zip(S.BENCHMARKS, values):
        files.append(folder / f"{name}{'_kv' if record.get('shared_kv') else ''}_{bench}.json")
        files[-1].write_text(
            json.dumps(
                {
                    "benchmark": bench,
                    "score": v,
                    "n": 10,
                    "unresolved": 0,
                    "missing": 0,
                    "model": f"runs/{name}/export",
                    "model_fingerprint": f"fp-{name}",
                    "pv": 1,
                    "pl": 1,
                    "vision_branch": None,
                    "language_branch": None,
                    "shared_kv": False,
                    "router": None,
                    "random_pair": None,
                    "branches": {},
                }
                | record
            )
            + "\n"
        )
    return files


def expected_scalars(lines: list[dict], dtype=np.float32) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as a tracker should hold it: each number at its line's step, a nested one under
    outer/inner, nulls absent; float32, as TensorBoard's event files store scalars."""
    want = {}
    for line in lines:
        for key, value in line.items():
            items = (
                value.items()
                if isinstance(value, dict)
                else enumerate(value)
                if isinstance(value, list)
                else [(None, value)]
            )
            for sub, x in items:
                if key != "step" and x is not None:
                    want.setdefault(key if sub is None else f"{key}/{sub}", []).append(
                        (line["step"], float(dtype(x)))
                    )
    return want


def event_scalars(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard run folder (or one event file), read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 0: keep every event, no sampling
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
