"""train.py with one fault injected, for the tests (not collected by pytest): the production code has
no test hooks, so the faults are put in here by replacing the function they happen in.

    python tests/faults.py stop-after=2 TRAIN_FLAGS...        # leave after step 2's checkpoint, as if killed
    python tests/faults.py nan-step=2 TRAIN_FLAGS...          # step 2's loss is NaN
    python tests/faults.py save-error=ENOSPC:4 TRAIN_FLAGS... # the save of step 4 fails with ENOSPC after its shards
    python tests/faults.py oom=2:1 TRAIN_FLAGS...             # rank 1's first micro-batch of step 2 cannot allocate
"""

import errno
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import train  # noqa: E402
from shell.cli import exit_process  # noqa: E402
from training import step as train_step  # noqa: E402


class Stop(BaseException):
    """Leaves the run the way a kill does (not an Exception: train.main lets it pass, after its cleanup)."""


fault, _, value = sys.argv[1].partition("=")
if fault == "stop-after":
    save_checkpoint = train.save_checkpoint

    def save_then_stop(model, optim, sched, step, *args):
        save_checkpoint(model, optim, sched, step, *args)
        if step >= int(value):
            raise Stop

    train.save_checkpoint = save_then_stop
elif fault == "nan-step":
    clip, micro_loss, steps = torch.nn.utils.clip_grad_norm_, train_step.micro_loss, [0]

    def count_steps(*args, **kwargs):  # called once per optimizer step, after its micro-batches
        steps[0] += 1
        return clip(*args, **kwargs)

    def nan_loss(*args):  # the loss of every micro-batch of step `value`
        loss, ent = micro_loss(*args)
        return (loss * float("nan"), ent) if steps[0] + 1 == int(value) else (loss, ent)

    torch.nn.utils.clip_grad_norm_ = count_steps
    train_step.micro_loss = nan_loss
elif fault == "save-error":
    name, step = value.split(":")
    save = dcp.save

    def save_then_fail(state, checkpoint_id, **kwargs):  # as if the disk filled up after the shards
        save(state, checkpoint_id=checkpoint_id, **kwargs)
        if Path(checkpoint_id).name == f"step_{step}.tmp":
            code = getattr(errno, name)
            raise OSError(code, os.strerror(code), str(Path(checkpoint_id) / ".metadata"))

    dcp.save = save_then_fail
elif fault == "oom":
    step, rank = map(int, value.split(":"))
    micro_loss, calls = train_step.micro_loss, [0]

    # the CPU allocator's words; the first micro-batch of each step counts it
    def allocation_fails(*args):
        calls[0] += 1
        if calls[0] == step and int(os.environ.get("RANK", 0)) == rank:
            raise RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 37591663152 bytes."
            )
        return micro_loss(*args)

    train_step.micro_loss = allocation_fails
else:
    sys.exit(f"tests/faults.py: unknown fault {sys.argv[1]!r}")

try:
    code = train.main(sys.argv[2:])
except Stop:
    code = 0
exit_process(code)
