"""Flags, declared once: each command's flags are the fields of its config dataclass.

    @dataclass
    class Config:
        max_new_tokens: int = flag(512, "token budget per answer", unit="tokens", range="[1, inf)")
        dtype: str | None = flag(None, "weights and activations", choices=["bf16", "fp32"], shown="bf16 on CUDA")

        def check(self):  # optional: flags that exclude each other
            ...

    cfg = parse(command_parser("What the command does.", Config), argv)

A field's metadata is its flag: the help as --help shows it (with the unit, the range and the default),
its range as an interval checked once for every command (out_of_range: "--top-p must be in (0, 1], got
1.5"), its choices, and what argparse needs beyond that. ParConfig's fields (config.py) are flags too,
so every command that takes a branch flag shares its help and range. A bad flag is one line and exit
2 (OneLineParser), from rank 0 alone under torchrun.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, field, fields

from cli import error, one_line


class OneLineParser(argparse.ArgumentParser):
    """A flag error is one line, not the usage of every flag, and exits 2 (argparse's code); under
    torchrun only rank 0 prints it (every rank parses the same flags)."""

    def error(self, message: str):
        error(f"{self.prog}: error: {message} (see --help)")
        sys.exit(2)


def flag(default=None, help: str = "", *, range: str | None = None, choices=None, unit: str | None = None,
         shown: str | None = None, factory=None, **argparse_kw):
    """A config dataclass field that is also a command-line flag: its help (with unit, range and
    default, as --help shows them), its range as an interval ("[1, inf)", "(0, 1]"; checked once for
    every command, see parse), its choices, and what argparse needs beyond that (positional=True,
    nargs, metavar, type, required). `shown` is the default as the help says it ("the checkpoint's");
    `factory` makes a default that is a list, or one read at start (an environment variable)."""
    meta = {"help": help, "range": range, "choices": choices, "unit": unit, "shown": shown, **argparse_kw}
    meta = {k: v for k, v in meta.items() if v is not None}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


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
        notes = [m.pop("unit", None), m.pop("range", None) and f"in {f.metadata['range']}"]
        shown = m.pop("shown", None)
        if shown is not None or (default not in (None, "", [], False) and not m.get("positional")):
            notes.append(f"default {shown if shown is not None else default_text(default)}")
        notes = [n for n in notes if n]
        if notes:  # "rank (the paper's best; in [1, inf); default 16)": one pair of brackets
            help_ = f"{help_[:-1]}; {'; '.join(notes)})" if help_.endswith(")") else f"{help_} ({'; '.join(notes)})"
        kw = {"help": help_}
        annotation = f.type.__name__ if isinstance(f.type, type) else str(f.type)  # a string under __future__
        many = annotation.startswith("list[")
        kind = FLAG_TYPES.get(annotation.removeprefix("list[").removesuffix("]").split("|")[0].strip())
        if m.pop("positional", False):
            p.add_argument(f.name, **{"type": kind} | kw | m)
        elif annotation.startswith("bool"):
            p.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=default,
                           **kw | m)
        else:
            p.add_argument("--" + f.name.replace("_", "-"), default=default,
                           **{"type": kind} | ({"nargs": "+"} if many else {}) | kw | m)


def default_text(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def command_parser(description: str, config=None, subcommands: dict | None = None, **kw) -> "OneLineParser":
    """The parser of a command whose flags are one config dataclass's fields, or of a command with
    subcommands, {name: (config class, one-line help)}. parse() then returns the config."""
    p = OneLineParser(description=description, **kw)
    if subcommands is None:
        add_flags(p, config)
        p.configs = {None: config}
        return p
    sub = p.add_subparsers(dest="command", required=True)
    for name, (cls, help_) in subcommands.items():
        add_flags(sub.add_parser(name, help=help_, description=help_), cls)
    p.configs = {name: cls for name, (cls, _) in subcommands.items()}
    return p


def parse(p: "OneLineParser", argv=None):
    """The config the flags say (for a command with subcommands, the subcommand's own class), its
    ranges checked (out_of_range) and then its `check()`, if it has one, for flags that exclude each
    other: either failing is one line and exit 2, as argparse's own errors."""
    values = vars(p.parse_args(argv))
    cls = p.configs[values.pop("command", None)]
    cfg = cls(**values)
    if why := out_of_range(cfg, {f.name: f.metadata["range"] for f in fields(cls) if "range" in f.metadata}):
        p.error(why)
    try:
        getattr(cfg, "check", lambda: None)()
    except ValueError as e:
        p.error(one_line(e))
    return cfg


def out_of_range(args, ranges: dict[str, str]) -> str | None:
    """The first flag whose value lies outside its interval ("[1, inf)", "(0, 1]", ...), as one line
    ("--top-p must be in (0, 1], got 1.5"), or None. A flag not given (None) passes; a list is checked
    element by element."""
    for name, interval in ranges.items():
        value = getattr(args, name, None)
        low, high = (float(x) for x in interval[1:-1].split(","))
        inside = [(low < x or interval[0] == "[" and x == low) and (x < high or interval[-1] == "]" and x == high)
                  for x in (value if isinstance(value, list) else [value]) if x is not None]
        if not all(inside):
            low = int(low) if low.is_integer() else low
            bound = (f">= {low}" if interval[0] == "[" else f"> {low}") if high == float("inf") else f"in {interval}"
            return f"--{name.replace('_', '-')} must be {bound}, got {value}"
    return None
