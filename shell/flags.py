"""Flags, declared once: each command's flags are the fields of its config dataclass.

    @dataclass
    class Config:
        max_new_tokens: int = flag(512, "token budget per answer", unit="tokens", range="[1, inf)")
        dtype: str | None = flag(None, "weights and activations", choices=["bf16", "fp32"], shown="bf16 on CUDA")

        def check(self):  # optional: flags that exclude each other
            ...

    cfg = parse(command_parser("What the command does.", Config), argv)

A field's metadata is its flag: the help as --help shows it (with the unit, the range and the default),
its range as an interval checked once for every command (out_of_range: "--top-p must be in (0, 1],
got 1.5"), its choices, what a path flag's command does there (reads, writes: an output is never an input,
output_is_input, checked once for every command too), and what argparse needs beyond that. A bad flag is
one line and exit 2 (OneLineParser), from rank 0 alone under torchrun. This is the shell: it knows no model
(ParConfig's fields as branch flags are inference/flags.py's).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, dataclass, field, fields
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Callable

from shell.cli import error, one_line, shell
from shell.outputs import one_writer


def out_of_range(values, ranges: dict[str, str]) -> str | None:
    """The first field of `values` (a config, or any object with those attributes) whose value lies outside
    its interval ("[1, inf)", "(0, 1]", ...), as one line ("--top-p must be in (0, 1], got 1.5"), or None.
    None (not given) passes; a list is checked element by element."""
    for name, interval in ranges.items():
        value = getattr(values, name, None)
        low, high = (float(x) for x in interval[1:-1].split(","))
        inside = [
            (low < x or interval[0] == "[" and x == low)
            and (x < high or interval[-1] == "]" and x == high)
            for x in (value if isinstance(value, list) else [value])
            if x is not None
        ]
        if not all(inside):
            low = int(low) if low.is_integer() else low
            bound = (
                (f">= {low}" if interval[0] == "[" else f"> {low}")
                if high == float("inf")
                else f"in {interval}"
            )
            return f"--{name.replace('_', '-')} must be {bound}, got {value}"
    return None


class OneLineParser(argparse.ArgumentParser):
    """A flag error is one line, not the usage of every flag, and exits 2 (argparse's code); under
    torchrun only rank 0 prints it (every rank parses the same flags). A flag is taken only as spelled
    whole: argparse's abbreviations (allow_abbrev) are refused, so `--overwr` is no `--overwrite` that a
    requeue's `--resume` (slurm/parvl.sbatch), or a later flag named alike, would then contradict."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **{"allow_abbrev": False, **kw})

    def error(self, message: str):
        error(f"{self.prog}: error: {message} (see --help)")
        sys.exit(2)


def flag(
    default=None,
    help: str = "",
    *,
    range: str | None = None,
    choices=None,
    unit: str | None = None,
    shown: str | None = None,
    factory=None,
    reads=None,
    writes=None,
    **argparse_kw,
):
    """A config dataclass field that is also a command-line flag: its help (with unit, range and
    default, as --help shows them), its range as an interval ("[1, inf)", "(0, 1]"; checked once for
    every command, see parse), its choices, and what argparse needs beyond that (positional=True,
    nargs, metavar, type, required). `shown` is the default as the help says it ("the checkpoint's");
    `factory` makes a default that is a list, or one read at start (an environment variable). A flag
    that names a path says what the command does there: `reads` or `writes` True for the path itself (a
    file, or a folder and everything in it), or the names in the folder it reads or writes ("metrics.jsonl",
    "vlmeval/dataset/utils": a sub-folder, part by part,
    "heatmap_*.png"); an output is never an input (output_is_input, checked at parse)."""
    meta = {
        "help": help,
        "range": range,
        "choices": choices,
        "unit": unit,
        "shown": shown,
        "reads": reads,
        "writes": writes,
        **argparse_kw,
    }
    meta = {k: v for k, v in meta.items() if v is not None}
    return (
        field(default_factory=factory, metadata=meta)
        if factory
        else field(default=default, metadata=meta)
    )


FLAG_TYPES = {"int": int, "float": float, "str": str}


def add_flags(p: argparse.ArgumentParser, cls) -> None:
    """One argparse argument per field of cls that carries a help (flag()): `--max-new-tokens` for
    max_new_tokens, its type from the annotation (a list: nargs="+"), a bool as --x / --no-x."""
    for f in fields(cls):
        m = dict(f.metadata)
        if "help" not in m:
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        help_ = m.pop("help")
        # the paths' roles: output_is_input's, not argparse's
        (m.pop("reads", None), m.pop("writes", None))
        notes = [m.pop("unit", None), m.pop("range", None) and f"in {f.metadata['range']}"]
        shown = m.pop("shown", None)
        if shown is not None or (default not in (None, "", [], False) and not m.get("positional")):
            notes.append(f"default {shown if shown is not None else default_text(default)}")
        notes = [n for n in notes if n]
        if notes:  # "rank (the paper's best; in [1, inf); default 16)": one pair of brackets
            help_ = (
                f"{help_[:-1]}; {'; '.join(notes)})"
                if help_.endswith(")")
                else f"{help_} ({'; '.join(notes)})"
            )
        kw = {"help": help_}
        # a string under __future__
        annotation = f.type.__name__ if isinstance(f.type, type) else str(f.type)
        many = annotation.startswith("list[")
        kind = FLAG_TYPES.get(
            annotation.removeprefix("list[").removesuffix("]").split("|")[0].strip()
        )
        if m.pop("positional", False):
            p.add_argument(f.name, **{"type": kind} | kw | m)
        elif annotation.startswith("bool"):
            p.add_argument(
                "--" + f.name.replace("_", "-"),
                action=argparse.BooleanOptionalAction,
                default=default,
                **kw | m,
            )
        else:
            p.add_argument(
                "--" + f.name.replace("_", "-"),
                default=default,
                **{"type": kind} | ({"nargs": "+"} if many else {}) | kw | m,
            )


def reuse_flag(cls, name: str):
    """Field `name` of another config class, as a flag of this one: declared once, there (its default, help,
    range and choices), for a command that takes that flag and not its siblings.

        dtype: str | None = reuse_flag(DeviceFlags, "dtype")    # router.py: --dtype, as every command has it
    """
    f = next(f for f in fields(cls) if f.name == name)
    if f.default_factory is not MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(default=f.default, metadata=f.metadata)


def default_text(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def command_parser(description: str, config, **kw) -> "OneLineParser":
    """The parser of one config dataclass's fields (a command without subcommands, or one subcommand)."""
    p = OneLineParser(description=description, **kw)
    add_flags(p, config)
    p.configs = {None: config}
    return p


def parse(p: "OneLineParser", argv=None):
    """The config the flags say, its ranges checked (out_of_range) and then its `check()`, if it has
    one, for flags that exclude each other: either failing is one line and exit 2, as argparse's own errors."""
    return parse_named(p, argv)[1]


def parse_named(p: "OneLineParser", argv=None) -> tuple[str | None, Any]:
    """parse, and the subcommand it chose (None for a parser without subcommands)."""
    values = vars(p.parse_args(argv))
    name = values.pop("command", None)
    cfg = p.configs[name](**values)
    if why := out_of_range(
        cfg, {f.name: f.metadata["range"] for f in fields(cfg) if "range" in f.metadata}
    ):
        p.error(why)
    try:
        getattr(cfg, "check", lambda: None)()
    except ValueError as e:
        p.error(one_line(e))
    if why := output_is_input(cfg):
        p.error(why)
    return name, cfg


# -- an output is never an input ---------------------------------------------------------------------


def areas(cfg, role: str) -> list[tuple[str, str, Path, str | None]]:
    """What the flags of `role` ("reads" or "writes", flag()'s) cover, as (flag, value, path, name): name None
    for the path itself (a file, or a folder and everything in it), else the entries of folder `path` whose name
    matches it (a glob), each with everything in it. A path is where it lands: links resolved."""
    found = []
    for f in fields(cfg):
        names, value = f.metadata.get(role), getattr(cfg, f.name)
        name = f.name.upper() if f.metadata.get("positional") else "--" + f.name.replace("_", "-")
        values = value if isinstance(value, list) else [value]
        # action="append" groups: a name (a scale's), then its paths
        if values and isinstance(values[0], list):
            values = [v for group in values for v in group[1:]]
        for v in values if names else ():
            if v:  # None or "": not given
                found += [
                    (name, str(v), Path(v).resolve(), n)
                    for n in ([None] if names is True else names)
                ]
    return found


def overlap(a: tuple[Path, str | None], b: tuple[Path, str | None]) -> Path | None:
    """A path in both areas (path, name) of `areas`, or None: one area's top (the path, or its entry of that name)
    is the other's or lies inside it, or a glob's folder does. A file and a hard link to it are one."""

    def inside(x: Path, area) -> bool:  # x is the area's top or lies below it
        top, name = area
        if name is None:
            return (
                x == top
                or top in x.parents
                or x.exists()
                and top.exists()
                and os.path.samefile(x, top)
            )
        # a name of several parts ("vlmeval/dataset/utils"): that sub-folder of the folder, part by part
        want, got = name.split("/"), x.relative_to(top).parts if top in x.parents else ()
        return len(got) >= len(want) and all(fnmatch(g, w) for g, w in zip(got, want))

    for (folder, name), other in ((a, b), (b, a)):
        top = folder if name is None else folder / name
        if not any(c in (name or "") for c in "*?[") and inside(top, other):
            return top
        # every entry of a glob whose folder lies in the other
        if other[1] is None and inside(folder, other):
            return top
    return None


def output_is_input(cfg) -> str | None:
    """An output flag that would write what an input flag reads (--out onto --predictions, a plot onto the run's
    metrics.jsonl, a run folder over its --model), or what another output flag writes, as one line; None when
    none does. Every command's flags pass here (parse): a flag that names a path says so (flag()'s reads, writes)."""
    written = areas(cfg, "writes")
    others = [(x, "reads", "an output is never an input") for x in areas(cfg, "reads")] + [
        (x, "writes too", "two outputs never share a path") for x in written
    ]
    for flag_, value, *w in written:
        for (other, other_value, *r), does, rule in others:
            if other != flag_ and (path := overlap(w, r)) is not None:
                return (
                    f"{flag_} {value}: would write {path}, which {other} {other_value} {does}; {rule}: pick "
                    f"another {flag_}"
                )
    return None


# -- one dispatch: a command is a table of (sub)commands ------------------------------------------


@dataclass(frozen=True)
class Command:
    """One command, or one subcommand of it: the config class its flags fill (flag()), the job run on that
    config, what it does in a line (its --help), and, for a job that writes an output, that output
    (writes(cfg): outputs.one_writer holds it for the job) and what an interrupt leaves of it (interrupted(cfg))."""

    config: type
    job: Callable[[Any], int | None]
    help: str = ""
    writes: Callable[[Any], Path | None] | None = None
    interrupted: Callable[[Any], str] | None = None


def parse_command(
    description: str, table: dict[str | None, Command], argv=None, prog: str | None = None
) -> tuple[str | None, Any]:
    """The name of the (sub)command argv asks for and its config. Named entries are subcommands
    (`evaluate.py run ...`; a missing or unknown one is argparse's one line about `cmd`); an entry named None
    is the command's own flags, taken when argv does not start with a subcommand's name (`train.py ...`
    beside `train.py plot RUN`)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    named = {name: c for name, c in table.items() if name is not None}
    if None not in table:
        p = OneLineParser(description=description, prog=prog)
        sub = p.add_subparsers(dest="command", required=True, metavar="cmd")
        for name, c in named.items():
            add_flags(sub.add_parser(name, help=c.help, description=c.help), c.config)
        p.configs = {name: c.config for name, c in named.items()}
        return parse_named(p, argv)
    if argv[:1] and argv[0] in named:
        c = named[argv[0]]
        return argv[0], parse(command_parser(c.help, c.config, prog=f"{prog} {argv[0]}"), argv[1:])
    epilog = "; ".join(
        f"{prog} {name}: {c.help} ({prog} {name} --help)" for name, c in named.items()
    )
    return None, parse(
        command_parser(description, table[None].config, prog=prog, epilog=epilog or None), argv
    )


def dispatch(
    description: str, table: dict[str | None, Command], argv=None, prog: str | None = None
) -> int:
    """A command's main: parse argv (a bad flag: one line, exit 2), then run the job it names in the shell
    (cli.shell: exit codes, one-line errors, signals): the config's check_files(), if it has one (inputs that
    must be there: exit 1, before anything is written), then the job, holding the output it writes
    (outputs.one_writer)."""
    name, cfg = parse_command(description, table, argv, prog)
    c = table[name]

    def job():
        getattr(cfg, "check_files", lambda: None)()
        with one_writer(c.writes(cfg) if c.writes else None):
            return c.job(cfg)

    return shell(job, interrupted=lambda: c.interrupted(cfg) if c.interrupted else "")
