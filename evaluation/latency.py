"""The paper's latency protocol on random weights (Appendix C.1, C.2), which `profiling.py latency` runs, and
Tables S7 and 4 made of its rows.

Each sample is one random 448 px tile repeated --tiles times (256 image tokens each) and random filler ids up
to --text-tokens non-image tokens, the same for the whole batch (no padding); inference/engine.py's Engine decodes
greedily exactly --new-tokens tokens. --warmup untimed calls, then --iters timed ones, synchronised (CUDA
events); latency per sample = elapsed / (iters x batch). The memory peak is reset before the timed calls: peak
allocated on CUDA, peak RSS on CPU (Linux VmHWM). The Engine keeps its static KV cache across calls, so
"resident" (before the timed calls) holds the weights and the cache, whose exact size is reported too. C.2's
incremental peak subtracts "the resident allocation measured immediately before timed generation" in the paper's
generation path, which allocates its KV cache inside each generate call: so here the resident less the static KV
cache already in it (incremental_peak_gib = peak - (resident - that cache)), and the cache counts in the
increment, as the paper's "persistent ordinary-token KV component" does. Compile time = first call - steady
call. Ratios (x): against the first row of each batch size, standard 1:1 with --baseline. The rows are printed
in the paper's layouts (paper_layout: Table S7, Table 4 and the shared-KV Δ rows of C.2) and drawn (plot_latency).
"""

from __future__ import annotations

import ctypes
import gc
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from config import ParConfig, ParVLConfig, branch_variant
from evaluation.flops import Workload
from inference.engine import Engine, GenerateConfig
from inference.flags import quant_spec
from inference.quant import quantize, weight_bytes
from parvl import ParVL
from shell.cli import UsageError, allocation, pyplot
from shell.files import writing

# -- timing and memory on random weights (Appendix C.1) -------------------------------------------


def synthetic_inputs(
    cfg: ParVLConfig,
    work: Workload,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """C.1's sample, `batch` identical copies: ids [B,T], a short text head, the <IMG_CONTEXT> run of the
    tiles, then filler ids; pixels [B*tiles,3,448,448], one random tile repeated (None without tiles)."""
    assert 0 < cfg.image_token_id <= cfg.llm.vocab_size, (cfg.image_token_id, cfg.llm.vocab_size)
    g = torch.Generator().manual_seed(seed)
    # never the image id
    text = torch.randint(0, cfg.image_token_id, (work.text_tokens,), generator=g).tolist()
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
        return (
            torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
        )
    key = "VmHWM:" if peak else "VmRSS:"
    line = next(s for s in Path("/proc/self/status").read_text().splitlines() if s.startswith(key))
    return int(line.split()[1]) * 1024  # reported in kB


def kv_cache_bytes(model: ParVL) -> tuple[int, int]:
    """Exact bytes of the static KV cache (every layer's k and v buffers), and of its token slots alone
    (the prefix slots in front excluded): the part Shared KV divides by Pl. 0 before a call allocates it."""
    # k, v [rows,Hkv,S,D]
    caches = [layer.self_attn.kv_cache for layer in model.language_model.model.layers]
    caches = [c for c in caches if c is not None]
    total = sum(c.k.nbytes + c.v.nbytes for c in caches)
    tokens = sum(
        (c.k.nbytes + c.v.nbytes) // c.k.shape[2] * (c.k.shape[2] - c.offset) for c in caches
    )
    return total, tokens


def trace(fn, device: torch.device, folder: Path, name: str) -> None:
    """torch.profiler over three calls, schedule wait 1 / warmup 1 / active 1: a Chrome trace of the
    third (chrome://tracing, ui.perfetto.dev) and, on CUDA, a memory snapshot (pytorch.org/memory_viz)."""
    folder.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    )
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        profile_memory=True,
        on_trace_ready=lambda p: p.export_chrome_trace(str(folder / f"{name}.json")),
    ) as prof:
        for _ in range(3):
            fn()
            prof.step()
    if cuda:
        torch.cuda.memory._dump_snapshot(str(folder / f"{name}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)


def profile_latency(engine: Engine, cfg: ParVLConfig, work: Workload, batch: int, args) -> dict:
    """One row of Table S7: warm-ups, then timed generate calls of `batch` samples, exactly N tokens each."""
    device, dtype, n = engine.device, engine.dtype, work.response_tokens
    ids_BT, pixels = synthetic_inputs(cfg, work, batch, dtype, device, args.seed)
    prompts = ids_BT.tolist()  # the Engine takes token lists and builds the batch itself
    gen = GenerateConfig(max_new_tokens=n, ignore_eos=True)  # greedy, min = max new tokens
    call = lambda: engine.generate(prompts, pixels, gen, stop_ids=[])  # noqa: E731
    torch._dynamo.reset()  # each row compiles afresh: its own compile time, and no recompile limit
    first = [timed(call, device)[1] for _ in range(args.warmup)][:1]
    reset_peak(device)  # after warm-up: the cache is allocated, compilation is done
    resident = memory_bytes(device, peak=False)
    # the static cache within `resident` (0 without warm-up)
    resident_kv = kv_cache_bytes(engine.model)[0]
    runs = [timed(call, device) for _ in range(args.iters)]
    peak = memory_bytes(device, peak=True)
    assert all(len(t) == n for res, _ in runs for t in res.tokens), (
        f"not exactly {n} tokens per sample"
    )
    times = [s for _, s in runs]
    steps = sum(res.decode_steps - 1 for res, _ in runs)  # the first token comes from prefill
    decode_s = sum(res.decode_s for res, _ in runs)
    kv, kv_tokens = kv_cache_bytes(engine.model)
    if args.trace:
        kind = "shared" if engine.shared_kv else "std"
        trace(call, device, Path(args.trace), f"latency_{cfg.par.pv}x{cfg.par.pl}_{kind}_b{batch}")
    return {
        "arch": args.arch,
        "pv": cfg.par.pv,
        "pl": cfg.par.pl,
        "shared_kv": engine.shared_kv,
        "compiled": engine.compiled,  # the regime: C.1's eager batched generation, or the CUDA-graph decode
        "batch": batch,
        "latency_s": sum(times) / (len(times) * batch),  # per sample, as in C.1
        "latency_median_s": statistics.median(times) / batch,  # robust to a busy shared machine
        "iter_s": [round(s, 4) for s in times],
        "prefill_ms": 1e3 * statistics.mean(res.prefill_s for res, _ in runs),
        "decode_ms_per_step": 1e3 * decode_s / steps if steps else None,
        "decode_tok_s": batch * steps / decode_s if steps else None,
        # first call - steady state; without --compile nothing compiles (the difference is noise, even negative)
        "compile_s": first[0] - statistics.mean(times) if first and engine.compiled else None,
        "memory": "cuda_allocated" if device.type == "cuda" else "cpu_rss",
        "resident_gib": resident / 2**30,
        "peak_gib": peak / 2**30,
        "resident_kv_cache_bytes": resident_kv,
        # C.2: peak less the resident allocation before generation as the paper's path has it, without a KV cache
        "incremental_peak_gib": (peak - (resident - resident_kv)) / 2**30,
        "kv_cache_bytes": kv,
        "kv_token_bytes": kv_tokens,
    }


def run_latency(
    args, main_cfg: ParVLConfig, arch: str, device: torch.device, dtype: torch.dtype
) -> list[dict]:
    """Standard (and/or shared-KV) Pv:Pl, after standard 1:1 with --baseline; ratios vs the first row per batch.
    Each row records its architecture and branch parameterisation (config.branch_variant), so that
    `evaluate.py cost` puts each configuration at its own profile."""
    work = Workload(args.tiles, args.text_tokens, args.new_tokens)
    modes = (False, True) if args.compare_shared else (args.shared_kv,)
    runs = [(main_cfg, modes)]
    if args.baseline and (main_cfg.par.pv, main_cfg.par.pl) != (1, 1):
        runs.insert(0, (replace(main_cfg, par=ParConfig()), (False,)))  # 1:1, the paper's branches
    rows = []
    for cfg, kv_modes in runs:
        model = ParVL.from_config(cfg, dtype, device, seed=args.seed).eval()
        try:  # --quant, as load_engine applies it
            quantize(model, *quant_spec(args))
        except ValueError as e:  # int4 groups that do not divide the architecture's widths
            raise UsageError(str(e)) from None
        weights = weight_bytes(model)
        for shared in kv_modes:
            # the previous variant's cache must not count here
            for layer in model.language_model.model.layers:
                layer.self_attn.kv_cache = None
            engine = Engine(model, compile=args.compile, shared_kv=shared)
            for b in args.batch:  # a batch that does not fit: one line with the flags that lower it
                with allocation(
                    f"Pv:Pl {cfg.par.pv}:{cfg.par.pl} --batch {b} ({work.tiles} tiles, "
                    f"{work.text_tokens} text tokens, {work.response_tokens} new tokens per sample)",
                    "--batch, --tiles, --text-tokens or --new-tokens",
                ):
                    rows.append(
                        profile_latency(engine, cfg, work, b, args)
                        | {
                            "weights_gib": weights / 2**30,
                            "arch": arch,
                            "branches": branch_variant(cfg.par),
                            "quant": model.quant,
                        }
                    )
        # one model resident at a time, as when variants are profiled sequentially
        del (model, engine)
    return add_ratios(rows)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Table 4's ratios: each row's latency, peak memory and KV cache against the first row of its batch
    size (standard 1:1 with --baseline)."""
    for r in rows:
        base = next(b for b in rows if b["batch"] == r["batch"])
        r |= {
            "latency_x": r["latency_s"] / base["latency_s"],
            "peak_x": r["peak_gib"] / base["peak_gib"],
            "kv_cache_x": r["kv_cache_bytes"] / base["kv_cache_bytes"]
            if base.get("kv_cache_bytes")
            else None,
        }
    return rows


# -- Tables 4 and S7 from profiling.py latency's rows (Appendix C.1, C.2) -------------------------


def shared_vs_standard(rows: list[dict]) -> list[dict]:
    """Per Pv:Pl profiled both ways and per batch size, shared KV against the standard cache (Appendix
    C.2, the paragraph under Table S7): the change of per-sample latency, of peak memory, and of the
    incremental peak (C.2's "after subtracting the resident allocation measured immediately before timed
    generation": the memory generation adds, its KV cache included; profile_latency), in % of standard's."""
    out = []
    for r in rows:
        std = next(
            (
                s
                for s in rows
                if not s["shared_kv"]
                and (s["pv"], s["pl"], s["batch"], s.get("branches"))
                == (r["pv"], r["pl"], r["batch"], r.get("branches"))
            ),
            None,
        )
        if r["shared_kv"] and std is not None:
            change = lambda new, old: 100 * (new / old - 1) if old else None  # noqa: E731
            out.append(
                {
                    "pv": r["pv"],
                    "pl": r["pl"],
                    "batch": r["batch"],
                    "latency_pct": change(r["latency_s"], std["latency_s"]),
                    "peak_pct": change(r["peak_gib"], std["peak_gib"]),
                    "incremental_peak_pct": change(
                        r["incremental_peak_gib"], std["incremental_peak_gib"]
                    ),
                }
            )
    return out


def paper_layout(rows: list[dict], delta: list[dict]) -> str:
    """Tables S7 and 4 as the paper prints them (a row per configuration and metric, a column per batch
    size: absolute, then relative to the first configuration), then the Δ rows of shared KV against
    standard per batch size."""
    batches = sorted({r["batch"] for r in rows})
    head = "| Pv:Pl | Shared KV | Metric | " + " | ".join(map(str, batches)) + " |"
    rule = "|" + " --- |" * (len(batches) + 3)
    configs = list(
        dict.fromkeys(
            (r["pv"], r["pl"], r["shared_kv"], json.dumps(r.get("branches") or {})) for r in rows
        )
    )
    cell = {
        (r["pv"], r["pl"], r["shared_kv"], json.dumps(r.get("branches") or {}), r["batch"]): r
        for r in rows
    }
    mem = "Memory (GB)" if rows[0]["memory"] == "cuda_allocated" else "Memory (GB, RSS)"

    def line(c, metric, key, fmt, unit=""):
        name = f"{c[0]}:{c[1]}" + ("" if c[3] == "{}" else f" {c[3]}")
        vals = [
            format(cell[c + (b,)][key], fmt) + unit if c + (b,) in cell else "-" for b in batches
        ]
        return f"| {name} | {'✓' if c[2] else '✗'} | {metric} | " + " | ".join(vals) + " |"

    # the paper's tables are the eager regime's; the compiled decode is this project's table, titled apart
    eager = not any(r.get("compiled") for r in rows)
    s7, t4 = ("Table S7", "Table 4") if eager else ("Table S7's layout", "Table 4's layout")
    regime = (
        "Decode: eager, the paper's regime (C.1: the batched generation path, min_new_tokens = "
        "max_new_tokens)."
        if eager
        else "Decode: compiled, CUDA graphs (this project's regime, not the paper's: launch overhead no "
        "longer hides the branches' extra compute, so ratios and absolute times both differ from C.1's)."
    )
    md = [
        f"{s7}: Absolute profiling results. Latency in seconds per sample, memory the peak (GB: 2^30 "
        f"bytes); the settings profiled one after the other on the same device. {regime}",
        "",
        head,
        rule,
    ]
    for c in configs:  # GB as the paper prints them: 2**30 bytes
        md += [line(c, "Latency (s)", "latency_s", ".3f"), line(c, mem, "peak_gib", ".3f")]
    md += [
        "",
        f"{t4}: Relative inference costs. Per-sample latency and peak memory, normalized by the first "
        f"row (standard 1:1 with --baseline) at each batch size. {regime}",
        "",
        head,
        rule,
    ]
    for c in configs[1:]:
        md += [line(c, "Latency", "latency_x", ".2f", "×"), line(c, "Memory", "peak_x", ".2f", "×")]
    if delta:
        md += [
            "",
            "Appendix C.2: Δ (Shared − Standard), % of standard:",
            "",
            "| Pv:Pl | Metric | " + " | ".join(map(str, batches)) + " |",
            "|" + " --- |" * (len(batches) + 2),
        ]
        for pv, pl in dict.fromkeys((d["pv"], d["pl"]) for d in delta):
            mine = {d["batch"]: d for d in delta if (d["pv"], d["pl"]) == (pv, pl)}
            for key, metric in (
                ("latency_pct", "Latency"),
                ("peak_pct", "Peak memory"),
                ("incremental_peak_pct", "Incremental peak (C.2)"),
            ):
                vals = [
                    "-" if b not in mine or mine[b][key] is None else f"{mine[b][key]:+.1f} %"
                    for b in batches
                ]
                md.append(f"| {pv}:{pl} | {metric} | " + " | ".join(vals) + " |")
    return "\n".join(md)


def plot_latency(rows: list[dict], png: Path) -> None:
    """Latency per sample and peak memory against batch size, one line per configuration (Pv:Pl,
    standard or shared KV): the view of the paper's Figure 4 / Table 4."""
    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    configs = dict.fromkeys((r["pv"], r["pl"], r["shared_kv"]) for r in rows)  # in run order
    for pv, pl, shared in configs:
        mine = sorted(
            (r for r in rows if (r["pv"], r["pl"], r["shared_kv"]) == (pv, pl, shared)),
            key=lambda r: r["batch"],
        )
        label = f"{pv}:{pl}" + (" shared KV" if shared else "")
        batches = [r["batch"] for r in mine]
        ax_t.plot(batches, [1e3 * r["latency_s"] for r in mine], marker="o", label=label)
        ax_m.plot(batches, [r["peak_gib"] for r in mine], marker="o", label=label)
    for ax, what in (
        (ax_t, "latency per sample (ms)"),
        (ax_m, f"peak memory (GiB, {rows[0]['memory']})"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            sorted({r["batch"] for r in rows}), [str(b) for b in sorted({r["batch"] for r in rows})]
        )
        ax.set_xlabel("batch size")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"arch {rows[0]['arch']}", fontsize=10)
    fig.tight_layout()
    with writing(png):  # a full disk names the file
        fig.savefig(png, dpi=100, format="png")  # the file named, even without a .png suffix
    plt.close(fig)
