"""Inference profiling of ParVL (paper, Appendix C.1, C.2, Tables 4 and S7) on random weights, no
checkpoint needed, and the printing of the parameter and FLOP counts of flops.py (Table S3).

    python profiling.py params --arch 1b --pv 2 --pl 4     # one configuration
    python profiling.py params --all                       # the nine Pv:Pl in {1,2,4}^2 of --arch (1b)
    python profiling.py params --all --json                # one JSON object per configuration and line
    python profiling.py latency --arch 1b --pv 4 --pl 4 --batch 1 2 4 8 --baseline --compare-shared --compile
    python profiling.py latency ... --plot latency.png     # latency and peak memory against batch size (matplotlib)
    python profiling.py forward --arch mid --configs 1:1 2:2 4:4   # one forward pass per Pv:Pl, side by side

Latency (C.1): each sample is one random 448 px tile repeated --tiles times (256 image tokens each)
and random filler ids up to --text-tokens non-image tokens, the same for the whole batch (no padding);
engine.py's Engine decodes greedily exactly --new-tokens tokens. --warmup untimed calls, then
--iters timed ones, synchronised (CUDA events); latency per sample = elapsed / (iters x batch).
The memory peak is reset before the timed calls: peak allocated on CUDA, peak RSS on CPU (Linux
VmHWM). The Engine keeps its static KV cache across calls, so "resident" (before the timed calls)
holds the weights and the cache, whose exact size is reported too. Compile time = first call -
steady call. Ratios (x): against the first row of each batch size, standard 1:1 with --baseline.
Forward: one model(input_ids, pixel_values) per Pv:Pl, configurations interleaved across repeats.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from checkpoint import open_checkpoint
from cli import allocation, check_file_out, command, pyplot, resolve_device, resolve_dtype
from config import PRESETS, ParConfig, ParVLConfig, branch_variant
from engine import Engine, GenerateConfig
from flags import Command, branch_conflict, branch_flags, dispatch, flag, flag_of
from flops import ARCHS, BRANCHES, Workload, build_config, profile_params
from hub import resolve_model
from inference import DeviceFlags, InferenceFlags
from parvl import ParVL


def print_table(rows: list[dict]) -> None:
    parts = ("vit", "connector", "llm", "total")
    print(f"{'arch':<5}{'Pv:Pl':>6}" + "".join(f"{p + ' GFLOPs':>17}{p + ' M':>12}" for p in parts))
    for r in rows:
        cells = "".join(f"{r[p + '_gflops']:>17.2f}{r[p + '_params'] / 1e6:>12.2f}" for p in parts)
        print(f"{r['arch']:<5}{r['pv']:>4}:{r['pl']:<1}" + cells)


# -- timing and memory on random weights (Appendix C.1) -------------------------------------------


def synthetic_inputs(cfg: ParVLConfig, work: Workload, batch: int, dtype: torch.dtype, device: torch.device,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """C.1's sample, `batch` identical copies: ids [B,T], a short text head, the <IMG_CONTEXT> run of the
    tiles, then filler ids; pixels [B*tiles,3,448,448], one random tile repeated (None without tiles)."""
    assert 0 < cfg.image_token_id <= cfg.llm.vocab_size, (cfg.image_token_id, cfg.llm.vocab_size)
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, cfg.image_token_id, (work.text_tokens,), generator=g).tolist()  # never the image id
    head = min(16, len(text))  # a chat header in front of the image, as in InternVL's prompt
    ids = text[:head] + [cfg.image_token_id] * work.image_tokens(cfg) + text[head:]
    ids_BT = torch.tensor([ids] * batch, device=device)
    if work.image_tokens(cfg) == 0:
        return ids_BT, None
    size = cfg.vit.image_size
    tile = torch.randn(1, 3, size, size, generator=g)  # stands in for one normalised RGB tile
    return ids_BT, tile.repeat(batch * work.tiles, 1, 1, 1).to(device, dtype)  # [B*tiles,3,px,px]


def timed(fn, device: torch.device):
    """(fn(), seconds) with the device idle before and after: CUDA events on GPU, perf_counter on CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        return fn(), time.perf_counter() - t0  # evaluated left to right
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) / 1e3  # ms -> s


def reset_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:  # Linux: hand freed heap pages back (glibc keeps them), then restart the peak RSS (VmHWM) at the RSS
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")


def memory_bytes(device: torch.device, peak: bool) -> int:
    """Allocated bytes (CUDA) or resident set size (CPU, Linux), now or at the peak since reset_peak."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
    key = "VmHWM:" if peak else "VmRSS:"
    line = next(s for s in Path("/proc/self/status").read_text().splitlines() if s.startswith(key))
    return int(line.split()[1]) * 1024  # reported in kB


def kv_cache_bytes(model: ParVL) -> tuple[int, int]:
    """Exact bytes of the static KV cache (every layer's k and v buffers), and of its token slots alone
    (the prefix slots in front excluded): the part Shared KV divides by Pl."""
    caches = [layer.self_attn.kv_cache for layer in model.language_model.model.layers]  # k, v [rows,Hkv,S,D]
    total = sum(c.k.nbytes + c.v.nbytes for c in caches)
    tokens = sum((c.k.nbytes + c.v.nbytes) // c.k.shape[2] * (c.k.shape[2] - c.offset) for c in caches)
    return total, tokens


def trace(fn, device: torch.device, folder: Path, name: str) -> None:
    """torch.profiler over three calls, schedule wait 1 / warmup 1 / active 1: a Chrome trace of the
    third (chrome://tracing, ui.perfetto.dev) and, on CUDA, a memory snapshot (pytorch.org/memory_viz)."""
    folder.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, profile_memory=True,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(folder / f"{name}.json"))) as prof:
        for _ in range(3):
            fn()
            prof.step()
    if cuda:
        torch.cuda.memory._dump_snapshot(str(folder / f"{name}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)


def profile_latency(engine: Engine, cfg: ParVLConfig, work: Workload, batch: int, args) -> dict:
    """One row of Table S7: warm-ups, then timed generate calls of `batch` samples, exactly N tokens each."""
    device, dtype, n = engine.device, engine.model.language_model.lm_head.weight.dtype, work.response_tokens
    ids_BT, pixels = synthetic_inputs(cfg, work, batch, dtype, device, args.seed)
    prompts = ids_BT.tolist()  # the Engine takes token lists and builds the batch itself
    gen = GenerateConfig(max_new_tokens=n, ignore_eos=True)  # greedy, min = max new tokens
    call = lambda: engine.generate(prompts, pixels, gen, stop_ids=[])  # noqa: E731
    torch._dynamo.reset()  # each row compiles afresh: its own compile time, and no recompile limit
    first = [timed(call, device)[1] for _ in range(args.warmup)][:1]
    reset_peak(device)  # after warm-up: the cache is allocated, compilation is done
    resident = memory_bytes(device, peak=False)
    runs = [timed(call, device) for _ in range(args.iters)]
    peak = memory_bytes(device, peak=True)
    assert all(len(t) == n for res, _ in runs for t in res.tokens), f"not exactly {n} tokens per sample"
    times = [s for _, s in runs]
    steps = sum(res.decode_steps - 1 for res, _ in runs)  # the first token comes from prefill
    decode_s = sum(res.decode_s for res, _ in runs)
    kv, kv_tokens = kv_cache_bytes(engine.model)
    if args.trace:
        kind = "shared" if engine.shared_kv else "std"
        trace(call, device, Path(args.trace), f"latency_{cfg.par.pv}x{cfg.par.pl}_{kind}_b{batch}")
    return {
        "arch": args.arch, "pv": cfg.par.pv, "pl": cfg.par.pl, "shared_kv": engine.shared_kv, "batch": batch,
        "latency_s": sum(times) / (len(times) * batch),  # per sample, as in C.1
        "latency_median_s": statistics.median(times) / batch,  # robust to a busy shared machine
        "iter_s": [round(s, 4) for s in times],
        "prefill_ms": 1e3 * statistics.mean(res.prefill_s for res, _ in runs),
        "decode_ms_per_step": 1e3 * decode_s / steps if steps else None,
        "decode_tok_s": batch * steps / decode_s if steps else None,
        # first call - steady state; without --compile nothing compiles (the difference is noise, even negative)
        "compile_s": first[0] - statistics.mean(times) if first and engine.compiled else None,
        "memory": "cuda_allocated" if device.type == "cuda" else "cpu_rss",
        "resident_gib": resident / 2**30, "peak_gib": peak / 2**30,
        "kv_cache_bytes": kv, "kv_token_bytes": kv_tokens,
    }


def latency_config(args) -> tuple[ParVLConfig, str]:
    """The configuration `latency` profiles and the name of its backbone: --model's config.json (the
    preset's name when its towers are a preset's, else "checkpoint <hash of the towers>"), or --arch
    with --pv, --pl and the branch flags (the paper's branches where not given)."""
    if args.model is None:
        branches = branches_given(args)
        return build_config(args.arch, branches.pop("pv", 1), branches.pop("pl", 1), **branches), args.arch
    cfg, _ = open_checkpoint(resolve_model(args.model))
    towers = json.dumps([asdict(cfg.vit) if cfg.vit else None, asdict(cfg.llm)], sort_keys=True, default=str)
    name = next((k for k, p in PRESETS.items() if (p.vit, p.llm) == (cfg.vit, cfg.llm)),
                f"checkpoint {hashlib.sha256(towers.encode()).hexdigest()[:8]}")
    return cfg, name


def run_latency(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Standard (and/or shared-KV) Pv:Pl, after standard 1:1 with --baseline; ratios vs the first row per batch.
    Each row records its architecture and branch parameterisation (config.branch_variant), so that
    `evaluate.py cost` puts each configuration at its own profile."""
    work = Workload(args.tiles, args.text_tokens, args.new_tokens)
    modes = (False, True) if args.compare_shared else (args.shared_kv,)
    main_cfg, arch = latency_config(args)
    runs = [(main_cfg, modes)]
    if args.baseline and (main_cfg.par.pv, main_cfg.par.pl) != (1, 1):
        runs.insert(0, (replace(main_cfg, par=ParConfig()), (False,)))  # 1:1, the paper's branches
    rows = []
    for cfg, kv_modes in runs:
        model = ParVL.from_config(cfg, dtype, device, seed=args.seed).eval()
        weights = sum(p.nbytes for p in model.parameters())  # a tied tensor is yielded once
        for shared in kv_modes:
            for layer in model.language_model.model.layers:  # the previous variant's cache must not count here
                layer.self_attn.kv_cache = None
            engine = Engine(model, compile=args.compile, shared_kv=shared)
            for b in args.batch:  # a batch that does not fit: one line with the flags that lower it
                with allocation(f"Pv:Pl {cfg.par.pv}:{cfg.par.pl} --batch {b} ({work.tiles} tiles, "
                                f"{work.text_tokens} text tokens, {work.response_tokens} new tokens per sample)",
                                "--batch, --tiles, --text-tokens or --new-tokens"):
                    rows.append(profile_latency(engine, cfg, work, b, args) | {
                        "weights_gib": weights / 2**30, "arch": arch, "branches": branch_variant(cfg.par)})
        del model, engine  # one model resident at a time, as when variants are profiled sequentially
    return add_ratios(rows)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Table 4's ratios: each row's latency, peak memory and KV cache against the first row of its batch
    size (standard 1:1 with --baseline)."""
    for r in rows:
        base = next(b for b in rows if b["batch"] == r["batch"])
        r |= {"latency_x": r["latency_s"] / base["latency_s"], "peak_x": r["peak_gib"] / base["peak_gib"],
              "kv_cache_x": r["kv_cache_bytes"] / base["kv_cache_bytes"] if base.get("kv_cache_bytes") else None}
    return rows


def run_forward(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One full forward, model(input_ids, pixel_values), per Pv:Pl; configs interleaved A B C A B C ... so
    that slow drift of the machine (clock, other processes) reaches each alike; medians and ratios vs the first.
    --pair adds, for every config with branches, the same model running one pair (vision 0, language 0)
    per sample: the active-branch cost a router pays."""
    work = Workload(args.tiles, args.text_tokens, 0)  # the prompt only: image + text tokens
    cfgs = {key: build_config(args.arch, *key) for key in args.configs}
    models = {key: ParVL.from_config(cfg, dtype, device, seed=args.seed).eval() for key, cfg in cfgs.items()}
    runs = [(key, None) for key in models] + [(key, 0) for key in models if args.pair and key != (1, 1)]
    ids_BT, pixels = synthetic_inputs(cfgs[args.configs[0]], work, args.batch, dtype, device, args.seed)
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
    for ((pv, pl), pair), ts in times.items():  # GFLOPs: Table S3's count (calflops: no attention products)
        gflops = args.batch * profile_params(args.arch, *((pv, pl) if pair is None else (1, 1)), work)["total_gflops"]
        med = statistics.median(ts)
        rows.append({"arch": args.arch, "pv": pv, "pl": pl, "pair": None if pair is None else f"{pair},{pair}",
                     "batch": args.batch, "median_ms": 1e3 * med, "min_ms": 1e3 * min(ts), "gflops": gflops,
                     "gflop_s": gflops / med, "ms": [round(1e3 * s, 2) for s in ts]})
    for r in rows:
        r |= {"time_x": r["median_ms"] / rows[0]["median_ms"], "gflops_x": r["gflops"] / rows[0]["gflops"]}
    return rows


# -- Tables 4 and S7 from profiling.py latency's rows (Appendix C.1, C.2) -------------------------


def shared_vs_standard(rows: list[dict]) -> list[dict]:
    """Per Pv:Pl profiled both ways and per batch size, shared KV against the standard cache (Appendix
    C.2, the paragraph under Table S7): the change of per-sample latency, of peak memory, and of the
    incremental peak (peak - resident, the memory the generation itself adds), in % of standard's."""
    out = []
    for r in rows:
        std = next((s for s in rows if not s["shared_kv"] and (s["pv"], s["pl"], s["batch"], s.get("branches")) ==
                    (r["pv"], r["pl"], r["batch"], r.get("branches"))), None)
        if r["shared_kv"] and std is not None:
            change = lambda new, old: 100 * (new / old - 1) if old else None  # noqa: E731
            out.append({"pv": r["pv"], "pl": r["pl"], "batch": r["batch"],
                        "latency_pct": change(r["latency_s"], std["latency_s"]),
                        "peak_pct": change(r["peak_gib"], std["peak_gib"]),
                        "incremental_peak_pct": change(r["peak_gib"] - r["resident_gib"],
                                                       std["peak_gib"] - std["resident_gib"])})
    return out


def paper_layout(rows: list[dict], delta: list[dict]) -> str:
    """Tables S7 and 4 as the paper prints them (a row per configuration and metric, a column per batch
    size: absolute, then relative to the first configuration), then the Δ rows of shared KV against
    standard per batch size."""
    batches = sorted({r["batch"] for r in rows})
    head = "| Pv:Pl | Shared KV | Metric | " + " | ".join(map(str, batches)) + " |"
    rule = "|" + " --- |" * (len(batches) + 3)
    configs = list(dict.fromkeys((r["pv"], r["pl"], r["shared_kv"], json.dumps(r.get("branches") or {}))
                                 for r in rows))
    cell = {(r["pv"], r["pl"], r["shared_kv"], json.dumps(r.get("branches") or {}), r["batch"]): r for r in rows}
    mem = "Memory (GB)" if rows[0]["memory"] == "cuda_allocated" else "Memory (GB, RSS)"

    def line(c, metric, key, fmt, unit=""):
        name = f"{c[0]}:{c[1]}" + ("" if c[3] == "{}" else f" {c[3]}")
        vals = [format(cell[c + (b,)][key], fmt) + unit if c + (b,) in cell else "-" for b in batches]
        return f"| {name} | {'✓' if c[2] else '✗'} | {metric} | " + " | ".join(vals) + " |"

    md = ["Absolute (Table S7's layout):", "", head, rule]
    for c in configs:  # GB as the paper prints them: 2**30 bytes
        md += [line(c, "Latency (s)", "latency_s", ".3f"), line(c, mem, "peak_gib", ".3f")]
    md += ["", "Relative to the first row at each batch size (Table 4's layout):", "", head, rule]
    for c in configs[1:]:
        md += [line(c, "Latency", "latency_x", ".2f", "×"), line(c, "Memory", "peak_x", ".2f", "×")]
    if delta:
        md += ["", "Δ (Shared − Standard), % of standard:", "",
               "| Pv:Pl | Metric | " + " | ".join(map(str, batches)) + " |", "|" + " --- |" * (len(batches) + 2)]
        for pv, pl in dict.fromkeys((d["pv"], d["pl"]) for d in delta):
            mine = {d["batch"]: d for d in delta if (d["pv"], d["pl"]) == (pv, pl)}
            for key, metric in (("latency_pct", "Latency"), ("peak_pct", "Peak memory"),
                                ("incremental_peak_pct", "Peak − resident")):
                vals = ["-" if b not in mine or mine[b][key] is None else f"{mine[b][key]:+.1f} %" for b in batches]
                md.append(f"| {pv}:{pl} | {metric} | " + " | ".join(vals) + " |")
    return "\n".join(md)


def plot_latency(rows: list[dict], png: Path) -> None:
    """Latency per sample and peak memory against batch size, one line per configuration (Pv:Pl,
    standard or shared KV): the view of the paper's Figure 4 / Table 4."""
    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    configs = dict.fromkeys((r["pv"], r["pl"], r["shared_kv"]) for r in rows)  # in run order
    for pv, pl, shared in configs:
        mine = sorted((r for r in rows if (r["pv"], r["pl"], r["shared_kv"]) == (pv, pl, shared)),
                      key=lambda r: r["batch"])
        label = f"{pv}:{pl}" + (" shared KV" if shared else "")
        batches = [r["batch"] for r in mine]
        ax_t.plot(batches, [1e3 * r["latency_s"] for r in mine], marker="o", label=label)
        ax_m.plot(batches, [r["peak_gib"] for r in mine], marker="o", label=label)
    for ax, what in ((ax_t, "latency per sample (ms)"), (ax_m, f"peak memory (GiB, {rows[0]['memory']})")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["batch"] for r in rows}), [str(b) for b in sorted({r["batch"] for r in rows})])
        ax.set_xlabel("batch size")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"arch {rows[0]['arch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100, format="png")  # the file named, even without a .png suffix
    plt.close(fig)


def print_rows(rows: list[dict], columns: dict[str, str]) -> None:
    """A plain table headed by the JSON keys; columns = {key: format spec}; None prints as '-'."""
    widths = {k: max(len(k), 7) for k in columns}
    print("Pv:Pl  " + "  ".join(f"{k:>{w}}" for k, w in widths.items()))
    for r in rows:
        cells = ("-" if r[k] is None else format(r[k], f) for k, f in columns.items())
        print(f"{r['pv']:>3}:{r['pl']:<1}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths.values())))


LATENCY_COLUMNS = {"shared_kv": "", "batch": "d", "latency_s": ".4f", "latency_median_s": ".4f", "prefill_ms": ".1f",
                   "decode_ms_per_step": ".2f", "compile_s": ".2f", "resident_gib": ".3f", "peak_gib": ".3f",
                   "kv_cache_bytes": "d", "latency_x": ".3f", "peak_x": ".3f", "kv_cache_x": ".3f"}
FORWARD_COLUMNS = {"pair": "", "median_ms": ".1f", "min_ms": ".1f", "time_x": ".3f", "gflops": ".1f", "gflops_x": ".3f",
                   "gflop_s": ".1f"}


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
    return {f.name: getattr(args, f.name) for f in fields(ParConfig) if getattr(args, f.name) is not None}


@dataclass
class ParamsConfig(BranchFlags):
    arch: str = flag("1b", "model size preset", choices=sorted(ARCHS))
    all: bool = flag(False, "all nine Pv:Pl in {1,2,4}^2 for --arch")
    json: bool = flag(False, "one JSON object per configuration and line")
    tiles: int = flag(3, "448 px image tiles, 256 tokens each", range="[0, inf)")
    text_tokens: int = flag(256, "prompt text tokens", range="[0, inf)")
    response_tokens: int = flag(128, "response tokens, scored in the same forward pass", range="[0, inf)")

    def check(self) -> None:
        """Branch flags that cannot mean anything (exit 2); --all has every Pv:Pl, 1:1 as its baseline."""
        given = branches_given(self)
        if self.all and {"pv", "pl"} & given.keys():
            raise ValueError(f"--all profiles every Pv:Pl; drop --{next(k for k in ('pv', 'pl') if k in given)}")
        if why := branch_conflict(asdict(ParConfig()) | given | ({"pv": None, "pl": None} if self.all else {}),
                                  ARCHS[self.arch].vit.hidden_size):
            raise ValueError(why)


@dataclass
class Timed(DeviceFlags):
    """The flags of the timed subcommands (latency, forward), which set their own defaults."""

    arch: str = flag("1b", "size preset, random weights", choices=sorted(ARCHS))
    tiles: int = flag(3, "448 px tiles per sample, 256 tokens each", range="[0, inf)")
    text_tokens: int = flag(256, "non-image tokens per sample", range="[0, inf)")
    warmup: int = flag(3, "untimed calls before the timed ones", range="[0, inf)")
    seed: int = flag(0, "weights and inputs")
    threads: int | None = flag(None, "CPU threads (torch.set_num_threads); 1 resists a busy shared machine",
                               range="[1, inf)", shown="torch's")
    trace: str | None = flag(None, "also write a Chrome trace (+ CUDA memory snapshot) per row", metavar="DIR")
    json: bool = flag(False, "print only the final JSON line, not the table")

    def check(self) -> None:
        super().check()
        if self.tiles == 0 and self.text_tokens == 0:
            raise ValueError("--tiles 0 --text-tokens 0 leaves an empty prompt: give one of them at least 1")


@dataclass
class LatencyConfig(BranchFlags, Timed):
    model: str | None = flag(None, "profile this checkpoint's configuration (its config.json: backbone, Pv:Pl, "
                                   "branches) on random weights, instead of --arch and the branch flags",
                             metavar="DIR")
    batch: list[int] = flag(help="batch sizes, samples per generate call", range="[1, inf)",
                            factory=lambda: [1, 2, 4, 8])
    new_tokens: int = flag(128, "generated tokens per sample, forced", range="[1, inf)")
    iters: int = flag(10, "timed generate calls per batch size", range="[1, inf)")
    compile: bool | None = flag_of(InferenceFlags, "compile")
    shared_kv: bool = flag_of(InferenceFlags, "shared_kv")
    compare_shared: bool = flag(False, "profile standard and shared KV in one run")
    baseline: bool = flag(False, "profile standard 1:1 first, as Table 4's reference")
    plot: str | None = flag(None, "also write latency and peak memory against batch size per configuration (needs "
                            "matplotlib)", metavar="FILE.png")

    def check(self) -> None:
        super().check()
        if self.model and (given := branches_given(self)):
            raise ValueError(f"--model profiles the checkpoint's own configuration; drop --"
                             f"{next(iter(given)).replace('_', '-')}")


@dataclass
class ForwardConfig(Timed):
    arch: str = flag("mid", "size preset, random weights", choices=sorted(ARCHS))
    tiles: int = flag(1, "448 px tiles per sample, 256 tokens each", range="[0, inf)")
    text_tokens: int = flag(128, "non-image tokens per sample", range="[0, inf)")
    warmup: int = flag(1, "untimed calls before the timed ones", range="[0, inf)")
    configs: list[tuple] = flag(help="Pv:Pl list, the first is the reference of the ratios", type=branch_pair,
                                factory=lambda: [(1, 1), (2, 2), (4, 4)], shown="1:1 2:2 4:4")
    batch: int = flag(1, "samples per forward", range="[1, inf)")
    repeats: int = flag(5, "timed rounds over all configs", range="[1, inf)")
    pair: bool = flag(False, "also time each config with branches running one pair (vision 0, language 0) per sample")


def params(args: ParamsConfig) -> None:
    """`params`: Table S3's parameter and FLOP counts of one configuration, or every Pv:Pl of --arch."""
    work = Workload(args.tiles, args.text_tokens, args.response_tokens)
    branches = branches_given(args)
    grid = [(pv, pl) for pv in BRANCHES for pl in BRANCHES] if args.all else [
        (branches.pop("pv", 1), branches.pop("pl", 1))]
    rows = [profile_params(args.arch, pv, pl, work, **branches) for pv, pl in grid]
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(f"workload: {work} -> LLM sequence {work.llm_tokens(ARCHS[args.arch])} tokens, batch 1")
        print_table(rows)


def timed_job(command: str):
    """The job of a timed subcommand (latency, forward): the device and threads set up, its rows measured,
    printed as a table (latency: also Tables S7 / 4 and the shared-KV deltas) and as one JSON line."""

    def job(args: Timed) -> None:
        if getattr(args, "plot", None):
            check_file_out(Path(args.plot), "--plot")  # a folder or a file in the way: said before the measurement
            pyplot()  # a missing matplotlib too
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        if args.threads:  # OpenMP threads that wait for each other slow down 100x when another process holds a core
            torch.set_num_threads(args.threads)
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
               f"cpu, {torch.get_num_threads()} threads", "dtype": str(dtype).removeprefix("torch.")}
        if not args.json:
            print(f"{command}: arch {args.arch} ({env['dtype']}, {env['device']}, torch {env['torch']}), "
                  f"{args.tiles} tiles + {args.text_tokens} text tokens per sample")
        if command == "latency":
            rows, columns = run_latency(args, device, dtype), LATENCY_COLUMNS
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
    "params": Command(ParamsConfig, params, "parameters (meta device) and forward FLOPs per part, Table S3"),
    "latency": Command(LatencyConfig, timed_job("latency"), "per-sample generation latency and peak memory, "
                       "Appendix C.1 / Table S7"),
    "forward": Command(ForwardConfig, timed_job("forward"), "time one full forward pass per Pv:Pl, interleaved, "
                       "medians and ratios"),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch(DESCRIPTION, COMMANDS, argv)


if __name__ == "__main__":
    command(main)
