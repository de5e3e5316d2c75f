"""Inputs a careless or hostile user gives (issue 29): one output has one writer, config.json is checked
against the checkpoint's tensors before any module is built, text that is not valid Unicode, absurd or
foreign arguments and files. Each case runs the command as a user does (in-process `main` where that is
the same thing, a subprocess where the point is another process) and checks the exit code, the one line
and that nothing already written changed."""
import fcntl
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate
import generate
import latency
import profiling
import router
import train
from conftest import png_b64, tree, write_dataset, write_tsv


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


# -- 7. text that is not valid Unicode; 10. a typed <IMG_CONTEXT> --------------------------------------

NOT_UTF8 = "character {k} is a lone surrogate U+DCFF (the byte 0xff of text that is not UTF-8?)"


def test_text_that_is_not_unicode_is_named_where_it_is(model_dir, tmp_path, capsys, monkeypatch):
    """A lone surrogate (a JSON "\\udcff", or bytes that are not UTF-8 as Python holds them) reached the
    tokenizer, whose TypeError was a traceback (in training followed by a hang): now a --batch row and a
    command-line question are one line naming them, a chat turn is refused and the session goes on, a
    training row is a bad row named like any other, a prediction line is named."""
    batch = tmp_path / "q.jsonl"
    batch.write_text('{"question": "Fine."}\n{"question": "Bad \\udcff."}\n')
    code, err = run_main(capsys, generate.main, ["--batch", batch, "--model", model_dir])
    assert code == 1 and err == [f"error: {batch} line 2: the question is not valid Unicode: " + NOT_UTF8.format(k=5)]
    code, err = run_main(capsys, generate.main, ["Bad \udcff byte", "--model", model_dir, "--max-new-tokens", 1])
    assert code == 1 and err[-1] == "error: the question is not valid Unicode: " + NOT_UTF8.format(k=5), err
    code, err = run_main(capsys, generate.main, ["What is <IMG_CONTEXT> here?", "--model", model_dir])
    assert code == 1 and err[-1] == ("error: the question holds <IMG_CONTEXT>, the token an image's features fill; "
                                     "write <image> where an image goes"), err
    # --chat: raw bytes on a terminal whose decoder is strict; the bad turn is dropped, the next one answered
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"bad \xff byte\nHello\n"), encoding="utf-8"))
    code, err = run_main(capsys, generate.main, ["--chat", "--model", model_dir, "--max-new-tokens", 2])
    notes = [x for x in err if x.startswith("error")]
    assert code == 0 and notes == ["error: the question is not valid Unicode: " + NOT_UTF8.format(k=5)
                                   + " (turn dropped; the conversation goes on)"], err
    assert len([x for x in err if x.startswith("load_s=")]) == 1  # "Hello" was answered
    # a prediction: lengths re-tokenises it
    pred = tmp_path / "p.jsonl"
    pred.write_text('{"index": "1", "prediction": "a \\udcff", "benchmark": "OCRBench"}\n')
    code, err = run_main(capsys, evaluate.main, ["lengths", "--model", model_dir, "--a", pred, "--b", pred])
    assert code == 1 and err == [f"error: {pred}: line 1 is not valid Unicode (a lone surrogate U+DCFF)"], err


def test_a_training_row_that_is_not_unicode_is_a_bad_row(model_dir, tmp_path, capsys):
    meta = write_dataset(tmp_path / "d", rows=4)
    lines = (tmp_path / "d" / "train.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace("Describe it.", "Describe \\udcff it.")
    (tmp_path / "d" / "train.jsonl").write_text("\n".join(lines) + "\n")
    code = train.main(["--validate-data", "--model", str(model_dir), "--data", str(meta), "--num-workers", "0",
                       "--max-bad-frac", "0.5"])
    out = capsys.readouterr().out
    assert code == 0 and (f"bad row: tiny line 2 of {tmp_path / 'd' / 'train.jsonl'}: turn 1 is not valid Unicode: "
                          + NOT_UTF8.format(k=18) + " [bad_row]") in out, out
    assert json.loads(out.strip().splitlines()[-1]) == {"good": 3, "missing_image": 0, "corrupt_image": 0,
                                                        "placeholder_mismatch": 0, "too_long": 0, "bad_row": 1}


def test_a_row_that_cannot_be_asked_is_skipped_by_name(model_dir, tmp_path, capsys):
    """evaluate.py run: a 100,000-character question (past the model's context) and a typed <IMG_CONTEXT>
    each skip their row, named; the other rows are answered (the long one aborted the whole run)."""
    img = png_b64(16, 16, 5)
    tsv = write_tsv(tmp_path / "t.tsv", [{"index": "0", "question": "Read it.", "answer": "['x']", "image": img},
                                         {"index": "1", "question": "word " * 20000, "answer": "['x']", "image": img},
                                         {"index": "2", "question": "Is <IMG_CONTEXT> it?", "answer": "['x']",
                                          "image": img}])
    out = tmp_path / "p.jsonl"
    code, err = run_main(capsys, evaluate.main, ["run", "--benchmark", "TextVQA_VAL", "--data", tsv, "--model",
                                                 model_dir, "--out", out, "--max-new-tokens", 2])
    skipped = [x for x in err if x.startswith("row ")]
    assert code == 0 and len(skipped) == 2, err
    assert skipped[0].startswith("row 1: prompt of ") and skipped[0].endswith(
        "tokens (image tokens included) + 2 new tokens exceeds the model context of 40960; skipped"), skipped
    assert skipped[1] == ("row 2: the question holds <IMG_CONTEXT>, the token an image's features fill; write <image> "
                          "where an image goes; skipped")
    assert [json.loads(x)["index"] for x in out.read_text().splitlines()] == ["0"]


# -- 6, 8, 10, 12: arguments and files, one line each ---------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Small files the cases below hand the commands."""
    d = tmp_path_factory.mktemp("inputs")
    img = png_b64(16, 16, 5)
    f = {"header_tsv": write_tsv(d / "header_tsv", [{"index": "0", "question": "q", "answer": "a", "image": img}]),
         "short_tsv": d / "short_tsv", "preds": d / "preds.jsonl", "score": d / "score.json",
         "nan": d / "nan.json", "text": d / "text.json", "six_csv": d / "six_csv", "bom_csv": d / "bom_csv",
         "big_csv": d / "big_csv", "a file": d / "a file", "folder": d / "folder", "run": d / "run"}
    f["header_tsv"].write_text(f["header_tsv"].read_text().splitlines()[0] + "\n")
    f["short_tsv"].write_text("index\tquestion\tanswer\n0\tWhat?\n1\tWhat?\tyes\n")  # row 0 has no answer cell
    f["preds"].write_text('{"index": "0", "prediction": "yes"}\n{"index": "1", "prediction": "yes"}\n')
    f["score"].write_text('{"benchmark": "OCRBench", "score": 50.0, "pv": 1, "pl": 1}\n')
    f["nan"].write_text('{"benchmark": "OCRBench", "score": NaN, "pv": 1, "pl": 1}\n')
    f["text"].write_text('{"benchmark": "OCRBench", "score": "high", "pv": 1, "pl": 1}\n')
    f["six_csv"].write_text("params,p,loss\n" + "1000000,2,2.5\n" * 6)
    rows = [(n, p, 1.5 + (3e8 / (n * (0.4 * math.log(p) + 1))) ** 0.3) for n in (1e8, 1e9) for p in (1, 2, 4)]
    f["bom_csv"].write_text("\ufeffparams,p,loss\n" + "".join(f"{n},{p},{loss}\n" for n, p, loss in rows),
                            encoding="utf-8")
    f["big_csv"].write_text("params,p,loss\n" + "".join(f"{n},{p},{loss}\n" for n, p, loss in rows) * 33334)
    f["a file"].write_text("x")
    f["folder"].mkdir()
    f["run"].mkdir()
    (f["run"] / "metrics.jsonl").write_text(
        '{"step": 1, "loss": null, "grad_norm": 1.0, "lr": {"pretrained": 0.001}}\n{"loss": 3}\nnull\n[1, 2]\n'
        '{"step": 2, "loss": 2.0, "grad_norm": null, "lr": null}\n"text"\n'
        '{"step": 3, "loss": 1.5, "grad_norm": 0.5, "lr": {"pretrained": 0.002, "branches": 0.01}}\n')
    return f


LINES = {  # case: (command, argv, exit code, the line (or its start and end, "..." between))
    "run: a header and no rows": (
        "evaluate", ["run", "--benchmark", "TextVQA_VAL", "--data", "{header_tsv}", "--model", "{model}", "--out",
                     "{folder}/p.jsonl"], 1, "error: {header_tsv}: a header and no rows"),
    "score: a header and no rows": (
        "evaluate", ["score", "--benchmark", "TextVQA_VAL", "--data", "{header_tsv}", "--predictions", "{preds}"], 1,
        "error: {header_tsv}: a header and no rows"),
    "lengths: a score file": (
        "evaluate", ["lengths", "--model", "{model}", "--a", "{score}", "--b", "{score}"], 1,
        "error: {score}: rows without index and prediction: not the predictions of evaluate.py run (a score file?)"),
    "lengths: 10**9 resamples": (
        "evaluate", ["lengths", "--model", "{model}", "--a", "{preds}", "--b", "{preds}", "--resamples", 10**9], 2,
        "evaluate.py: error: --resamples must be in [1, 1000000], got 1000000000 (see --help)"),
    "report: --tie-decimals -3": (
        "evaluate", ["report", "{score}", "--out", "{folder}/r", "--tie-decimals", -3], 2,
        "evaluate.py: error: --tie-decimals must be >= 0, got -3 (see --help)"),
    "report: a NaN score": (
        "evaluate", ["report", "{nan}", "--out", "{folder}/r"], 1,
        "error: {nan}: not a score file with benchmark, score, pv, pl (ValueError: score must be a number in "
        "[0, 100], got nan)"),
    "report: a string score": (
        "evaluate", ["report", "{text}", "--out", "{folder}/r"], 1,
        "error: {text}: not a score file with benchmark, score, pv, pl (ValueError: score must be a number in "
        "[0, 100], got 'high')"),
    "report: --out at a file": (
        "evaluate", ["report", "{score}", "--out", "{a file}"], 1, "error: --out {a file}: {a file} is a file, not a "
                                                                  "folder"),
    "run: --out behind a file": (
        "evaluate", ["run", "--benchmark", "TextVQA_VAL", "--data", "{short_tsv}", "--model", "{model}", "--out",
                     "{a file}/p.jsonl"], 1, "error: --out {a file}/p.jsonl: {a file} is a file, not a folder"),
    "fit-law: six equal points": (
        "evaluate", ["fit-law", "{six_csv}"], 1,
        "error: {six_csv}: 1 point in 6 rows; the law has 4 parameters (E, A, alpha, k), so fitting it needs at least "
        "5 distinct (params, p) points with two params and two p values at least (here 1 and 1)"),
    "fit-law: 200,000 rows": (
        "evaluate", ["fit-law", "{big_csv}"], 1,
        "error: {big_csv}: 200004 rows; the fit runs 300 L-BFGS starts over every row, which takes too long past "
        "1,000 rows: average each (params, p)'s losses into one row"),
    "forward --configs 0:1": (
        "profiling", ["forward", "--configs", "0:1"], 2,
        "profiling.py forward: error: argument --configs: Pv and Pl must be >= 1, got '0:1' (see --help)"),
    "latency --tiles 0 --text-tokens 0": (
        "profiling", ["latency", "--tiles", 0, "--text-tokens", 0], 2,
        "profiling.py: error: --tiles 0 --text-tokens 0 leaves an empty prompt: give one of them at least 1 "
        "(see --help)"),
    "latency --plot at a folder": (
        "profiling", ["latency", "--arch", "tiny", "--plot", "{folder}"], 1,
        "error: --plot {folder}: a folder; give the file to write, such as {folder}/plot.png"),
    "train.py plot --out at a folder": (
        "train", ["plot", "{run}", "--out", "{folder}"], 1,
        "error: --out {folder}: a folder; give the file to write, such as {folder}/plot.png"),
    "generate --router at an empty folder": (
        "generate", ["Hi", "--model", "{model}", "--router", "{folder}", "--max-new-tokens", 1], 1,
        "error: {folder}: not a router folder (it holds nothing; router.py train writes config.json and "
        "router.safetensors)"),
}
MAINS = {"evaluate": evaluate.main, "profiling": profiling.main, "train": train.main, "generate": generate.main}


@pytest.mark.parametrize("case", list(LINES))
def test_bad_arguments_and_files_are_one_line(files, model_dir, capsys, case):
    command, argv, want_code, want = LINES[case]
    names = {k: str(v) for k, v in files.items()} | {"model": str(model_dir)}
    code, err = run_main(capsys, MAINS[command], [str(a).format(**names) for a in argv])
    prog = Path(sys.argv[0]).name  # argparse's name for the command: evaluate.py when run as one
    want = want.format(**names).replace(f"{command}.py", prog, 1) if want.startswith(command) else want.format(**names)
    assert code == want_code and err[-1:] == [want], err
    assert not any("Traceback" in x for x in err), err
    assert not (files["folder"].parent / "folder.png").exists() and not list(files["folder"].iterdir())
    assert files["a file"].read_text() == "x"


def test_score_reads_a_short_row_as_pandas_does(files, capsys):
    """A row with fewer cells than the header has missing values there, as pandas reads it (VLMEvalKit),
    not a KeyError: ChartQA's relaxed accuracy finds row 0's "yes" against its missing answer ("nan")
    wrong and row 1's "yes" against "yes" right, 1 of 2 rows."""
    code = evaluate.main(["score", "--benchmark", "ChartQA_TEST", "--data", str(files["short_tsv"]), "--predictions",
                          str(files["preds"])])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and line["n"] == 2 and line["score"] == 50.0, line


def test_fit_law_reads_a_byte_order_mark(files, capsys):
    code = evaluate.main(["fit-law", str(files["bom_csv"])])
    fit = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and fit["k"] == pytest.approx(0.4, abs=0.02) and fit["alpha"] == pytest.approx(0.3, abs=0.02)


def test_train_plot_reads_nulls_and_foreign_rows(files, capsys):
    """Nulls are gaps and rows that are not log steps are left out (a KeyError before); the PNG is written
    where --out names it, even without a .png suffix."""
    png = files["run"] / "picture"
    code = train.main(["plot", str(files["run"]), "--out", str(png)])
    assert code == 0 and capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hub_cache_under_a_file_is_named_with_its_variable(tmp_path, capsys, monkeypatch):
    """HOME or HF_HOME set to a file: the hub cache cannot be made there; said with the variable, not as a
    failed download that blames the network."""
    from huggingface_hub import constants

    blocker = tmp_path / "home"
    blocker.write_text("not a folder")
    for var, cache, fix in (("HF_HOME", blocker / "hub", "point HF_HOME at a folder"),
                            ("HOME", blocker / ".cache" / "huggingface" / "hub", "set HF_HOME to a folder")):
        for v in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "PARVL_MODEL"):
            monkeypatch.delenv(v, raising=False)
        monkeypatch.setenv(var, str(blocker))
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # what huggingface_hub derives at import
        code, err = run_main(capsys, generate.main, ["Hi"])
        assert code == 1 and err == [f"error: OpenGVLab/InternVL3_5-1B: the hub cache {cache} (from {var}={blocker}) "
                                     f"cannot be a folder: {blocker} is a file; {fix}, or pass --model a local "
                                     f"checkpoint folder"], err


def test_latency_compile_s_and_a_batch_that_does_not_fit(capsys, monkeypatch):
    """compile_s is null without --compile (the first call minus the steady state was noise, even negative);
    an allocation failure is one line with the flags that lower it (the allocator's traceback before)."""
    code = profiling.main(["latency", "--arch", "tiny", "--tiles", "0", "--text-tokens", "8", "--new-tokens", "2",
                           "--batch", "1", "--iters", "2", "--warmup", "1", "--device", "cpu", "--json"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert code == 0 and [r["compile_s"] for r in rows] == [None]

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(latency.Engine, "generate", no_memory)
    code, err = run_main(capsys, profiling.main, ["latency", "--arch", "tiny", "--tiles", 1, "--text-tokens", 8,
                                                  "--new-tokens", 2, "--batch", 64, "--device", "cpu"])
    assert code == 1 and err[-1] == ("error: out of memory at Pv:Pl 1:1 --batch 64 (1 tiles, 8 text tokens, 2 new "
                                     "tokens per sample); lower --batch, --tiles, --text-tokens or --new-tokens"), err


def test_every_flag_says_its_default_once(capsys):
    """--help of every command and subcommand: no flag's help names two defaults."""
    import re

    helps = []
    for main, argv in [(generate.main, []), (train.main, []), (train.main, ["plot"])] + [
            (evaluate.main, [s]) for s in evaluate.COMMANDS] + [(profiling.main, [s]) for s in profiling.COMMANDS] + [
            (router.main, [s]) for s in router.COMMANDS]:
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        helps.append(capsys.readouterr().out)
    flags = [" ".join(b.split()) for h in helps for b in re.split(r"\n  (?=-)", h)[1:]]
    assert len(flags) > 100 and not [f for f in flags if f.lower().count("default") > 1]
