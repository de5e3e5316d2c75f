"""The first import of every command: a Ctrl-C during the seconds its imports take (torch, safetensors) ends it
with exit 130 and one line, not a KeyboardInterrupt traceback, until the shell takes SIGINT over (cli.interruptible
while the job runs). It imports nothing heavy and does nothing unless a command is the script being run (a test
importing a command keeps its own Ctrl-C)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

COMMANDS = ("train.py", "generate.py", "evaluate.py", "router.py", "profiling.py", "study.py")


def on_sigint(signum, frame) -> None:
    """Nothing is written before the job starts: say so and leave at once (os._exit: no half-imported module's
    teardown runs)."""
    print("interrupted by SIGINT while starting: nothing written", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)


if Path(getattr(sys.modules.get("__main__"), "__file__", None) or "").name in COMMANDS:
    signal.signal(signal.SIGINT, on_sigint)
