"""The paper's whole study as one script (docs/evaluation.md, "The study as one script"): the nine
allocations, the Figure 3 and Table S8 ablations, every benchmark of every run, the fixed pairs, the
random pair and the router (Appendix E) of one allocation, the latency profiles, then the report
(Tables 2, S4, S9, 3), Table S5, Table S2 and Figure 4.

    python study.py --model InternVL3_5-1B-Pretrained --data sft.json --tsv ~/LMUData --out study --plan
    python study.py --model InternVL3_5-1B-Pretrained --data sft.json --tsv ~/LMUData --out study
    python study.py ... --launcher slurm --nodes 4 --slurm-flags "--partition gpu --time 24:00:00"

It runs the commands, one after the other, as a user would: train.py, evaluate.py, router.py,
profiling.py, under torchrun on this machine or through slurm/parvl.sbatch on a Slurm cluster. It is
no workflow engine: each piece is one command with the file it leaves when it has finished; a piece
whose file is there is skipped, and every command resumes by itself (train.py --resume, `evaluate.py
run` and `router.py label` keep their finished parts), so after an interrupt or a failure the same
command goes on where it stopped. The tables at the end are made again whenever a piece before them
ran. --plan prints what would run and what is done, and runs nothing.

    OUT/runs/2x2/          train.py's run folder (export/ the model)     OUT/profile/2x2.json  latency
    OUT/pred/RUN/B.jsonl   predictions     OUT/score/RUN/B.json  scores  OUT/router/           labels, gates
    OUT/report/            report.md, report.json, heatmaps              OUT/tables/           S5, S2, Figure 4
"""
from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cli import SEED, command, log
from flags import Command, dispatch, flag
from evaluation.scoring import BENCHMARKS  # the paper's nine (Appendix A.3)

ROOT = Path(__file__).resolve().parent
ALLOCATIONS = ["1:1", "1:2", "1:4", "2:1", "2:2", "2:4", "4:1", "4:2", "4:4"]  # Table 2 / S4
ABLATIONS = {"prefix72": ["--vit-prefix-len", "72"], "prefix128": ["--vit-prefix-len", "128"],  # Figure 3 (96:
             "lora": ["--vision-branches", "lora", "--lora-rank", "16"],                          # the base run)
             "mean": ["--aggregation", "mean"]}                                                  # Table S8


@dataclass
class StudyConfig:
    model: str = flag("", "the starting checkpoint (the paper's: InternVL3.5 *pretrained*)", required=True, reads=True)
    data: str = flag("", "SFT meta JSON (official InternVL format)", required=True, reads=True)
    tsv: str = flag("", "folder of the benchmarks' VLMEvalKit TSVs, named BENCHMARK.tsv", required=True, reads=True)
    out: str = flag("study", "the study's folder (on a shared file system with --launcher slurm)",
                    writes=("runs", "pred", "score", "router", "profile", "tables", "report"))  # the layout above
    allocations: list[str] = flag(help="Pv:Pl allocations trained and evaluated", factory=lambda: list(ALLOCATIONS),
                                  shown="the nine of Table 2")
    benchmarks: list[str] = flag(help="benchmarks run for every model", factory=lambda: list(BENCHMARKS),
                                 shown="the nine")
    ablations: list[str] = flag(help="branch variants of --ablation-base (Figure 3: prefix72 prefix128 lora; "
                                "Table S8: mean), or none", factory=lambda: list(ABLATIONS), shown="all four")
    ablation_base: str = flag("4:1", "the allocation the ablations vary")
    router_allocation: str = flag("4:4", "the allocation of the fixed pairs, the random pair and the router")
    router_step: int = flag(0, "its training step the router, fixed and random pairs use (the paper: 7000; keep it "
                            "with --train-flags \"--keep-last K\", docs/training.md), 0 = the end-of-run export",
                            range="[0, inf)")
    router_data: str = flag("", "meta JSON the router is labelled and trained on", shown="--data", reads=True)
    router_eval_data: str = flag("", "held-out meta JSON for `router.py eval` (Table 3 / S9 layout)", shown="none",
                                 reads=True)
    lengths: list[str] = flag(help="the two allocations of Table S5", nargs=2, factory=lambda: ["1:1", "4:4"])
    cost_column: str = flag("All", "Figure 4's score column (a benchmark, or an aggregate all of whose benchmarks ran)")
    arch: str = flag("1b", "backbone preset of Tables 4 / S7's profile and of the report's FLOPs")
    launcher: str = flag("local", "local: torchrun on this machine; slurm: sbatch --wait slurm/parvl.sbatch (srun "
                         "for one-GPU pieces)", choices=["local", "slurm"])
    nproc_per_node: int = flag(8, "processes (GPUs) per node; 1 = plain python", range="[1, inf)")
    nodes: int = flag(1, "--launcher slurm: nodes per multi-process piece", range="[1, inf)")
    slurm_flags: str = flag("", "extra sbatch / srun flags (partition, account, time), one string")
    train_flags: str = flag("", "extra train.py flags, one string")
    eval_flags: str = flag("", "extra `evaluate.py run` flags, one string")
    label_flags: str = flag("", "extra `router.py label` flags, one string")
    router_flags: str = flag("", "extra `router.py train` flags, one string")
    profile_flags: str = flag("", "extra `profiling.py latency` flags, one string")
    plan: bool = flag(False, "print every piece, done or to run, and run nothing")

    def check(self) -> None:
        """Bad flags (exit 2): allocations as Pv:Pl, the ones the other pieces name among --allocations."""
        for a in (*self.allocations, self.ablation_base, self.router_allocation, *self.lengths):
            if len(a.split(":")) != 2 or not all(x.isdigit() and int(x) > 0 for x in a.split(":")):
                raise ValueError(f"allocation {a!r}: write it Pv:Pl, as 2:4")
        for name, a in (("--router-allocation", self.router_allocation), ("--lengths", self.lengths[0]),
                        ("--lengths", self.lengths[1])):
            if a not in self.allocations:
                raise ValueError(f"{name} {a}: not among --allocations {' '.join(self.allocations)}")
        if unknown := [a for a in self.ablations if a not in ABLATIONS and a != "none"]:
            raise ValueError(f"--ablations {' '.join(unknown)}: choose from {' '.join(ABLATIONS)}, or none")


@dataclass
class Piece:
    """One command of the study and the file it leaves once finished (its `done`)."""
    name: str
    argv: list[str] | Callable[[], list[str]]  # SCRIPT.py and its flags; a callable: read when it runs
    done: Path
    kind: str = "cpu"  # multi: ranks share it (torchrun / sbatch); gpu: one device; cpu: light, here
    stdout: Path | None = None  # the command's stdout is this file (profiles, tables)
    derived: bool = False  # a table of what came before: made again when an earlier piece ran
    leaves: Path | None = None  # the file the command must leave, when `done` is the next piece's (a run's score)


def run_name(a: str) -> str:
    return a.replace(":", "x")  # 2:2 -> 2x2, a folder name every tool takes


def pieces(c: StudyConfig) -> list[Piece]:
    """The study, in order: every run trained, every benchmark of every run, the router's allocation (fixed
    pairs, random pair, router), the latency profiles, then the tables of all of them."""
    out, trained = Path(c.out), trained_runs(c)
    return ([train_piece(c, name, alloc, extra) for name, alloc, extra in trained]
            + [p for name, _, _ in trained for p in benchmark_pieces(c, name, out / "runs" / name / "export")]
            + router_pieces(c) + profile_pieces(c, trained) + table_pieces(c))


def extra(c: StudyConfig, command: str) -> list[str]:
    """The extra flags --train-flags, --eval-flags, ... give one kind of piece."""
    return shlex.split(getattr(c, f"{command}_flags"))


def trained_runs(c: StudyConfig) -> list[tuple[str, str, list[str]]]:
    """(run name, Pv:Pl, branch flags) of every run trained: Table 2 / S4's allocations, then Figure 3's and Table
    S8's variants of --ablation-base."""
    runs = [(run_name(a), a, []) for a in c.allocations]
    return runs + [(f"{run_name(c.ablation_base)}_{a}", c.ablation_base, ABLATIONS[a]) for a in c.ablations
                   if a != "none"]


def train_piece(c: StudyConfig, name: str, alloc: str, branches: list[str]) -> Piece:
    pv, pl = alloc.split(":")
    run = Path(c.out) / "runs" / name
    resume = ["--resume"] if (run / "checkpoints").is_dir() or (run / "metrics.jsonl").exists() else []  # go on
    return Piece(f"train {name}", ["train.py", "--pv", pv, "--pl", pl, *branches, "--model", c.model, "--data",
                                   c.data, "--out", str(run), *resume, *extra(c, "train")],
                 run / "export" / "model.safetensors", "multi")


def benchmark_pieces(c: StudyConfig, name: str, model: Path, flags: list[str] = ()) -> list[Piece]:
    """Every benchmark of one model (with `flags`, a branch choice or a router): its predictions, then its score."""
    out, tsv, todo = Path(c.out), Path(c.tsv), []
    for b in c.benchmarks:
        pred, score = out / "pred" / name / f"{b}.jsonl", out / "score" / name / f"{b}.json"
        todo.append(Piece(f"run {name} {b}", ["evaluate.py", "run", "--benchmark", b, "--data", str(tsv / f"{b}.tsv"),
                                              "--model", str(model), *flags, "--out", str(pred), *extra(c, "eval")],
                          score, "multi", leaves=pred))
        todo.append(Piece(f"score {name} {b}", ["evaluate.py", "score", "--benchmark", b, "--data",
                                                str(tsv / f"{b}.tsv"), "--predictions", str(pred), "--out", str(score)],
                          score))
    return todo


def router_pieces(c: StudyConfig) -> list[Piece]:
    """Table S9 and Table 3 on the router allocation's model (its end-of-run export, or --router-step's): every
    fixed pair, the random pair, the router labelled, trained (and evaluated on held-out labels), then routed."""
    out, ra = Path(c.out), run_name(c.router_allocation)
    model, todo = out / "runs" / ra / "export", []
    if c.router_step:
        model = out / "router" / f"model_step_{c.router_step}"
        todo.append(Piece(f"export {ra} step {c.router_step}", ["train.py", "export", str(out / "runs" / ra),
                                                                  "--step", str(c.router_step), "--out", str(model)],
                          model / "model.safetensors", "gpu"))
    pv, pl = map(int, c.router_allocation.split(":"))
    for v in range(pv):
        for lb in range(pl):
            todo += benchmark_pieces(c, f"{ra}_pair{v}{lb}", model, ["--vision-branch", str(v), "--language-branch",
                                                                     str(lb)])
    todo += benchmark_pieces(c, f"{ra}_random", model, ["--random-pair", "--seed", str(SEED)])
    labels, gates = out / "router" / "labels", out / "router" / "gates"
    todo.append(Piece("label router data", ["router.py", "label", "--model", str(model), "--data",
                                            c.router_data or c.data, "--out", str(labels), *extra(c, "label")],
                      labels / "labels.json", "multi"))
    todo.append(Piece("train router", ["router.py", "train", "--model", str(model), "--labels", str(labels), "--out",
                                       str(gates), "--overwrite", *extra(c, "router")],
                      gates / "router.safetensors", "gpu"))
    if c.router_eval_data:
        held = out / "router" / "heldout"
        todo.append(Piece("label held-out data", ["router.py", "label", "--model", str(model), "--data",
                                                  c.router_eval_data, "--out", str(held), *extra(c, "label")],
                          held / "labels.json", "multi"))
        todo.append(Piece("eval router", ["router.py", "eval", "--model", str(model), "--router", str(gates),
                                          "--labels", str(held)], gates / "eval.json", "gpu"))
    return todo + benchmark_pieces(c, f"{ra}_router", model, ["--router", str(gates)])


def profile_pieces(c: StudyConfig, trained: list) -> list[Piece]:
    """Figure 4: each run's own batch-1 latency and memory (its config, random weights); Tables 4 / S7: the router
    allocation against 1:1, standard and shared KV."""
    out, todo = Path(c.out), []
    for name, _, _ in trained:
        profile = out / "profile" / f"{name}.json"
        todo.append(Piece(f"profile {name}", ["profiling.py", "latency", "--model", str(out / "runs" / name / "export"),
                                              "--batch", "1", "--json", *extra(c, "profile")], profile, "gpu",
                          stdout=profile))
    pv, pl = c.router_allocation.split(":")
    table4 = out / "tables" / "table4.md"
    return todo + [Piece("Tables 4 / S7", ["profiling.py", "latency", "--arch", c.arch, "--pv", pv, "--pl", pl,
                                           "--baseline", "--compare-shared", *extra(c, "profile")], table4, "gpu",
                         stdout=table4)]


def table_pieces(c: StudyConfig) -> list[Piece]:
    """The tables of everything before them (derived: made again whenever an earlier piece ran), their input
    files read when they run: the report, Table S5, Table S2 and Figure 4."""
    out, tsv, tables, report = Path(c.out), Path(c.tsv), Path(c.out) / "tables", Path(c.out) / "report"
    found = lambda pattern: sorted(map(str, out.glob(pattern))) or [str(out / pattern)]  # noqa: E731 (--plan)
    a, b = c.lengths
    return [
        Piece("report", lambda: ["evaluate.py", "report", *found("score/*/*.json"), "--arch", c.arch, "--out",
                                 str(report)], report / "report.json", derived=True),
        Piece("Table S5", ["evaluate.py", "lengths", "--model", c.model, "--a",
                           *(str(out / "pred" / run_name(a) / f"{x}.jsonl") for x in c.benchmarks),
                           "--b", *(str(out / "pred" / run_name(b) / f"{x}.jsonl") for x in c.benchmarks),
                           "--names", a, b, "--out", str(tables / "S5.json")],
              tables / "S5.json", stdout=tables / "S5.md", derived=True),
        Piece("Table S2", lambda: ["evaluate.py", "descriptors", *(str(tsv / f"{x}.tsv") for x in c.benchmarks),
                                   "--model", c.model, "--report", str(report / "report.json"), "--predictions",
                                   *found("pred/*/*.jsonl"), "--out", str(tables / "S2.json")],
              tables / "S2.json", stdout=tables / "S2.md", derived=True),
        Piece("Figure 4", lambda: ["evaluate.py", "cost", "--report", str(report / "report.json"), "--latency",
                                   *found("profile/*.json"), "--column", c.cost_column, "--out",
                                   str(tables / "figure4")],
              tables / "figure4" / "score_cost.json", stdout=tables / "figure4.md", derived=True),
    ]


def launch(c: StudyConfig, p: Piece, argv: list[str]) -> list[str]:
    """The command line of a piece: its script under torchrun, sbatch or srun, or plain python."""
    script, flags, py = str(ROOT / argv[0]), argv[1:], sys.executable
    slurm = shlex.split(c.slurm_flags)
    if c.launcher == "slurm" and p.kind == "multi":  # every node of a job: slurm/parvl.sbatch (docs/cluster.md)
        return ["sbatch", "--wait", f"--nodes={c.nodes}", f"--gpus-per-node={c.nproc_per_node}",
                f"--export=ALL,NPROC_PER_NODE={c.nproc_per_node}", *slurm, str(ROOT / "slurm" / "parvl.sbatch"), script,
                *flags]
    if c.launcher == "slurm" and p.kind == "gpu":
        return ["srun", "--nodes=1", "--ntasks=1", "--gpus=1", *slurm, py, script, *flags]
    if p.kind == "multi" and c.nproc_per_node > 1:
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(c.nproc_per_node), script,
                *flags]
    return [py, script, *flags]


def execute(cmd: list[str], stdout: Path | None) -> int:
    """Run one piece's command; its stdout into `stdout` (whole or not at all). A signal to this script
    stops the command too (SIGTERM, then waits): its own interrupt handling keeps what it finished."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if stdout else None, text=True)
    try:
        text, _ = proc.communicate()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    if stdout is not None and proc.returncode == 0:
        stdout.parent.mkdir(parents=True, exist_ok=True)
        tmp = stdout.with_name(stdout.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(stdout)
    return proc.returncode


def study(c: StudyConfig) -> int:
    for path, what in ((c.model, "--model"), (c.tsv, "--tsv")):
        if not c.plan and not Path(path).is_dir():
            raise ValueError(f"{what} {path}: not a folder")
    todo, ran = pieces(c), False
    for k, p in enumerate(todo, 1):
        head = f"[{k}/{len(todo)}] {p.name}"
        if p.done.exists() and not (p.derived and ran):
            log(f"{head}: done ({p.done})", sys.stdout)
            continue
        cmd = launch(c, p, p.argv() if callable(p.argv) else p.argv)
        if c.plan:
            ran = True  # the tables after it would be made again
            log(f"{head}: would run {shlex.join(cmd)}" + (f" > {p.stdout}" if p.stdout else ""), sys.stdout)
            continue
        for path in (p.done, p.leaves):  # the folders a command writes its files into (score --out needs it)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        log(f"{head}: {shlex.join(cmd)}" + (f" > {p.stdout}" if p.stdout else ""), sys.stdout)
        if (code := execute(cmd, p.stdout)) != 0:
            raise ValueError(f"{p.name} failed (exit {code}; its own line above); the same study.py command "
                             f"resumes from this piece")
        if not (p.leaves or p.done).exists():
            raise ValueError(f"{p.name} ended without writing {p.leaves or p.done}")
        ran = True
    if not c.plan:
        log(f"the study is complete: {Path(c.out) / 'report' / 'report.md'}, {Path(c.out) / 'tables'}", sys.stdout)
    return 0


DESCRIPTION = __doc__.split("\n\n")[0]
COMMANDS = {None: Command(StudyConfig, study,
                          interrupted=lambda c: "the finished pieces stay; the same command resumes")}


def main(argv=None) -> int:
    return dispatch(DESCRIPTION, COMMANDS, argv)


if __name__ == "__main__":
    command(main)
