"""The study at cluster scale: a kept step's export (`train.py export`), experiment trackers
(`--tracker`), the Slurm launch (slurm/) and the study recipe as one script (study.py)."""
import contextlib
import importlib
import io
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import generate
import runs
import study
import train
from conftest import COMMON, event_scalars, expected_scalars, fake_slurm, sbatch, slurm_log, train_here
from processor import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def answer(capsys, model: Path, png: Path) -> str:
    """generate.py's greedy answer (its default) from a model folder, as a user runs it."""
    capsys.readouterr()
    assert generate.main([str(png), "Hi?", "--model", str(model), "--max-new-tokens", "6", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["answer"]


@pytest.fixture(scope="module")
def run3(model_dir, meta, tmp_path_factory):
    """A 2:2 run of 3 steps saving every step and keeping the last 2, logged to TensorBoard; the model it
    held in memory after step 2 is exported by the run itself (the end-of-run export's function, through a
    patched save) into a folder beside it."""
    root = tmp_path_factory.mktemp("run3")
    out, at_two = root / "run", root / "in_memory_step_2"
    save = train.save_checkpoint

    def save_and_export(model, optim, sched, step, *args):
        save(model, optim, sched, step, *args)
        if step == 2:
            runs.export(model, at_two, Path(model_dir))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "save_checkpoint", save_and_export)
        train_here("--model", model_dir, "--data", meta, "--pv", "2", "--pl", "2", "--max-steps", "3", "--save-every",
                   "1", "--keep-last", "2", "--tracker", "tensorboard", "--out", out, *COMMON)
    return out, at_two


def test_export_of_a_kept_step(run3, model_dir, tmp_path, capsys):
    """`train.py export RUN --step N`: step 2 gives the weights the run held in memory after step 2, step 3
    the run's own end-of-run export, in the same layout; generate.py answers alike from each pair. Step 1
    (no longer kept) and a step whose shard lost its tail are refused in one line, nothing written."""
    out, at_two = run3
    assert train.main(["export", str(out), "--step", "2", "--out", str(tmp_path / "two")]) == 0
    assert train.main(["export", str(out), "--step", "3"]) == 0
    for got, want in ((tmp_path / "two", at_two), (out / "export_step_3", out / "export")):
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
        a, b = load_file(str(got / "model.safetensors")), load_file(str(want / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert json.loads((got / "config.json").read_text()) == json.loads((want / "config.json").read_text())
    first = load_file(str(model_dir / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "model.safetensors"))
    three = load_file(str(out / "export" / "model.safetensors"))
    trained = [k for k in first if k in two and not torch.equal(first[k], two[k])]
    assert trained and all(not torch.equal(two[k], three[k]) for k in trained)  # step 2 is its own model
    png = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8)).save(png)
    assert answer(capsys, tmp_path / "two", png) == answer(capsys, at_two, png)
    assert answer(capsys, out / "export_step_3", png) == answer(capsys, out / "export", png)

    shutil.copytree(out / "checkpoints", tmp_path / "run" / "checkpoints")  # a copy to break
    ckpts = tmp_path / "run" / "checkpoints"
    assert train.main(["export", str(tmp_path / "run"), "--step", "1"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {ckpts / 'step_1'}: no such checkpoint (kept: step_2, step_3); a run keeps its newest --keep-last "
        f"saves, see docs/training.md to keep a step"]
    shard = next(p for p in (ckpts / "step_2").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-8])
    size = shard.stat().st_size
    assert train.main(["export", str(tmp_path / "run"), "--step", "2"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {ckpts / 'step_2'}: does not verify ({shard.name} is {size} bytes, the save wrote {size + 8})"]
    assert not (tmp_path / "run" / "export_step_2").exists()


# -- trackers ---------------------------------------------------------------------------------------


def test_tensorboard_curves_equal_metrics_and_continue_on_resume(run3, model_dir, meta, tmp_path):
    """--tracker tensorboard: the events read back by TensorBoard equal metrics.jsonl, every number at
    its step. The run is then cut back to its step-2 checkpoint (step 3's events were logged already)
    and resumed into the same folder: the curves hold steps 1, 2, 3 once each, step 3 being the resumed
    run's (its timing differs), in the same OUT/tensorboard."""
    pytest.importorskip("tensorboard")
    out = run3[0]
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    want = expected_scalars(logged)
    assert {"loss", "grad_norm", "lr/branches", "lr/pretrained", "tokens_per_s", "eta_s"} <= want.keys()
    assert event_scalars(out / "tensorboard") == want

    cut = tmp_path / "cut"
    shutil.copytree(out, cut, ignore=shutil.ignore_patterns("step_3", "export*"))
    train_here("--model", model_dir, "--data", meta, "--pv", "2", "--pl", "2", "--max-steps", "3", "--save-every",
               "1", "--keep-last", "2", "--tracker", "tensorboard", "--out", cut, "--resume", *COMMON)
    resumed = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert resumed[:2] == logged[:2] and resumed[2]["loss"] == logged[2]["loss"]
    assert resumed[2]["tokens_per_s"] != logged[2]["tokens_per_s"]  # the resumed step is told apart
    files = sorted((cut / "tensorboard").iterdir())
    assert len(files) == 2 and event_scalars(files[0])["loss"] == want["loss"]  # the first run's step 3 is there
    assert event_scalars(cut / "tensorboard") == expected_scalars(resumed)


def test_a_missing_tracker_package_is_one_line(model_dir, meta, tmp_path, monkeypatch, capsys):
    """--tracker with its package absent: one line naming the package and how to get it, exit 1, before
    anything is written into --out."""
    for name in ("tensorboard", "torch.utils.tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of it raises ImportError
    for kind in ("tensorboard", "wandb"):
        res = train_here("--model", model_dir, "--data", meta, "--max-steps", "1", "--tracker", kind, "--out",
                         tmp_path / kind, *COMMON, check=False)
        assert (res.returncode, res.stderr.strip().splitlines()) == (
            1, [f"error: --tracker {kind}: the {kind} package is not installed (pip install {kind})"])
        assert not (tmp_path / kind).exists()


def wandb_history(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series an offline W&B run logged, read from its run-ID.wandb file: W&B's record log
    (":W&B", its magic and version in 7 bytes, then LevelDB log records in 32 KiB blocks: crc32, length,
    type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4, data), each a wandb_internal Record; the history records
    hold the logged values as JSON at their step. W&B's own keys (_step, _runtime, ...) are left out."""
    from wandb.proto import wandb_internal_pb2

    [path] = run.glob("run-*.wandb")
    data, pos, frag, history = path.read_bytes(), 7, b"", {}
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        frag, pos = frag + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(frag)
            frag = b""
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    name = item.key or "/".join(item.nested_key)
                    if not name.startswith("_"):
                        history.setdefault(name, []).append((record.history.step.num, json.loads(item.value_json)))
    return history


def test_wandb_offline_run_holds_the_metrics(model_dir, meta, tmp_path, monkeypatch):
    """--tracker wandb under WANDB_MODE=offline (no network): the offline run is OUT/wandb's, under the id
    kept in OUT/wandb_id, and the history it logged, read back from W&B's own file, equals metrics.jsonl,
    every number at its step; a resume continues the same run id."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = ["--model", model_dir, "--data", meta, "--tracker", "wandb", "--out", out, "--save-every", "1", *COMMON]
    train_here(*args, "--max-steps", "2")
    run_id = (out / "wandb_id").read_text()
    [run] = (out / "wandb").glob(f"offline-run-*-{run_id}")
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2]
    want = expected_scalars(logged, dtype=float)  # W&B keeps the float64 JSON numbers
    assert {"loss", "grad_norm", "lr/pretrained", "tokens_per_s"} <= want.keys() and wandb_history(run) == want
    train_here(*args, "--max-steps", "3", "--resume")  # one step more, into the same W&B run id
    assert (out / "wandb_id").read_text() == run_id
    assert len(list((out / "wandb").glob(f"offline-run-*-{run_id}"))) == 2


# -- Slurm ------------------------------------------------------------------------------------------


def torchrun_line(env: dict, args: list) -> list[str]:
    """What srun must be given on a 2-node allocation: one task per node, each the torchrun of the
    multi-node form of docs/training.md with the rendezvous of Slurm's environment (first node, job id)."""
    return ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", sys.executable, "-m",
            "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{env['RDZV_PORT']}", "--rdzv-id", "4242", *map(str, args)]


def test_sbatch_expands_to_one_torchrun_per_node(tmp_path):
    """slurm/parvl.sbatch under a faked 2-node Slurm job (srun only writes down what it is given): the
    rendezvous host is the first node scontrol lists, the id the job's. A requeued job's restart
    (SLURM_RESTART_COUNT 1) resumes train.py (--overwrite, which would discard the run, dropped) and
    reruns `evaluate.py run` / `router.py label` as they are: they keep their finished parts."""
    train_args = ["train.py", "--model", "m", "--data", "meta.json", "--out", "/shared/runs/22", "--overwrite"]
    evaluate = ["evaluate.py", "run", "--benchmark", "MMStar", "--data", "MMStar.tsv", "--model", "m", "--out", "p"]
    label = ["router.py", "label", "--model", "m", "--data", "meta.json", "--out", "/shared/labels"]
    cases = [(train_args, 0, train_args), (train_args, 1, [*train_args[:-1], "--resume"]), (evaluate, 1, evaluate),
             (label, 0, label), (label, 2, label)]
    for args, restarts, want in cases:
        env = fake_slurm(tmp_path / f"{args[0]}{restarts}", SLURM_RESTART_COUNT=restarts, FAKE_SRUN_SLEEP=0)
        res = sbatch(args, env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert slurm_log(env) == [["scontrol", "show", "hostnames", "127.0.0.1,127.0.0.1"], torchrun_line(env, want)]
    res = sbatch([], fake_slurm(tmp_path / "none"), timeout=60)
    assert (res.returncode, res.stderr) == (2, "usage: sbatch [--nodes N] slurm/parvl.sbatch SCRIPT.py [FLAGS...]\n")


def test_sbatch_requeues_near_the_time_limit(tmp_path):
    """Slurm's warning signal (#SBATCH --signal=B:USR1@300) makes the script requeue its own job, and it
    then waits for srun to end (Slurm stops the steps) and exits with srun's code."""
    env = fake_slurm(tmp_path, FAKE_SRUN_SLEEP=3)
    proc = subprocess.Popen(["bash", str(ROOT / "slurm" / "parvl.sbatch"), "train.py", "--out", "r"], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(slurm_log(env)) < 2 and time.monotonic() < deadline:  # srun has started: the trap is set
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert slurm_log(env)[2:] == [["scontrol", "requeue", "4242"]]
    assert "parvl.sbatch: time limit near, requeueing job 4242" in err.splitlines()


# -- the study as one script ------------------------------------------------------------------------


def in_process(cmd: list[str], stdout: Path | None) -> int:
    """study.execute for the test: the command's main in this process (a new interpreter per piece would
    cost 3.6 s of imports each), one thread, its stdout into `stdout` when it succeeds."""
    assert cmd[0] == sys.executable, cmd  # --nproc-per-node 1, local: plain python, SCRIPT.py, flags
    module = importlib.import_module(Path(cmd[1]).stem)
    out, threads = io.StringIO(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out):
            try:
                code = module.main(cmd[2:])
            except SystemExit as e:
                code = e.code
    finally:
        torch.set_num_threads(threads)
    if stdout is not None and code == 0:
        stdout.parent.mkdir(parents=True, exist_ok=True)
        stdout.write_text(out.getvalue())
    return code


def benchmark_tsvs(folder: Path) -> Path:
    """Two benchmarks of three rows: MMMU (options) and ChartQA (open answers)."""
    from conftest import png_b64, write_tsv

    folder.mkdir(parents=True)
    imgs = [png_b64(24, 24, k) for k in range(3)]
    write_tsv(folder / "MMMU_DEV_VAL.tsv", [
        {"index": str(k), "question": q, "A": "cat", "B": "dog", "answer": "AB"[k % 2], "split": "validation",
         "explanation": "It looks like one.", "image": imgs[k]}
        for k, q in enumerate(("What is shown?", "Which animal?", "Pick one."))])
    write_tsv(folder / "ChartQA_TEST.tsv", [
        {"index": str(10 + k), "question": q, "answer": a, "image": imgs[k]}
        for k, (q, a) in enumerate((("How many bars?", "3"), ("Highest value?", "12"), ("Title?", "Sales")))])
    return folder


def test_study_end_to_end_on_the_tiny_checkpoint(model_dir, meta, tmp_path, monkeypatch, capsys):
    """study.py with two allocations (1:1, 2:2), one ablation (2:2 with mean aggregation), two benchmarks
    and a short router on step 1 of the 2:2 run: every table and figure it promises is there and made
    from these runs (the report's scores are the score files', Table S2's best and Figure 4's points the
    report's and the profiles'); a second call finds every piece done, and a lost score file brings back
    that piece and the tables after it, nothing else."""
    from conftest import write_dataset

    monkeypatch.setattr(study, "execute", in_process)
    tsv, out = benchmark_tsvs(tmp_path / "tsv"), tmp_path / "study"
    router_meta = write_dataset(tmp_path / "router_data", rows=4)
    argv = ["--model", str(model_dir), "--data", str(meta), "--tsv", str(tsv), "--out", str(out),
            "--allocations", "1:1", "2:2", "--benchmarks", "MMMU_DEV_VAL", "ChartQA_TEST", "--ablations", "mean",
            "--ablation-base", "2:2", "--router-allocation", "2:2", "--router-step", "1", "--router-data",
            str(router_meta), "--router-eval-data", str(router_meta), "--lengths", "1:1", "2:2", "--arch", "tiny",
            "--cost-column", "MMMU_DEV_VAL", "--nproc-per-node", "1",
            "--train-flags", " ".join([*COMMON, "--max-steps", "2", "--save-every", "1", "--keep-last", "2"]),
            "--eval-flags", "--max-new-tokens 4 --batch-size 4",
            "--label-flags", "--num-workers 0 --max-tiles 2 --batch-size 2",
            "--router-flags", "--steps 3 --global-batch 2 --log-every 1 --check-samples 0",
            "--profile-flags", "--batch 1 --iters 1 --warmup 0 --new-tokens 2 --tiles 1 --text-tokens 8"]
    assert study.main(argv) == 0, capsys.readouterr().err[-3000:]

    read = lambda path: json.loads((out / path).read_text())  # noqa: E731
    encode = Tokenizer.from_pretrained(model_dir).encode
    benches = ["MMMU_DEV_VAL", "ChartQA_TEST"]

    def mean_tokens(run: str, bench: str) -> float:  # a run's answers re-tokenised, by hand
        rows = [json.loads(x) for x in (out / "pred" / run / f"{bench}.jsonl").read_text().splitlines()]
        assert len(rows) == 3
        return float(np.mean([len(encode(r["prediction"])) for r in rows]))

    # the report: every run a row of its own, each score the score file's, from the run's own model
    report = read("report/report.json")
    configs = {c["label"]: c for c in report["configs"]}
    runs_of = {"1:1": "1x1", "2:2": "2x2", "2:2 aggregation=mean": "2x2_mean", **{
        f"2:2 pair ({v},{lb})": f"2x2_pair{v}{lb}" for v in (0, 1) for lb in (0, 1)}}
    assert configs.keys() == runs_of.keys()
    for label, run in runs_of.items():
        for b in benches:
            score = read(f"score/{run}/{b}.json")
            assert (score["n"], score["model_fingerprint"]) == (3, configs[label]["model"])
            assert configs[label]["scores"][b] == score["score"]
    step_one = configs["2:2 pair (0,0)"]["model"]  # the pairs, the router and the random pair: step 1's model
    assert step_one != configs["2:2"]["model"] and {read(f"score/2x2_{r}/{b}.json")["model_fingerprint"]
                                                    for r in ("router", "random") for b in benches} == {step_one}
    assert {row["label"].split(" /")[0] for row in report["table3"]} == {"2:2 dense", "2:2 random pair (seed 42)",
                                                                          "2:2 router"}
    assert report["pairs"]["MMMU_DEV_VAL"]["v"] == [0, 1] and report["pairs"]["MMMU_DEV_VAL"]["l"] == [0, 1]
    assert (out / "report" / "report.md").is_file()
    assert {"router", "random pair", "oracle", "dense"} <= read("router/gates/eval.json")["rows"].keys()
    # Table S5: 1:1 against 2:2, each mean the re-tokenised answers' of its run
    s5 = read("tables/S5.json")["table"]
    for b in benches:
        assert (s5[b]["a"], s5[b]["b"], s5[b]["n_paired"]) == (mean_tokens("1x1", b), mean_tokens("2x2", b), 3)
    # Table S2: the TSVs' rows, the report's best, that run's mean answer length
    s2 = read("tables/S2.json")["benchmarks"]
    for b in benches:
        best = report["best"][b]
        assert (s2[b]["rows"], s2[b]["best"]) == (3, best)
        assert s2[b]["response_tokens"] == mean_tokens(runs_of[best], b)
    # Figure 4: each trained run at its report score and its own profile's batch-1 latency
    points = {p["label"]: p for p in read("tables/figure4/score_cost.json")["points"]}
    assert points.keys() == {"1:1", "2:2", "2:2 aggregation=mean"}
    for label, p in points.items():
        row = next(r for r in read(f"profile/{runs_of[label]}.json")["rows"] if r["batch"] == 1)
        assert (p["score"], p["latency_s"]) == (configs[label]["scores"]["MMMU_DEV_VAL"], row["latency_s"])
    assert (out / "tables" / "figure4" / "score_cost.png").stat().st_size > 0
    assert "| 2:2 aggregation=mean |" in (out / "tables" / "figure4.md").read_text()
    assert (out / "tables" / "table4.md").read_text().strip()

    # resumable piece by piece: all done; a lost score brings back its run, its score and the tables only
    ran = []
    monkeypatch.setattr(study, "execute", lambda cmd, stdout: ran.append(" ".join(cmd[2:4])) or in_process(cmd, stdout))
    assert study.main(argv) == 0 and ran == []
    (out / "score" / "1x1" / "ChartQA_TEST.json").unlink()
    capsys.readouterr()
    assert study.main([*argv, "--plan"]) == 0
    planned = [x for x in capsys.readouterr().out.splitlines() if ": would run " in x]
    assert [x.split("] ")[1].split(":")[0] for x in planned] == [
        "run 1x1 ChartQA_TEST", "score 1x1 ChartQA_TEST", "report", "Table S5", "Table S2", "Figure 4"]
    assert study.main(argv) == 0
    assert ran == ["run --benchmark", "score --benchmark", "report " + str(out / "score" / "1x1" / "ChartQA_TEST.json"),
                   "lengths --model", "descriptors " + str(tsv / "MMMU_DEV_VAL.tsv"), "cost --report"]


def test_study_plan_prints_the_command_lines(tmp_path, capsys):
    """`study.py --plan` (as a user runs it) with the defaults: every piece of the paper's study, 591 of
    them (13 runs: 9 allocations and 4 ablations; 9 benchmarks run and scored for each, for each of the
    16 fixed pairs of 4:4, its random pair and its router: 2 x 9 x 31 = 558; label and train the router;
    13 profiles and Tables 4 / S7; the report, S5, S2, Figure 4), nothing run; locally under torchrun,
    through slurm/parvl.sbatch with --launcher slurm."""
    out = tmp_path / "s"
    base = ["--model", "M", "--data", "d.json", "--tsv", "T", "--out", str(out), "--plan"]
    plans = []
    for argv in (base, [*base, "--launcher", "slurm", "--nodes", "4"]):
        assert study.main(argv) == 0
        plans.append(capsys.readouterr().out.splitlines())
        assert len(plans[-1]) == 591 and plans[-1][-1].startswith("[591/591] Figure 4: would run")
    flags = f"--pv 2 --pl 4 --model M --data d.json --out {out / 'runs' / '2x4'}"
    assert plans[0][5] == (f"[6/591] train 2x4: would run {sys.executable} -m torch.distributed.run --standalone "
                           f"--nproc-per-node 8 {ROOT / 'train.py'} {flags}")
    assert plans[1][5] == (f"[6/591] train 2x4: would run sbatch --wait --nodes=4 --gpus-per-node=8 "
                           f"--export=ALL,NPROC_PER_NODE=8 {ROOT / 'slurm' / 'parvl.sbatch'} {ROOT / 'train.py'} "
                           f"{flags}")
    assert not out.exists()
