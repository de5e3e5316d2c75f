"""slurm/parvl.sbatch against what a real Slurm cluster gives it (issue 38): the processes and CPUs per node
taken from the allocation, the time limit against the requeue warning, and every setting checked before use.
Each test runs the script under conftest.fake_slurm, whose srun writes down its arguments and environment and
ends at once (FAKE_SRUN_SLEEP 0), so nothing trains; one test starts a real 2-process torchrun."""

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cluster_fakes import fake_slurm, sbatch, slurm_log

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "slurm" / "parvl.sbatch"
# what the script reads to count a node's GPUs; the test's own environment may hold any of them
GPU_VARS = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")


def job_env(folder: Path, drop=(), **env) -> dict:
    """fake_slurm's 2-node job with no GPU variable, less `drop`, plus `env`; srun ends at once and writes its
    environment into folder / srun_env.json."""
    full = fake_slurm(folder, FAKE_SRUN_SLEEP=0, FAKE_SRUN_ENV=folder / "srun_env.json")
    for name in (*GPU_VARS, *drop):
        full.pop(name, None)
    return {**full, **{k: str(v) for k, v in env.items()}}


def run_job(
    folder: Path, drop=(), **env
) -> tuple[subprocess.CompletedProcess, list[str] | None, dict | None]:
    """The script on `train.py --out r` in job_env: its result, srun's arguments and environment (None: not run)."""
    env = job_env(folder, drop, **env)
    res = sbatch(["train.py", "--out", "r"], env, timeout=60)
    sruns = [call for call in slurm_log(env) if call[0] == "srun"]
    srun_env = folder / "srun_env.json"
    return (
        res,
        sruns[0] if sruns else None,
        json.loads(srun_env.read_text()) if srun_env.exists() else None,
    )


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def ids(cases) -> list[str]:
    """A case's name: its variables, as NAME=VALUE,..."""
    return [",".join(f"{k}={v}" for k, v in c[0].items()) for c in cases]


# -- item 17: processes per node from the allocation ----------------------------------------------------------

NO_GPU = "no GPU on the node (none of SLURM_GPUS_ON_NODE, SLURM_GPUS_PER_NODE, SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES)"
NPROC = [
    ({"SLURM_GPUS_ON_NODE": 4}, 4, "one per GPU Slurm gave the node (SLURM_GPUS_ON_NODE=4)"),
    (
        {"SLURM_GPUS_PER_NODE": "h100:2"},
        2,
        "one per GPU Slurm gave the node (SLURM_GPUS_PER_NODE=h100:2)",
    ),
    (
        {"SLURM_GPUS_PER_NODE": "a100:2,v100:1"},
        3,
        "one per GPU Slurm gave the node (SLURM_GPUS_PER_NODE=a100:2,v100:1)",
    ),
    ({"SLURM_JOB_GPUS": "0,1,2"}, 3, "one per GPU Slurm gave the node (SLURM_JOB_GPUS=0,1,2)"),
    (
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        2,
        "one per GPU Slurm gave the node (CUDA_VISIBLE_DEVICES=0,1)",
    ),
    ({"SLURM_GPUS_ON_NODE": 8, "NPROC_PER_NODE": 2}, 2, "NPROC_PER_NODE=2"),
    (
        {"SLURM_GPUS_PER_NODE": 0},
        1,
        "no GPU on the node (SLURM_GPUS_PER_NODE=0): one per task Slurm gave it (SLURM_NTASKS_PER_NODE=1)",
    ),
    (
        {"CUDA_VISIBLE_DEVICES": "NoDevFiles", "SLURM_NTASKS_PER_NODE": 2},
        2,
        "no GPU on the node (CUDA_VISIBLE_DEVICES=NoDevFiles): one per task Slurm gave it (SLURM_NTASKS_PER_NODE=2)",
    ),
    (
        {"SLURM_NTASKS_PER_NODE": 3},
        3,
        f"{NO_GPU}: one per task Slurm gave it (SLURM_NTASKS_PER_NODE=3)",
    ),
    (
        {"SLURM_TASKS_PER_NODE": "4,2"},
        2,
        f"{NO_GPU}: one per task Slurm gave it (SLURM_TASKS_PER_NODE=4,2)",
    ),
]


@pytest.mark.parametrize("env, nproc, why", NPROC, ids=ids(NPROC))
def test_processes_per_node_come_from_the_allocation(tmp_path, env, nproc, why):
    """--nproc-per-node is the GPUs Slurm gave the node (whichever of its variables is set), else its tasks per
    node (never a fixed 8: f741ade gave a GPU-less job 8 processes), NPROC_PER_NODE above both; the log says
    which and why in one line."""
    drop = ["NPROC_PER_NODE"] + (["SLURM_NTASKS_PER_NODE"] if "SLURM_TASKS_PER_NODE" in env else [])
    res, srun, _ = run_job(tmp_path, drop, **env)
    assert res.returncode == 0, res.stderr
    assert flag(srun, "--nproc-per-node") == str(nproc)
    assert f"parvl.sbatch: --nproc-per-node {nproc}: {why}" in res.stderr.splitlines(), res.stderr


def test_the_defaults_ask_for_whole_nodes_and_no_gpus():
    """The #SBATCH defaults ask for no GPU (sbatch refuses a GPU request where there is no GPU gres: the user
    asks with --gpus-per-node or --gres) and for whole nodes (--exclusive: every CPU, whatever the node)."""
    lines = [x for x in SCRIPT.read_text().splitlines() if x.startswith("#SBATCH")]
    assert not [x for x in lines if re.search(r"--gpu|--gres|\s-G", x)], lines
    assert "#SBATCH --exclusive" in lines and not [x for x in lines if "--cpus-per-task" in x], (
        lines
    )


# -- item 18: the CPUs reach srun -----------------------------------------------------------------------------

CPUS = [
    (
        {"SLURM_JOB_CPUS_PER_NODE": "96(x2)"},
        96,
        "all the job has on its node with the fewest (SLURM_JOB_CPUS_PER_NODE=96(x2))",
    ),
    (
        {"SLURM_JOB_CPUS_PER_NODE": "128,64"},
        64,
        "all the job has on its node with the fewest (SLURM_JOB_CPUS_PER_NODE=128,64)",
    ),
    (
        {"SLURM_JOB_CPUS_PER_NODE": "128(x2)", "SLURM_CPUS_PER_TASK": 16},
        16,
        "the job's --cpus-per-task (SLURM_CPUS_PER_TASK=16)",
    ),
]


@pytest.mark.parametrize("env, cpus, why", CPUS, ids=ids(CPUS))
def test_srun_gets_the_cpus_of_the_node(tmp_path, env, cpus, why):
    """srun is given the CPUs for each node's torchrun (SRUN_CPUS_PER_TASK: Slurm 22.05's srun no longer reads
    SLURM_CPUS_PER_TASK, and a step given none pins every rank to one CPU): the job's --cpus-per-task, else all
    the CPUs it has on its smallest node; the log says which."""
    res, _, srun_env = run_job(tmp_path, **env)
    assert res.returncode == 0, res.stderr
    assert srun_env["SRUN_CPUS_PER_TASK"] == str(cpus)
    assert (
        f"parvl.sbatch: --cpus-per-task {cpus} (SRUN_CPUS_PER_TASK) for each node's torchrun: {why}"
        in res.stderr.splitlines()
    ), res.stderr


# -- item 19: a time limit within the requeue warning ---------------------------------------------------------

WITHIN = (
    "parvl.sbatch: the time limit {} is within the requeue warning ({}, sent up to {} s before the end): "
    "this job runs once, to its limit, and is not requeued at the warning"
)


@pytest.mark.parametrize(
    "limit, signal_env, within",
    [
        ("5:00", None, True),
        ("5:30", None, True),
        ("1:00", None, True),
        ("5:31", None, False),
        ("1:00:00", None, False),
        ("1-00:00:00", None, False),
        ("UNLIMITED", None, False),
        ("5:00", "B:USR1@60", False),
        ("1:30", "B:USR1@60", True),
        ("10:00", "B:SIGUSR1@600", True),
    ],
)
def test_a_time_limit_within_the_warning_is_said_at_the_start(tmp_path, limit, signal_env, within):
    """The job's time limit (squeue) against the warning's lead (#SBATCH --signal=B:USR1@300, or SBATCH_SIGNAL
    when submitted with it) plus Slurm's 30 s check: a limit within it is said in one line at the start (its
    warning would come at once, f741ade's requeue loop); a longer one, or none, says nothing."""
    env = {"FAKE_TIME_LIMIT": limit, **({"SBATCH_SIGNAL": signal_env} if signal_env else {})}
    res, srun, _ = run_job(tmp_path, **env)
    assert res.returncode == 0 and srun is not None, res.stderr
    sig = signal_env or "B:USR1@300"
    lead = int(sig.split("@")[1])
    said = [x for x in res.stderr.splitlines() if "within the requeue warning" in x]
    assert said == ([WITHIN.format(limit, sig, lead + 30)] if within else [])


def test_a_script_without_the_warning_has_none_to_fit(tmp_path):
    """A copy of the script without its #SBATCH --signal line (a user who wants no requeue at the time limit)
    runs under any limit and says nothing of a warning; a bad --signal line is one line, exit 2."""
    lines = SCRIPT.read_text().splitlines(keepends=True)
    for name, signal_line, code, err in [
        ("none", [], 0, []),
        (
            "bad",
            ["#SBATCH --signal=USR1@300\n"],
            2,
            [
                "parvl.sbatch: #SBATCH --signal='USR1@300': not B:USR1@SECONDS (the batch shell hears USR1 "
                "and requeues the job)"
            ],
        ),
    ]:
        copy = tmp_path / f"{name}.sbatch"
        copy.write_text(
            "".join(
                y
                for x in lines
                for y in (signal_line if x.startswith("#SBATCH --signal=") else [x])
            )
        )
        env = job_env(tmp_path / name, FAKE_TIME_LIMIT="1:00")
        res = subprocess.run(
            ["bash", str(copy), "train.py", "--out", "r"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == code, res.stderr
        assert [x for x in res.stderr.splitlines() if "warning" in x or "signal" in x] == err


def send_usr1(tmp_path: Path, limit: str) -> tuple[int, str, list[list[str]]]:
    """The script under a job of this time limit whose srun runs 3 s; USR1 (Slurm's warning) once srun has
    started. Its exit code, stderr and the Slurm calls it made."""
    env = fake_slurm(tmp_path, FAKE_SRUN_SLEEP=3, FAKE_TIME_LIMIT=limit)
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "train.py", "--out", "r"],
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
    return proc.returncode, err, slurm_log(env)


def test_the_warning_of_a_limit_within_it_does_not_requeue(tmp_path):
    """A 5-minute job under the default 300 s warning: the warning, which Slurm sends at the start, is ignored
    with one line (f741ade requeued it, and its restart was warned again, forever) and the job runs on to
    srun's end; with an hour's limit the same warning requeues the job."""
    code, err, calls = send_usr1(tmp_path / "short", "5:00")
    assert code == 0, err
    assert [c for c in calls if c[:2] == ["scontrol", "requeue"]] == []
    assert (
        "parvl.sbatch: time-limit warning ignored, job 4242 is not requeued (its limit is within the warning); "
        "it runs on until Slurm stops it at the limit"
    ) in err.splitlines()
    code, err, calls = send_usr1(tmp_path / "long", "1:00:00")
    assert code == 0 and calls[2:] == [["scontrol", "requeue", "4242"]], err


# -- item 20: every setting checked before use ----------------------------------------------------------------

BAD = [
    ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE='0': not a process count (1, 2, ...)"),
    ({"NPROC_PER_NODE": "abc"}, "NPROC_PER_NODE='abc': not a process count (1, 2, ...)"),
    ({"NPROC_PER_NODE": "08"}, "NPROC_PER_NODE='08': not a process count (1, 2, ...)"),
    ({"RDZV_PORT": "abc"}, "RDZV_PORT='abc': not a TCP port (1 to 65535)"),
    ({"RDZV_PORT": "70000"}, "RDZV_PORT='70000': not a TCP port (1 to 65535)"),
    (
        {"SLURM_JOB_NODELIST": ""},
        "SLURM_JOB_NODELIST='': not a Slurm node list (as node[01-04],gpu7)",
    ),
    (
        {"SLURM_JOB_NODELIST": "127.0.0.1"},
        "SLURM_JOB_NODELIST='127.0.0.1' names 1 hosts, SLURM_JOB_NUM_NODES=2",
    ),
    ({"SLURM_JOB_NUM_NODES": "two"}, "SLURM_JOB_NUM_NODES='two': not a node count"),
    ({"SLURM_JOB_ID": "42x"}, "SLURM_JOB_ID='42x': not a Slurm job id"),
    ({"SLURM_RESTART_COUNT": "-1"}, "SLURM_RESTART_COUNT='-1': not a restart count"),
    (
        {"PYTHON": "/no/such/python"},
        "PYTHON='/no/such/python': no such command (the interpreter with torch)",
    ),
    ({"SLURM_GPUS_ON_NODE": "8x"}, "SLURM_GPUS_ON_NODE='8x': not a GPU count"),
    (
        {"SLURM_GPUS_PER_NODE": "h100:"},
        "SLURM_GPUS_PER_NODE='h100:': not a GPU count per node ([TYPE:]N, as h100:8)",
    ),
    ({"SLURM_JOB_GPUS": "0,,1"}, "SLURM_JOB_GPUS='0,,1': not a list of GPU ids (as 0,1,2,3)"),
    (
        {"CUDA_VISIBLE_DEVICES": "0;1"},
        "CUDA_VISIBLE_DEVICES='0;1': not a list of GPU indices or UUIDs",
    ),
    ({"SLURM_CPUS_PER_TASK": "0"}, "SLURM_CPUS_PER_TASK='0': not a CPU count"),
    (
        {"SLURM_JOB_CPUS_PER_NODE": "many"},
        "SLURM_JOB_CPUS_PER_NODE='many': not Slurm's CPUs per node (as 72(x2),36)",
    ),
    (
        {"SBATCH_SIGNAL": "USR1@60"},
        "SBATCH_SIGNAL='USR1@60': not B:USR1@SECONDS (the batch shell hears USR1 and requeues the job)",
    ),
    ({"FAKE_TIME_LIMIT": "soon"}, "squeue -h -j 4242 -o %l: 'soon' is not a time limit"),
]


@pytest.mark.parametrize("env, line", BAD, ids=ids(BAD))
def test_a_bad_setting_is_one_line_and_exit_2(tmp_path, env, line):
    """A setting that is not the number or name it must be: one line naming it, exit 2, srun never started
    (f741ade handed NPROC_PER_NODE=0, RDZV_PORT=abc and an empty node list to torchrun, or took them). The GPU
    variables are read with NPROC_PER_NODE unset."""
    res, srun, _ = run_job(tmp_path, ["NPROC_PER_NODE"], **env)
    assert (res.returncode, res.stderr.splitlines(), srun) == (2, [f"parvl.sbatch: {line}"], None)


def test_no_setting_runs_a_command(tmp_path):
    """SLURM_RESTART_COUNT='PATH[$(cmd)]' (and every other number) is matched, never evaluated: f741ade's
    `[[ $SLURM_RESTART_COUNT -gt 0 ]]` ran cmd. Outside a Slurm job the script says so in one line."""
    marker = tmp_path / "ran"
    for name in (
        "SLURM_RESTART_COUNT",
        "SLURM_JOB_NUM_NODES",
        "NPROC_PER_NODE",
        "RDZV_PORT",
        "SLURM_GPUS_ON_NODE",
        "SLURM_CPUS_PER_TASK",
    ):
        value = f"PATH[$(touch {marker})]"
        res, srun, _ = run_job(tmp_path / name, ["NPROC_PER_NODE"], **{name: value})
        assert not marker.exists(), name
        assert (res.returncode, res.stderr.splitlines(), srun) == (
            2,
            [
                f"parvl.sbatch: {name}='{value}': "
                + {
                    "SLURM_RESTART_COUNT": "not a restart count",
                    "SLURM_JOB_NUM_NODES": "not a node count",
                    "NPROC_PER_NODE": "not a process count (1, 2, ...)",
                    "RDZV_PORT": "not a TCP port (1 to 65535)",
                    "SLURM_GPUS_ON_NODE": "not a GPU count",
                    "SLURM_CPUS_PER_TASK": "not a CPU count",
                }[name]
            ],
            None,
        )
    res, srun, _ = run_job(tmp_path / "outside", drop=["SLURM_JOB_ID"])
    assert (res.returncode, res.stderr.splitlines(), srun) == (
        2,
        [
            "parvl.sbatch: not inside a Slurm job (no SLURM_JOB_ID): submit it, sbatch slurm/parvl.sbatch ..."
        ],
        None,
    )


# -- a real job -----------------------------------------------------------------------------------------------


def test_a_gpu_less_node_runs_its_tasks_as_processes(tmp_path):
    """One node with no GPU and 2 tasks, NPROC_PER_NODE unset: the script's torchrun (real, on 127.0.0.1)
    starts 2 processes, ranks 0 and 1 of a world of 2 by its rendezvous; the CPUs it was given reach each."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, pathlib, sys\n"
        "keys = 'RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'SRUN_CPUS_PER_TASK'\n"
        "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(' '.join(map(os.environ.get, keys)))\n"
    )
    env = fake_slurm(
        tmp_path / "slurm", nodes=1, SLURM_NTASKS_PER_NODE=2, SLURM_JOB_CPUS_PER_NODE=3
    )
    for name in (*GPU_VARS, "NPROC_PER_NODE"):
        env.pop(name, None)
    res = sbatch([probe, tmp_path], env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {p.name: p.read_text() for p in tmp_path.iterdir() if p.name.isdigit()} == {
        "0": "0 0 2 2 3",
        "1": "1 1 2 2 3",
    }
    srun = slurm_log(env)[1]
    assert flag(srun, "--nproc-per-node") == "2" and srun[-2:] == [str(probe), str(tmp_path)]
