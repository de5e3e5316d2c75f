"""The files a command reads and writes, as every command treats them: a file read must be a regular file
(regular_file), a write's failure names its file (writing), a small output file is written whole or not at
all (write_text), and a failed read or write is said in a few words, "FILE: CAUSE" (os_error, os_cause), the
line cli.shell prints.
Run the tests: python -m pytest tests/test_shell.py -q -k "regular_file or full_disk"
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError


def regular_file(path, what: str = "") -> Path:
    """A file a command reads, refused in one line unless it is a regular file (a link to one is): reading a FIFO
    blocks until some process writes it, maybe forever, and a device or a folder holds no data. A missing file
    passes: the opener's own line says so. `what` names the file's role ("--batch")."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return Path(path)
    if not stat.S_ISREG(mode):
        kind = (
            "a folder"
            if stat.S_ISDIR(mode)
            else "a FIFO (named pipe)"
            if stat.S_ISFIFO(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device"
        )
        raise ValueError(
            f"{what + ' ' if what else ''}{path}: {kind}, not a regular file; a command reads files only"
        )
    return Path(path)


@contextmanager
def writing(path):
    """Writes to the file `path` inside: a failure is an OSError naming it, so that shell's line says which file
    ("OUT.part0: no space left on the device"). A write's or a close's OSError carries no file name (only an
    open's does, and a full disk shows at the write), and safetensors' SafetensorError neither a name nor an
    errno (its text holds the cause, which os_cause reads)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, os.fspath(path)) from e
    except SafetensorError as e:
        raise OSError(None, " ".join(str(e).split()), os.fspath(path)) from e


def write_text(path: Path, text: str) -> None:
    """A command's output file, written whole or not at all (UTF-8, into PATH.tmp, then renamed onto PATH): a
    failure (a full disk) leaves what PATH held and is one line naming PATH and the cause."""
    path, tmp = Path(path), Path(f"{path}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only file system: the first failure is the one to say
            pass
        raise OSError(e.errno, e.strerror, os.fspath(path)) from e


CAUSES = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or folder",
    errno.ENOTDIR: "a parent is a file, not a folder",
    errno.EISDIR: "a folder, not a file",
    errno.EIO: "input/output error",
    errno.EEXIST: "a file is already there",
}


def os_cause(e: BaseException, folder: Path | None = None) -> str:
    """The cause of a failed write or read in a few words: the first OSError in the exception's chain
    (DCP wraps each rank's failure in a CheckpointException), else its message. torch's zip writer
    reports a full disk as "file write failed" with no errno, so the free space is checked too."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno:
            return CAUSES.get(x.errno, os.strerror(x.errno))
        if isinstance(x, dcp_errors()):  # DCP: each rank's failure
            failures = [f[0] if isinstance(f, tuple) else f for f in x.failures.values()]
            # its text holds every rank's traceback: the first rank's failure speaks for it, on one line
            e = e if e is not x or not failures else failures[0]
            todo += failures
        todo += [x.__cause__, x.__context__]
    text = " ".join(str(e).split())  # on one line
    for needle, cause in (
        ("No space left", errno.ENOSPC),
        ("Read-only file system", errno.EROFS),
        ("Permission denied", errno.EACCES),
    ):
        if needle in text:
            return CAUSES[cause]
    if folder is not None:
        try:
            free = shutil.disk_usage(next(p for p in (folder, *folder.parents) if p.exists())).free
            if free < 2**30:
                return f"the disk is (nearly) full, {free / 2**20:.0f} MiB free ({type(e).__name__}: {text[:120]})"
        except OSError:
            pass
    return f"{type(e).__name__}: {text[:200]}"


def os_error(e: BaseException, folder: Path | None = None) -> str:
    """A failed read or write in one line: the file, when the error names one, and its cause
    ("OUT/parts: read-only file system")."""
    return (
        f"{e.filename}: {os_cause(e, folder)}"
        if isinstance(e, OSError) and e.filename
        else os_cause(e, folder)
    )


def dcp_errors() -> tuple[type, ...]:
    """DCP's CheckpointException (a BaseException that wraps each rank's failure of a save or load), when DCP is
    loaded: only a job that imported torch.distributed.checkpoint can raise it, and importing it here would cost
    every command (generate.py among them) 1.5-3.4 s of start-up, measured on the 2-core machine."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (api.CheckpointException,) if api is not None else ()


def same_file(a: str, b: str) -> bool:
    """Whether the paths name one file (links and hard links resolved); a missing one is no file."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
