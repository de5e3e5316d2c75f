"""study.py, the paper's study as one script: end to end on the tiny checkpoint (every table and figure it
promises, made from these runs; resumable piece by piece) and `--plan` (every piece's command line, locally
under torchrun and through slurm/parvl.sbatch, nothing run)."""
import contextlib
import importlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch

import study
from conftest import COMMON, ROOT, png_b64, write_dataset, write_tsv
from processor import Tokenizer


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
