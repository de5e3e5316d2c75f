"""More than one machine: train.py and `evaluate.py run` as 2 nodes x 1 process against one process (a Slurm
job through slurm/parvl.sbatch under a faked srun and scontrol, conftest.fake_slurm; or two torchrun
launchers, conftest.two_nodes), a node that cannot see the run folder, and the sbatch script itself (one
torchrun per node, a requeue near the time limit). The router's labels on two nodes: test_router.py."""

import json
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cluster_fakes import fake_slurm, sbatch, slurm_log, two_nodes
from commands import COMMON, ROOT, metrics, train_here
from conftest import BENCH_NEW
from PIL import Image
from safetensors.torch import load_file

import generate
from data.processor import Tokenizer, build_prompt, load_image
from inference.engine import Engine, GenerateConfig
from loading.pretrained import load_pretrained

# -- train.py ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_node_runs(model_dir, meta, tmp_path_factory):
    """One 2:2 training of 3 steps whose vision branches are LoRA ones (Figure 3), run twice: in one process,
    and as 2 nodes x 1 process started as a Slurm job (slurm/parvl.sbatch under conftest.fake_slurm: srun
    starts one torchrun per node on 127.0.0.1, the rendezvous at the first node under the job id), with
    activation checkpointing on. The tests below read the two runs; they are made once per module."""
    root = tmp_path_factory.mktemp("two_nodes")
    args = [
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
        "--vision-branches",
        "lora",
        "--lora-rank",
        "2",
        "--lora-dropout",  # its masks are drawn per rank: 2 ranks equal 1 process without it only
        "0",
        *COMMON,
    ]
    train_here(*args, "--out", root / "one")
    command = [ROOT / "train.py", *args, "--out", root / "two", "--activation-checkpointing"]
    env = fake_slurm(root / "slurm")
    job = sbatch(command, env)
    assert job.returncode == 0, job.stderr[-3000:]
    return SimpleNamespace(one=root / "one", two=root / "two", command=command, log=slurm_log(env))


@pytest.mark.slow
def test_two_nodes_start_as_one_srun_of_the_whole_command(two_node_runs):
    """sbatch hands srun the command whole, over --nodes=2: one torchrun per node."""
    command = two_node_runs.command
    srun = two_node_runs.log[1]  # srun's one call: torchrun on each node, the command whole
    assert srun[:2] == ["srun", "--nodes=2"] and srun[-len(command) :] == list(map(str, command))


@pytest.mark.slow
def test_two_nodes_losses_equal_one_process(two_node_runs):
    """The same loss and gradient norm at every step, to fp32 reduction-order noise."""
    one, two = metrics(two_node_runs.one), metrics(two_node_runs.two)
    # fp32 on CPU; the two runs differ only in the order of reductions (gradients summed over 2 ranks)
    # and in recomputing activations (activation checkpointing on for the 2-rank run)
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-4
        )


@pytest.mark.slow
def test_two_nodes_export_equals_one_process(two_node_runs):
    """The exports hold the same tensors, equal to fp32 reduction-order noise: the LoRA updates, sharded by
    FSDP2 like every tensor, included."""
    a, b = (
        load_file(str(run / "export" / "model.safetensors"))
        for run in (two_node_runs.one, two_node_runs.two)
    )
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


@pytest.mark.slow
def test_lora_vision_branches_replace_the_prefixes_and_train(two_node_runs):
    """LoRA vision branches are updates in place of the vision prefixes, and every update is trained away
    from its zero start (B starts at zero)."""
    a = load_file(str(two_node_runs.one / "export" / "model.safetensors"))
    ups = [k for k in a if k.endswith(".lora_B")]
    # LoRA in place of prefixes
    assert ups and not any(k.endswith(".prefix_k") and k.startswith("vision") for k in a)
    assert all(a[k].abs().max() > 0 for k in ups)  # every update trained away from its zero start


@pytest.mark.slow
def test_the_export_config_keeps_the_lora_branches(two_node_runs):
    model = load_pretrained(two_node_runs.one / "export")
    assert (model.cfg.par.vision_branches, model.cfg.par.lora_rank) == ("lora", 2)


@pytest.mark.slow
def test_generate_runs_the_lora_export(two_node_runs, tmp_path, capsys):
    """generate.py on the export answers what the engine answers on the model loaded from it."""
    export = two_node_runs.one / "export"
    model = load_pretrained(export)
    png = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8)).save(
        png
    )
    assert (
        generate.main([str(png), "Hi?", "--model", str(export), "--max-new-tokens", "4", "--json"])
        == 0
    )
    tok, pv = Tokenizer.from_pretrained(export), load_image(png, max_tiles=12)
    ids = tok.encode(
        build_prompt("<image>\nHi?", [pv.shape[0]], tokens_per_tile=model.cfg.tokens_per_tile)
    )
    want = (
        Engine(model).generate([ids], pv, GenerateConfig(max_new_tokens=4), tok.eos_ids).tokens[0]
    )
    assert json.loads(capsys.readouterr().out)["answer"] == tok.answer(want)


def test_a_node_that_cannot_see_the_run_folder_is_refused(model_dir, meta, tmp_path):
    """Node 1 writes into another folder than node 0 (as a node-local disk would): one line naming the
    rank and host that cannot see --out, before anything is written there."""
    args = ["--model", model_dir, "--data", meta, "--max-steps", "1", *COMMON]
    codes, err = two_nodes(
        [ROOT / "train.py", *args], (["--out", tmp_path / "a"], ["--out", tmp_path / "b"])
    )
    assert codes == [1, 1], err[-3000:]
    want = (
        f"error: --out {tmp_path / 'a'}: rank 1 on {socket.gethostname()} cannot see this folder, which rank 0 "
        f"(on {socket.gethostname()}) writes; on more than one machine it must be on a file system every node "
        f'shares (docs/training.md, "More than one machine")'
    )
    assert [x for x in err.splitlines() if x.startswith("error:")] == [want], err[-3000:]
    assert not (tmp_path / "a" / "config.json").exists() and not list((tmp_path / "b").iterdir())


# -- evaluate.py run -----------------------------------------------------------------------------------


def test_evaluate_run_on_two_nodes_equals_one_process(bench, full_run, tmp_path):
    """2 nodes x 1 process (conftest.two_nodes, docs/training.md's multi-node torchrun on 127.0.0.1): the
    merged predictions are the one process's, byte for byte."""
    folder, tsv, _, _ = bench
    out = tmp_path / "pred.jsonl"
    codes, err = two_nodes(
        [
            ROOT / "evaluate.py",
            "run",
            "--benchmark",
            "MMMU_DEV_VAL",
            "--data",
            tsv,
            "--model",
            folder,
            "--out",
            out,
            "--batch-size",
            2,
            "--max-new-tokens",
            BENCH_NEW,
        ]
    )
    assert codes == [0, 0], err[-3000:]
    assert out.read_text() == full_run.read_text()
    # rows 10, 12, 14 on rank 0; 11 and the corrupt 13 on rank 1 (rows are read in a stream: 13 is counted, then
    # skipped when its image is read)
    assert "rank 0: 3/3 rows" in err and "rank 1: 1/2 rows" in err
    assert not list(tmp_path.glob("*.part*"))


# -- slurm/parvl.sbatch --------------------------------------------------------------------------------


def torchrun_line(env: dict, args: list) -> list[str]:
    """What srun must be given on a 2-node allocation: one task per node, each the torchrun of the
    multi-node form of docs/training.md with the rendezvous of Slurm's environment (first node, job id)."""
    return [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{env['RDZV_PORT']}",
        "--rdzv-id",
        "4242",
        *map(str, args),
    ]


def test_sbatch_expands_to_one_torchrun_per_node(tmp_path):
    """slurm/parvl.sbatch under a faked 2-node Slurm job (srun only writes down what it is given): the
    rendezvous host is the first node scontrol lists, the id the job's. A requeued job's restart
    (SLURM_RESTART_COUNT 1) resumes train.py (--overwrite, which would discard the run, dropped) and
    reruns `evaluate.py run` / `router.py label` as they are: they keep their finished parts."""
    train_args = [
        "train.py",
        "--model",
        "m",
        "--data",
        "meta.json",
        "--out",
        "/shared/runs/22",
        "--overwrite",
    ]
    evaluate = [
        "evaluate.py",
        "run",
        "--benchmark",
        "MMStar",
        "--data",
        "MMStar.tsv",
        "--model",
        "m",
        "--out",
        "p",
    ]
    label = ["router.py", "label", "--model", "m", "--data", "meta.json", "--out", "/shared/labels"]
    cases = [
        (train_args, 0, train_args),
        (train_args, 1, [*train_args[:-1], "--resume"]),
        (evaluate, 1, evaluate),
        (label, 0, label),
        (label, 2, label),
    ]
    for args, restarts, want in cases:
        env = fake_slurm(
            tmp_path / f"{args[0]}{restarts}", SLURM_RESTART_COUNT=restarts, FAKE_SRUN_SLEEP=0
        )
        res = sbatch(args, env, timeout=60)
        assert res.returncode == 0, res.stderr
        assert slurm_log(env) == [
            ["scontrol", "show", "hostnames", "127.0.0.1,127.0.0.1"],
            torchrun_line(env, want),
        ]
    res = sbatch([], fake_slurm(tmp_path / "none"), timeout=60)
    assert (res.returncode, res.stderr) == (
        2,
        "usage: sbatch [--nodes N] slurm/parvl.sbatch SCRIPT.py [FLAGS...]\n",
    )


def test_sbatch_requeues_near_the_time_limit(tmp_path):
    """Slurm's warning signal (#SBATCH --signal=B:USR1@300) makes the script requeue its own job, and it
    then waits for srun to end (Slurm stops the steps) and exits with srun's code."""
    env = fake_slurm(tmp_path, FAKE_SRUN_SLEEP=3)
    proc = subprocess.Popen(
        ["bash", str(ROOT / "slurm" / "parvl.sbatch"), "train.py", "--out", "r"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    # srun has started: the trap is set
    while len(slurm_log(env)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert slurm_log(env)[2:] == [["scontrol", "requeue", "4242"]]
    assert "parvl.sbatch: time limit near, requeueing job 4242" in err.splitlines()
