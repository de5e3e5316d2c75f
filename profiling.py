"""Inference profiling of ParVL (paper, Appendix C.1, C.2, Tables 4 and S7) on random weights, no
checkpoint needed, and the printing of the parameter and FLOP counts of evaluation/flops.py (Table S3).

    python profiling.py params --arch 1b --pv 2 --pl 4     # one configuration
    python profiling.py params --all                       # the nine Pv:Pl in {1,2,4}^2 of --arch (1b)
    python profiling.py params --all --json                # one JSON object per configuration and line
    python profiling.py latency --arch 1b --pv 4 --pl 4 --batch 1 2 4 8 --baseline --compare-shared --compile
    python profiling.py latency ... --plot latency.png     # latency and peak memory against batch size (matplotlib)
    python profiling.py forward --arch mid --configs 1:1 2:2 4:4   # one forward pass per Pv:Pl, side by side

Latency: the paper's protocol (C.1), evaluation/latency.py, printed as Tables S7 and 4. Forward: one model(input_ids,
pixel_values) per Pv:Pl, configurations interleaved across repeats.
"""

from __future__ import annotations

import shell.early  # noqa: F401  first: a Ctrl-C during the imports below is one line, exit 130

# isort: split

import argparse
import hashlib
import json
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from config import PRESETS, ParConfig, ParVLConfig
from data.processor import MAX_TILES
from evaluation.flops import ARCHS, BRANCHES, Workload, build_config, profile_params
from evaluation.latency import (
    paper_layout,
    plot_latency,
    run_latency,
    shared_vs_standard,
    synthetic_inputs,
    timed,
    trace,
)
from inference.flags import DeviceFlags, InferenceFlags, branch_conflict, branch_flags, check_quant
from loading.config_json import open_checkpoint
from loading.hub import resolve_model
from parvl import ParVL
from shell.cli import SEEDS, command, pyplot
from shell.devices import resolve_device, resolve_dtype
from shell.flags import Command, dispatch, flag, reuse_flag
from shell.outputs import check_file_out, make_folder

# tiles per sample: generate.py's most (--max-tiles, InternVL's 64) and a thumbnail beside them; 0: text only
TILES = f"[0, {MAX_TILES + 1}]"


def print_table(rows: list[dict]) -> None:
    parts = ("vit", "connector", "llm", "total")
    print(
        f"{'arch':<10}{'Pv:Pl':>6}"
        + "".join(f"{p + ' GFLOPs':>17}{p + ' M':>12}" for p in parts)
        + f"{'active M':>12}"  # a Qwen3-MoE's parameters a token runs (K of E experts); else the total
    )
    for r in rows:
        cells = "".join(f"{r[p + '_gflops']:>17.2f}{r[p + '_params'] / 1e6:>12.2f}" for p in parts)
        active = f"{r['total_active_params'] / 1e6:>12.2f}"
        print(f"{r['arch']:<10}{r['pv']:>4}:{r['pl']:<1}" + cells + active)


def latency_config(args) -> tuple[ParVLConfig, str]:
    """The configuration `latency` profiles and the name of its backbone: --model's config.json (the
    preset's name when its towers are a preset's, else "checkpoint <hash of the towers>"), or --arch
    with --pv, --pl and the branch flags (the paper's branches where not given)."""
    if args.model is None:
        branches = branches_given(args)
        return build_config(
            args.arch, branches.pop("pv", 1), branches.pop("pl", 1), **branches
        ), args.arch
    cfg, _ = open_checkpoint(resolve_model(args.model))
    towers = json.dumps(
        [asdict(cfg.vit) if cfg.vit else None, asdict(cfg.llm)], sort_keys=True, default=str
    )
    name = next(
        (k for k, p in PRESETS.items() if (p.vit, p.llm) == (cfg.vit, cfg.llm)),
        f"checkpoint {hashlib.sha256(towers.encode()).hexdigest()[:8]}",
    )
    return cfg, name


def run_forward(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One full forward, model(input_ids, pixel_values), per Pv:Pl; configs interleaved A B C A B C ... so
    that slow drift of the machine (clock, other processes) reaches each alike; medians and ratios vs the first.
    --pair adds, for every config with branches, the same model running one pair (vision 0, language 0)
    per sample: the active-branch cost a router pays."""
    work = Workload(args.tiles, args.text_tokens, 0)  # the prompt only: image + text tokens
    cfgs = {key: build_config(args.arch, *key) for key in args.configs}
    models = {
        key: ParVL.from_config(cfg, dtype, device, seed=args.seed).eval()
        for key, cfg in cfgs.items()
    }
    runs = [(key, None) for key in models] + [
        (key, 0) for key in models if args.pair and key != (1, 1)
    ]
    ids_BT, pixels = synthetic_inputs(
        cfgs[args.configs[0]], work, args.batch, dtype, device, args.seed
    )
    times = {run: [] for run in runs}
    with torch.no_grad():
        for r in range(args.warmup + args.repeats):
            for key, pair in runs:
                call = lambda: models[key](ids_BT, pixels, vision_branch=pair, language_branch=pair)  # noqa: B023, E731
                _, s = timed(call, device)
                if r >= args.warmup:
                    times[key, pair].append(s)
        for (pv, pl), model in models.items() if args.trace else ():
            trace(lambda: model(ids_BT, pixels), device, Path(args.trace), f"forward_{pv}x{pl}")  # noqa: B023
    rows = []
    # GFLOPs: Table S3's count (calflops: no attention products)
    for ((pv, pl), pair), ts in times.items():
        gflops = (
            args.batch
            * profile_params(args.arch, *((pv, pl) if pair is None else (1, 1)), work)[
                "total_gflops"
            ]
        )
        med = statistics.median(ts)
        rows.append(
            {
                "arch": args.arch,
                "pv": pv,
                "pl": pl,
                "pair": None if pair is None else f"{pair},{pair}",
                "batch": args.batch,
                "median_ms": 1e3 * med,
                "min_ms": 1e3 * min(ts),
                "gflops": gflops,
                "gflop_s": gflops / med,
                "ms": [round(1e3 * s, 2) for s in ts],
            }
        )
    for r in rows:
        r |= {
            "time_x": r["median_ms"] / rows[0]["median_ms"],
            "gflops_x": r["gflops"] / rows[0]["gflops"],
        }
    return rows


def print_rows(rows: list[dict], columns: dict[str, str]) -> None:
    """A plain table headed by the JSON keys; columns = {key: format spec}; None prints as '-'."""
    widths = {k: max(len(k), 7) for k in columns}
    print("Pv:Pl  " + "  ".join(f"{k:>{w}}" for k, w in widths.items()))
    for r in rows:
        cells = ("-" if r[k] is None else format(r[k], f) for k, f in columns.items())
        print(
            f"{r['pv']:>3}:{r['pl']:<1}  "
            + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths.values()))
        )


LATENCY_COLUMNS = {
    "shared_kv": "",
    "batch": "d",
    "latency_s": ".4f",
    "latency_median_s": ".4f",
    "prefill_ms": ".1f",
    "decode_ms_per_step": ".2f",
    "compile_s": ".2f",
    "resident_gib": ".3f",
    "peak_gib": ".3f",
    "incremental_peak_gib": ".3f",
    "kv_cache_bytes": "d",
    "latency_x": ".3f",
    "peak_x": ".3f",
    "kv_cache_x": ".3f",
}
FORWARD_COLUMNS = {
    "pair": "",
    "median_ms": ".1f",
    "min_ms": ".1f",
    "time_x": ".3f",
    "gflops": ".1f",
    "gflops_x": ".3f",
    "gflop_s": ".1f",
}


def branch_pair(text: str) -> tuple[int, int]:
    try:
        pv, pl = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected Pv:Pl such as 2:4, got {text!r}") from None
    if pv < 1 or pl < 1:
        raise argparse.ArgumentTypeError(f"Pv and Pl must be >= 1, got {text!r}")
    return pv, pl


# ParConfig's fields as flags (flags.branch_flags): None takes ParConfig's default, the paper's branches
BranchFlags = branch_flags("BranchFlags", lambda f: str(f.default))


def branches_given(args) -> dict:
    """The branch flags given (not None), by ParConfig's field names."""
    return {
        f.name: getattr(args, f.name)
        for f in fields(ParConfig)
        if getattr(args, f.name) is not None
    }


@dataclass
class ParamsConfig(BranchFlags):
    arch: str = flag("1b", "model size preset", choices=sorted(ARCHS))
    all: bool = flag(False, "all nine Pv:Pl in {1,2,4}^2 for --arch")
    json: bool = flag(False, "one JSON object per configuration and line")
    tiles: int = flag(3, "448 px image tiles, 256 tokens each", range=TILES)
    text_tokens: int = flag(256, "prompt text tokens", range="[0, inf)")
    response_tokens: int = flag(
        128, "response tokens, scored in the same forward pass", range="[0, inf)"
    )

    def check(self) -> None:
        """Branch flags that cannot mean anything (exit 2); --all has every Pv:Pl, 1:1 as its baseline."""
        given = branches_given(self)
        if self.all and {"pv", "pl"} & given.keys():
            raise ValueError(
                f"--all profiles every Pv:Pl; drop --{next(k for k in ('pv', 'pl') if k in given)}"
            )
        if why := branch_conflict(
            asdict(ParConfig()) | given | ({"pv": None, "pl": None} if self.all else {}),
            ARCHS[self.arch].vit.hidden_size,
        ):
            raise ValueError(why)


@dataclass
class Timed(DeviceFlags):
    """The flags of the timed subcommands (latency, forward), which set their own defaults."""

    arch: str = flag("1b", "size preset, random weights", choices=sorted(ARCHS))
    tiles: int = flag(3, "448 px tiles per sample, 256 tokens each", range=TILES)
    text_tokens: int = flag(256, "non-image tokens per sample", range="[0, inf)")
    warmup: int = flag(3, "untimed calls before the timed ones", range="[0, inf)")
    seed: int = flag(0, "weights and inputs", range=SEEDS)
    threads: int | None = flag(
        None,
        "CPU threads (torch.set_num_threads); 1 resists a busy shared machine",
        range="[1, inf)",
        shown="torch's",
    )
    trace: str | None = flag(
        None,
        "also write a Chrome trace (+ CUDA memory snapshot) per row",
        metavar="DIR",
        writes=("latency_*", "forward_*"),
    )
    json: bool = flag(False, "print only the final JSON line, not the table")

    def check(self) -> None:
        super().check()
        if self.tiles == 0 and self.text_tokens == 0:
            raise ValueError(
                "--tiles 0 --text-tokens 0 leaves an empty prompt: give one of them at least 1"
            )


@dataclass
class LatencyConfig(BranchFlags, Timed):
    model: str | None = flag(
        None,
        "profile this checkpoint's configuration (its config.json: backbone, Pv:Pl, "
        "branches) on random weights, instead of --arch and the branch flags",
        metavar="DIR",
        reads=True,
    )
    batch: list[int] = flag(
        help="batch sizes, samples per generate call",
        range="[1, inf)",
        factory=lambda: [1, 2, 4, 8],
    )
    new_tokens: int = flag(128, "generated tokens per sample, forced", range="[1, inf)")
    iters: int = flag(10, "timed generate calls per batch size", range="[1, inf)")
    compile: bool | None = reuse_flag(InferenceFlags, "compile")
    shared_kv: bool = reuse_flag(InferenceFlags, "shared_kv")
    quant: str | None = reuse_flag(InferenceFlags, "quant")
    group_size: int | None = reuse_flag(InferenceFlags, "group_size")
    compare_shared: bool = flag(False, "profile standard and shared KV in one run")
    baseline: bool = flag(False, "profile standard 1:1 first, as Table 4's reference")
    plot: str | None = flag(
        None,
        "also write latency and peak memory against batch size per configuration (needs "
        "matplotlib)",
        metavar="FILE.png",
        writes=True,
    )

    def check(self) -> None:
        super().check()
        check_quant(self.quant, self.group_size)
        if self.model and (given := branches_given(self)):
            raise ValueError(
                f"--model profiles the checkpoint's own configuration; drop --"
                f"{next(iter(given)).replace('_', '-')}"
            )


@dataclass
class ForwardConfig(Timed):
    arch: str = flag("mid", "size preset, random weights", choices=sorted(ARCHS))
    tiles: int = flag(1, "448 px tiles per sample, 256 tokens each", range=TILES)
    text_tokens: int = flag(128, "non-image tokens per sample", range="[0, inf)")
    warmup: int = flag(1, "untimed calls before the timed ones", range="[0, inf)")
    configs: list[tuple] = flag(
        help="Pv:Pl list, the first is the reference of the ratios",
        type=branch_pair,
        factory=lambda: [(1, 1), (2, 2), (4, 4)],
        shown="1:1 2:2 4:4",
    )
    batch: int = flag(1, "samples per forward", range="[1, inf)")
    repeats: int = flag(5, "timed rounds over all configs", range="[1, inf)")
    pair: bool = flag(
        False,
        "also time each config with branches running one pair (vision 0, language 0) per sample",
    )


def params(args: ParamsConfig) -> None:
    """`params`: Table S3's parameter and FLOP counts of one configuration, or every Pv:Pl of --arch."""
    work = Workload(args.tiles, args.text_tokens, args.response_tokens)
    branches = branches_given(args)
    grid = (
        [(pv, pl) for pv in BRANCHES for pl in BRANCHES]
        if args.all
        else [(branches.pop("pv", 1), branches.pop("pl", 1))]
    )
    rows = [profile_params(args.arch, pv, pl, work, **branches) for pv, pl in grid]
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(
            f"workload: {work} -> LLM sequence {work.llm_tokens(ARCHS[args.arch])} tokens, batch 1"
        )
        print_table(rows)


def timed_job(command: str):
    """The job of a timed subcommand (latency, forward): the device and threads set up, its rows measured,
    printed as a table (latency: also Tables S7 / 4 and the shared-KV deltas) and as one JSON line."""

    def job(args: Timed) -> None:
        if getattr(args, "plot", None):
            # a folder or a file in the way: said before the measurement
            check_file_out(Path(args.plot), "--plot")
            # a missing one made now, not found after it
            make_folder(Path(args.plot).parent, "--plot")
            pyplot()  # a missing matplotlib too
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        if args.threads:  # OpenMP threads that wait for each other slow down 100x when another process holds a core
            torch.set_num_threads(args.threads)
        env = {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"cpu, {torch.get_num_threads()} threads",
            "dtype": str(dtype).removeprefix("torch."),
        }
        if not args.json:
            print(
                f"{command}: arch {args.arch} ({env['dtype']}, {env['device']}, torch {env['torch']}), "
                f"{args.tiles} tiles + {args.text_tokens} text tokens per sample"
            )
        if command == "latency":
            rows, columns = run_latency(args, *latency_config(args), device, dtype), LATENCY_COLUMNS
            extra = {"shared_vs_standard": shared_vs_standard(rows)}
            if args.plot:
                plot_latency(rows, Path(args.plot))
        else:
            rows, columns, extra = run_forward(args, device, dtype), FORWARD_COLUMNS, {}
        if not args.json:
            print_rows(rows, columns)
            if "shared_vs_standard" in extra:
                print("\n" + paper_layout(rows, extra["shared_vs_standard"]) + "\n")
        settings = {k: v for k, v in asdict(args).items() if k != "json"}
        print(json.dumps({"command": command, **env, "args": settings, "rows": rows, **extra}))

    return job


DESCRIPTION = __doc__.split("\n")[0]
COMMANDS = {
    "params": Command(
        ParamsConfig, params, "parameters (meta device) and forward FLOPs per part, Table S3"
    ),
    "latency": Command(
        LatencyConfig,
        timed_job("latency"),
        "per-sample generation latency and peak memory, Appendix C.1 / Table S7",
    ),
    "forward": Command(
        ForwardConfig,
        timed_job("forward"),
        "time one full forward pass per Pv:Pl, interleaved, medians and ratios",
    ),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch(DESCRIPTION, COMMANDS, argv)


if __name__ == "__main__":
    command(main)
