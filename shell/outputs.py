"""Where a command writes: a folder or file checked before any work starts, one writer per output (a lock
held for the whole job, the second command refused in one line), a folder that every node of a job must
see (check_shared)."""

from __future__ import annotations

import errno
import os
import secrets
import socket
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from shell.cli import rank, world_size
from shell.files import os_cause


def check_folder(folder: Path, flag: str, given: Path | None = None) -> None:
    """A folder a command will write into may be missing, but no file (nor a link to nothing) may stand in
    its way: one line naming the flag's value (`given`, by default the folder) and that file, before any
    work."""
    above = next(p for p in (folder, *folder.parents) if p.exists() or p.is_symlink())
    if above.is_symlink() and not above.exists():
        raise ValueError(
            f"{flag} {given or folder}: {above} is a link to {os.readlink(above)}, which does not "
            f"exist"
        )
    if not above.is_dir():
        raise ValueError(f"{flag} {given or folder}: {above} is a file, not a folder")


def check_file_out(path: Path, flag: str) -> None:
    """A file a command will write (a plot): not a folder (matplotlib would write FOLDER.png beside it), and
    no file in the way of its folder; one line, before any work."""
    if path.is_dir():
        raise ValueError(
            f"{flag} {path}: a folder; give the file to write, such as {path / 'plot.png'}"
        )
    check_folder(path.parent, flag, given=path)


def make_folder(folder: Path, flag: str) -> None:
    """check_folder, then the folder made with its parents (a read-only file system is the OSError's
    own line)."""
    check_folder(folder, flag)
    folder.mkdir(parents=True, exist_ok=True)


@contextmanager
def one_writer(out: Path | None, flag: str = "--out"):
    """One output, one writer: an OS advisory lock (flock) on OUT.lock beside the output (a file or a
    folder) for as long as the command writes it. A second command at the same output is refused in one
    line before it reads or writes anything there; the kernel releases the lock of a process that dies
    however it dies (kill -9 too), so a crash never leaves a stale lock, only an empty OUT.lock that the
    next run takes over. Under torchrun one process holds it for the job: RANK 0, before the process
    group starts (the other ranks take none, so they cannot block one another). The lock is the output's
    where it lands (links resolved: another path to it meets the same lock), and it is never a link: one
    at OUT.lock is refused, not followed to create a file elsewhere. out None: no output, no lock."""
    if out is None or rank() != 0:
        yield
        return
    import fcntl  # POSIX: here, so that the shell imports everywhere

    out = Path(os.path.abspath(out))
    check_folder(out.parent, flag, given=out)
    lock = out.resolve().with_name(out.resolve().name + ".lock")
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except (
            OSError
        ) as e:  # a read-only or virtual file system (/proc), a folder without write permission
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise ValueError(
                    f"{flag} {out}: {lock} is a link to {os.readlink(lock)}, not a lock file; remove "
                    f"it"
                ) from None
            raise ValueError(f"{flag} {out}: cannot write there ({os_cause(e)})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"{flag} {out}: another process is writing it (it holds {lock}); wait for it to "
                f"finish or stop it, or pick another {flag}"
            ) from None
        try:  # the lock file may have been removed by its last holder between our open and our lock
            same = os.fstat(fd).st_ino == os.lstat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:  # removed while still held: a process waiting on the old file retries on a new one (above)
        try:
            os.unlink(lock)
        except OSError:
            pass
        os.close(fd)


def check_shared(folder: Path, flag: str) -> None:
    """More than one machine: every rank must see the folder that rank 0 creates and all ranks write
    into (a run's checkpoints, label chunks, prediction parts), so it must sit on a file system every
    node shares. Rank 0 leaves a marker with a random token there and every rank reads it back; if any
    cannot, every rank raises the same one line naming those ranks and their hosts. Collective: every
    rank calls it; a world of one returns at once."""
    if world_size() == 1:
        return
    token = [secrets.token_hex(8) if rank() == 0 else None]
    dist.broadcast_object_list(token)
    marker = folder / f".parvl-shared-{token[0]}"
    if rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        marker.write_text(token[0])
    dist.barrier()
    try:
        seen = marker.read_text() == token[0]
    except OSError:
        seen = False
    views: list = [None] * world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if rank() == 0:
        marker.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise ValueError(
            f"{flag} {folder}: {', '.join(blind)} cannot see this folder, which rank 0 (on {views[0][1]}) "
            f"writes; on more than one machine it must be on a file system every node shares "
            f'(docs/training.md, "More than one machine")'
        )
