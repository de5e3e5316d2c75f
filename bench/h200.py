"""The GPU suite: one prepared run that proves the CUDA paths and leaves figures behind.

    bash bench/h200.sh [OUT]            # on a CUDA machine (an H200): nothing downloaded, over 10 minutes
    bash bench/h200.sh --dry-run [OUT]  # the same steps on CPU at tiny sizes (what CI runs)
    bash bench/h200.sh OUT --steps tests latency_quant training   # part one (each step within its limit)
    bash bench/h200.sh OUT2 --steps latency                       # part two, to another folder

Seen on the first H200 run (torch 2.11.0+cu130): the tests took 85 s; every compiled row of a latency
step compiles its own decode step (static shapes: the batch size is in the KV cache's shape), 42-55 s
for the 1B model, so a row costs about a minute and the latency step about seven. The steps' limits
(240 + 420 + 2 x 180 + 2 x 240 s) exceed one command of a lease (10 minutes): run the parts above,
part one first (every CUDA path: tests, quantized decode, FSDP2), each to its own OUT (a run writes its
OUT/h200.json whole, "not run" for the steps it skips).

Steps, each in its own process with a time limit, so one failure never stops the rest (run in the
order 1, 3, 4, 2: the CUDA paths first, the long protocol last):
1. tests: `pytest -m gpu` (tests/test_gpu.py: compiled reduce-overhead decode against eager for 1:1,
   4:4, shared KV and per-sample pairs; tests/test_quant.py: the same with int8 / int4 weights;
   tests/test_moe.py: Qwen3-MoE's grouped_mm on CUDA and its compiled decode) and
   tests/test_kernels.py (the SDPA kernel of every attention case from torch.profiler, and no graph
   break in the decode step); the kernel table is kept.
2. latency: profiling.py's latency protocol (paper Appendix C.1: 3 tiles = 768 image tokens, 256
   text tokens, exactly 128 new tokens, 3 warm-ups, 10 timed iterations) for the 1B architecture
   with random weights at 1:1, 4:4 and 4:4 shared KV, batch 1 and 8 (the table's ends: all four batch
   sizes would compile 12 rows, over ten minutes), bf16, compiled decode; the Table S7 layout next to
   the paper's numbers, and the Table 4 ratios.
3. quantized latency: the same protocol at 1:1 with the language model's weights in int8 and int4
   (profiling.py latency --quant, groups of 128), batch 1, 2 warm-ups and 5 timed iterations,
   beside bf16's 1:1 rows of step 2: CUDA-graph decode on the packed weights (inference/quant.py).
4. training: a short FSDP2 run of train.py (torchrun, one process per GPU) of the 1B architecture
   with random weights on synthetic rows of the paper's shape (one 2-tile image + thumbnail = 768
   image tokens, about 256 text tokens), 1:1 and 2:2 with --compile, packed (the step's 8 samples in
   one row: flex_attention under a BlockMask); tokens/s, MFU and padding of the steps after compilation.

Everything goes to OUT/h200.json (every figure, each step's status and the tail of its output) and
OUT/h200.md (the tables). The tokenizer of the synthetic checkpoint is the tests' tiny byte-level BPE
(tests/tiny_tokenizer.py): the 1B embedding table keeps its 151,936 rows, the text is random.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

# Table S7 (paper): seconds per sample and peak allocated GB on one H200, batch 1, 2, 4, 8.
PAPER_S7 = {
    ("1:1", False): ([1.963, 0.977, 0.498, 0.256], [2.310, 2.458, 2.760, 3.361]),
    ("4:4", False): ([2.048, 1.061, 0.558, 0.313], [2.837, 3.456, 4.677, 7.117]),
    ("4:4", True): ([2.422, 1.288, 0.681, 0.414], [2.571, 2.908, 3.585, 4.927]),
}
BATCHES = [1, 2, 4, 8]  # Table S7's columns
# what the suite measures of them: a compiled row costs about a minute on an H200
LATENCY_BATCHES = [1, 8]


def run(
    cmd: list[str],
    timeout: float,
    env: dict | None = None,
    last_json: bool = False,
    log: Path | None = None,
) -> dict:
    """Run one step; never raise: status ok / failed / timeout, the exit code, the output's tail and, with
    last_json, its last JSON line (whole: a profile's line alone can be longer than the tail); with log,
    the whole output is written there."""
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
        status, rc, out = (
            ("ok" if res.returncode == 0 else "failed"),
            res.returncode,
            res.stdout + res.stderr,
        )
    except subprocess.TimeoutExpired as e:
        status, rc = "timeout", None
        out = (
            (e.stdout or b"").decode(errors="replace")
            if isinstance(e.stdout, bytes)
            else (e.stdout or "")
        )
    print(
        f"[{status}] {' '.join(cmd[:6])} ... ({time.perf_counter() - t0:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    res = {
        "status": status,
        "rc": rc,
        "seconds": round(time.perf_counter() - t0, 1),
        "cmd": cmd,
        "tail": out[-4000:],
    }
    if log is not None:
        log.write_text(out)
    if last_json:
        res["json"] = next((x for x in reversed(out.splitlines()) if x.startswith("{")), None)
    return res


def step_tests(out: Path, dry: bool) -> dict:
    report = out / "kernels.json"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        "tests/test_gpu.py",
        "tests/test_quant.py",
        "tests/test_kernels.py",
        "tests/test_moe.py",  # Qwen3-MoE's grouped_mm on CUDA, its compiled decode
    ]
    # on CUDA the GPU tests and the kernel tests; the dry run (CPU, inside the suite, which runs both
    # files itself) only proves the plumbing: pytest runs and the kernel table comes back
    cmd += ["-m", "gpu"] if not dry else ["-k", "every_attention_case"]
    res = run(cmd, 240, {"PARVL_KERNEL_REPORT": str(report)}, log=out / "tests.log")
    res["kernels"] = json.loads(report.read_text()) if report.exists() else None
    res["failed"] = failed_ids((out / "tests.log").read_text())
    return res


def failed_ids(output: str) -> list[str]:
    """The ids of the failed (and erroring) tests in pytest's -rfE summary, whatever the tail kept of
    their tracebacks."""
    return [
        x.split(" - ")[0].split(" ", 1)[1]
        for x in output.splitlines()
        if x.startswith(("FAILED ", "ERROR "))
    ]


def step_latency(dry: bool) -> dict:
    if dry:
        size = [
            "--arch",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--batch",
            "1",
            "2",
            "--warmup",
            "1",
            "--iters",
            "1",
            "--new-tokens",
            "4",
            "--tiles",
            "1",
            "--text-tokens",
            "16",
            "--threads",
            "1",
        ]
    else:  # the protocol's defaults: 3 tiles, 256 text tokens, 128 new tokens, 3 warm-ups, 10 iterations
        size = [
            "--arch",
            "1b",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--batch",
            *map(str, LATENCY_BATCHES),
            "--compile",
        ]
    res = run(
        [
            sys.executable,
            "profiling.py",
            "latency",
            "--pv",
            "4",
            "--pl",
            "4",
            "--baseline",
            "--compare-shared",
            "--json",
            *size,
        ],
        60 if dry else 420,
        last_json=True,
    )
    line = res.pop("json")
    res["rows"] = json.loads(line)["rows"] if res["status"] == "ok" and line else None
    return res


QUANT_BATCHES = [1]


def step_latency_quant(dry: bool) -> dict:
    """Step 3: profiling.py latency --quant int8 and int4 at 1:1, one process each (one may fail alone)."""
    if dry:  # the tiny preset's widths (64, 96, 128) take groups of 32
        size = [
            "--arch",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "fp32",
            "--batch",
            "1",
            "2",
            "--warmup",
            "1",
            "--iters",
            "1",
            "--new-tokens",
            "4",
            "--tiles",
            "1",
            "--text-tokens",
            "16",
            "--threads",
            "1",
        ]
        group = ["--group-size", "32"]
    else:
        size = [
            "--arch",
            "1b",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--batch",
            *map(str, QUANT_BATCHES),
            "--warmup",
            "2",
            "--iters",
            "5",
            "--compile",
        ]
        group = ["--group-size", "128"]
    res = {"status": "ok", "rows": [], "runs": {}}
    for mode in ("int8", "int4"):
        run_ = run(
            [
                sys.executable,
                "profiling.py",
                "latency",
                "--pv",
                "1",
                "--pl",
                "1",
                "--json",
                "--quant",
                mode,
                *(group if mode == "int4" else []),
                *size,
            ],
            60 if dry else 180,
            last_json=True,
        )
        line = run_.pop("json")
        if run_["status"] == "ok" and line:
            res["rows"] += json.loads(line)["rows"]
        else:
            res["status"] = "failed"
        res["runs"][mode] = run_
    return res


def synthetic_checkpoint(folder: Path, arch: str, rows: int, seed: int = 0) -> Path:
    """A random-weight checkpoint of `arch` with the tests' tiny tokenizer, and `rows` SFT rows of the
    paper's shape; returns the meta JSON."""
    from dataclasses import replace

    import numpy as np
    from PIL import Image
    from tiny_tokenizer import write_tiny_tokenizer

    from config import PRESETS
    from loading.pretrained import save_pretrained
    from parvl import ParVL

    ids = write_tiny_tokenizer(folder / "model")
    cfg = PRESETS[arch]
    # tiny's 512 rows are too few
    llm = replace(cfg.llm, vocab_size=max(cfg.llm.vocab_size, ids["vocab_size_tokenizer"]))
    save_pretrained(
        ParVL.from_config(replace(cfg, llm=llm, image_token_id=ids["img_context_id"]), seed=seed),
        folder / "model",
    )
    rng = np.random.default_rng(seed)
    words = [
        "the",
        "chart",
        "shows",
        "a",
        "value",
        "of",
        "image",
        "red",
        "blue",
        "line",
        "sum",
        "what",
        "is",
    ]
    # 2 tiles + thumbnail
    Image.fromarray(rng.integers(0, 255, (448, 896, 3), dtype=np.uint8)).save(folder / "img.png")
    lines = []
    for _ in range(rows):
        q = " ".join(rng.choice(words, 200))  # about 256 text tokens with the template
        a = " ".join(rng.choice(words, 100))
        lines.append(
            {
                "image": "img.png",
                "conversations": [
                    {"from": "human", "value": "<image>\n" + q},
                    {"from": "gpt", "value": a},
                ],
            }
        )
    (folder / "rows.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    meta = {
        "synthetic": {
            "root": str(folder),
            "annotation": str(folder / "rows.jsonl"),
            "repeat_time": 1,
            "length": rows,
            "data_augment": False,
        }
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / "meta.json"


def step_training(out: Path, dry: bool) -> dict:
    steps, batch = (2, 2) if dry else (10, 8)
    meta = synthetic_checkpoint(out / "synthetic", "tiny" if dry else "1b", steps * batch)
    runs = {}
    # the dry run checks the plumbing once; on the GPU both are figures
    for p in (2,) if dry else (1, 2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1" if dry else str(max(1, _gpus())),
            "train.py",
            "--model",
            str(meta.parent / "model"),
            "--data",
            str(meta),
            "--out",
            str(out / f"train_{p}x{p}"),
            "--pv",
            str(p),
            "--pl",
            str(p),
            "--max-steps",
            str(steps),
            "--global-batch",
            str(batch),
            "--micro-batch",
            "1",
            "--max-tiles",
            "2",
            "--save-every",
            "100000",
            "--num-workers",
            "0" if dry else "2",
            "--packing",
        ] + ([] if dry else ["--compile"])
        res = run(cmd, 120 if dry else 240)
        metrics = out / f"train_{p}x{p}" / "metrics.jsonl"
        lines = (
            [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        )
        steady = lines[2:] or lines  # the first steps compile
        res["steps"] = len(lines)
        if steady:
            res["tokens_per_s"] = statistics.median(x["tokens_per_s"] for x in steady)
            mfu = [x["mfu"] for x in steady if x.get("mfu") is not None]
            res["mfu"] = statistics.median(mfu) if mfu else None
            res["pad_frac"] = statistics.median(x["pad_frac"] for x in steady)
        runs[f"{p}:{p}"] = res
    status = (
        "ok"
        if all(r["status"] == "ok" and r.get("steps") == steps for r in runs.values())
        else "failed"
    )
    return {"status": status, "runs": runs}


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def markdown(result: dict) -> str:
    md = [
        f"# GPU suite ({result['device']}, torch {result['torch']}{', dry run' if result['dry_run'] else ''})",
        "",
    ]
    md += ["| step | status | seconds |", "| --- | --- | --- |"]
    for name in STEPS:
        s = result[name]
        md.append(f"| {name} | {s['status']} | {s.get('seconds', '')} |")
    kernels = result["tests"].get("kernels") or {}
    if kernels:
        md += [
            "",
            "## SDPA kernel per attention case",
            "",
            "| case | kernels | fused |",
            "| --- | --- | --- |",
        ]
        md += [
            f"| {case} | {', '.join(k['kernels'])} | {k['fused']} |" for case, k in kernels.items()
        ]
    rows = result["latency"].get("rows")
    if rows:
        md += [
            "",
            "## Latency (Table S7 layout; ours / paper)",
            "",
            "| Pv:Pl | Shared KV | metric | "
            + " | ".join(f"batch {b}" for b in sorted({r["batch"] for r in rows}))
            + " |",
            "| --- | --- | --- |" + " --- |" * len({r["batch"] for r in rows}),
        ]
        for key in PAPER_S7:
            mine = sorted(
                (r for r in rows if f"{r['pv']}:{r['pl']}" == key[0] and r["shared_kv"] == key[1]),
                key=lambda r: r["batch"],
            )
            for metric, col, paper in (
                ("latency (s)", "latency_s", PAPER_S7[key][0]),
                ("memory (GB)", "peak_gib", PAPER_S7[key][1]),
            ):
                cells = [
                    f"{r[col] * (2**30 / 1e9 if col == 'peak_gib' else 1):.3f} / "
                    f"{paper[BATCHES.index(r['batch'])]:.3f}"
                    for r in mine
                ]
                md.append(
                    f"| {key[0]} | {'yes' if key[1] else 'no'} | {metric} | "
                    + " | ".join(cells)
                    + " |"
                )
        md += [
            "",
            "## Table 4 ratios (vs standard 1:1 at the same batch; ours / paper)",
            "",
            "| variant | batch | latency x | memory x |",
            "| --- | --- | --- | --- |",
        ]
        for r in rows:
            key = (f"{r['pv']}:{r['pl']}", r["shared_kv"])
            if key[0] == "1:1":
                continue
            i = BATCHES.index(r["batch"])
            lat = PAPER_S7[key][0][i] / PAPER_S7[("1:1", False)][0][i]
            mem = PAPER_S7[key][1][i] / PAPER_S7[("1:1", False)][1][i]
            md.append(
                f"| {key[0]}{' shared KV' if key[1] else ''} | {r['batch']} | {r['latency_x']:.2f} / {lat:.2f} | "
                f"{r['peak_x']:.2f} / {mem:.2f} |"
            )
    md += quant_markdown(rows or [], result["latency_quant"].get("rows") or [])
    runs = result["training"].get("runs") or {}
    if runs:
        md += [
            "",
            "## FSDP2 training (steady steps)",
            "",
            "| Pv:Pl | status | tokens/s | MFU |",
            "| --- | --- | --- | --- |",
        ]
        for key, r in runs.items():
            mfu = r.get("mfu")
            md.append(
                f"| {key} | {r['status']} | {r.get('tokens_per_s', float('nan')):.0f} | "
                f"{'-' if mfu is None or mfu != mfu else f'{100 * mfu:.1f} %'} |"
            )
    return "\n".join(md) + "\n"


def quant_markdown(rows: list[dict], quant_rows: list[dict]) -> list[str]:
    """Step 3's rows against bf16's standard 1:1 rows of step 2 at the same batch size."""
    if not quant_rows:
        return []
    bf16 = {r["batch"]: r for r in rows if (r["pv"], r["pl"], r["shared_kv"]) == (1, 1, False)}
    md = [
        "",
        "## Quantized latency, 1:1 (weight-only, inference/quant.py; x = against bf16's 1:1 row)",
        "",
        "| weights | batch | latency (s) | x | decode tok/s | x | peak (GB) | weights (GB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in quant_rows:
        b = bf16.get(r["batch"])
        lat_x = f"{r['latency_s'] / b['latency_s']:.2f}" if b else "-"
        tok_x = (
            f"{r['decode_tok_s'] / b['decode_tok_s']:.2f}"
            if b and r["decode_tok_s"] and b["decode_tok_s"]
            else "-"
        )
        tok = f"{r['decode_tok_s']:.0f}" if r["decode_tok_s"] else "-"
        md.append(
            f"| {r['quant']} | {r['batch']} | {r['latency_s']:.3f} | {lat_x} | {tok} | {tok_x} | "
            f"{r['peak_gib'] * 2**30 / 1e9:.3f} | {r['weights_gib'] * 2**30 / 1e9:.3f} |"
        )
    return md


# the order they run in: every CUDA path first
STEPS = ("tests", "latency_quant", "training", "latency")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="The GPU suite: CUDA tests, the latency protocol and FSDP2 training, "
        "figures to OUT."
    )
    p.add_argument("out", nargs="?", default="runs/h200", help="output folder (default runs/h200)")
    p.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny sizes: check the suite itself (CI)"
    )
    p.add_argument(
        "--steps",
        nargs="+",
        choices=STEPS,
        default=list(STEPS),
        help="the steps to run, in this order (default: all, as listed)",
    )
    args = p.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device; use --dry-run to check the suite on CPU", file=sys.stderr)
        return 1
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "device": "cpu" if args.dry_run else torch.cuda.get_device_name(0),
    }
    result |= {name: {"status": "not run"} for name in STEPS}
    t0 = time.perf_counter()
    steps = {
        "tests": lambda: step_tests(out, args.dry_run),
        "latency": lambda: step_latency(args.dry_run),
        "latency_quant": lambda: step_latency_quant(args.dry_run),
        "training": lambda: step_training(out, args.dry_run),
    }
    for name in args.steps:
        try:
            result[name] = steps[name]()
        except Exception as e:  # noqa: BLE001  the suite records a broken step and goes on
            result[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        # what is done so far survives a kill
        (out / "h200.json").write_text(json.dumps(result, indent=2))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "h200.json").write_text(json.dumps(result, indent=2))
    (out / "h200.md").write_text(markdown(result))
    print((out / "h200.md").read_text())
    print(json.dumps({k: result[k]["status"] for k in STEPS} | {"seconds": result["seconds"]}))
    return 0 if all(result[k]["status"] == "ok" for k in args.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
