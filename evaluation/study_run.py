"""How study.py runs its plan (study_plan.py): what each piece was made from, what to do with it now, its
command line under each launcher, and running it.

A piece that finishes records what it was made from in OUT/made/PIECE.json: its command line, the study flags
it came from and a fingerprint of every file it read (a file of at most 64 MiB by its sha256, a larger one by
its size and modification time, a folder by its files'). On a later call a piece is
  - done: it left its file and its record is what it would be made from now;
  - to run: it has not left its file (never run, cut short, or its file was removed): its command resumes;
  - made again: its record differs (another --eval-flags, --cost-column, --judge-model, a changed TSV, a
    piece before it made again): what it made before is moved to OUT/replaced/N/ (nothing is lost), then it
    runs, and so does every piece after it that reads what it leaves;
  - refused: a trained run whose record differs (another --model, --train-flags, data): a run is not retrained
    in place, so the study stops before running anything, in one line naming the flag (exit 2) or the file
    (exit 1).
A file without its record (a partial copy, a clean-up of OUT/made/, a --out that already held a meta.json) is
never taken as made here with these settings: it is made again like a changed piece (moved aside first), and a
trained run is refused in one line (restore its record, or remove the run to train it again).
A piece that reads what an earlier piece of this call will make is decided when it is reached.

A record names the study's own files relative to OUT ("$OUT/runs/2x2") and every other path resolved: the same
study resumes under another spelling of its --out (st1, ./st1, /abs/st1) or from another disk it was moved to.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from evaluation.study_config import ROOT, Piece, StudyConfig
from shell.cli import UsageError

# bytes: a larger file is fingerprinted by its size and modification time, not read whole
BIG = 64 * 2**20


class Fingerprints:
    """Files' fingerprints, each read once per call (forget() after a piece wrote under a path)."""

    def __init__(self):
        self.cache: dict[str, str] = {}

    def of(self, path: Path) -> str:
        key = str(path)
        if key not in self.cache:
            self.cache[key] = fingerprint(path)
        return self.cache[key]

    def forget(self, paths: list[Path]) -> None:
        roots = [str(p) for p in paths]
        self.cache = {
            k: v
            for k, v in self.cache.items()
            if not any(k == r or k.startswith(r + "/") for r in roots)
        }


def fingerprint(path: Path) -> str:
    if path.is_dir():
        h = hashlib.sha256()
        for f in sorted(
            q for q in path.rglob("*") if q.is_file() and not q.name.endswith((".lock", ".tmp"))
        ):
            h.update(f"{f.relative_to(path)}:{fingerprint(f)};".encode())
        return "folder " + h.hexdigest()[:16]
    if not path.is_file():
        return "missing"
    st = path.stat()
    if st.st_size > BIG:
        return f"size {st.st_size}, modified {st.st_mtime_ns}"
    with open(path, "rb") as f:
        return "sha256 " + hashlib.file_digest(f, "sha256").hexdigest()[:16]


def show(value) -> str:
    """A flag's value as the user wrote it."""
    if value is None or value == "":
        return "none"
    return shlex.join(map(str, value)) if isinstance(value, list) else shlex.quote(str(value))


class Plan:
    """The pieces of one call, who makes what (producers), their records and what to do with each."""

    def __init__(self, c: StudyConfig, todo: list[Piece]):
        self.out, self.prints = Path(c.out), Fingerprints()
        self.home = self.out.resolve()  # where the study lives, whatever --out's spelling
        self.producer = {str(o): p for p in todo for o in p.outputs}
        self.pending: set[str] = set()  # while planning: the pieces this call will run
        # while planning: piece name -> why it will be made again
        self.changing: dict[str, str] = {}

    def made(self, p: Piece) -> Path:
        return self.out / "made" / (re.sub(r"[^A-Za-z0-9._-]+", "_", p.name) + ".json")

    def produced_by(self, path: Path) -> Piece | None:
        return next(
            (self.producer[str(q)] for q in (path, *path.parents) if str(q) in self.producer), None
        )

    def record(self, p: Piece) -> dict:
        return self.comparable(
            {
                "argv": p.argv,
                "flags": p.flags,
                "inputs": {str(path): self.prints.of(path) for path in p.inputs.values()},
            }
        )

    def comparable(self, record: dict) -> dict:
        """A record with its paths portable: the command line, the flags, the inputs' names (not their
        fingerprints)."""
        return {
            "argv": self.portable(record["argv"]),
            "flags": self.portable(record["flags"]),
            "inputs": {self.portable(k): v for k, v in record["inputs"].items()},
        }

    def portable(self, value):
        """A record's paths as they compare: under OUT relative to it ("$OUT/data/meta.json"), any other path
        that exists resolved (a relative --model and its absolute spelling are one); every other string as it is.
        Applied to a record read back too, so a record written before this spelling compares alike."""
        if isinstance(value, dict):
            return {k: self.portable(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.portable(v) for v in value]
        if not isinstance(value, str) or not value or value.startswith(("-", "$OUT")):
            return value
        where = Path(value).resolve()
        if where == self.home or self.home in where.parents:
            return "/".join(["$OUT", *where.relative_to(self.home).parts])
        return str(where) if where.exists() else value

    def key(self, path: Path) -> str:
        return self.portable(str(path))

    def why(self, p: Piece, old: dict, new: dict) -> tuple[str, bool] | None:
        """What changed since p was made, and whether it is a flag; None for nothing."""
        for k in sorted(set(old["flags"]) | set(new["flags"])):
            if old["flags"].get(k) != new["flags"].get(k):
                return (
                    f"{k} {show(old['flags'].get(k))} then, {show(new['flags'].get(k))} now",
                    True,
                )
        for label, path in p.inputs.items():
            if old["inputs"].get(self.key(path)) != new["inputs"][self.key(path)]:
                maker = self.produced_by(path)
                return (
                    f"what {maker.name} leaves ({path}) changed"
                    if maker
                    else f"its {label} {path} changed ({old['inputs'].get(self.key(path))} then)"
                ), False
        return (
            ("its command line changed (another study.py)", False)
            if old["argv"] != new["argv"]
            else None
        )

    def status(self, p: Piece, planning: bool = False) -> tuple[str, str | None]:
        """("done" | "run" | "redo" | "after", why); a refused change raises. planning: the pieces
        before p that this call runs have not run yet, so a finished piece reading what one of them makes is
        decided when it is reached ("after" it); a trained run after a piece made again is refused now."""
        upstream = [m for m in map(self.produced_by, p.inputs.values()) if m is not None]
        if (
            planning
            and p.done.exists()
            and (pending := [m for m in upstream if m.name in self.pending])
        ):
            changed = next((m for m in pending if m.name in self.changing), None)
            if changed and p.refuse_change:
                raise UsageError(
                    f"{p.name} would be made from another input: {changed.name} is made again "
                    f"({self.changing[changed.name]}); {self.refusal(p)}"
                )
            if changed:
                self.changing[p.name] = f"{changed.name} is made again"
            self.pending.add(p.name)
            return "after", pending[0].name
        status, why = self.decide(p)
        if status in ("run", "redo"):
            self.pending.add(p.name)
        if status == "redo":
            self.changing[p.name] = why
        return status, why

    def decide(self, p: Piece) -> tuple[str, str | None]:
        """p's status from its file and record as they are now."""
        if not p.done.exists():
            return "run", None
        # no record: made elsewhere, or with other settings; nothing vouches for the file
        if not self.made(p).is_file():
            if p.refuse_change:
                raise ValueError(
                    f"{p.name}: {p.done} is there but not its record {self.made(p)}, so nothing says it was "
                    f"made with these flags; restore the record (it was copied or cleaned away), or remove "
                    f"{p.resume or p.outputs[0]} to train it again"
                )
            return "redo", f"{p.done} is there without its record {self.made(p)}"
        old, new = self.comparable(self.read_record(p)), self.record(p)
        if (why := self.why(p, old, new)) is None:
            return "done", None
        if p.refuse_change:
            raise (UsageError if why[1] else ValueError)(
                f"{p.name} was made with {why[0]}; {self.refusal(p)}"
            )
        return "redo", why[0]

    def read_record(self, p: Piece) -> dict:
        """p's record as saved; one that is not a record (torn, edited) is one line naming it."""
        try:
            old, why = json.loads(self.made(p).read_text()), "no argv, flags and inputs"
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            old, why = None, f"not JSON: {e}"
        kinds = {"argv": list, "flags": dict, "inputs": dict}
        if not isinstance(old, dict) or any(
            not isinstance(old.get(k), t) for k, t in kinds.items()
        ):
            raise ValueError(
                f"{self.made(p)}: not a record study.py wrote ({why}); restore it from a copy, or remove it "
                f"and {p.outputs[0]} to make {p.name} again"
            )
        return old

    def refusal(self, p: Piece) -> str:
        return (
            f"a trained run is not retrained in place: give the study's earlier value, another --out, or "
            f"remove {p.resume or p.outputs[0]} to train it again"
        )

    def save(self, p: Piece) -> None:
        """p's record, once it has finished (or is taken as done)."""
        self.prints.forget(p.outputs)
        self.made(p).parent.mkdir(parents=True, exist_ok=True)
        tmp = self.made(p).with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record(p), indent=1) + "\n")
        tmp.replace(self.made(p))

    def move_aside(self, p: Piece) -> Path:
        """What p made before, moved under OUT/replaced/N/ (its place in OUT kept), before it is made again."""
        n = 1 + max(
            (int(d.name) for d in (self.out / "replaced").glob("*") if d.name.isdigit()), default=0
        )
        dest = self.out / "replaced" / str(n)
        for o in p.outputs:
            # `run`'s parts too
            for q in [o, *o.parent.glob(o.name + ".part*")] if o.exists() else []:
                target = dest / q.relative_to(self.out)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(q), str(target))
        self.prints.forget(p.outputs)
        return dest


def started(run: Path) -> bool:
    return (run / "checkpoints").is_dir() or (run / "metrics.jsonl").exists()


def launch(c: StudyConfig, p: Piece) -> list[str]:
    """The command line of a piece: its script under torchrun, sbatch or srun, or plain python. The device
    request is --gpus-per-node's alone: sbatch --gpus-per-node=G for a multi-process piece (slurm/parvl.sbatch
    runs one process per GPU the node got, or per task without GPUs), srun --gpus=1 for a one-device piece;
    none at 0, a partition without GPUs."""
    # train.py goes on
    argv = p.argv + (["--resume"] if p.resume is not None and started(p.resume) else [])
    script, flags, py = str(ROOT / argv[0]), argv[1:], sys.executable
    slurm, gpus = shlex.split(c.slurm_flags), c.gpus_per_node
    # every node of a job: slurm/parvl.sbatch (docs/cluster.md)
    if c.launcher == "slurm" and p.kind == "multi":
        return [
            "sbatch",
            "--wait",
            f"--nodes={c.nodes}",
            *([f"--gpus-per-node={gpus}"] if gpus else []),
            *slurm,
            str(ROOT / "slurm" / "parvl.sbatch"),
            script,
            *flags,
        ]
    if c.launcher == "slurm" and p.kind == "gpu":
        return [
            "srun",
            "--nodes=1",
            "--ntasks=1",
            *(["--gpus=1"] if gpus else []),
            *slurm,
            py,
            script,
            *flags,
        ]
    if p.kind == "multi" and c.nproc_per_node > 1:
        return [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(c.nproc_per_node),
            script,
            *flags,
        ]
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
