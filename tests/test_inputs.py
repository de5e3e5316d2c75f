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


# -- 5. config.json against the checkpoint's tensors, before any module is built -----------------------


SPOILED_CONFIGS = {  # what is changed in the tiny checkpoint's config.json -> the line that names it
    "layers 10**6": (lambda c: c["llm_config"].update(num_hidden_layers=10**6),
                     "config.json: the language model's num_hidden_layers is 1000000, but the tensors in {d} hold 2 "
                     "language model layers"),
    "vision layers": (lambda c: c["vision_config"].update(num_hidden_layers=3),
                      "config.json: the vision model's num_hidden_layers is 3, but the tensors in {d} hold 2 vision "
                      "model layers"),
    "width": (lambda c: c["llm_config"].update(hidden_size=128),
              "config.json: the language model's hidden_size is 128, but in {d} language_model.model.embed_tokens."
              "weight has shape [640, 64]"),
    "mlp": (lambda c: c["vision_config"].update(intermediate_size=256),
            "config.json: the vision model's intermediate_size is 256, but in {d} vision_model.encoder.layers.0.mlp."
            "fc1.weight has shape [128, 64]"),
    "negative heads": (lambda c: c["llm_config"].update(num_attention_heads=-4),
                       "config.json: llm_config.num_attention_heads must be a positive integer, got -4"),
    "zero heads": (lambda c: c["vision_config"].update(num_attention_heads=0),
                   "config.json: vision_config.num_attention_heads must be a positive integer, got 0"),
    "string size": (lambda c: c["llm_config"].update(hidden_size="64"),
                    "config.json: llm_config.hidden_size must be a positive integer, got '64'"),
    "kv heads": (lambda c: c["llm_config"].update(num_key_value_heads=3),
                 "config.json: llm_config.num_attention_heads 4 is not a multiple of llm_config.num_key_value_heads 3"),
    "ratio": (lambda c: c.update(downsample_ratio=0.3),
              "config.json: downsample_ratio must be 1/k for a k that divides the 32-patch grid, got 0.3"),
    "a list": (lambda c: [c], "{d}/config.json: a JSON list, not the object of names and values it must be"),
    "block a list": (lambda c: c.update(llm_config=[1]), "config.json: llm_config must be a JSON object, got list"),
}


@pytest.mark.parametrize("case", list(SPOILED_CONFIGS))
def test_a_config_that_disagrees_with_its_tensors_is_refused_before_building(model_dir, tmp_path, capsys,
                                                                            monkeypatch, case):
    """A config.json whose sizes or counts are not the tensors' (read from the safetensors headers), or
    whose values cannot size a model, is one line naming config.json and the field, before any module
    is built (a million layers used to be built for minutes)."""
    import shutil

    import parvl

    spoil, line = SPOILED_CONFIGS[case]
    d = tmp_path / "ckpt"
    shutil.copytree(model_dir, d)
    config = json.loads((d / "config.json").read_text())
    config = spoil(config) or config
    (d / "config.json").write_text(json.dumps(config))
    if case in ("layers 10**6", "vision layers"):  # counts: refused before the model's constructor runs
        monkeypatch.setattr(parvl.ParVL, "__init__", lambda *a, **k: pytest.fail("a module was built"))
    code, err = run_main(capsys, generate.main, ["Hi", "--model", d, "--max-new-tokens", 1])
    assert code == 1 and err[-1] == "error: " + line.format(d=d), err
