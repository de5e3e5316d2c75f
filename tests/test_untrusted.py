"""What a command takes on trust, and no longer does (issue 46): an output adopted only when it was made here
with these settings, a Ctrl-C that is never an answer, one precision per report, one writer for every output, a
study that resumes where it lives, what --plan can know, flags spelled whole, a newcomer's first minute and the
remaining unclear messages. The answer extractor as an untrusted service: test_judge_service.py; router.py's
finite save: test_router.py. Each test names the rule it holds; each is small (no model is trained)."""

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cluster_fakes import fake_slurm, sbatch, slurm_log
from commands import ROOT, run_main

import evaluate
import generate
import profiling
import router
import study
import train

# -- rule 9: a flag is spelled whole; the sbatch script's first word is a script ----------------------------


@pytest.mark.parametrize(
    "main, argv, whole",
    [
        (train.main, ["--overwr"], None),
        (generate.main, ["--max-new", "4"], None),
        (evaluate.main, ["run", "--bench", "MMMU_DEV_VAL"], "--benchmark"),
        (router.main, ["train", "--mod", "m"], "--model"),
        (profiling.main, ["latency", "--arc", "1b"], None),
        (study.main, ["--mod", "m"], "--model"),
    ],
)
def test_an_abbreviated_flag_is_refused_in_every_command(capsys, main, argv, whole):
    """argparse took `--overwr` for --overwrite: a requeued job then got `--overwr --resume` and exited 2 on every
    restart. A flag is taken only as spelled whole (OneLineParser, allow_abbrev=False): exit 2, one line naming it."""
    abbreviation = next(a for a in argv if a.startswith("--"))
    code, err = run_main(capsys, main, argv)
    assert (code, len(err)) == (2, 1), err
    # a command with required flags names the whole flag as missing: the abbreviation filled none
    assert (
        f"required: {whole}" in err[0]
        if whole
        else f"unrecognized arguments: {abbreviation}" in err[0]
    ), err


def test_sbatch_refuses_a_first_word_that_is_no_script(tmp_path):
    """`sbatch slurm/parvl.sbatch python train.py ...` ran torchrun on `python` and never resumed a requeued
    train.py: the first word is the command's script, else one line and exit 2, srun never started."""
    env = fake_slurm(tmp_path, FAKE_SRUN_SLEEP=0)
    res = sbatch(["python", "train.py", "--out", "r"], env, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        "parvl.sbatch: 'python': not a command's script (train.py, evaluate.py, router.py, ...; the "
        "interpreter is PYTHON's)"
    ]
    assert not [c for c in slurm_log(env) if c[0] == "srun"]


# -- rules 1, 6, 7: the study's records; one study per --out ----------------------------------------------


def study_pieces(out: Path, data: Path) -> list:
    """Two pieces as study_plan makes them: the subsample (its file OUT/data/meta.json) and a trained run reading
    it (refused rather than retrained)."""
    from evaluation.study_config import Piece

    meta = out / "data" / "meta.json"
    return [
        Piece(
            "subsample",
            ["study.py", "subsample", "--data", str(data), "--out", str(out / "data")],
            meta,
            flags={"--data-fraction": 0.05},
            inputs={"--data": data},
            outputs=[out / "data"],
        ),
        Piece(
            "train 2:2",
            ["train.py", "--data", str(meta), "--out", str(out / "runs" / "2x2")],
            out / "runs" / "2x2" / "export" / "config.json",
            inputs={"data": meta},
            resume=out / "runs" / "2x2",
            refuse_change=True,
        ),
    ]


def made_study(out: Path, data: Path):
    """The two pieces' files under `out`, and their Plan."""
    from evaluation.study_run import Plan

    todo = study_pieces(out, data)
    for p in todo:
        p.done.parent.mkdir(parents=True, exist_ok=True)
        p.done.write_text("{}")
    return todo, Plan(SimpleNamespace(out=str(out)), todo)


def test_an_output_without_its_record_is_not_adopted(tmp_path):
    """Rule 1: OUT/made/ lost (a partial rsync, a clean-up), or a --out that already held a data/meta.json: the
    old files were taken as made with the new flags and recorded ("adopt"), and every allocation trained on them.
    Now a piece without its record is made again (moved aside, nothing lost) and a trained run is refused in one
    line; a record that is not JSON is one line naming it."""
    data = tmp_path / "sft.json"
    data.write_text("{}")
    (sub, run), plan = made_study(tmp_path / "st", data)
    status, why = plan.status(sub)
    assert status == "redo" and "without its record" in why, (status, why)
    with pytest.raises(
        ValueError, match="is there but not its record .*remove .*2x2 to train it again"
    ):
        plan.decide(run)
    plan.save(sub)
    assert plan.decide(sub) == ("done", None)
    plan.made(sub).write_text('{"argv": [')
    with pytest.raises(ValueError, match=r"made/subsample.json: not a record study.py wrote"):
        plan.decide(sub)


def test_a_study_resumes_under_another_spelling_and_moved(tmp_path, monkeypatch):
    """Rule 7: the same study resumed with --out st1 after /abs/st1, or moved to another disk, was refused as
    "another study.py" (its records held the command lines as spelled). Records now name OUT's files relative to
    it and other paths resolved: every piece is done under each spelling and after a move."""
    from evaluation.study_run import Plan

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "sft.json"
    data.write_text("{}")
    todo, plan = made_study(Path("st1"), Path("sft.json"))
    for p in todo:
        plan.save(p)
    again = study_pieces(tmp_path / "st1", data)
    assert [Plan(SimpleNamespace(out=str(tmp_path / "st1")), again).decide(p) for p in again] == [
        ("done", None)
    ] * 2
    (tmp_path / "disk2").mkdir()
    shutil.move(tmp_path / "st1", tmp_path / "disk2" / "st1")
    moved = study_pieces(tmp_path / "disk2" / "st1", data)
    plan = Plan(SimpleNamespace(out=str(tmp_path / "disk2" / "st1")), moved)
    assert [plan.decide(p) for p in moved] == [("done", None)] * 2


def test_one_study_per_out_and_subsample_keeps_what_it_did_not_write(tmp_path, capsys):
    """Rule 6: a second study.py on one --out was refused only at its first piece's lock, with advice to resume
    while the first ran; it is refused before anything, as a second writer. `study.py subsample --out` replaced a
    meta.json it did not write, and drew 0 rows without a word: both one line, exit 1, nothing touched."""
    from shell.outputs import one_writer

    out = tmp_path / "st"
    argv = ["--model", "m", "--data", "d.json", "--tsv", "lmu", "--out", str(out)]
    with one_writer(out):
        code, err = run_main(capsys, study.main, argv)
    assert code == 1 and len(err) == 1 and "another process is writing it" in err[0], err
    data = tmp_path / "sft.json"
    (tmp_path / "rows.jsonl").write_text('{"id": 1, "conversations": []}\n' * 4)
    data.write_text(json.dumps({"general_chat": {"root": "img", "annotation": "rows.jsonl"}}))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "meta.json").write_text('{"mine": 1}')
    code, err = run_main(capsys, study.main, ["subsample", "--data", data, "--out", theirs])
    assert code == 1 and err == [
        f"error: --out {theirs}: holds a meta.json that study.py subsample did not write (no "
        "subsample.json beside it); pick another --out"
    ]
    assert (theirs / "meta.json").read_text() == '{"mine": 1}'
    argv = ["subsample", "--data", data, "--out", tmp_path / "none", "--fraction", "0.01"]
    code, err = run_main(capsys, study.main, argv)
    assert code == 1 and err == [
        f"error: --fraction 0.01: draws 0 of the 4 rows of {data}; raise --fraction"
    ], err
    assert not (tmp_path / "none" / "meta.json").exists()


# -- rule 2: a Ctrl-C is never an answer ---------------------------------------------------------------------


class SwallowsASignal:
    """Sends this process SIGINT from its __del__: the shell's handler raises Interrupted there, where Python
    only prints it ("Exception ignored in") and goes on, as it does inside a callback of a model load."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)  # the swallowed Interrupted
def test_a_signal_swallowed_during_the_model_load_records_no_row(
    bench, tmp_path, capsys, monkeypatch
):
    """A SIGINT while `evaluate.py run` loaded the model left the load half done and unraised: every row was
    answered (0 new tokens), recorded, and the command exited 0, so a resume kept them. Now a signal received is
    an interrupt wherever it was swallowed: no row recorded, exit 130 with the interrupt's line."""
    import inference.flags

    folder, tsv, _, _ = bench
    real = inference.flags.load_pretrained

    def load_and_swallow(*args, **kw):
        model = real(*args, **kw)
        SwallowsASignal()  # collected at once: its __del__ runs here
        return model

    monkeypatch.setattr(inference.flags, "load_pretrained", load_and_swallow)
    out = tmp_path / "pred.jsonl"
    argv = ["run", "--benchmark", "MMMU_DEV_VAL", "--data", tsv, "--model", folder, "--out", out]
    code, err = run_main(capsys, evaluate.main, [*argv, "--max-new-tokens", 2, "--max-tiles", 1])
    assert code == 130 and err[-1].startswith("interrupted by SIGINT"), err
    rows = [x for f in tmp_path.glob("pred.jsonl*") for x in f.read_text().splitlines()]
    assert rows == [], rows


def test_a_ctrl_c_during_the_imports_is_one_line():
    """A SIGINT during a command's imports (seconds of torch) printed a KeyboardInterrupt traceback: it is one
    line and exit 130 (shell/early.py, each command's first import)."""
    import time

    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "evaluate.py"), "report", "x.json"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    time.sleep(0.5)  # the imports take seconds; shell.early is the first, within milliseconds
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err.splitlines()) == (
        130,
        ["interrupted by SIGINT while starting: nothing written"],
    ), err


def test_one_export_per_folder(tmp_path, capsys):
    """Rule 6: two `train.py export` into one new folder at once both passed its empty-folder check and exited 0,
    the folder holding one of them. An export holds its --out (default RUN/export_step_N) as every writer does:
    the second is refused in one line before it reads anything."""
    from shell.outputs import one_writer

    run = tmp_path / "run"
    for out, argv in ((tmp_path / "new", ["--out", tmp_path / "new"]), (run / "export_step_2", [])):
        with one_writer(out):
            code, err = run_main(capsys, train.main, ["export", run, "--step", 2, *argv])
        assert code == 1 and len(err) == 1 and "another process is writing it" in err[0], err
        assert not out.exists()


# -- rule 4: one report, one precision -------------------------------------------------------------------


def test_a_report_refuses_a_mix_of_dtypes(tmp_path, capsys):
    """Quantized beside full-precision scores was refused, but fp32 beside bf16 was reported with a best row
    and no dtype anywhere: refused in one line naming a file of each, nothing written; one dtype passes."""
    from commands import main_out, write_scores

    fp32 = write_scores(tmp_path / "a", "11", [40.0] * 9, dtype="float32")
    bf16 = write_scores(tmp_path / "b", "22", [41.0] * 9, pv=2, pl=2, dtype="bfloat16")
    rc, _, err = main_out(capsys, "report", *fp32, *bf16, "--out", tmp_path / "r")
    assert rc == 1 and err.count("\n") == 1 and not (tmp_path / "r").exists(), err
    assert (
        f"{bf16[0]} was predicted in bfloat16, {fp32[0]} in float32: one report, one precision"
        in err
    )
    more = write_scores(tmp_path / "c", "22", [41.0] * 9, pv=2, pl=2, dtype="float32")
    assert main_out(capsys, "report", *fp32, *more, "--out", tmp_path / "r")[0] == 0


# -- rule 8: what --plan can know, it checks --------------------------------------------------------------

PLAN_CASES = [
    (
        ["--router-allocation", "1:1"],
        "--router-allocation 1:1: one branch pair, nothing for a router to choose",
    ),
    (
        ["--reference-model", "1b=I", "1b=I"],
        "--reference-model 1b=I: given twice (each reference model is one row of Table 1)",
    ),
    (["--nodes", "2"], "--nodes: --launcher local never reads it"),
    (
        ["--launcher", "slurm", "--nproc-per-node", "4"],
        "--nproc-per-node: --launcher slurm never reads it",
    ),
    (
        ["--judge-url", "https://api.example.com/v1", "--judge-model", "m", "--vlmevalkit", "K"]
        + ["--judge-key-env", "UNSET_KEY_46"],
        "--judge-key-env UNSET_KEY_46: not set, and --judge-url's api.example.com is not this machine",
    ),
]


@pytest.mark.parametrize("flags, line", PLAN_CASES, ids=[c[0][0] for c in PLAN_CASES])
def test_plan_refuses_what_would_fail_after_the_training(
    tmp_path, capsys, monkeypatch, flags, line
):
    """Each passed --plan and failed after the training, or was silently ignored: a flag error, exit 2, one line,
    nothing written."""
    monkeypatch.delenv("UNSET_KEY_46", raising=False)
    out = tmp_path / "s"
    argv = ["--model", "M", "--data", "d.json", "--tsv", "T", "--out", out, "--plan", *flags]
    code, err = run_main(capsys, study.main, argv)
    assert code == 2 and len(err) == 1 and line in err[0], err
    assert not out.exists()


def test_plan_checks_the_vlmevalkit_checkout_and_quotes_its_paths(tmp_path, capsys):
    """A --vlmevalkit that is no VLMEvalKit checkout failed the first score, after the training: --plan names it
    (exit 1). The plan quotes every path it shows, a redirect target with spaces included; profiling.py --tiles
    has generate's range at parse."""
    out = tmp_path / "my study"
    argv = ["--model", "M", "--data", "d.json", "--tsv", "T", "--out", out, "--plan"]
    kit = tmp_path / "kit"
    kit.mkdir()
    judge = ["--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m", "--vlmevalkit", kit]
    code, err = run_main(capsys, study.main, [*argv, *judge])
    assert code == 1 and len(err) == 1, err
    assert f"--vlmevalkit {kit}: not a VLMEvalKit checkout" in err[0], err
    assert study.main([str(a) for a in argv]) == 0
    plan = capsys.readouterr().out.splitlines()
    # each redirect target one quoted word (whatever follows it on the line)
    redirects = [x.rsplit(" > ", 1)[1] for x in plan if " > " in x]
    assert redirects and all(r.startswith(f"'{out}/") and r.count("'") == 2 for r in redirects), (
        redirects
    )
    code, err = run_main(capsys, profiling.main, ["latency", "--tiles", 10**5])
    assert code == 2 and "--tiles must be in [0, 65], got 100000" in err[0], err


# -- rule 10: a newcomer's first minute --------------------------------------------------------------------


def test_a_missing_image_is_said_before_the_model_is_fetched(tmp_path, capsys, monkeypatch):
    """README's first command names image.png, which a newcomer does not have: the missing image was reported
    only after the model was fetched (gigabytes; offline, never). The image is opened first: one line, exit 1,
    and nothing asked of the hub."""
    import inference.flags

    fetched = []
    monkeypatch.setattr(
        inference.flags, "resolve_model", lambda *a, **k: fetched.append(a) or 1 / 0
    )
    code, err = run_main(capsys, generate.main, [tmp_path / "image.png", "Describe the image."])
    assert code == 1 and len(err) == 1 and "image.png" in err[0] and not fetched, err


def test_a_benchmark_says_how_to_install_what_it_needs(tmp_path, monkeypatch):
    """bench/bench_llamacpp.py died with ModuleNotFoundError for `gguf`: without it, llama.cpp's side is skipped
    in one line that says how to install it (the benchmark's own Skip, which it prints and goes on)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    # as if not installed: its import raises ImportError
    monkeypatch.setitem(sys.modules, "gguf", None)
    import bench_llamacpp

    with pytest.raises(
        bench_llamacpp.Skip, match=r"gguf package is not installed \(pip install gguf\)"
    ):
        bench_llamacpp.write_gguf(None, tmp_path / "x.gguf", "F32")


# -- rule 11: every remaining unclear message ------------------------------------------------------------


@pytest.mark.parametrize(
    "text, line",
    [
        (
            'index\tquestion\tanswer\timage\n1\t"torn q\tA\tiVBORw0KGgo\n2\tq2\tB\timg2\n',
            "cannot read TSV: unexpected end of data (a quoted cell of line 2 never closes: is the file cut "
            "short?)",
        ),
        (
            "index\tquestion\tanswer\timage\n1\tq\tA\n2\tq2\tB\n",
            "no row has an image (VLMEvalKit leaves such rows out); 2 row(s) have fewer cells than the "
            "header's 4, the first on line 2 (3): is the file cut short, or a tab missing?",
        ),
    ],
    ids=["torn quote", "short rows"],
)
def test_a_torn_or_short_tsv_says_where(tmp_path, text, line):
    """A torn quote swallowed the rest of the file into one cell, and short rows lost their image: both said only
    "no row has an image". Each now names the line and what is wrong with it."""
    from evaluation.tsv import DataError, read_tsv

    path = tmp_path / "B.tsv"
    path.write_text(text)
    with pytest.raises(DataError) as e:
        read_tsv(path)
    assert str(e.value) == f"{path}: {line}"


def test_a_plot_of_one_step_without_lr_groups_says_nothing_raw(tmp_path):
    """A one-step run whose line carries no lr groups got matplotlib's own warning ("No artists with labels found
    to put in legend") on its plot: the legend is drawn only of what is drawn, and the plot warns nothing."""
    import warnings

    pytest.importorskip("matplotlib")
    from training.metrics import plot_run

    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 0.001}\n'
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_run(tmp_path).is_file()


class BufferedOnAFullDisk(io.StringIO):
    """A buffered file on a full disk: a write lands in the buffer, every flush fails (ENOSPC, no file name, as
    the kernel's), and so does the close, which flushes what is left."""

    def flush(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self):
        self.flush()


def test_a_full_disk_at_the_close_of_batch_answers_names_the_file(
    model_dir, tmp_path, capsys, monkeypatch
):
    """`generate.py --batch --out` on a full disk: the flush's error named the file, but the close in the finally
    flushed again and its error, with no file name, replaced it. The close is named as the writes are."""
    from inference import questions

    batch = tmp_path / "q.jsonl"
    batch.write_text('{"question": "Hi"}\n')
    out = tmp_path / "answers.jsonl"
    monkeypatch.setattr(questions, "open", lambda *a, **k: BufferedOnAFullDisk(), raising=False)
    argv = ["--batch", batch, "--out", out, "--model", model_dir, "--max-new-tokens", 2]
    code, err = run_main(capsys, generate.main, argv)
    assert code == 1 and err[-1] == f"error: {out}: no space left on the device", err


def test_a_dcp_failure_is_its_cause_without_a_traceback():
    """A DCP save failure that is no OSError was printed as DCP's own text, every rank's traceback folded into
    the line: it is the first rank's failure, named by its type, on one line."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from shell.files import os_cause

    e = CheckpointException(
        "save", {0: (RuntimeError("file write failed"), traceback.extract_stack())}
    )
    assert os_cause(e) == "RuntimeError: file write failed"


def test_no_unit_is_kept_after_a_swallowed_signal(tmp_path):
    """Rule 2 at every writer: a unit file (router.py label's chunks) made after a signal whose Interrupted was
    swallowed is not kept; the shell's interrupt is raised instead."""
    from shell.cli import Interrupted, interruptible
    from shell.shards import FileParts

    (tmp_path / "chunks").mkdir()
    parts = FileParts(tmp_path / "chunks", "chunk_{:06d}.safetensors")
    with interruptible() as signals:
        signals.received.append(signal.SIGINT)  # as on_signal records one whose raise was swallowed
        signals.armed = False
        with pytest.raises(Interrupted):
            parts.keep(0, lambda path: Path(path).write_text("made after the signal"))
    assert not parts.done(0) and not list(tmp_path.rglob("*.tmp"))
