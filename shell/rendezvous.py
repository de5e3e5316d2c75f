"""Where ranks started without torchrun meet (RANK and WORLD_SIZE set by hand, or by srun from SLURM_PROCID):
rank 0 hosts a TCP store at MASTER_ADDR:MASTER_PORT and the others join it, within RENDEZVOUS_S, each saying
after WAITING_NOTE_S what it waits for. torch's own env:// rendezvous waits the process group's timeout
(30 min; the group keeps it, for the collectives of a long job) in silence, then prints C++ stack frames: this
wait is polled from Python and ends in one line. cli.start_processes calls it; it knows no command.
Run the tests: python -m pytest tests/test_shell.py -q -k torchrun
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

RENDEZVOUS_S = (
    900  # how long ranks started without torchrun wait for each other: torchrun's own default
)
WAITING_NOTE_S = 5  # after this long, a waiting rank says what it waits for
START = "start every rank (torchrun --nproc-per-node N ... starts and joins them), or unset RANK to run alone"


class NoRendezvous(ValueError):
    """The ranks did not meet: one line naming this rank, the place and the cause."""


def join(backend: str, me: int, say: Callable[[str], None]) -> None:
    """This rank's process group with WORLD_SIZE - 1 others at MASTER_ADDR:MASTER_PORT; `say` prints the note
    of a rank still waiting. Every rank waits for all (rank 0 included), so none starts a collective alone."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    who, addr, port = (
        f"rank {me} of {world}",
        os.environ.get("MASTER_ADDR"),
        os.environ.get("MASTER_PORT", ""),
    )
    if not addr or not port.isdigit():
        raise NoRendezvous(
            f"{who}: RANK is set, so this process waits for its peers, but MASTER_ADDR and "
            f"MASTER_PORT ({addr!r}, {port!r}) name no place to meet; {START}"
        )
    waits = (
        f"for rank 0 at {addr}:{port}"
        if me
        else f"at {addr}:{port} for the other {world - 1} rank(s)"
    )
    note = threading.Timer(
        WAITING_NOTE_S,
        say,
        (
            f"{who}: waiting {waits} (RANK and WORLD_SIZE are set, without "
            f"torchrun; at most {RENDEZVOUS_S} s)",
        ),
    )
    note.daemon, deadline, joined = True, time.monotonic() + RENDEZVOUS_S, 0
    note.start()
    try:
        if me:  # the port must accept before the store's client connects: its own retries log C++ frames
            while not port_open(addr, int(port)):
                if time.monotonic() > deadline:
                    raise NoRendezvous(
                        f"{who}: no rendezvous {waits} within {RENDEZVOUS_S} s (nothing listens "
                        f"there); {START}"
                    )
                time.sleep(0.2)
        store = dist.TCPStore(
            addr,
            int(port),
            world,
            is_master=me == 0,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
        )
        joined = store.add("parvl/joined", 1)
        while joined < world and time.monotonic() < deadline:
            time.sleep(0.2)
            joined = store.add("parvl/joined", 0)
    except RuntimeError as e:  # DistNetworkError: no rank 0 there; an address in use
        raise NoRendezvous(
            f"{who}: no rendezvous {waits} ({' '.join(str(e).split())[:160]}); {START}"
        ) from None
    finally:
        note.cancel()
    if joined < world:
        raise NoRendezvous(
            f"{who}: no rendezvous {waits} within {RENDEZVOUS_S} s ({joined} of {world} ranks "
            f"came); {START}"
        )
    dist.init_process_group(backend, store=store, rank=me, world_size=world)


def port_open(addr: str, port: int) -> bool:
    """Whether something accepts connections at addr:port (a store that is up)."""
    try:
        socket.create_connection((addr, port), timeout=1).close()
        return True
    except OSError:
        return False
