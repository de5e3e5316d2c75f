"""The command shell: what every command shares and that knows no model. `shell` runs a command's job
and turns each way it can end into its exit code and one line (one-line errors, also into torchrun's
error file; the causes of failed reads and writes, files.py's; allocation failures; SIGINT / SIGTERM); around it,
the process group torchrun asks for, the check that every node sees a shared folder, logging from
rank 0 and the process exit; device and dtype resolution, the paper's seed, small figures (h:mm:ss,
peak memory) and the optional matplotlib import. The flags are flags.py's. generate.py, train.py,
router.py, evaluate.py and profiling.py run in it; it imports no model code, so every floor of the
house can sit on it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from shell import rendezvous
from shell.files import dcp_errors, os_cause, os_error

SEED = 42  # the paper's seed for every SFT and router-training job (Appendix A.1), and ours for every draw
SEEDS = "[0, 4294967295]"  # every seed flag's range: numpy's, and far below torch's 2**64 once train.py adds steps


class UsageError(ValueError):
    """Flags that turn out bad only once a file is read (a branch flag against the checkpoint it applies
    to): one line and exit 2, as a flag error found while parsing."""


def one_line(e: BaseException) -> str:
    """An error message folded onto one line (paths and causes can carry newlines)."""
    return " ".join(str(e).split())


# -- processes ----------------------------------------------------------------------------------


def rank() -> int:
    """This process's rank; before the process group starts, the one torchrun assigned."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def log(msg: str, stream=None, every_rank: bool = False) -> None:
    """A line for people, from rank 0 only (or every_rank): stderr by default (stdout stays for results)."""
    if every_rank or rank() == 0:
        print(msg, file=stream or sys.stderr, flush=True)


def start_processes(cuda: bool, always: bool = False) -> torch.device:
    """The process group torchrun asks for (RANK set: NCCL on CUDA, gloo on CPU), and this process's
    device. A plain `python` process runs alone with no group, or, with always (FSDP2 wants one), in a
    world of one over an in-process store. Ranks started without torchrun (RANK set by hand or by srun)
    meet at MASTER_ADDR:MASTER_PORT (rendezvous.py)."""
    if not dist.is_initialized():
        if "RANK" in os.environ:
            # Rank 0 may leave before the group is up (a second writer refused, outputs.one_writer): torchrun then
            # stops the others with SIGTERM, and a rank blocked in the rendezvous runs no Python handler, so
            # here SIGTERM keeps its default action (nothing is written yet) rather than wait out torchrun's
            # 30 s grace and its SIGKILL
            handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                # a torchrun worker: its agents have met
                if "TORCHELASTIC_USE_AGENT_STORE" in os.environ:
                    dist.init_process_group("nccl" if cuda else "gloo")
                else:  # RANK set by hand or by srun
                    rendezvous.join(
                        "nccl" if cuda else "gloo", rank(), lambda note: log(note, every_rank=True)
                    )
            except rendezvous.NoRendezvous as e:  # this rank's own wait
                raise RankError(str(e)) from None
            finally:
                signal.signal(signal.SIGTERM, handler)
        elif always:
            dist.init_process_group(
                "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
            )
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    return device


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def end_processes() -> None:
    """The last barrier (gloo can abort at exit without it) and the end of the process group."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def error(line: str, every_rank: bool = False, wait: bool = True) -> None:
    """A command's one-line error, on stderr, from rank 0 alone (an error every rank meets alike) or,
    every_rank, from each rank that meets it (the caller's line names the rank). Under torchrun it also goes to
    this worker's error file, TORCHELASTIC_ERROR_FILE, in the layout torch.distributed.elastic's
    `record` writes: torchrun's failure report prints that file as the root cause, so the line
    reaches the user even when torchrun stops this worker before its stderr is read. The message
    carries no traceback: the report shows the line itself. The other ranks wait for torchrun
    (wait_for_torchrun) unless wait is False: the caller then meets a barrier that holds them until
    rank 0 has reported."""
    if not every_rank and rank() != 0:
        if wait:
            wait_for_torchrun()
        return
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump(
                    {
                        "message": {
                            "message": line,
                            "extraInfo": {"timestamp": str(int(time.time()))},
                        }
                    },
                    f,
                )
        except OSError:
            pass  # the report then says "To enable traceback see ..."; the line below still goes out
    print(line, file=sys.stderr, flush=True)


# whether command() runs this process, which then exits when the job ends
_process = {"main": False}


def command(main):
    """The __main__ of a command: main() under torch.distributed.elastic's `record`, which writes an
    uncaught exception (a bug: its traceback is the useful report) to the error file torchrun reads,
    then exit_process with main's code. Its output never fails on a character its stream cannot encode
    (PYTHONIOENCODING=ascii, a C locale without UTF-8): such a character is written as a backslash escape."""
    _process["main"] = True
    # the imports are done: shell.early's "while starting" handler gives way to Python's (the job's are shell's)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    exit_process(record(main)() or 0)


def shell(job: Callable[[], int | None], interrupted: Callable[[], str] | None = None) -> int:
    """Run a command's job and turn every way it can end into the exit code and at most one line, the
    same in every command (docs/reliability.md). A command's main parses its flags (a bad flag exits 2
    there, OneLineParser) and hands its job here:

        0          the job returned (or the code it returned);
        1          bad input, any ValueError (data, a checkpoint, an image, a value found bad late):
                   "error: LINE" from rank 0 (every rank meets it alike); 2 for a UsageError;
                   a failed read or write: the file and its cause (os_error), from the rank that met it;
                   DCP's failed save: its cause (os_cause);
                   an allocation failure: the sizes and the flags that lower them (OutOfMemory), and
                   any failure only one rank meets (RankError), from the rank that met it;
                   a lost peer under torchrun: said by this rank, which leaves the report to the peer;
                   a closed output pipe (`| head`): quietly;
        130 / 143  SIGINT / SIGTERM (interruptible): "interrupted by SIGINT", then the job's own words
                   on what stays and how to go on (`interrupted()`), whatever the signal then caused
                   elsewhere (a peer's exit seen as a lost connection is still the signal's).

    Anything else is a bug and keeps its traceback. Under torchrun the line also goes to the worker's
    error file (error), and the process group ends here: with a last barrier when every rank met the
    same end, or at once (os._exit) when this rank's peers may be mid-collective or gone (end)."""
    code, alone, lost, waits = 0, False, False, False  # alone: leave without the last barrier
    try:
        with interruptible() as signals:
            try:
                code = job() or 0
                # a signal whose Interrupted was swallowed (raised where Python only prints it: a __del__, a
                # callback) still ends the command as interrupted, never as done
                check_interrupt()
                sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
                signals.armed = (
                    False  # each path disarms as its last step: a later signal raises nowhere
                )
            except (
                BrokenPipeError
            ):  # the reader left (`| head`): stop quietly, as command-line tools do
                # no second error at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                code, signals.armed = 1, False
            except (KeyboardInterrupt, *dcp_errors(), Exception) as e:
                code, alone, lost, waits = report(e, signals.received, interrupted)
                signals.armed = False
    finally:  # the handlers are gone: torchrun's SIGTERM to a rank that waits for it ends that rank quietly
        end(code, alone, lost, waits)
    return code


def report(
    e: BaseException, received: list[int], interrupted: Callable[[], str] | None
) -> tuple[int, bool, bool, bool]:
    """shell's table for a job that raised e: say it in one line (from the ranks that should) and return
    (exit code, leave alone without the last barrier, a peer was lost, the other ranks wait for torchrun).
    A bug is raised again, with its traceback."""
    many = dist.is_initialized() and dist.get_world_size() > 1
    who = f"rank {rank()}: " if many else ""  # a line only this rank may meet names it
    # the signal that raised it, else the first one
    if received or isinstance(e, KeyboardInterrupt):
        signum = (
            e.code - 128
            if isinstance(e, Interrupted)
            else received[0]
            if received
            else signal.SIGINT
        )
        words = interrupted() if interrupted is not None else ""
        log(f"interrupted by {signal.Signals(signum).name}" + (f": {words}" if words else ""))
        return 128 + signum, many, False, False
    # this rank's alone (its batch, its tracker): the others may be mid-collective
    if isinstance(e, RankError):
        error(f"error: {who}{e}", every_rank=True)
        return 1, many, False, False
    if isinstance(e, (ValueError, *dcp_errors())):  # alike on every rank
        error(f"error: {one_line(e) if isinstance(e, ValueError) else os_cause(e)}", wait=False)
        # the other ranks wait for torchrun; in a process group, the last barrier holds them
        return 2 if isinstance(e, UsageError) else 1, False, False, not dist.is_initialized()
    if isinstance(e, OSError):  # a file this rank could not read or write: maybe this rank's alone
        error(f"error: {who}{os_error(e)}", every_rank=True)
        return 1, many, False, False
    if isinstance(e, dist.DistBackendError) or "by peer" in str(
        e
    ):  # another rank left: it says why
        # a consequence: no error file, torchrun reports the cause
        log(f"error: lost contact with another rank ({one_line(e)[:200]})", every_rank=True)
        return 1, True, True, False
    raise e  # a bug: the traceback is the useful report


def end(code: int, alone: bool, lost: bool, waits: bool) -> None:
    """shell's last step under torchrun: the process group ends with the last barrier when every rank met the
    same end, or at once (os._exit) when peers may be gone or mid-collective; a rank that leaves the report to
    another waits for torchrun."""
    if dist.is_initialized():
        if alone:  # peers may be gone: no barrier to wait on, no teardown that can abort
            sys.stdout.flush(), sys.stderr.flush()
            if lost:
                wait_for_torchrun()
            os._exit(code)
        end_processes()  # its barrier: rank 0 has reported before any rank leaves
    elif waits and rank() != 0:
        wait_for_torchrun()


def wait_for_torchrun() -> None:
    """For a rank that is not the one to report: another rank meets the same error and reports it
    (rank 0, for an error every rank meets alike), or this rank only lost its peer to the failure that
    rank reports. Under torchrun, wait (at most 10 s) for torchrun to stop this process, so that the
    reporting rank exits first and torchrun's report names its error file as the root cause. Without
    the wait torchrun can see this rank fail first and stop the reporting one before its line is out,
    or, the report's timestamps being whole seconds, name this rank on a tie, with no message."""
    if "RANK" in os.environ:
        time.sleep(10)


def exit_process(code: int) -> NoReturn:
    """sys.exit for the __main__ of the commands, called once main() has passed its last barrier and
    destroyed the process group. On this torch build a gloo process can still abort in the
    interpreter's own teardown after that ("terminate called without an active exception", SIGABRT,
    which torchrun reports as a failed run; docs/reliability.md, "Under torchrun"). Every file is closed by then, so a
    process torchrun started flushes its output and leaves with os._exit, skipping that teardown; a
    plain `python` process exits as usual."""
    if "RANK" in os.environ:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM, raised where the command is (see interruptible); `code` is the
    exit code, 128 + the signal's number (130, 143)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.code = 128 + signum


@dataclass
class Signals:
    """The signals a command received, first first (what a signal then caused elsewhere, a peer's exit seen as
    a lost connection, is still the signal's), and whether the next one raises Interrupted (`armed`: while the
    job runs; shell disarms it once the job has ended, however it ended)."""

    received: list[int] = field(default_factory=list)
    armed: bool = True


@contextmanager
def interruptible():
    """SIGINT and SIGTERM raise Interrupted inside, so the command stops through its own finally
    blocks (a file half written removed, the ones complete kept) and says so in one line; the
    previous handlers come back after. Yields the Signals received.

    Idempotent: a signal that comes while an interrupt is being handled (a finally block, shell's line)
    or once the job has ended is recorded, not raised. Slurm signals every rank and torchrun forwards its
    own, so a second SIGTERM often follows the first within milliseconds; raised inside the print of the
    first's line, or in this block's own exit, it escaped as a traceback instead of 143. A process that was
    interrupted (command) then ignores every signal until it has exited with 130 / 143: their default action
    would end it as killed."""
    signals = Signals()
    _current.append(signals)

    def on_signal(signum, frame):
        signals.received.append(signum)
        # none is being handled
        if signals.armed and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            raise Interrupted(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield signals
    finally:
        _current.remove(signals)
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if signals.received and _process["main"] else handler)


_current: list[Signals] = []  # the Signals of the interruptible blocks running now, innermost last


def check_interrupt() -> None:
    """Raise Interrupted if a signal has arrived in the running job (interruptible) although nothing raised it
    where the job is: its Interrupted was raised where Python only prints an exception and goes on (a
    __del__, a weakref or C callback), so the job went on with half-done work (a model load cut short that
    answers every row with 0 tokens). A writer calls it before it records anything: an interrupted row is never
    recorded, at any moment. Nothing outside an interruptible block."""
    if _current and _current[-1].received:
        raise Interrupted(_current[-1].received[0])


def interrupt_handled() -> None:
    """The job has answered the signals received so far (generate.py's chat: Ctrl-C stops one answer and the
    conversation goes on): check_interrupt no longer raises for them."""
    if _current:
        _current[-1].received.clear()


class RankError(ValueError):
    """Bad input or a failure that only this rank meets (its batch's allocation, rank 0's tracker, its wait for
    the others): said by this rank, named as its own under torchrun, and it leaves at once (the others may be
    in a collective it will never join)."""


class OutOfMemory(RankError):
    """An allocation failed: one line naming the sizes that asked for it (a ValueError, so every
    command's one-line error path reports it)."""


@contextmanager
def allocation(sizes: str, lower: str):
    """Turn an allocation failure inside into OutOfMemory: `out of memory at SIZES; lower LOWER`. The
    CUDA caching allocator raises torch.OutOfMemoryError; the CPU allocator a RuntimeError
    ("DefaultCPUAllocator: can't allocate memory"); anything else passes through."""
    try:
        yield
    except RuntimeError as e:
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        raise OutOfMemory(f"out of memory at {sizes}; lower {lower}") from None


# -- devices and dtypes -------------------------------------------------------------------------


def hms(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend. matplotlib is optional (train.py plot, --plot,
    evaluate.py report): without it, one line saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "matplotlib is not installed (it draws the plot): pip install matplotlib"
        ) from None
    return plt
