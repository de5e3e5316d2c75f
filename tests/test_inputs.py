"""Inputs a careless or hostile user gives (issue 29): one output has one writer, config.json is checked
against the checkpoint's tensors before any module is built, text that is not valid Unicode, absurd or
foreign arguments and files. Each case runs the command as a user does (in-process `main` where that is
the same thing, a subprocess where the point is another process) and checks the exit code, the one line
and that nothing already written changed."""
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import evaluate
import generate
import router
import train
from test_robust import tree
from test_train import ROOT, write_dataset


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("qwen3", "original")


def run_main(capsys, main, argv) -> tuple[int, list[str]]:
    """A command's main in this process: its exit code (a flag error's too) and its stderr lines."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


# -- 3. one output, one writer -----------------------------------------------------------------------


def hold(lock: Path) -> int:
    """What a running command holds on its output: an flock on OUT.lock (another open file description
    of this process conflicts with it as another process's would)."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


@pytest.mark.parametrize("command", ["generate.py --batch", "evaluate.py run", "router.py label", "router.py train",
                                     "train.py"])
def test_a_second_writer_of_one_output_is_refused(model_dir, tmp_path, capsys, command):
    """While another process writes an output (it holds OUT.lock), each command that writes a resumable
    output or a run folder is refused in one line naming the output, and leaves what is there untouched."""
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question": "Hi"}\n')
    meta = write_dataset(tmp_path / "d", rows=4)
    m = str(model_dir)
    out, argv, main = {
        "generate.py --batch": ("a.jsonl", ["--batch", questions, "--model", m], generate.main),
        "evaluate.py run": ("p.jsonl", ["run", "--benchmark", "TextVQA_VAL", "--data", meta, "--model", m],
                            evaluate.main),
        "router.py label": ("labels", ["label", "--model", m, "--data", meta, "--num-workers", "0"], router.main),
        "router.py train": ("gates", ["train", "--model", m, "--labels", m], router.main),
        "train.py": ("run", ["--model", m, "--data", meta, "--resume"], train.main),
    }[command]
    out = tmp_path / "o" / out
    out.parent.mkdir()
    if out.suffix:  # what the first writer has written so far: a torn last line a resume would cut
        out.write_text('{"line": 1, "question": "Hi", "answer": "x"}\n{"line": 2, "quest')
    else:
        (out / "parts").mkdir(parents=True)
        (out / "parts" / "chunk_000000.safetensors.tmp").write_bytes(b"half")
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
    fd = hold(out.with_name(out.name + ".lock"))
    before = tree(out.parent)
    try:
        code, err = run_main(capsys, main, [*argv, "--out", out])
    finally:
        os.close(fd)
    assert code == 1 and err == [f"error: --out {out}: another process is writing it (it holds {out}.lock); wait "
                                 f"for it to finish or stop it, or pick another --out"], (command, err)
    assert tree(out.parent) == before


def test_a_killed_writer_leaves_no_lock(model_dir, tmp_path, capsys):
    """The lock is the kernel's: a writer killed with SIGKILL holds nothing any more, and the next run at
    its --out answers every question once; the lock file goes when the run ends."""
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question": "Hi"}\n{"question": "Bye"}\n')
    out = tmp_path / "a.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(out) + '.lock'!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"  # the lock is taken: no sleep to guess when
        argv = ["--batch", questions, "--out", out, "--model", model_dir, "--max-new-tokens", 2]
        code, err = run_main(capsys, generate.main, argv)
        assert code == 1 and "another process is writing it" in err[-1] and not out.exists(), err
    finally:
        holder.kill()
        holder.wait(timeout=60)
    code, err = run_main(capsys, generate.main, argv)
    assert code == 0, err
    assert [json.loads(x)["line"] for x in out.read_text().splitlines()] == [1, 2]
    assert not Path(str(out) + ".lock").exists()
