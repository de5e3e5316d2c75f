"""Several nodes on one machine: two torchrun launchers that meet on 127.0.0.1 (two_nodes), and a Slurm job
faked by srun / scontrol / squeue stand-ins that write down what they were asked (fake_slurm, sbatch)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import parvl`


def two_nodes(
    args: list, node_args: tuple[list, list] = ([], []), timeout: int = 300
) -> tuple[list[int], str]:
    """A command (script and flags) as 2 nodes x 1 process: two torchrun launchers on 127.0.0.1, the
    multi-node invocation of docs/training.md, "More than one machine" (--nnodes 2 --node-rank 0 / 1,
    rendezvous at --master-addr and --master-port), as two machines sharing a file system. node_args: flags
    only one node gets.
    Returns both launchers' exit codes and their stderr, node 0's first."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(k),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                *map(str, args),
                *map(str, node_args[k]),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in (0, 1)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [p.returncode for p in procs], "".join(err for _, err in outs)


# A faked Slurm for slurm/parvl.sbatch: `scontrol show hostnames` lists the comma-separated nodes of
# SLURM_JOB_NODELIST, `scontrol requeue` is written down; `srun --nodes=N ...` writes down its arguments
# (and its whole environment into FAKE_SRUN_ENV, when set) and starts its command once per node with that
# node's SLURM_NODEID (as N machines would), or with FAKE_SRUN_SLEEP only sleeps that long. Both append one
# JSON line per call to FAKE_SLURM_LOG. `squeue -h -j JOBID -o %l` (the one query the script makes; any other
# is refused) prints FAKE_TIME_LIMIT, the job's time limit as squeue writes it, and is not logged.
FAKE_SRUN = """import json, os, subprocess, sys, time
args = sys.argv[1:]
opts = [a for a in args[:next(i for i, a in enumerate(args) if not a.startswith("--"))]]
cmd = args[len(opts):]
nodes = int(next(a for a in opts if a.startswith("--nodes=")).split("=")[1])
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps(["srun", *args]) + "\\n")
if "FAKE_SRUN_ENV" in os.environ:
    with open(os.environ["FAKE_SRUN_ENV"], "w") as f:
        json.dump(dict(os.environ), f)
if "FAKE_SRUN_SLEEP" in os.environ:
    time.sleep(float(os.environ["FAKE_SRUN_SLEEP"]))
    sys.exit(0)
procs = [subprocess.Popen(cmd, env=dict(os.environ, SLURM_NODEID=str(k), SLURM_PROCID=str(k))) for k in range(nodes)]
sys.exit(max(p.wait() for p in procs))
"""


FAKE_SCONTROL = """import json, os, sys
with open(os.environ["FAKE_SLURM_LOG"], "a") as f:
    f.write(json.dumps(["scontrol", *sys.argv[1:]]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(sys.argv[3].split(",")))
"""


FAKE_SQUEUE = """import os, sys
if sys.argv[1:] != ["-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%l"]:
    sys.exit(f"fake squeue: unexpected arguments {sys.argv[1:]}")
print(os.environ["FAKE_TIME_LIMIT"])
"""


def fake_slurm(folder: Path, nodes: int = 2, job_id: int = 4242, **env) -> dict:
    """The environment of a Slurm batch job of `nodes` nodes on 127.0.0.1 (one process each, one task and all
    of this machine's CPUs per node, an hour's time limit), with fake srun, scontrol and squeue first on PATH;
    `env` adds or overrides variables. Its log: folder / "slurm.log"."""
    bin_ = folder / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    for name, code in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("squeue", FAKE_SQUEUE)):
        (bin_ / name).write_text(f"#!{sys.executable}\n{code}")
        (bin_ / name).chmod(0o755)
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the job's own Slurm variables only: none of a Slurm job these tests may themselves run in
    outer = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
    }
    return {
        **outer,
        **dict(
            PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}",
            OMP_NUM_THREADS="1",
            FAKE_SLURM_LOG=str(folder / "slurm.log"),
            SLURM_JOB_ID=str(job_id),
            SLURM_JOB_NUM_NODES=str(nodes),
            SLURM_JOB_NODELIST=",".join(["127.0.0.1"] * nodes),
            NPROC_PER_NODE="1",
            RDZV_PORT=str(port),
            SLURM_NTASKS_PER_NODE="1",
            SLURM_JOB_CPUS_PER_NODE=f"{os.cpu_count()}(x{nodes})",
            FAKE_TIME_LIMIT="1:00:00",
            PYTHON=sys.executable,
        ),
        **{k: str(v) for k, v in env.items()},
    }


def slurm_log(env: dict) -> list[list[str]]:
    path = Path(env["FAKE_SLURM_LOG"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def sbatch(args: list, env: dict, timeout: int = 300, **popen) -> subprocess.CompletedProcess:
    """slurm/parvl.sbatch with these arguments, as Slurm runs a batch script (bash, in the submit folder)."""
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        ["bash", str(root / "slurm" / "parvl.sbatch"), *map(str, args)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )
