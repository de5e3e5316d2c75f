"""Run folders (train.py --out) and what keeps them whole: one run per folder (a finished run refused, on
one rank and under torchrun; --overwrite; folders that cannot hold a run), --resume (bit-identical, past
partial saves, a longer schedule, falling back past broken checkpoints and a truncated shard, a resume that
changes the run refused, no checkpoint yet), DCP safety (a pickle that would run code is never loaded), a
failed save and a signal that keep every complete checkpoint, `train.py export` of a kept step,
metrics.jsonl and the progress line, and `train.py plot`. Each test checks the exit code, that stderr says
it in one line, and that what was saved before is intact (files byte-identical). Runs that must train run
in this process (conftest.train_here) where they can, as subprocesses (two under torchrun with 2 ranks)
where the point is another process or a fault (tests/faults.py)."""

import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from commands import (
    COMMON,
    ROOT,
    metrics,
    notes,
    one_line,
    png_ok,
    run_main,
    run_train,
    train_here,
    tree,
    worker_lines,
)
from inputs import write_dataset
from PIL import Image
from safetensors.torch import load_file

import generate
import train
from config import ParConfig
from loading.config_json import trained_step
from loading.pretrained import load_pretrained
from shell import cli
from training import dcp
from training.metrics import finite
from training.schedule import lr_lambda


@pytest.fixture(scope="module")
def base_run(model_dir, meta, tmp_path_factory):
    """A finished 3-step run: checkpoints step_1..3, export, metrics. Tests copy it."""
    out = tmp_path_factory.mktemp("base") / "run"
    train_here(
        "--model",
        model_dir,
        "--data",
        meta,
        "--out",
        out,
        "--max-steps",
        3,
        "--save-every",
        1,
        "--keep-last",
        5,
        *COMMON,
    )
    return out


def copy_run(base: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base, out)
    return out


# -- a run folder belongs to one run -------------------------------------------------------------------


def test_new_run_into_a_finished_run_is_refused(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    before = tree(out)
    res = train_here(
        "--model", model_dir, "--data", meta, "--out", out, "--max-steps", 2, *COMMON, check=False
    )
    code, err = res.returncode, res.stderr
    line = one_line(err)
    assert (
        code == 1 and "already holds a run" in line and "--resume" in line and "--overwrite" in line
    ), line
    assert tree(out) == before


def test_new_run_into_a_finished_run_is_refused_under_torchrun(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    before = tree(out)
    res = run_train(
        "--model",
        model_dir,
        "--data",
        meta,
        "--out",
        out,
        "--max-steps",
        2,
        *COMMON,
        nproc=2,
        check=False,
    )
    assert res.returncode == 1
    ours = worker_lines(res.stderr)
    assert (
        len(ours) == 1 and "already holds a run" in ours[0] and "Traceback" not in "\n".join(ours)
    ), res.stderr
    assert tree(out) == before


def test_overwrite_discards_the_old_run_explicitly(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    old_export = tree(out / "export")
    res = train_here(
        "--model",
        model_dir,
        "--data",
        meta,
        "--out",
        out,
        "--max-steps",
        1,
        "--overwrite",
        "--lr-pretrained",
        "1e-2",
        *COMMON,
    )
    assert res.returncode == 0 and notes(res.stderr) == [], res.stderr
    assert [m["step"] for m in metrics(out)] == [1]  # not 1, 2, 3, 1
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == ["step_1"]
    assert (
        tree(out / "export") != old_export
        and json.loads((out / "config.json").read_text())["max_steps"] == 1
    )


@pytest.mark.parametrize("case", ["file", "proc", "sys"])
def test_unusable_out_is_one_line(model_dir, meta, tmp_path, case):
    """An --out that is a file (not the --data meta JSON: that is an output onto an input, exit 2 at parse,
    test_shell.py), or on a file system that cannot be written."""
    (tmp_path / "a_file").write_text("x")
    out = {
        "file": tmp_path / "a_file",
        "proc": Path("/proc/parvl_test/run"),
        "sys": Path("/sys/parvl_test"),
    }[case]
    before = meta.read_bytes()
    res = train_here("--model", model_dir, "--data", meta, "--out", out, *COMMON, check=False)
    code, err = res.returncode, res.stderr
    line = one_line(err)
    needle = {
        "file": "is a file, not a folder",
        "proc": "cannot write there",
        "sys": "cannot write there",
    }[case]
    assert code == 1 and line.startswith("error: ") and needle in line, line
    assert meta.read_bytes() == before and (tmp_path / "a_file").read_text() == "x"


def test_an_out_that_cannot_hold_a_run_is_one_line_before_training(model_dir, meta, tmp_path):
    """Issue 29, item 10: --out a symbolic link to nothing (main: "cannot write there (File exists)"),
    a run folder whose checkpoints is a file or whose metrics.jsonl is a folder (main trained a step,
    then failed to save it)."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    res = train_here("--model", model_dir, "--data", meta, "--out", link, *COMMON, check=False)
    assert res.returncode == 1 and one_line(res.stderr) == (
        f"error: --out {link}: a symbolic link to {tmp_path / 'nowhere'}, which does not exist"
    )
    for name, kind, says in [
        ("checkpoints", "file", "checkpoints folder"),
        ("metrics.jsonl", "folder", "metrics.jsonl file"),
    ]:
        out = tmp_path / name.split(".")[0]
        out.mkdir()
        if kind == "folder":
            (out / name).mkdir()
        else:
            (out / name).write_text("")
        before = tree(out)
        res = train_here(
            "--model", model_dir, "--data", meta, "--out", out, "--resume", *COMMON, check=False
        )
        assert res.returncode == 1 and one_line(res.stderr) == (
            f"error: --out {out}: {out / name} is a {kind}, where the run keeps its {says}"
        )
        assert tree(out) == before and sorted(p.name for p in out.iterdir()) == [name]


def test_train_plot_of_lines_that_are_not_json_is_one_line(tmp_path, capsys):
    """Issue 29, item 10: `train.py plot` on a metrics.jsonl of garbage (main: "no log steps yet")."""
    (tmp_path / "metrics.jsonl").write_text("not a metrics line\n\x00\x01\n")
    assert train.main(["plot", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'metrics.jsonl'}: none of its 2 lines is JSON; "
        f"train.py writes one JSON line a log step"
    )


# -- --resume ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_is_bit_identical_and_ignores_partial_saves(model_dir, meta, tmp_path):
    args = [
        "--model",
        model_dir,
        "--data",
        meta,
        "--pv",
        "2",
        "--pl",
        "1",
        "--max-steps",
        "4",
        "--save-every",
        "1",
        *COMMON,
    ]
    train_here(*args, "--out", tmp_path / "full")
    # a process of its own, stopped after step 2
    run_train(*args, "--out", tmp_path / "cut", fault="stop-after=2")
    ckpts = tmp_path / "cut" / "checkpoints"
    shutil.copytree(ckpts / "step_2", ckpts / "step_3.tmp")  # a save killed half-way: never "done"
    (ckpts / "step_3.tmp" / "done").unlink()
    train_here(*args, "--out", tmp_path / "cut", "--resume")
    full, cut = metrics(tmp_path / "full"), metrics(tmp_path / "cut")
    assert [m["step"] for m in cut] == [1, 2, 3, 4]
    # --keep-last 2; the stale .tmp replaced
    assert sorted(d.name for d in ckpts.iterdir()) == ["step_3", "step_4"]
    assert [(m["loss"], m["grad_norm"]) for m in cut] == [(m["loss"], m["grad_norm"]) for m in full]
    a, b = (
        load_pretrained(tmp_path / "full" / "export"),
        load_pretrained(tmp_path / "cut" / "export"),
    )
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.slow
def test_resume_with_more_steps_follows_the_new_schedule(model_dir, tmp_path):
    """2 steps, then --resume --max-steps 4: steps 3 and 4 take the 4-step schedule's rates (not the
    2-step schedule's final 0.0), the bad-row counts go on from the checkpoint (equal to an unbroken
    4-step run's), and a resume that changes a flag fixing the run (--seed) is refused in one line."""
    data = write_dataset(tmp_path / "d", rows=14, bad=2)  # 16 rows: four global batches of 4
    args = [
        "--model",
        model_dir,
        "--data",
        data,
        "--pv",
        "1",
        "--pl",
        "2",
        "--save-every",
        "1",
        "--max-bad-frac",
        "0.5",
        "--warmup-ratio",
        "0.5",
        *COMMON,
    ]
    train_here(*args, "--out", tmp_path / "full", "--max-steps", "4")
    train_here(*args, "--out", tmp_path / "ext", "--max-steps", "2")
    res = train_here(*args, "--out", tmp_path / "ext", "--max-steps", "4", "--resume")
    assert "--max-steps 2 -> 4" in res.stderr, res.stderr
    full, ext = metrics(tmp_path / "full"), metrics(tmp_path / "ext")
    assert [m["step"] for m in ext] == [1, 2, 3, 4]
    f = lr_lambda(4, 0.5)
    # the rate an update uses is base * lambda(step before it), on the new schedule
    for m in ext[2:]:
        assert (
            m["lr"]["branches"] == pytest.approx(8e-5 * f(m["step"] - 1), rel=1e-12)
            and m["lr"]["branches"] > 0
        )
    assert [m["bad_rows"] for m in ext] == [m["bad_rows"] for m in full] and sum(
        full[-1]["bad_rows"].values()
    ) == 2

    def files() -> dict:
        return {
            str(p): p.read_bytes() for p in sorted((tmp_path / "ext").rglob("*")) if p.is_file()
        }

    before = files()
    res = train_here(
        *args, "--out", tmp_path / "ext", "--max-steps", "4", "--resume", "--seed", "7", check=False
    )
    assert (
        res.returncode == 1 and "--seed" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    ), res.stderr
    assert files() == before  # config.json too: it is written only once a resume is accepted


def test_resume_falls_back_past_broken_checkpoints(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    ck = out / "checkpoints"
    (ck / "step_3" / ".metadata").unlink()  # was a bare AssertionError
    # was a JSONDecodeError naming no file
    (ck / "step_2" / "train.json").write_text('{"step": 2, "sched')
    broken3, broken2, good1 = tree(ck / "step_3"), tree(ck / "step_2"), tree(ck / "step_1")
    res = train_here(
        "--model",
        model_dir,
        "--data",
        meta,
        "--out",
        out,
        "--max-steps",
        4,
        "--save-every",
        1,
        "--keep-last",
        5,
        "--resume",
        *COMMON,
    )
    line = one_line(res.stderr)
    assert line.startswith(f"resuming from {ck / 'step_1'} at step 1"), line
    assert "step_3: .metadata is missing" in line and "step_2: train.json is unreadable" in line, (
        line
    )
    # kept byte for byte, and the broken ones set aside, not deleted
    assert tree(ck / "step_1") == good1
    assert tree(ck / "step_3.broken") == broken3 and tree(ck / "step_2.broken") == broken2
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]  # trimmed to step 1, then continued
    assert all(dcp.verify_checkpoint(ck / f"step_{k}") is None for k in (2, 3, 4))


def test_resume_falls_back_past_a_truncated_shard_under_torchrun(
    model_dir, meta, base_run, tmp_path
):
    out = copy_run(base_run, tmp_path)
    ck = out / "checkpoints"
    shard = ck / "step_3" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    good = {k: tree(ck / f"step_{k}") for k in (1, 2)}
    res = run_train(
        "--model",
        model_dir,
        "--data",
        meta,
        "--out",
        out,
        "--max-steps",
        3,
        "--save-every",
        1,
        "--keep-last",
        5,
        "--resume",
        *COMMON,
        nproc=2,
    )
    line = one_line(res.stderr)  # once, from rank 0
    assert line.startswith(f"resuming from {ck / 'step_2'} at step 2"), line
    assert f"step_3: __0_0.distcp is {size // 2} bytes, the save wrote {size}" in line, line
    assert {k: tree(ck / f"step_{k}") for k in (1, 2)} == good
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]
    assert (
        dcp.verify_checkpoint(ck / "step_3") is None
        and (out / "export" / "model.safetensors").is_file()
    )


def test_a_resume_that_changes_the_branches_is_refused_and_leaves_the_run_as_it_was(
    model_dir, meta, tmp_path
):
    """Issue 29, items 1, 10 and 11. A 2:2 run with prefix lengths 3 and 2, started from the data's folder
    with a relative --data. A resume that changes a branch flag is refused in one line naming the flag,
    the run's value and the given one, and the folder stays byte for byte (main called every checkpoint
    broken, renamed it .broken, retrained from step 0 and exited 0). A checkpoint whose tensors are not
    the model's is refused too, not set aside as broken. A resume with no branch flag takes the run's
    values (not --model's 96 and 48) and goes on, from another folder with the data by another path
    (main: "trained with --data meta.json"). And FSDP2's view-tensor warning no longer shows."""
    out = tmp_path / "run"
    ck = out / "checkpoints" / "step_1"
    args = ["--model", model_dir, "--out", out, "--save-every", 1, *COMMON]
    first = subprocess.run(
        [
            sys.executable,
            ROOT / "train.py",
            *map(str, args),
            "--data",
            "meta.json",
            "--pv",
            "2",
            "--pl",
            "2",
            "--vit-prefix-len",
            "3",
            "--llm-prefix-len",
            "2",
            "--max-steps",
            "1",
        ],
        cwd=meta.parent,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert first.returncode == 0 and "returned a view tensor" not in first.stderr, first.stderr[
        -3000:
    ]
    before = tree(out)
    refusal = (
        f"error: --resume: {ck} was trained with --{{}} {{}}, this run asks for {{}}; resume without the flag "
        f"(or with the run's value), or start a new run in another --out"
    )
    resumed = [*map(str, args), "--data", str(meta), "--resume", "--max-steps", "2"]
    res = subprocess.run(
        [sys.executable, ROOT / "train.py", *resumed, "--vision-branches", "lora"],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert res.returncode == 1 and one_line(res.stderr) == refusal.format(
        "vision-branches", "prefix", "lora"
    )
    assert tree(out) == before
    for flag, was, given in [
        ("lambda-l", 0.1, 0.5),
        ("vit-prefix-len", 3, 72),
        ("aggregation", "mlp", "mean"),
    ]:
        res = train_here(*resumed, f"--{flag}", given, check=False)
        assert res.returncode == 1 and one_line(res.stderr) == refusal.format(flag, was, given)
        assert tree(out) == before
    # a run that recorded no prefix length (None: --model's) but trained 3: its tensors say so
    record = (ck / "train.json").read_bytes()
    meta_json = json.loads(record)
    meta_json["config"]["vit_prefix_len"] = None
    (ck / "train.json").write_text(json.dumps(meta_json))
    res = train_here(*resumed, check=False)
    vit = json.loads((model_dir / "config.json").read_text())["vision_config"]
    heads, dim = vit["num_attention_heads"], vit["hidden_size"] // vit["num_attention_heads"]
    assert res.returncode == 1 and one_line(res.stderr) == (
        f"error: --resume: {ck} holds vision_model.encoder.layers.0.attn.prefix_k as [2, {heads}, 3, {dim}], this "
        f"run's model has [2, {heads}, 96, {dim}]: the run was trained as another model (--model or branch flags); "
        f"resume with the run's, or start a new run in another --out"
    )
    (ck / "train.json").write_bytes(record)
    assert tree(out) == before
    res = train_here(*resumed)
    assert f"resuming from {ck} at step 1" in res.stderr and [m["step"] for m in metrics(out)] == [
        1,
        2,
    ], res.stderr
    assert load_pretrained(out / "export").cfg.par == ParConfig(
        pv=2, pl=2, vit_prefix_len=3, llm_prefix_len=2
    )


def test_resume_refuses_a_checkpoint_whose_pickle_would_run_code(
    model_dir, meta, base_run, tmp_path
):
    """Issue 29, item 2: DCP's .metadata is a pickle. One that would run code (os.system, padded to the
    size train.json records) is refused in one line naming the file, the code never runs and nothing in
    the folder changes; main ran it, then fell back past the checkpoint as broken. A non-tensor entry
    of a shard (torch.load's pickle) is held to weights_only the same way."""
    out = copy_run(base_run, tmp_path)
    marker = tmp_path / "ran"
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    metadata = out / "checkpoints" / "step_3" / ".metadata"
    metadata.write_bytes(payload.ljust(metadata.stat().st_size, b" "))  # pickle stops at "."
    before = tree(out)
    res = subprocess.run(
        [
            sys.executable,
            ROOT / "train.py",
            "--model",
            model_dir,
            "--data",
            meta,
            "--out",
            out,
            "--max-steps",
            "4",
            "--resume",
            *COMMON,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert res.returncode == 1 and one_line(res.stderr) == (
        f"error: {metadata}: refused to load: its pickle names os.system, which DCP's checkpoint metadata never holds "
        f"(loading it could run code); nothing was loaded"
    )
    assert not marker.exists() and tree(out) == before

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    buffer = io.BytesIO()
    torch.save({"lr": 0.1, "x": Payload()}, buffer)
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    with pytest.raises(dcp.Unsafe, match="refused to load optim.param_groups.0.lr: not plain data"):
        dcp.PlainBytesPlanner().load_bytes(item, io.BytesIO(buffer.getvalue()))
    assert not marker.exists()


def test_resume_with_no_checkpoint_says_it_starts_fresh_and_names_bad_rows(model_dir, tmp_path):
    meta = write_dataset(tmp_path / "d", rows=6, bad=2)
    out = tmp_path / "run"
    # 2 steps of 4: every row once
    res = train_here(
        "--model",
        model_dir,
        "--data",
        meta,
        "--out",
        out,
        "--max-steps",
        2,
        "--resume",
        "--max-bad-frac",
        "0.5",
        *COMMON,
    )
    lines = notes(res.stderr)
    assert "Traceback" not in res.stderr and lines[0] == (
        f"--resume: no usable checkpoint in {out / 'checkpoints'}: starting from step 0"
    ), res.stderr
    # bad rows are named: dataset, line in the file, the file, the cause and the reason
    bad = sorted(lines[1:])
    assert len(bad) == 2 and all(
        x.startswith("warning: skipped bad row tiny line ")
        and f"of {meta.parent / 'train.jsonl'}" in x
        and "missing.png [missing_image]" in x
        for x in bad
    ), bad
    # write_dataset puts them there
    assert {x.split(" line ")[1].split()[0] for x in bad} == {"2", "5"}


def test_a_resume_on_changed_data_is_refused_naming_both_fingerprints(model_dir, tmp_path):
    """Issue 38, item 7: rows appended to the annotation file at the same path, then --resume: it was accepted
    and trained on another sample order. The run records its data files (size and sha256 of the meta JSON and
    of each annotation file, bad_rows.data_files); a resume on changed files is refused in one line naming both
    fingerprints and the file, the run as it was; the same files again resume."""
    data, out = write_dataset(tmp_path / "d", rows=8), tmp_path / "run"
    args = ["--model", model_dir, "--data", data, "--out", out, "--save-every", 1, *COMMON]
    train_here(*args, "--max-steps", 1)
    annotation = tmp_path / "d" / "train.jsonl"
    rows = annotation.read_bytes()
    was = f"{len(rows)} bytes, sha256 {hashlib.sha256(rows).hexdigest()[:16]}"
    annotation.write_bytes(rows + rows.splitlines(keepends=True)[0])  # a row appended
    before = tree(out)
    res = train_here(*args, "--max-steps", 2, "--resume", check=False)
    line = one_line(res.stderr)
    assert res.returncode == 1 and re.fullmatch(
        rf"error: --resume: {re.escape(str(out / 'checkpoints' / 'step_1'))} was trained on data [0-9a-f]{{16}} then, "
        rf"[0-9a-f]{{16}} now: dataset tiny \({re.escape(str(annotation))}\) was {was}, is "
        rf"{len(rows) + len(rows.splitlines(keepends=True)[0])} bytes, sha256 [0-9a-f]{{16}} now; resume on the data "
        rf"the run was trained on, or start a new run in another --out",
        line,
    ), line
    assert (
        tree(out) == before
        and json.loads((out / "config.json").read_text())["data_files"]["dataset tiny"] == was
    )
    annotation.write_bytes(rows)
    res = train_here(*args, "--max-steps", 2, "--resume")
    assert [m["step"] for m in metrics(out)] == [1, 2], res.stderr


# -- saving and interrupting keep every complete checkpoint --------------------------------------------


def test_failed_save_is_one_line_and_keeps_complete_checkpoints(
    model_dir, meta, base_run, tmp_path
):
    out = copy_run(base_run, tmp_path)
    before = tree(out)
    res = run_train(
        "--model",
        model_dir,
        "--data",
        meta,
        "--out",
        out,
        "--max-steps",
        4,
        "--save-every",
        1,
        "--keep-last",
        5,
        "--resume",
        *COMMON,
        check=False,
        fault="save-error=ENOSPC:4",
    )
    lines = notes(res.stderr)
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(lines) == 2, res.stderr[
        -3000:
    ]
    assert lines[0].startswith("resuming from") and lines[1] == (
        f"error: cannot save checkpoint {out / 'checkpoints' / 'step_4.tmp'}: no space left on the device; "
        f"removed the partial save, kept {out / 'checkpoints' / 'step_3'}"
    ), lines
    after = tree(out)
    # no step_4(.tmp), all else intact
    assert {k: v for k, v in after.items() if k != "metrics.jsonl" and k != "config.json"} == {
        k: v for k, v in before.items() if k != "metrics.jsonl" and k != "config.json"
    }


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_abandons_the_step_and_keeps_the_checkpoints(model_dir, tmp_path, sig):
    # 40 steps: it is still training when signalled
    meta = write_dataset(tmp_path / "d", rows=8, repeat=20)
    out = tmp_path / "run"
    # a loader worker gets it too
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--model",
        str(model_dir),
        "--data",
        str(meta),
        "--out",
        str(out),
        "--save-every",
        "1",
        "--keep-last",
        "50",
        *COMMON,
        "--num-workers",
        "1",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,
    )
    deadline = time.time() + 120
    while (
        not (out / "checkpoints" / "step_2").is_dir()
        and time.time() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.05)
    first = tree(out / "checkpoints" / "step_1")
    # as Ctrl-C in a terminal or a job scheduler does: the whole process group
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    line = one_line(err)
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert line.startswith(
        f"interrupted by {sig.name}: the current step was abandoned; last complete checkpoint "
    ), line
    assert tree(out / "checkpoints" / "step_1") == first
    names = [d.name for d in (out / "checkpoints").iterdir()]
    # a save cut short leaves nothing behind
    assert not any(n.endswith(".tmp") for n in names), names
    assert all(dcp.verify_checkpoint(out / "checkpoints" / n) is None for n in names)
    assert line.endswith(f"{dcp.checkpoints(out)[-1]} (continue with --resume)"), line
    # the newest checkpoint loads: a resume goes on from it for one more step
    if sig == signal.SIGTERM:
        newest = dcp.checkpoints(out)[-1]
        step = int(newest.name.split("_")[1])
        res = subprocess.run(
            cmd + ["--resume", "--max-steps", str(step + 1)],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert res.returncode == 0 and f"resuming from {newest} at step {step}" in res.stderr, (
            res.stderr[-2000:]
        )
        assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()][
            -1
        ] == step + 1


# -- train.py export of a kept step --------------------------------------------------------------------


def answer(capsys, model: Path, png: Path) -> str:
    """generate.py's greedy answer (its default) from a model folder, as a user runs it."""
    capsys.readouterr()
    assert (
        generate.main([str(png), "Hi?", "--model", str(model), "--max-new-tokens", "6", "--json"])
        == 0
    )
    return json.loads(capsys.readouterr().out)["answer"]


def test_export_of_a_kept_step_is_the_model_at_that_step(run3, model_dir, tmp_path, capsys):
    """`train.py export RUN --step N`: step 2 gives the weights the run held in memory after step 2, step 3
    the run's own end-of-run export, in the same layout; generate.py answers alike from each pair. Each export
    records its training step in config.json (issue 37, item 2: Table 3 names its checkpoint's step)."""
    out, at_two, _ = run3
    assert train.main(["export", str(out), "--step", "2", "--out", str(tmp_path / "two")]) == 0
    assert train.main(["export", str(out), "--step", "3"]) == 0
    for got, want in ((tmp_path / "two", at_two), (out / "export_step_3", out / "export")):
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
        a, b = load_file(str(got / "model.safetensors")), load_file(str(want / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert json.loads((got / "config.json").read_text()) == json.loads(
            (want / "config.json").read_text()
        )
    assert (trained_step(tmp_path / "two"), trained_step(out / "export")) == (2, 3)
    first = load_file(str(model_dir / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "model.safetensors"))
    three = load_file(str(out / "export" / "model.safetensors"))
    trained = [k for k in first if k in two and not torch.equal(first[k], two[k])]
    # step 2 is its own model
    assert trained and all(not torch.equal(two[k], three[k]) for k in trained)
    png = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8)).save(
        png
    )
    assert answer(capsys, tmp_path / "two", png) == answer(capsys, at_two, png)
    assert answer(capsys, out / "export_step_3", png) == answer(capsys, out / "export", png)


def test_export_finds_its_base_model_from_any_folder(
    model_dir, meta, base_run, tmp_path, capsys, monkeypatch
):
    """A run records its --model by absolute path; one recorded by a relative path (a run from before) exported
    from another working folder could not find it: one line saying to pass `train.py export --model`, which then
    gives the run's own export (issue 38, item 22)."""
    seen = []
    monkeypatch.setattr(train, "train", lambda cfg, *_: seen.append(cfg.model) or 0)
    monkeypatch.chdir(model_dir.parent)
    assert (
        train.main(
            [
                "--model",
                model_dir.name,
                "--data",
                str(meta),
                "--out",
                str(tmp_path / "new"),
                *COMMON,
            ]
        )
        == 0
    )
    assert seen == [str(model_dir.resolve())]
    out = copy_run(base_run, tmp_path)
    step = out / "checkpoints" / "step_3"
    record = json.loads((step / "train.json").read_text())
    record["config"]["model"] = model_dir.name  # relative to the folder it was started from
    (step / "train.json").write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)
    code, err = run_main(capsys, train.main, ["export", out, "--step", 3])
    assert code == 1 and err == [
        f"error: {step}: trained from --model '{model_dir.name}', which is not a folder from "
        f"here (the export takes its config and tokenizer); pass train.py export --model "
        f"with that base model's folder"
    ], err
    code, err = run_main(capsys, train.main, ["export", out, "--step", 3, "--model", model_dir])
    mine, its = (
        load_file(out / "export_step_3" / "model.safetensors"),
        load_file(out / "export" / "model.safetensors"),
    )
    assert (
        code == 0 and mine.keys() == its.keys() and all(torch.equal(mine[k], its[k]) for k in its)
    ), err


def test_a_full_disk_while_exporting_is_one_line(
    model_dir, base_run, tmp_path, capsys, monkeypatch
):
    """A full disk while `train.py export` writes the weights was safetensors' SafetensorError traceback (its words,
    injected here): one line naming the export, exit 1, no half-written weights (issue 38, item 15)."""
    from safetensors import SafetensorError

    import loading.pretrained

    def full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
            'left on device" })'
        )

    monkeypatch.setattr(loading.pretrained, "save_file", full)
    out = copy_run(base_run, tmp_path)
    code, err = run_main(capsys, train.main, ["export", out, "--step", 3, "--out", tmp_path / "x"])
    assert (
        code == 1
        and err[-1]
        == f"error: cannot write the export {tmp_path / 'x'}: no space left on the device"
    ), err
    assert not list((tmp_path / "x").glob("model.safetensors*"))


def test_export_refuses_a_step_not_kept_or_broken(run3, tmp_path, capsys):
    """Step 1 (no longer kept) and a step whose shard lost its tail are refused in one line, nothing written."""
    out = run3[0]
    shutil.copytree(out / "checkpoints", tmp_path / "run" / "checkpoints")  # a copy to break
    ckpts = tmp_path / "run" / "checkpoints"
    assert train.main(["export", str(tmp_path / "run"), "--step", "1"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {ckpts / 'step_1'}: no such checkpoint (kept: step_2, step_3); a run keeps its newest --keep-last "
        f"saves, see docs/training.md to keep a step"
    ]
    shard = next(p for p in (ckpts / "step_2").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-8])
    size = shard.stat().st_size
    assert train.main(["export", str(tmp_path / "run"), "--step", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {ckpts / 'step_2'}: does not verify ({shard.name} is {size} bytes, the save wrote {size + 8})"
    ]
    assert not (tmp_path / "run" / "export_step_2").exists()


def test_an_export_goes_to_a_new_or_empty_folder(run3, model_dir, meta, tmp_path, capsys):
    """Issue 38, item 2: `train.py export --out` into an existing model folder or over the end-of-run export
    replaced what was there, into the run folder it mixed a model into the run, and train.py --out equal to
    --model replaced the model's config.json. Each is refused in one line before anything loads, every file as it
    was (exit 1: a folder that holds something, as train.py's --out; 2: flags naming one folder, at parse).
    --overwrite replaces an export, written whole beside it and put in its place, but never the run's base model."""
    run, model = tmp_path / "run", tmp_path / "model"
    shutil.copytree(run3[0], run)  # a copy: its end-of-run export is replaced below
    shutil.copytree(model_dir, model)
    export = ["export", run, "--step", 3]
    held = ", ".join(sorted(p.name for p in model.iterdir())[:4])
    cases = [
        (
            export + ["--out", model],
            1,
            f"error: --out {model} already holds {held}, ...: an export goes to a new "
            f"or empty folder; pick another --out, or pass --overwrite to replace "
            f"what is there",
        ),
        (
            export + ["--out", run / "export"],
            1,
            f"error: --out {run / 'export'} already holds added_tokens",
        ),
        (
            export + ["--out", run],
            2,
            f"error: --out {run}: would write {run / 'checkpoints'}, which RUN {run} "
            f"reads; an output is never an input",
        ),
        (
            ["--model", model, "--data", meta, "--out", model],
            2,
            f"error: --out {model}: would write "
            f"{model / 'config.json'}, which --model {model} "
            f"reads; an output is never an input",
        ),
        (
            export + ["--out", model_dir, "--overwrite"],
            1,
            f"error: --out {model_dir}: is the run's base model {model_dir}, which the export reads",
        ),
        (  # issue 46: said the way round it is, not "the base model is there"
            export + ["--out", model_dir / "sub", "--overwrite"],
            1,
            f"error: --out {model_dir / 'sub'}: lies inside the run's base model {model_dir}, which the "
            "export reads",
        ),
    ]
    before, base = tree(tmp_path), tree(model_dir)
    for argv, want, needle in cases:
        code, err = run_main(capsys, train.main, argv)
        assert code == want and len(err) == 1 and needle in err[0], (argv, err)
    assert tree(tmp_path) == before and tree(model_dir) == base
    assert train.main([str(a) for a in export + ["--out", run / "export", "--overwrite"]]) == 0
    assert not (run / "export.tmp").exists()  # written there, then put in place
    got, want = (
        load_file(str(run / "export" / "model.safetensors")),
        load_file(str(run3[0] / "export" / "model.safetensors")),
    )
    # step 3 is the run's end
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


# -- metrics.jsonl, the progress line, train.py plot ---------------------------------------------------


def test_metrics_are_json_with_null_for_nan(base_run):
    text = (base_run / "metrics.jsonl").read_text()

    def no_nan(name):
        raise AssertionError(f"{name} in metrics.jsonl")

    rows = [json.loads(line, parse_constant=no_nan) for line in text.splitlines()]
    # CPU: no peak FLOPs, so no MFU
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["mfu"] is None
    assert finite({"a": float("nan"), "b": {"c": float("inf")}, "d": 1.0}) == {
        "a": None,
        "b": {"c": None},
        "d": 1.0,
    }


@pytest.fixture(scope="module")
def run_dir(checkpoint, tmp_path_factory):
    """A 3-step tiny training run with --dtype auto (the default): its folder and stderr."""

    root = tmp_path_factory.mktemp("run")
    meta = write_dataset(root / "data", rows=12)
    res = train_here(
        "--model",
        checkpoint("qwen3", "original"),
        "--data",
        meta,
        "--out",
        root / "run",
        "--pl",
        "2",
        "--max-steps",
        "3",
        *COMMON,
        "--dtype",
        "auto",
    )
    return root / "run", res.stderr


def test_the_progress_line_says_each_metrics_line(run_dir):
    out, stderr = run_dir
    human = [x for x in stderr.splitlines() if x.startswith("step ")]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(human) == len(metrics) == 3, stderr
    for k, (line, m) in enumerate(zip(human, metrics), 1):
        fields = line.split(" | ")
        assert fields[0] == f"step {k}/3" and fields[1] == f"loss {m['loss']:.4f}", line
        assert fields[2] == f"grad norm {m['grad_norm']:.3f}"
        assert (
            fields[3]
            == f"lr branches {m['lr']['branches']:.2e} pretrained {m['lr']['pretrained']:.2e}"
        )
        # no peak known on CPU
        assert fields[4] == f"{m['tokens_per_s']:,.0f} tokens/s" and fields[5] == "MFU n/a"
        assert fields[6] == f"peak {m['peak_gib']:.1f} GiB" and len(fields) == 9
        assert (
            re.fullmatch(r"elapsed \d+:\d\d:\d\d", fields[7])
            and fields[8] == f"eta {cli.hms(m['eta_s'])}"
        )
    assert human[-1].endswith("eta 0:00:00")
    assert cli.hms(3725.9) == "1:02:05"


def test_dtype_auto_is_fp32_on_cpu(run_dir):
    out, _ = run_dir
    assert json.loads((out / "config.json").read_text())["dtype"] == "fp32"  # auto on CPU


def test_train_plot_draws_the_metrics(run_dir, capsys):
    # requirements-dev.txt has matplotlib; test_train_plot_without_matplotlib_is_one_line covers its absence
    pytest.importorskip("matplotlib")
    out, _ = run_dir
    assert train.main(["plot", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "metrics.png")
    png_ok(out / "metrics.png", (1000, 650))


def test_train_plot_without_matplotlib_is_one_line(run_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    out, _ = run_dir
    assert train.main(["plot", str(out), "--out", str(tmp_path / "m.png")]) == 1
    assert one_line(capsys.readouterr().err) == (
        "error: matplotlib is not installed (it draws the plot): pip install matplotlib"
    )
    assert not (tmp_path / "m.png").exists()
    assert train.main(["plot", str(tmp_path)]) == 1
    assert "metrics.jsonl: no such file" in one_line(capsys.readouterr().err)


def test_train_plot_reads_nulls_and_foreign_rows(input_files, capsys):
    """Nulls are gaps and rows that are not log steps are left out (a KeyError before); the PNG is written
    where --out names it, even without a .png suffix."""
    png = input_files["run"] / "picture"
    code = train.main(["plot", str(input_files["run"]), "--out", str(png)])
    assert code == 0 and capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_keep_step_survives_keep_last(tmp_path):
    """Issue 47, item 2: a save deletes all but the newest --keep-last checkpoints, except the steps of
    --keep-step (the study's --router-step), which a later export needs whatever --keep-last is."""
    saved = [tmp_path / f"step_{s}" for s in (500, 1000, 1500, 2000)]
    assert dcp.stale(saved, 2, []) == saved[:2]
    assert dcp.stale(saved, 2, [1000]) == saved[:1]
    assert dcp.stale(saved, 1, [500, 2000]) == saved[1:3]
