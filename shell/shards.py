"""One long job that the ranks share and a rerun resumes, written once for the two commands that are
such a job: `evaluate.py run` (a benchmark's predictions, row by row) and `router.py label` (the
router's teacher labels, chunk by chunk). Under torchrun every rank runs the same steps:

    folder  every rank writes its parts into one folder, so on more than one machine it must sit on
            a file system every node shares (outputs.check_shared, called by the command before any work);
    resume  every rank reads what earlier runs finished, whatever their world size, and waits for the
            others before any rank writes (resumed);
    share   rank r of W takes the units r, r + W, r + 2W, ... of a list every rank holds alike (share);
    keep    each result is written the moment it is complete, and whole: a batch of JSON lines appended
            to the rank's own part file in one write call (LineParts; signals run between calls, so an
            interrupt leaves whole lines, and a line a kill -9 or a full disk cut short is dropped before
            the next run appends: LineParts.mend), or one file per unit written beside its name and renamed
            into place (FileParts);
    merge   once every part is written, rank 0 merges the parts in the command's canonical order (the
            TSV's rows, the chunks' numbers), so the result depends neither on the world size nor on
            the interrupts on the way, writes it, and only then removes the parts (merged).

An interrupted run (Ctrl-C, SIGTERM, a lost node, an allocation failure) leaves its parts; the same
command, on any number of ranks, resumes from them.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from shell.cli import barrier, check_interrupt, log, rank, world_size
from shell.files import writing

T = TypeVar("T")


def share(units: Sequence[T]) -> Sequence[T]:
    """This rank's units: r, r + W, r + 2W, ... of W ranks (all of them in a single process)."""
    return units[rank() :: world_size()]


def resumed(read: Callable[[], T]) -> T:
    """What read() finds of earlier runs, read by every rank before any rank writes (a barrier)."""
    found = read()
    barrier()
    return found


def merged(merge: Callable[[], T]) -> T | None:
    """merge() on rank 0 once every rank is done with the parts (a barrier), the others waiting until
    it has written the result and removed the parts (a second barrier). Rank 0 gets merge's value."""
    barrier()
    result = merge() if rank() == 0 else None
    barrier()
    return result


class LineParts:
    """Results as JSON lines, one record a line, beside an output file OUT (evaluate.py run's
    predictions): rank r appends to OUT.part{r}; OUT itself, when there, holds what an earlier run
    merged. read(path) reads one such file (a last line cut short is dropped: its unit is redone);
    key(record) names the unit a record is the result of."""

    def __init__(self, out: Path, read: Callable[[Path], list[dict]], key: Callable[[dict], str]):
        self.out, self.read, self.key = out, read, key

    def files(self) -> list[Path]:
        """The merged file first, then the part files of every rank of every earlier run."""
        return [self.out] + sorted(self.out.parent.glob(self.out.name + ".part*"))

    def part(self) -> Path:
        """This rank's part file."""
        return self.out.with_name(f"{self.out.name}.part{rank()}")

    def mend(self) -> None:
        """This rank's part file cut after its last whole line, said in a line: a line without its newline (a run
        killed or out of disk mid-write) is dropped, its unit redone, and the next record starts a line of its own.
        Every rank mends its own part before any rank reads one (resumed(mend), then resumed(done))."""
        if not self.part().is_file():
            return
        with open(self.part(), "r+b") as f:
            end = f.seek(0, os.SEEK_END)
            keep, stop = 0, end
            while stop > 0:  # back from the end, 64 KiB at a time, to the last newline
                start = max(0, stop - 2**16)
                f.seek(start)
                cut = f.read(stop - start).rfind(b"\n")
                if cut >= 0:
                    keep = start + cut + 1
                    break
                stop = start
            if keep < end:
                f.truncate(keep)
                log(
                    f"{self.part()}: dropped its last {end - keep} bytes, a line cut short by an interrupted run; its "
                    f"row is redone",
                    every_rank=True,
                )

    def done(self) -> set[str]:
        """The units some earlier run finished."""
        return {self.key(p) for f in self.files() for p in self.read(f)}

    @contextmanager
    def appending(self) -> Iterator[Callable[[list[dict]], None]]:
        """keep(records): this rank's records appended to its part file, one write call and a flush."""
        part = self.part()
        with (
            writing(part),
            open(part, "a", encoding="utf-8") as f,
        ):  # a full disk names the part (writing)

            def keep(records: list[dict]) -> None:
                check_interrupt()  # records made after a signal are never kept (a swallowed Interrupted)
                f.write("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in records))
                f.flush()

            yield keep

    def merge(self, order: dict[str, int]) -> int:
        """Rank 0: every record of the merged file and the parts in one file, ordered by order[key]
        (a unit it lacks goes last; of two records of one unit, the later file's), written beside OUT and
        renamed onto it; then the parts go. Returns the number of records. Memory holds where each record
        is, not the records: they are copied line by line (the files were read whole by done())."""
        files = [f for f in self.files() if f.exists()]
        # key -> (place, file, byte offset, length)
        where: dict[str, tuple[int, int, int, int]] = {}
        for n, f in enumerate(files):
            with open(f, "rb") as lines:
                offset = 0
                for raw in lines:
                    try:
                        key = self.key(json.loads(raw)) if raw.strip() else None
                    except (
                        ValueError
                    ):  # a last line cut short: read() drops it too, and its unit is redone
                        key = None
                    if key is not None:
                        where[key] = (order.get(key, len(order)), n, offset, len(raw))
                    offset += len(raw)
        tmp, handles = self.out.with_name(self.out.name + ".tmp"), [open(f, "rb") for f in files]
        try:
            with writing(self.out), open(tmp, "wb") as sink:  # whole, or none: renamed once written
                for _, n, offset, size in sorted(where.values()):
                    handles[n].seek(offset)
                    line = handles[n].read(size)
                    sink.write(line if line.endswith(b"\n") else line + b"\n")
            os.replace(tmp, self.out)
        except OSError:
            tmp.unlink(missing_ok=True)  # what OUT held stays
            raise
        finally:
            for h in handles:
                h.close()
        for f in files:
            if f != self.out:  # the parts go; OUT, when it was there, was read and is now replaced
                f.unlink()
        return len(where)


class FileParts:
    """Results as one file per unit k in a folder (router.py label: OUT/parts/chunk_000003.safetensors),
    name.format(k) naming it; a unit is done when its file is there."""

    def __init__(self, folder: Path, name: str):
        self.folder, self.name = folder, name

    def path(self, k: int) -> Path:
        return self.folder / self.name.format(k)

    def done(self, k: int) -> bool:
        return self.path(k).exists()

    def keep(self, k: int, write: Callable[[str], None]) -> None:
        """write(path) writes unit k's file beside its name; the rename makes it appear whole. Nothing made after
        a signal is kept (cli.check_interrupt)."""
        check_interrupt()
        with writing(str(self.path(k)) + ".tmp"):  # safetensors' failure too names the file
            write(str(self.path(k)) + ".tmp")
        os.replace(str(self.path(k)) + ".tmp", self.path(k))

    def remove(self) -> None:
        """The folder and every part in it (rank 0, once merged)."""
        shutil.rmtree(self.folder)
