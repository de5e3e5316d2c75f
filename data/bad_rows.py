"""Bad rows of a data set, and what a run records of its data: `validate` counts the bad rows of a whole
data set (train.py --validate-data), `check_bad_fraction` is the one rule for how many may be bad, and a
run's data files are fingerprinted (size and sha256) so that --resume on changed data is refused."""

from __future__ import annotations

import hashlib
import json
import os

import torch

from data.sft import BAD_REASONS, BadRow, SFTData, _bad_or_good


def validate(
    data: SFTData, num_workers: int = 0, bad_rows: list | None = None, max_listed: int = 20
) -> dict:
    """{"good": n, reason: count for each of BAD_REASONS} over every row after repeat_time.

    A repeated row is checked once and counted once per copy: whether a row is usable does not
    depend on its copy (only the JPEG qualities do). `bad_rows`, if given, receives the first
    `max_listed` BadRows (each names its file, line and reason).
    """
    rows, weight = [], []
    for k, d in enumerate(data.datasets):
        rows += range(data.starts[k], data.starts[k] + d["kept"])
        weight += [d["repeat"]] * d["kept"]
    counts = dict.fromkeys(("good",) + BAD_REASONS, 0)
    loader = torch.utils.data.DataLoader(
        data, sampler=rows, batch_size=None, collate_fn=_bad_or_good, num_workers=num_workers
    )
    for outcome, w in zip(loader, weight):
        counts[outcome if outcome == "good" else outcome.reason] += w
        if outcome != "good" and bad_rows is not None and len(bad_rows) < max_listed:
            bad_rows.append(outcome)
    return counts


MAX_NAMED = 20  # bad rows named one by one (per rank in training, in all for --validate-data)


def report_bad_rows(data: SFTData, max_bad_frac: float) -> None:
    """train.py --validate-data: the first MAX_NAMED bad rows named (file:line, why), then the counts
    of the whole data set as one JSON line on stdout, then the bad-row rule (check_bad_fraction)."""
    bad: list[BadRow] = []
    counts = validate(data, bad_rows=bad, max_listed=MAX_NAMED)
    for b in bad:
        print(f"bad row: {b.detail} [{b.reason}]")
    if sum(counts[r] for r in BAD_REASONS) > len(bad):
        print(f"... and {sum(counts[r] for r in BAD_REASONS) - len(bad)} more bad rows")
    print(json.dumps(counts))
    check_bad_fraction(counts, len(data), max_bad_frac)


def check_bad_fraction(bad: dict, rows: int, max_bad_frac: float) -> None:
    """The one rule for bad rows, in --validate-data, training and labelling alike: more than
    max_bad_frac of the data set's `rows` (after repeat_time) bad is too many. `bad` maps reasons
    to the bad rows met so far: all of them (validate), or those of the steps run so far (training).
    So training stops on exactly the data sets --validate-data refuses, at the step where the count
    passes the bound, and never on one it passes."""
    n = sum(bad.get(r, 0) for r in BAD_REASONS)
    if n > max_bad_frac * rows:
        raise ValueError(
            f"{n} of the data set's {rows} rows are bad ({n / rows:.2%} > --max-bad-frac "
            f"{max_bad_frac:.2%}): { {r: bad[r] for r in BAD_REASONS if bad.get(r)} }"
        )


def data_files(data: SFTData) -> dict[str, str]:
    """What the rows are read from, file by file: the meta JSON and every annotation file it names, each as
    "BYTES bytes, sha256 HEX16", by its role ("meta JSON", "dataset NAME": a copy elsewhere is the same data).
    train.py records it in the run; a resume on files that changed since is refused (data_change)."""
    files = {"meta JSON": data.meta_path} | {
        f"dataset {d['name']}": d["path"] for d in data.datasets
    }
    found = {}
    for role, path in files.items():
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
            found[role] = f"{os.fstat(f.fileno()).st_size} bytes, sha256 {digest}"
    return found


def data_change(was: dict[str, str], now: dict[str, str], data: SFTData) -> str | None:
    """How the data files `now` (data_files of `data`) differ from those a run recorded, `was`: one line naming
    both fingerprints (a hash of all the files) and the first file that changed; None when none did."""
    if was == now:
        return None
    role = next(k for k in [*now, *was] if was.get(k) != now.get(k))
    paths = {"meta JSON": data.meta_path} | {
        f"dataset {d['name']}": d["path"] for d in data.datasets
    }
    whole = [
        hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()[:16] for x in (was, now)
    ]
    return (
        f"data {whole[0]} then, {whole[1]} now: {role} ({paths.get(role, 'not in the meta JSON now')}) was "
        f"{was.get(role, 'not there')}, is {now.get(role, 'not there')} now"
    )
