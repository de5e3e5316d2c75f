"""Samples into steps: the batches of one optimizer step for one rank (train.py, router.py label).

`collate` pads a micro-batch of one sample per row; `pack_rows` / `collate_packed` put several samples
in each row (their Eq. 6 weights are loss.py's); `RankSampler` / `make_loader` cut a seeded epoch
order into global batches, ranks and micro-batches so that resuming and re-sharding never change which
rows a step sees.

    order = data.epoch_order(seed=42)
    for step, batches in make_loader(data, order, rank, world, 512, 1, 0, 8, pad_id, packing=True):
        ...  # each batch: input_ids [B,T], labels [B,T], segment_ids [B,T], pixel_values [N,3,448,448]

Packing (`make_loader(packing=True)`, train.py's default). The bounded buffer is this rank's share of
one optimizer step (global_batch / world samples, in the seeded order), so a step keeps exactly its
samples and resuming keeps its meaning. First fit in order: each sample goes into the first row that
still has room for it within max_seq_len tokens, else opens a new row; micro-batches are
`micro_batch` consecutive rows, padded to their longest row. The only waste is that padding (train.py
logs it as pad_frac): none with one row per micro-batch, the default; 10-13 % at 2-4 rows per forward
for 64 samples of 0-12 tiles per rank and step at 32K tokens (a step's last rows are part-empty).
The number of micro-batches then differs between ranks and steps; train.py evens it out.
"""

import os
import signal
import sys
from dataclasses import dataclass, field
from functools import partial

import torch

from data.processor import IMAGE_SIZE
from data.sft import BadRow, Sample, SFTData
from loss import IGNORE
from packing import pack_rows

# ---------------------------------------------------------------------------------------------
# Batching and loss weights


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with pad_id
    labels: torch.Tensor  # [B, T] int64, IGNORE on padding and bad rows
    attention_mask: torch.Tensor  # [B, T] bool, True on real tokens and on a bad row's dummy
    position_ids: torch.Tensor  # [B, T] int64, 0.. per sample (restarts per sample when packed)
    pixel_values: torch.Tensor  # [N, 3, 448, 448] float32, tiles of all samples in row order
    num_tiles: list[int]  # tiles per batch row (0 for text-only and bad rows), sums to N
    num_samples: int  # good rows
    bad: dict = field(default_factory=dict)  # reason -> count of bad rows in this batch
    rows: list[int] = field(default_factory=list)  # global row index of each sample, in batch order
    segment_ids: torch.Tensor | None = (
        None  # [B, T] int64 when packed: sample 0, 1, ... of the row, then padding
    )
    # global row index of each bad row counted in `bad`
    bad_rows: list[int] = field(default_factory=list)


def collate(items: list, pad_id: int, image_size: int = IMAGE_SIZE) -> Batch:
    """Right-pad samples into one Batch; a BadRow becomes a 1-token dummy row with no labels.

    Keeping bad rows as rows (instead of dropping them) keeps B and every row's position fixed, so
    a global batch means the same thing however it is split over ranks and micro-batches (packed
    batches, collate_packed, drop them and only count them).
    """
    lengths = [len(s.input_ids) if isinstance(s, Sample) else 1 for s in items]
    B, T = len(items), max(lengths, default=1)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    bad: dict[str, int] = {}
    for b, s in enumerate(items):
        if isinstance(s, Sample):
            input_ids[b, : lengths[b]], labels[b, : lengths[b]] = s.input_ids, s.labels
        else:
            bad[s.reason] = bad.get(s.reason, 0) + 1
        # The dummy token of a bad row is "attended": a row whose keys are all masked makes SDPA
        # return NaN, and 0 * NaN would poison the weighted loss sum.
        mask[b, : lengths[b]] = True
    pix = [s.pixel_values for s in items if isinstance(s, Sample)]
    pixel_values = torch.cat(pix) if pix else torch.zeros(0, 3, image_size, image_size)
    return Batch(
        input_ids,
        labels,
        mask,
        torch.arange(T).expand(B, T).contiguous(),
        pixel_values,
        [sum(s.num_tiles) if isinstance(s, Sample) else 0 for s in items],
        sum(isinstance(s, Sample) for s in items),
        bad,
        [s.row for s in items],
        bad_rows=[s.row for s in items if isinstance(s, BadRow)],
    )


def collate_packed(rows: list[list[Sample]], pad_id: int, image_size: int = IMAGE_SIZE) -> Batch:
    """Samples packed into rows: each row holds its samples one after another, right-padded to the
    longest row; segment_ids number the samples of a row 0, 1, ... and the padding after them gets the
    next id; positions restart per sample; the tiles follow row by row, sample by sample."""
    T = max((sum(len(s.input_ids) for s in row) for row in rows), default=1)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    segments, positions = (
        torch.zeros((B, T), dtype=torch.long),
        torch.zeros((B, T), dtype=torch.long),
    )
    for b, row in enumerate(rows):
        t = 0
        for k, s in enumerate(row):
            n = len(s.input_ids)
            input_ids[b, t : t + n], labels[b, t : t + n], segments[b, t : t + n] = (
                s.input_ids,
                s.labels,
                k,
            )
            positions[b, t : t + n], mask[b, t : t + n] = torch.arange(n), True
            t += n
        segments[b, t:] = len(row)
    samples = [s for row in rows for s in row]
    pix = [s.pixel_values for s in samples]
    pixel_values = torch.cat(pix) if pix else torch.zeros(0, 3, image_size, image_size)
    return Batch(
        input_ids,
        labels,
        mask,
        positions,
        pixel_values,
        [sum(sum(s.num_tiles) for s in row) for row in rows],
        len(samples),
        {},
        [s.row for s in samples],
        segments,
    )


def pack_step(
    items: list, max_seq_len: int, rows_per_batch: int, pad_id: int, image_size: int = IMAGE_SIZE
) -> list[Batch]:
    """One rank's samples of one optimizer step -> its packed micro-batches (pack_rows, then
    rows_per_batch rows each). Bad rows take no room; they are counted in the first micro-batch."""
    good = [s for s in items if isinstance(s, Sample)]
    rows = [
        [good[i] for i in row] for row in pack_rows([len(s.input_ids) for s in good], max_seq_len)
    ]
    batches = [
        collate_packed(rows[i : i + rows_per_batch], pad_id, image_size)
        for i in range(0, len(rows), rows_per_batch)
    ]
    bad = [s for s in items if isinstance(s, BadRow)]
    if bad:
        if not batches:
            batches.append(filler_batch(pad_id, image_size))
        for s in bad:
            batches[0].bad[s.reason] = batches[0].bad.get(s.reason, 0) + 1
            batches[0].bad_rows.append(s.row)
    return batches


def filler_batch(pad_id: int, image_size: int = IMAGE_SIZE) -> Batch:
    """A packed micro-batch with no sample (one pad token, no label): a rank with fewer micro-batches
    than the others in a step runs these, so every rank issues the same FSDP collectives."""
    one = torch.full((1, 1), pad_id, dtype=torch.long)
    return Batch(
        one,
        torch.full_like(one, IGNORE),
        torch.zeros((1, 1), dtype=torch.bool),
        torch.zeros_like(one),
        torch.zeros(0, 3, image_size, image_size),
        [0],
        0,
        {},
        [],
        torch.zeros_like(one),
    )


# ---------------------------------------------------------------------------------------------
# Order, ranks, micro-batches


class RankSampler:
    """This rank's micro-batches of row indices, global step by global step, from start_step.

    Global step s covers order[s*G : (s+1)*G]; rank r takes the r-th contiguous G/world slice and
    cuts it into micro-batches. So the rows of a global batch do not depend on the world size, and
    starting at step k yields exactly the tail of a run from step 0. A last partial global batch is
    dropped, so every step has G rows (and the same loss normalisation). Iterating yields lists of
    row indices (a DataLoader batch_sampler); `schedule()` yields the matching (step, micro_index).
    """

    def __init__(
        self,
        order,
        rank: int,
        world: int,
        global_batch: int,
        micro_batch: int | None = None,
        start_step: int = 0,
    ):
        local = global_batch // world
        micro_batch = micro_batch or local
        assert 0 <= rank < world and global_batch % world == 0 and local % micro_batch == 0, (
            f"need 0 <= rank < world, world | global_batch, micro_batch | global_batch/world; "
            f"got rank={rank} world={world} global_batch={global_batch} micro_batch={micro_batch}"
        )
        self.order = torch.as_tensor(order, dtype=torch.long)
        self.rank, self.local, self.micro, self.G = rank, local, micro_batch, global_batch
        self.num_steps = len(self.order) // global_batch
        self.start_step = start_step

    def rows(self, step: int) -> list[int]:
        """This rank's rows of global step `step`."""
        a = step * self.G + self.rank * self.local
        return self.order[a : a + self.local].tolist()

    def schedule(self):
        for step in range(self.start_step, self.num_steps):
            for m in range(self.local // self.micro):
                yield step, m

    def __iter__(self):
        for step, m in self.schedule():
            yield self.rows(step)[m * self.micro : (m + 1) * self.micro]

    def __len__(self) -> int:
        return max(0, self.num_steps - self.start_step) * (self.local // self.micro)


def make_loader(
    data: SFTData,
    order,
    rank: int,
    world: int,
    global_batch: int,
    micro_batch: int,
    start_step: int,
    num_workers: int,
    pad_id: int,
    pin_memory: bool = False,
    packing: bool = False,
):
    """Yield (step, [Batch, ...]) for this rank, one optimizer step at a time, decoding images in
    worker processes. Unpacked: global_batch / world / micro_batch micro-batches of micro_batch
    samples, one per row (collate). Packed: the step's samples packed into rows of at most
    data.max_seq_len tokens, micro_batch rows per micro-batch (pack_step; see the module docstring).

    The DataLoader returns items in sampler order whatever the number of workers, and every row
    is a pure function of its index (augmentation included), so the output does not depend on
    num_workers.
    """
    if packing:  # samples travel one by one (every worker decodes some); the step is packed here
        sampler = RankSampler(order, rank, world, global_batch, None, start_step)
        indices = (i for step in range(start_step, sampler.num_steps) for i in sampler.rows(step))
        loader = iter(
            torch.utils.data.DataLoader(
                data,
                sampler=indices,
                batch_size=None,
                collate_fn=keep,
                num_workers=num_workers,
                worker_init_fn=leave_signals_to_the_trainer,
            )
        )
        for step in range(start_step, sampler.num_steps):
            items = [next(loader) for _ in range(sampler.local)]
            yield step, pack_step(items, data.max_seq_len, micro_batch, pad_id, data.image_size)
        return
    sampler = RankSampler(order, rank, world, global_batch, micro_batch, start_step)
    loader = torch.utils.data.DataLoader(
        data,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=partial(collate, pad_id=pad_id, image_size=data.image_size),
        pin_memory=pin_memory,
        worker_init_fn=leave_signals_to_the_trainer,
    )
    per_step = sampler.local // sampler.micro
    batches = []
    for (step, m), batch in zip(sampler.schedule(), loader, strict=True):
        batches.append(batch)
        if m == per_step - 1:
            yield step, batches
            batches = []


# ---------------------------------------------------------------------------------------------
# Loader workers


def keep(item):
    return item  # a DataLoader collate_fn that passes one Sample or BadRow through (module level: picklable)


def leave_signals_to_the_trainer(worker_id: int) -> None:
    """Ctrl-C or a SIGTERM sent to the process group reaches the loader workers too: they ignore it,
    the trainer stops (one line) and shuts them down, instead of each dying with its own report.
    A trainer that stops while it fetches a batch cuts the connection of the worker's fd-sharing
    thread (multiprocessing.resource_sharer) short, mid-handshake or mid-send (EOFError, a broken
    pipe, a reset), which it reports through sys.excepthook: that alone is quiet."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    report = sys.excepthook

    def quiet_if_the_trainer_left(kind, value, tb):
        if not issubclass(kind, (EOFError, ConnectionError)):
            report(kind, value, tb)

    sys.excepthook = quiet_if_the_trainer_left


def default_workers() -> int:
    """Data loading processes per rank: 4, or fewer when this process may use fewer CPUs per local rank."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
