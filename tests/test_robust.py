"""Nothing lost, nothing raw, for train.py and data.py: run folders that cannot overwrite
each other, checkpoints that fall back, and one line (no traceback) for every failure (generate.py,
profiling.py and images: test_robust_cli.py). Each test checks the exit code, that stderr says it in
one line, and that what was saved before is intact (files byte-identical). Exit codes: 0 ok, 1 bad
input or failure, 2 usage, 130 / 143 interrupted. Runs that must train are subprocesses (two under
torchrun with 2 ranks); errors raised before training are checked in-process, much cheaper."""
import errno
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

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import cli
import data as D
import runs
import train
from config import ParConfig
from conftest import (COMMON, ROOT, metrics, notes, one_line, parse_flags, root_cause, run_train, train_here, tree,
                      worker_lines, write_dataset)
from data import SFTData
from parvl import ParVL
from processor import Tokenizer

TRAIN = ["--max-tiles", "2", "--dtype", "fp32", "--global-batch", "4", "--num-workers", "0", "--log-every", "1",
         "--no-activation-checkpointing"]
assert set(TRAIN) <= set(COMMON)


@pytest.fixture(scope="module")
def base_run(model_dir, meta, tmp_path_factory):
    """A finished 3-step run: checkpoints step_1..3, export, metrics. Tests copy it."""
    out = tmp_path_factory.mktemp("base") / "run"
    train_here("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 3, "--save-every", 1,
               "--keep-last", 5, *TRAIN)
    return out


def copy_run(base: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base, out)
    return out


# -- 1. a run folder belongs to one run ----------------------------------------------------------


def test_new_run_into_a_finished_run_is_refused(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    before = tree(out)
    res = train_here("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 2, *TRAIN, check=False)
    code, err = res.returncode, res.stderr
    line = one_line(err)
    assert code == 1 and "already holds a run" in line and "--resume" in line and "--overwrite" in line, line
    assert tree(out) == before


def test_new_run_into_a_finished_run_is_refused_under_torchrun(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    before = tree(out)
    res = run_train("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 2, *TRAIN, nproc=2, check=False)
    assert res.returncode == 1
    ours = worker_lines(res.stderr)
    assert len(ours) == 1 and "already holds a run" in ours[0] and "Traceback" not in "\n".join(ours), res.stderr
    assert tree(out) == before


def test_a_second_writer_under_torchrun_is_refused_and_every_rank_ends_at_once(model_dir, meta, tmp_path):
    """train.py as 2 ranks at an --out another process writes (it holds OUT.lock): rank 0 is refused
    before the process group starts, torchrun's report gives its line as the root cause, and rank 1,
    waiting in the rendezvous for a rank 0 that never comes, ends on torchrun's SIGTERM (cli.start_processes
    leaves SIGTERM's default action there), not on the SIGKILL that follows 30 s later."""
    import fcntl

    out = tmp_path / "run"
    fd = os.open(f"{out}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        res = run_train("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 1, *TRAIN, nproc=2,
                        check=False)
    finally:
        os.close(fd)
    assert res.returncode == 1 and root_cause(res.stderr) == (
        f"error: --out {out}: another process is writing it (it holds {out}.lock); wait for it to finish or stop "
        f"it, or pick another --out"), res.stderr[-3000:]
    assert "SIGKILL" not in res.stderr, res.stderr[-3000:]
    assert not any(out.rglob("*"))  # nothing written (rank 1's writability check leaves the folder, empty)


def test_an_error_under_torchrun_reaches_the_user_every_time(model_dir, tmp_path):
    """A missing file for train.py, router.py label and evaluate.py run, each as 2 ranks, all at once
    (three launchers on two cores: a loaded machine, on which torchrun could stop rank 0 before its
    line was out). Every run names the error in torchrun's report as the root cause (the worker's
    error file, cli.error), and rank 0 prints it once. (A flag error takes the same path: OneLineParser.)"""
    missing = tmp_path / "missing.json"
    cases = [(["train.py", "--model", model_dir, "--data", missing, "--out", tmp_path / "t"],
              f"error: --data '{missing}': no such meta JSON file"),
             (["router.py", "label", "--model", model_dir, "--data", missing, "--out", tmp_path / "r"],
              f"error: --data {missing}: no such meta JSON file"),
             (["evaluate.py", "run", "--benchmark", "ChartQA_TEST", "--data", missing, "--model", model_dir, "--out",
               tmp_path / "e"],
              f"error: {missing}: cannot read TSV: [Errno 2] No such file or directory")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
             for args, _ in cases]
    for p, (_, want) in zip(procs, cases):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 1, err[-3000:]  # torchrun's own code for a failed worker
        got = root_cause(err)
        assert got.startswith(want), err[-3000:]
        assert worker_lines(err).count(got) == 1, err[-3000:]


def test_max_steps_past_the_epoch_is_refused(model_dir, meta, tmp_path):
    """16 rows in global batches of 4 make 4 steps: --max-steps 5 is one line, not a silent 4."""
    res = train_here("--model", model_dir, "--data", meta, "--out", tmp_path / "run", "--max-steps", 5, *TRAIN,
                     check=False)
    code, err = res.returncode, res.stderr
    assert code == 1 and one_line(err) == (f"error: --max-steps 5: {meta} gives 4 steps of 4 samples in its one epoch "
                                           "(train.py trains one epoch, as the paper does); pass at most 4, or raise "
                                           "repeat_time in the meta file"), err
    assert not (tmp_path / "run" / "config.json").exists()


def test_overwrite_discards_the_old_run_explicitly(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    old_export = tree(out / "export")
    res = train_here("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 1, "--overwrite",
                     "--lr-pretrained",
                     "1e-2", *TRAIN)
    assert res.returncode == 0 and notes(res.stderr) == [], res.stderr
    assert [m["step"] for m in metrics(out)] == [1]  # not 1, 2, 3, 1
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == ["step_1"]
    assert tree(out / "export") != old_export and json.loads((out / "config.json").read_text())["max_steps"] == 1


@pytest.mark.parametrize("case", ["file", "proc", "sys"])
def test_unusable_out_is_one_line(model_dir, meta, tmp_path, case):
    out = {"file": meta, "proc": Path("/proc/parvl_test/run"), "sys": Path("/sys/parvl_test")}[case]
    before = meta.read_bytes()
    res = train_here("--model", model_dir, "--data", meta, "--out", out, *TRAIN, check=False)
    code, err = res.returncode, res.stderr
    line = one_line(err)
    needle = {"file": "is a file, not a folder", "proc": "cannot write there", "sys": "cannot write there"}[case]
    assert code == 1 and line.startswith("error: ") and needle in line, line
    assert meta.read_bytes() == before and not (tmp_path / "new").exists()


def test_an_out_that_cannot_hold_a_run_is_one_line_before_training(model_dir, meta, tmp_path, capsys):
    """Issue 29, item 10: --out a symbolic link to nothing (main: "cannot write there (File exists)"),
    a run folder whose checkpoints is a file or whose metrics.jsonl is a folder (main trained a step,
    then failed to save it); and `train.py plot` on a metrics.jsonl of garbage (main: "no log steps yet")."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    res = train_here("--model", model_dir, "--data", meta, "--out", link, *TRAIN, check=False)
    assert res.returncode == 1 and one_line(res.stderr) == (f"error: --out {link}: a symbolic link to "
                                                            f"{tmp_path / 'nowhere'}, which does not exist")
    for name, kind, says in [("checkpoints", "file", "checkpoints folder"), ("metrics.jsonl", "folder",
                                                                             "metrics.jsonl file")]:
        out = tmp_path / name.split(".")[0]
        out.mkdir()
        if kind == "folder":
            (out / name).mkdir()
        else:
            (out / name).write_text("")
        before = tree(out)
        res = train_here("--model", model_dir, "--data", meta, "--out", out, "--resume", *TRAIN, check=False)
        assert res.returncode == 1 and one_line(res.stderr) == (f"error: --out {out}: {out / name} is a {kind}, where "
                                                                f"the run keeps its {says}")
        assert tree(out) == before and sorted(p.name for p in out.iterdir()) == [name]
    (tmp_path / "metrics.jsonl").write_text("not a metrics line\n\x00\x01\n")
    assert train.main(["plot", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'metrics.jsonl'}: none of its 2 lines is JSON; "
                                               f"train.py writes one JSON line a log step")


# -- 2. --resume falls back past broken checkpoints -------------------------------------------------


def test_resume_falls_back_past_broken_checkpoints(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    ck = out / "checkpoints"
    (ck / "step_3" / ".metadata").unlink()  # was a bare AssertionError
    (ck / "step_2" / "train.json").write_text('{"step": 2, "sched')  # was a JSONDecodeError naming no file
    broken3, broken2, good1 = tree(ck / "step_3"), tree(ck / "step_2"), tree(ck / "step_1")
    res = train_here("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 4, "--save-every", 1,
                     "--keep-last", 5, "--resume", *TRAIN)
    line = one_line(res.stderr)
    assert line.startswith(f"resuming from {ck / 'step_1'} at step 1"), line
    assert "step_3: .metadata is missing" in line and "step_2: train.json is unreadable" in line, line
    assert tree(ck / "step_1") == good1  # kept byte for byte, and the broken ones set aside, not deleted
    assert tree(ck / "step_3.broken") == broken3 and tree(ck / "step_2.broken") == broken2
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]  # trimmed to step 1, then continued
    assert all(runs.verify_checkpoint(ck / f"step_{k}") is None for k in (2, 3, 4))


def test_resume_falls_back_past_a_truncated_shard_under_torchrun(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    ck = out / "checkpoints"
    shard = ck / "step_3" / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    good = {k: tree(ck / f"step_{k}") for k in (1, 2)}
    res = run_train("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 3, "--save-every", 1,
                    "--keep-last", 5, "--resume", *TRAIN, nproc=2)
    line = one_line(res.stderr)  # once, from rank 0
    assert line.startswith(f"resuming from {ck / 'step_2'} at step 2"), line
    assert f"step_3: __0_0.distcp is {size // 2} bytes, the save wrote {size}" in line, line
    assert {k: tree(ck / f"step_{k}") for k in (1, 2)} == good
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]
    assert runs.verify_checkpoint(ck / "step_3") is None and (out / "export" / "model.safetensors").is_file()


def test_a_resume_that_changes_the_branches_is_refused_and_leaves_the_run_as_it_was(model_dir, meta, tmp_path):
    """Issue 29, items 1, 10 and 11. A 2:2 run with prefix lengths 3 and 2, started from the data's folder
    with a relative --data. A resume that changes a branch flag is refused in one line naming the flag,
    the run's value and the given one, and the folder stays byte for byte (main called every checkpoint
    broken, renamed it .broken, retrained from step 0 and exited 0). A checkpoint whose tensors are not
    the model's is refused too, not set aside as broken. A resume with no branch flag takes the run's
    values (not --model's 96 and 48) and goes on, from another folder with the data by another path
    (main: "trained with --data meta.json"). And FSDP2's view-tensor warning no longer shows."""
    out = tmp_path / "run"
    ck = out / "checkpoints" / "step_1"
    args = ["--model", model_dir, "--out", out, "--save-every", 1, *TRAIN]
    first = subprocess.run([sys.executable, ROOT / "train.py", *map(str, args), "--data", "meta.json", "--pv", "2",
                            "--pl", "2", "--vit-prefix-len", "3", "--llm-prefix-len", "2", "--max-steps", "1"],
                           cwd=meta.parent, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert first.returncode == 0 and "returned a view tensor" not in first.stderr, first.stderr[-3000:]
    before = tree(out)
    refusal = (f"error: --resume: {ck} was trained with --{{}} {{}}, this run asks for {{}}; resume without the flag "
               f"(or with the run's value), or start a new run in another --out")
    resumed = [*map(str, args), "--data", str(meta), "--resume", "--max-steps", "2"]
    res = subprocess.run([sys.executable, ROOT / "train.py", *resumed, "--vision-branches", "lora"],
                         capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 1 and one_line(res.stderr) == refusal.format("vision-branches", "prefix", "lora")
    assert tree(out) == before
    for flag, was, given in [("lambda-l", 0.1, 0.5), ("vit-prefix-len", 3, 72), ("aggregation", "mlp", "mean")]:
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
        f"resume with the run's, or start a new run in another --out")
    (ck / "train.json").write_bytes(record)
    assert tree(out) == before
    res = train_here(*resumed)
    assert f"resuming from {ck} at step 1" in res.stderr and [m["step"] for m in metrics(out)] == [1, 2], res.stderr
    assert ParVL.from_pretrained(out / "export").cfg.par == ParConfig(pv=2, pl=2, vit_prefix_len=3, llm_prefix_len=2)


def test_resume_refuses_a_checkpoint_whose_pickle_would_run_code(model_dir, meta, base_run, tmp_path):
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
    res = subprocess.run([sys.executable, ROOT / "train.py", "--model", model_dir, "--data", meta, "--out", out,
                          "--max-steps", "4", "--resume", *TRAIN], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 1 and one_line(res.stderr) == (
        f"error: {metadata}: refused to load: its pickle names os.system, which DCP's checkpoint metadata never holds "
        f"(loading it could run code); nothing was loaded")
    assert not marker.exists() and tree(out) == before

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    buffer = io.BytesIO()
    torch.save({"lr": 0.1, "x": Payload()}, buffer)
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    with pytest.raises(runs.Unsafe, match="refused to load optim.param_groups.0.lr: not plain data"):
        runs.PlainBytesPlanner().load_bytes(item, io.BytesIO(buffer.getvalue()))
    assert not marker.exists()


def test_resume_with_no_checkpoint_says_it_starts_fresh_and_names_bad_rows(model_dir, tmp_path):
    meta = write_dataset(tmp_path / "d", rows=6, bad=2)
    out = tmp_path / "run"
    res = train_here("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 2, "--resume",
                     "--max-bad-frac", "0.5", *TRAIN)  # 2 steps of 4: every row once
    lines = notes(res.stderr)
    assert "Traceback" not in res.stderr and lines[0] == (f"--resume: no usable checkpoint in {out / 'checkpoints'}: "
                                                         "starting from step 0"), res.stderr
    # bad rows are named: dataset, line in the file, the file, the cause and the reason
    bad = sorted(lines[1:])
    assert len(bad) == 2 and all(x.startswith("warning: skipped bad row tiny line ") and f"of "
                                 f"{meta.parent / 'train.jsonl'}"
                                 in x and "missing.png [missing_image]" in x for x in bad), bad
    assert {x.split(" line ")[1].split()[0] for x in bad} == {"2", "5"}  # write_dataset puts them there


# -- 3. saving and interrupting keep every complete checkpoint --------------------------------------


def test_failed_save_is_one_line_and_keeps_complete_checkpoints(model_dir, meta, base_run, tmp_path):
    out = copy_run(base_run, tmp_path)
    before = tree(out)
    res = run_train("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 4, "--save-every", 1,
                    "--keep-last", 5, "--resume", *TRAIN, check=False,
                    fault="save-error=ENOSPC:4")
    lines = notes(res.stderr)
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(lines) == 2, res.stderr[-3000:]
    assert lines[0].startswith("resuming from") and lines[1] == (
        f"error: cannot save checkpoint {out / 'checkpoints' / 'step_4.tmp'}: no space left on the device; "
        f"removed the partial save, kept {out / 'checkpoints' / 'step_3'}"), lines
    after = tree(out)
    assert {k: v for k, v in after.items() if k != "metrics.jsonl" and k != "config.json"} == \
        {k: v for k,
         v in before.items() if k != "metrics.jsonl" and k != "config.json"}  # no step_4(.tmp), all else intact


def test_out_of_memory_on_one_rank_is_one_line_and_keeps_the_checkpoints(model_dir, meta, tmp_path):
    """Rank 1 of 2 cannot allocate in step 2 (the CPU allocator's RuntimeError): rank 1 names its
    --micro-batch and batch in one line, torchrun's report gives that line as the root cause, no rank
    hangs in the collective rank 1 left, and step 1's checkpoint stays complete."""
    out = tmp_path / "run"
    res = run_train("--model", model_dir, "--data", meta, "--out", out, "--max-steps", 3, "--save-every", 1, *TRAIN,
                    nproc=2, check=False, fault="oom=2:1")
    want = re.compile(r"error: rank 1: out of memory at --micro-batch 1 \(this one 1 rows of \d+ tokens\); lower "
                      r"--micro-batch or --max-seq-len")
    assert res.returncode == 1 and want.fullmatch(root_cause(res.stderr)), res.stderr[-3000:]
    errors = [x for x in worker_lines(res.stderr) if x.startswith("error:")]
    assert errors.count(root_cause(res.stderr)) == 1, res.stderr[-3000:]
    assert all(x.startswith("error: lost contact with another rank")
               for x in errors if x != root_cause(res.stderr)), errors
    assert "Traceback" not in "\n".join(worker_lines(res.stderr))
    assert runs.verify_checkpoint(out / "checkpoints" / "step_1") is None


def test_os_cause_names_the_cause(monkeypatch, tmp_path):
    for code, words in [(errno.ENOSPC, "no space left"), (errno.EROFS, "read-only"),
                        (errno.EACCES, "permission denied")]:
        wrapped = CheckpointException("save failed", {1: (OSError(code, os.strerror(code)), None)})  # DCP, rank 1
        assert cli.os_cause(wrapped) == cli.CAUSES[code] and words in cli.CAUSES[code]
        try:
            try:
                raise OSError(code, os.strerror(code))
            except OSError as e:
                raise RuntimeError("enforce fail at inline_container.cc: file write failed") from e
        except RuntimeError as e:
            assert cli.os_cause(e) == cli.CAUSES[code]
    # torch's zip writer on a full disk: no errno anywhere, so the free space is what tells
    zip_error = RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file")
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: SimpleNamespace(free=3 * 2**20))
    assert cli.os_cause(zip_error, tmp_path).startswith("the disk is (nearly) full, 3 MiB free")
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**40))
    assert cli.os_cause(zip_error, tmp_path).startswith("RuntimeError: [enforce fail")


def test_a_loader_worker_is_quiet_when_the_trainer_leaves_mid_handshake():
    """A loader worker hands each batch's tensors over by fd passing (multiprocessing.resource_sharer).
    When a signal stops the trainer while it fetches one, the trainer drops the connection midway,
    and the worker's sharing thread reports the EOFError (or a broken pipe) through sys.excepthook.
    Here a worker, set up as the loader sets it up, offers an fd, and a client connects to its
    sharer and leaves at once: nothing may reach stderr, while other errors still do."""
    code = f"""
import os, socket, sys, time
sys.path.insert(0, {str(ROOT)!r})
from multiprocessing import connection, current_process, resource_sharer
import batches
batches.leave_signals_to_the_trainer(0)
r, w = os.pipe()
offered = resource_sharer.DupFd(r)  # what pickling a shared tensor in a worker does
for half in (False, True):  # the trainer leaves before the handshake, or halfway through it
    client = socket.socket(socket.AF_UNIX)
    client.connect(resource_sharer._resource_sharer._address)
    if half:  # it answers the worker's challenge, then is gone before sending its own: EOFError there
        conn = connection.Connection(client.detach())
        connection.answer_challenge(conn, current_process().authkey)
        conn.close()
    else:
        client.close()  # a broken pipe when the worker sends its challenge
    time.sleep(0.5)
sys.excepthook(ValueError, ValueError("still reported"), None)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "ValueError: still reported", res.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_abandons_the_step_and_keeps_the_checkpoints(model_dir, tmp_path, sig):
    meta = write_dataset(tmp_path / "d", rows=8, repeat=20)  # 40 steps: it is still training when signalled
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), "--model", str(model_dir), "--data", str(meta), "--out", str(out),
           "--save-every", "1", "--keep-last", "50", *TRAIN, "--num-workers", "1"]  # a loader worker gets it too
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    deadline = time.time() + 120
    while not (out / "checkpoints" / "step_2").is_dir() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    first = tree(out / "checkpoints" / "step_1")
    os.killpg(proc.pid, sig)  # as Ctrl-C in a terminal or a job scheduler does: the whole process group
    _, err = proc.communicate(timeout=120)
    line = one_line(err)
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert line.startswith(f"interrupted by {sig.name}: the current step was abandoned; "
                           "last complete checkpoint "), line
    assert tree(out / "checkpoints" / "step_1") == first
    names = [d.name for d in (out / "checkpoints").iterdir()]
    assert not any(n.endswith(".tmp") for n in names), names  # a save cut short leaves nothing behind
    assert all(runs.verify_checkpoint(out / "checkpoints" / n) is None for n in names)
    assert line.endswith(f"{runs.checkpoints(out)[-1]} (continue with --resume)"), line
    if sig == signal.SIGTERM:  # the newest checkpoint loads: a resume goes on from it for one more step
        newest = runs.checkpoints(out)[-1]
        step = int(newest.name.split("_")[1])
        res = subprocess.run(cmd + ["--resume", "--max-steps", str(step + 1)], capture_output=True, text=True,
                             timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert res.returncode == 0 and f"resuming from {newest} at step {step}" in res.stderr, res.stderr[-2000:]
        assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()][-1] == step + 1


# -- 4. torchrun: flags are rejected once, before the process group ---------------------------------


def test_flag_errors_are_one_line_and_quiet_on_other_ranks(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        parse_flags(train, ["--bogus"])
    assert (e.value.code == 2
            and one_line(capsys.readouterr().err).endswith(": error: unrecognized arguments: --bogus (see --help)"))
    monkeypatch.setenv("RANK", "1")
    waits = []
    monkeypatch.setattr(cli.time, "sleep", waits.append)  # rank 1 waits for torchrun: rank 0 reports
    with pytest.raises(SystemExit) as e:
        parse_flags(train, ["--bogus"])
    assert e.value.code == 2 and capsys.readouterr().err == "" and waits == [10]  # rank 0 has said it


# -- 5. misleading messages, silently wrong inputs (generate.py, images: test_robust_cli.py) ------


def test_jsonl_given_as_meta_gets_a_hint(model_dir, meta, tmp_path):
    jsonl = meta.parent / "train.jsonl"
    res = train_here("--validate-data", "--model", model_dir, "--data", jsonl, *TRAIN, check=False)
    code, err = res.returncode, res.stderr
    line = one_line(err)
    assert code == 1 and "JSONL annotation file" in line and "meta JSON" in line, line


def test_metrics_are_json_with_null_for_nan(base_run):
    text = (base_run / "metrics.jsonl").read_text()

    def no_nan(name):
        raise AssertionError(f"{name} in metrics.jsonl")

    rows = [json.loads(line, parse_constant=no_nan) for line in text.splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["mfu"] is None  # CPU: no peak FLOPs, so no MFU
    assert runs.finite({"a": float("nan"), "b": {"c": float("inf")}, "d": 1.0}) == {"a": None, "b": {"c": None},
                                                                                    "d": 1.0}


def test_first_turn_from_gpt_is_kept_as_the_official_preprocessing_does(model_dir, tmp_path):
    """preprocess_internvl2_5 (InternVL's internvl_chat/internvl/train/dataset.py, the template of
    InternVL3.5) appends every turn in order after the system message and supervises every gpt turn,
    a leading one too; only the older templates' preprocess functions skip a first non-human turn."""
    tok = Tokenizer.from_pretrained(model_dir)
    turns = [("gpt", "Hello there."), ("human", "What is 2+2?"), ("gpt", "Four.")]
    (tmp_path / "a.jsonl").write_text(json.dumps({"conversations": [{"from": r, "value": v} for r, v in turns]}) + "\n")
    (tmp_path / "meta.json").write_text(json.dumps({"ds": {"root": ".", "annotation": "a.jsonl"}}))
    s = SFTData(tmp_path / "meta.json", tok)[0]
    header = {"human": "user", "gpt": "assistant"}
    segs = [tok.encode(f"<|im_start|>system\n{D.DEFAULT_SYSTEM_MESSAGE}<|im_end|>\n")] + [
        tok.encode(f"<|im_start|>{header[r]}\n{v}<|im_end|>\n") for r, v in turns]
    assert s.input_ids.tolist() == sum(segs, [])
    n = len(tok.encode("<|im_start|>assistant\n"))
    want = [-100] * len(segs[0])
    for (role, _), seg in zip(turns, segs[1:]):
        want += [-100] * n + seg[n:-1] + [-100] if role == "gpt" else [-100] * len(seg)
    assert s.labels.tolist() == want


def test_role_content_rows_are_told_the_format(model_dir, tmp_path):
    tok = Tokenizer.from_pretrained(model_dir)
    rows = [{"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"messages": [{"role": "user", "content": "hi"}]}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "meta.json").write_text(json.dumps({"ds": {"root": ".", "annotation": "a.jsonl"}}))
    data = SFTData(tmp_path / "meta.json", tok)
    first, second = data[0], data[1]
    assert isinstance(first, D.BadRow) and "from/value" in first.detail and first.detail.startswith(
        f"ds line 1 of {tmp_path / 'a.jsonl'}: "), first.detail
    assert isinstance(second, D.BadRow) and "'messages'" in second.detail and "from/value" in second.detail


def test_validate_data_lists_bad_rows_capped(model_dir, tmp_path, monkeypatch):
    meta = write_dataset(tmp_path / "d", rows=6, bad=2)
    jsonl = meta.parent / "train.jsonl"
    with open(jsonl, "a") as f:  # a blank line, then a row that is not JSON: named by its line in the file
        f.write("\n{not json\n")
    before = tree(meta.parent)
    res = train_here("--validate-data", "--model", model_dir, "--data", meta, "--max-bad-frac", "0.5",
                     *TRAIN, check=False)
    code, out, err = res.returncode, res.stdout, res.stderr
    lines = out.strip().splitlines()
    assert (code == 0 and err == "" and json.loads(lines[-1])["missing_image"] == 2
            and json.loads(lines[-1])["bad_row"] == 1)
    listed = lines[:-1]
    assert (len(listed) == 3
            and all(x.startswith("bad row: tiny line ") and f"of {jsonl}: " in x for x in listed)), listed
    assert listed[-1].startswith("bad row: tiny line 10 of") and listed[-1].endswith("[bad_row]"), listed  # 9 is blank
    monkeypatch.setattr(D, "MAX_NAMED", 1)
    res = train_here("--validate-data", "--model", model_dir, "--data", meta, "--max-bad-frac", "0.1",
                     *TRAIN, check=False)
    code, out, err = res.returncode, res.stdout, res.stderr
    lines = out.strip().splitlines()
    assert code == 1 and len(lines) == 3 and lines[1] == "... and 2 more bad rows", lines
    assert one_line(err).startswith("error: 3 of the data set's 9 rows are bad")
    assert tree(meta.parent) == before


