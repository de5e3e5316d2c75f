"""Benchmark: ParVL's compiled CPU decode against llama.cpp's `llama-bench`, side by side, on the same
random decoder, at every precision: fp32 / F32, bf16 / BF16, int8 / Q8_0 and int4 / Q4_0.

    python bench/bench_llamacpp.py                          # builds llama.cpp once (~7 min on 2 cores)
    python bench/bench_llamacpp.py --precisions bf16 int8 --rounds 9

The decoder is bench/bench_generate.py's (Qwen3 1024 x 6 layers, 16 / 8 heads of 128, vocabulary
151,936, untied head; a small ViT for the time to first token) with random weights, written once as an
official-layout bf16 checkpoint: ours loads it with ParVL.from_pretrained (and quant.quantize for int8 /
int4, as generate.py --quant does); llama.cpp reads the same weights written as GGUF with the `gguf`
package (F32 and BF16, norms F32), and its Q8_0 and Q4_0 made by its own `llama-quantize` from the BF16
file. Q4_0 twice: `--pure` (every matrix Q4_0, as our int4) and llama-quantize's default (the output
matrix in Q6_K, what a user gets).

llama.cpp is built from the llama-cpp-python source distribution on the package index (which vendors
it) with cmake and ninja from the index, into a cache folder outside the repository (--cache, default
~/.cache/parvl-llamacpp); nothing of it enters the repository. Where it cannot build, one line says
why and only our side runs.

Timing, in interleaved rounds (every side once per round, so a slow spell of a shared machine hits all
alike): ours is the engine's own decode timer over N - 1 steps (`Engine(model, compile=True)`, a short
text prompt, N new tokens forced); llama.cpp's is `llama-bench -p 0 -n N -t THREADS -r 1` (N decode
steps from an empty context, after its own warm-up). Medians are reported with the load average. Our
time to first token (ViT + prefill of a 1-tile prompt) is timed in the same rounds, against bf16's.

The weight-bandwidth floor of a side is its bytes read per token (every weight but the embedding table,
of which a step reads one row) over the machine's read rate. The read rate is measured the ways the
two sides read: torch.sum of a 1 GB buffer, the compiled fp32 gemv of the decode step (inductor's
reduction) over a 1 GB matrix, and the best rate either side reached in a decode run of this benchmark
(no way of reading is faster than one that was observed): the best of the three counts.

Accuracy on this decoder: bf16's greedy continuation of --agree-tokens tokens, then each quantized
model's logits over it (teacher-forced) against bf16's: top-1 agreement and the mean KL(bf16 || quant).
The last line is one JSON object with every figure. Speed is never asserted in a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

# bench_generate, test helpers
sys.path[:0] = [
    str(Path(__file__).resolve().parent),
    str(Path(__file__).resolve().parents[1] / "tests"),
]
from bench_generate import BenchConfig as DecoderConfig  # noqa: E402
from bench_generate import build_reference, write_checkpoint  # noqa: E402
from inputs import random_pixels  # noqa: E402

from data.processor import Tokenizer, build_prompt  # noqa: E402
from inference.engine import Engine, GenerateConfig  # noqa: E402
from inference.quant import Int4Linear, Int8Linear, quantize  # noqa: E402
from loading.pretrained import load_pretrained  # noqa: E402
from parvl import ParVL  # noqa: E402

LLAMA_SIDE = {"fp32": ["F32"], "bf16": ["BF16"], "int8": ["Q8_0"], "int4": ["Q4_0-pure", "Q4_0"]}
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
)


@dataclass
class Config:
    threads: int = 2  # torch.set_num_threads and llama-bench -t
    new_tokens: int = 64  # N, forced
    rounds: int = 5  # interleaved timing rounds after the warm-up
    tiles: int = 1  # image tiles of the time-to-first-token prompt
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16", "int8", "int4"])
    group_size: int = 128  # int4 group (llama.cpp's Q4_0: 32)
    agree_tokens: int = 1000  # bf16 greedy tokens the quantized models are scored on, 0 = skip
    llamacpp: str = "0.3.36"  # llama-cpp-python source distribution (vendors llama.cpp 0c1e57098)
    cache: str = str(Path.home() / ".cache" / "parvl-llamacpp")
    seed: int = 0


def parse_args(argv=None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help=f"CPU threads, both sides (default {d.threads})",
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=d.new_tokens,
        help=f"tokens per run, N >= 8 (default {d.new_tokens})",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=d.rounds,
        help=f"interleaved timing rounds (default {d.rounds})",
    )
    p.add_argument(
        "--tiles", type=int, default=d.tiles, help=f"tiles of the TTFT prompt (default {d.tiles})"
    )
    p.add_argument(
        "--precisions",
        nargs="+",
        choices=list(LLAMA_SIDE),
        default=d.precisions,
        help="ours / llama.cpp pairs to run (default all four)",
    )
    p.add_argument(
        "--group-size", type=int, default=d.group_size, help=f"int4 group (default {d.group_size})"
    )
    p.add_argument(
        "--agree-tokens",
        type=int,
        default=d.agree_tokens,
        help=f"bf16 greedy tokens for the quantized models' agreement and KL, 0 = skip "
        f"(default {d.agree_tokens})",
    )
    p.add_argument(
        "--llamacpp",
        default=d.llamacpp,
        help=f"llama-cpp-python version to build (default {d.llamacpp})",
    )
    p.add_argument("--cache", default=d.cache, help=f"llama.cpp build folder (default {d.cache})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"weights seed (default {d.seed})")
    cfg = Config(**vars(p.parse_args(argv)))
    if (
        cfg.new_tokens < 8
        or cfg.rounds < 1
        or cfg.threads < 1
        or cfg.tiles < 0
        or cfg.agree_tokens < 0
    ):
        p.error(f"out of range: {cfg}")
    return cfg


# -- the machine -----------------------------------------------------------------------------------


def cpu_info() -> dict:
    """Model name, the SIMD flags that decide these kernels, L3 size, cores."""
    info = {}
    for line in (
        Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    ).splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())  # the first core's
    l3 = (
        subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        if shutil.which("lscpu")
        else ""
    )
    l3 = next((x.split(":", 1)[1].strip() for x in l3.splitlines() if x.startswith("L3")), "?")
    have = set(info.get("flags", "").split())
    return {
        "model": info.get("model name", platform.processor()),
        "cores": os.cpu_count(),
        "flags": [f for f in CPU_FLAGS if f in have],
        "l3": l3,
    }


def read_rate(nbytes: int = 2**30, repeats: int = 5) -> dict[str, float]:
    """Bytes per second two ways of reading a fresh buffer of nbytes (past any cache) reach, best of
    `repeats`: torch.sum, and the decode step's own compiled fp32 gemv (inductor's reduction)."""
    from inference.cpu_decode import cpu_backend

    K = 1024
    w = torch.ones(nbytes // 4 // K, K)
    x = torch.ones(1, K)
    gemv = torch.compile(F.linear, backend=cpu_backend, fullgraph=True)
    out = {}
    for name, fn in (("torch.sum", lambda: w.sum()), ("compiled gemv", lambda: gemv(x, w))):
        fn()
        best = min(timed(fn) for _ in range(repeats))
        out[name] = w.numel() * 4 / best
    return out


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- llama.cpp: built once from the package index, into the cache -----------------------------------


class Skip(Exception):
    """llama.cpp cannot be built or run here; the message says why, in one line."""


def build_llamacpp(cache: Path, version: str) -> Path:
    """The folder holding llama-bench and llama-quantize, built on the first call: pip downloads the
    llama-cpp-python sdist, cmake (-DGGML_NATIVE=ON: this CPU's SIMD) and ninja build the two tools."""
    src = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    bin_dir = src / "build" / "bin"
    if (bin_dir / "llama-bench").exists() and (bin_dir / "llama-quantize").exists():
        return bin_dir
    cache.mkdir(parents=True, exist_ok=True)
    tools = Path(sys.executable).parent  # pip's cmake and ninja land next to the interpreter
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    for tool in ("cmake", "ninja"):
        if shutil.which(tool, path=env["PATH"]) is None:
            raise Skip(f"no {tool} (pip install cmake ninja)")

    def run(cmd, cwd=None):
        print(f"llama.cpp: {' '.join(map(str, cmd))}", flush=True)
        res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        if res.returncode:
            raise Skip(
                f"`{' '.join(map(str, cmd[:4]))} ...` failed: {(res.stderr or res.stdout).strip()[-300:]}"
            )

    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-python",
                f"llama-cpp-python=={version}",
                "-d",
                str(cache),
            ]
        )
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    run(
        [
            "cmake",
            "-B",
            "build",
            "-G",
            "Ninja",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DCMAKE_BUILD_TYPE=Release",
        ],
        cwd=src,
    )
    run(["cmake", "--build", "build", "--target", "llama-bench", "llama-quantize"], cwd=src)
    return bin_dir


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(key: str) -> str:
    """language_model.* key -> llama.cpp's tensor name for the qwen3 architecture."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if key in fixed:
        return fixed[key]
    _, _, layer, rest = key.split(".", 3)  # model.layers.{i}.{module}.weight
    module, _, leaf = rest.rpartition(".")
    return f"blk.{layer}.{GGUF_NAMES[module]}.{leaf}"


def write_gguf(model: ParVL, path: Path, kind: str) -> None:
    """The language model's weights as a qwen3 GGUF: F32, or BF16 matrices with F32 norms. The `gguf` package
    is this benchmark's alone: without it, llama.cpp's side is skipped with how to install it."""
    try:
        import gguf
    except ImportError:
        raise Skip(
            "the gguf package is not installed (pip install gguf), which writes llama.cpp's files"
        ) from None

    c = model.cfg.llm
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(c.num_layers)
    w.add_context_length(4096)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if kind == "F32" else gguf.LlamaFileType.MOSTLY_BF16)
    w.add_tokenizer_model("none")  # llama-bench feeds random token ids
    for key, t in model.language_model.state_dict().items():
        a = t.float().numpy()
        if kind == "BF16" and a.ndim == 2:
            bf16 = gguf.GGMLQuantizationType.BF16
            w.add_tensor(gguf_name(key), gguf.quants.quantize(a, bf16), raw_dtype=bf16)
        else:
            w.add_tensor(gguf_name(key), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_step_bytes(path: Path) -> int:
    """Bytes a decode step reads from a GGUF: every tensor but the embedding table."""
    import gguf

    return sum(
        int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.name != "token_embd.weight"
    )


def llama_bench(bin_dir: Path, model: Path, n: int, threads: int) -> float:
    """llama.cpp's decode tokens/s: n steps from an empty context, one repetition (after its warm-up)."""
    res = subprocess.run(
        [
            str(bin_dir / "llama-bench"),
            "-m",
            str(model),
            "-p",
            "0",
            "-n",
            str(n),
            "-t",
            str(threads),
            "-r",
            "1",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
    )
    if res.returncode:
        raise Skip(f"llama-bench failed on {model.name}: {res.stderr.strip()[-300:]}")
    return float(json.loads(res.stdout)[0]["avg_ts"])


def llama_models(bin_dir: Path, fp32: ParVL, folder: Path, wanted: list[str]) -> dict[str, Path]:
    """GGUF files of the decoder, by llama.cpp precision name; quantized ones made by llama-quantize."""
    files = {}
    for kind in ("F32", "BF16"):
        files[kind] = folder / f"decoder-{kind}.gguf"
        if kind in wanted or kind == "BF16":
            write_gguf(fp32, files[kind], kind)
    for name in wanted:
        if name in files:
            continue
        qtype, pure = name.split("-")[0], name.endswith("-pure")
        files[name] = folder / f"decoder-{name}.gguf"
        res = subprocess.run(
            [
                str(bin_dir / "llama-quantize"),
                *(["--pure"] if pure else []),
                str(files["BF16"]),
                str(files[name]),
                qtype,
                "2",
            ],
            capture_output=True,
            text=True,
        )
        if res.returncode:
            raise Skip(f"llama-quantize {name} failed: {res.stderr.strip()[-300:]}")
    return {k: v for k, v in files.items() if k in wanted}


# -- ours -------------------------------------------------------------------------------------------


def load(folder: Path, precision: str, group_size: int) -> ParVL:
    """The checkpoint as generate.py loads it: fp32 / bf16 weights, or bf16 with int8 / int4 linears."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    return quantize(
        load_pretrained(folder, dtype=dtype),
        precision if precision.startswith("int") else None,
        group_size,
    )


def step_bytes(model: ParVL) -> int:
    """Bytes our decode step reads: the language model's weights (packed ones as stored) but the embedding."""
    total = 0
    for name, module in model.language_model.named_modules():
        if isinstance(module, (Int8Linear, Int4Linear)):
            tensors = [
                module.weight,
                getattr(module, "scale", None),
                getattr(module, "scale_zero", None),
                module.bias,
            ]
        elif "embed_tokens" in name:
            continue
        else:
            tensors = list(module.parameters(recurse=False))
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def decode_run(engine: Engine, ids: list[int], n: int) -> float:
    res = engine.generate([ids], None, GenerateConfig(max_new_tokens=n, ignore_eos=True), [])
    return (res.decode_steps - 1) / res.decode_s


def ttft_run(engine: Engine, ids: list[int], pixels) -> float:
    return engine.generate(
        [ids], pixels, GenerateConfig(max_new_tokens=2, ignore_eos=True), []
    ).prefill_s


@torch.no_grad()
def agreement(
    ref: ParVL, models: dict[str, ParVL], ids: list[int], tokens: list[int]
) -> dict[str, dict]:
    """Teacher-forced over prompt + tokens: each model's top-1 agreement with ref's logits at every
    generated position, and the mean KL(ref || model), in fp32 (lm_head in chunks of 128 rows)."""
    seq = torch.tensor([ids + tokens[:-1]])
    start = len(ids) - 1  # the position whose logits chose tokens[0]

    def logits(model):
        h = model.hidden_from_ids(seq)[0][0, start:]  # [n,C]
        return [model.language_model.lm_head(h[i : i + 128]).float() for i in range(0, len(h), 128)]

    want = logits(ref)
    out = {}
    for name, model in models.items():
        agree, kl, n = 0, 0.0, 0
        for a, b in zip(want, logits(model)):
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            la, lb = a.log_softmax(-1), b.log_softmax(-1)
            kl += float((la.exp() * (la - lb)).sum())
            n += a.shape[0]
        out[name] = {
            "top1_agreement": round(agree / n, 4),
            "mean_kl": float(f"{kl / n:.3g}"),
            "positions": n,
        }
    return out


def main(argv=None) -> int:
    cfg = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    cpu = cpu_info()
    print("config", json.dumps(asdict(cfg)))
    print(
        f"cpu: {cpu['model']}, {cpu['cores']} cores, L3 {cpu['l3']}; flags: {' '.join(cpu['flags'])}; "
        f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_llamacpp_"))
    try:
        return run(cfg, cpu, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(cfg: Config, cpu: dict, tmp: Path) -> int:
    # the shared random checkpoint: bf16, the official layout, as the released checkpoints ship
    ref = build_reference(DecoderConfig(threads=cfg.threads, seed=cfg.seed)).to(torch.bfloat16)
    folder = tmp / "checkpoint"
    folder.mkdir()
    write_checkpoint(ref, folder)
    del ref
    tok = Tokenizer.from_pretrained(folder)
    text_ids = tok.encode(build_prompt("Tell me a story about the sea.", []))
    image_ids = tok.encode(
        build_prompt("Describe the image in detail.", [cfg.tiles] if cfg.tiles else [])
    )
    pixels = random_pixels(cfg.tiles, seed=cfg.seed + 1) if cfg.tiles else None

    ours = {p: load(folder, p, cfg.group_size) for p in cfg.precisions}
    engines = {p: Engine(m, compile=True) for p, m in ours.items()}
    try:
        bin_dir = build_llamacpp(Path(cfg.cache).expanduser(), cfg.llamacpp)
        fp32 = ours["fp32"] if "fp32" in ours else load(folder, "fp32", cfg.group_size)
        ggufs = llama_models(
            bin_dir, fp32, tmp, [name for p in cfg.precisions for name in LLAMA_SIDE[p]]
        )
    except Skip as e:
        print(f"llama.cpp: skipped ({e}); only our side runs")
        bin_dir, ggufs = None, {}

    def ttft(engine):  # the image prompt's time to first token, tiles in the model's dtype
        dtype = engine.model.language_model.model.embed_tokens.weight.dtype
        return ttft_run(engine, image_ids, pixels.to(dtype) if pixels is not None else None)

    # per precision: ours, llama.cpp's, and our time to first token; each called once a round
    sides = {}
    for p, engine in engines.items():
        sides[f"ours {p}"] = lambda e=engine: decode_run(e, text_ids, cfg.new_tokens)
        sides |= {
            f"llama.cpp {name}": (
                lambda path=ggufs[name]: llama_bench(bin_dir, path, cfg.new_tokens, cfg.threads)
            )
            for name in LLAMA_SIDE[p]
            if name in ggufs
        }
        sides[f"ttft {p}"] = lambda e=engine: ttft(e)
    runs, rates, load_before, load_after = time_rounds(cfg, sides, bin_dir, ggufs)
    nbytes = {f"ours {p}": step_bytes(m) for p, m in ours.items()} | {
        f"llama.cpp {name}": gguf_step_bytes(path) for name, path in ggufs.items()
    }
    rates["best decode run"] = max(nbytes[s] * max(v) for s, v in runs.items() if s in nbytes)
    rows = report(cfg, runs, nbytes, rates, load_before, load_after)

    acc = {}
    if cfg.agree_tokens and "bf16" in ours and any(p.startswith("int") for p in ours):
        t0 = time.perf_counter()
        gen = GenerateConfig(max_new_tokens=cfg.agree_tokens, ignore_eos=True)
        tokens = engines["bf16"].generate([text_ids], None, gen, []).tokens[0]
        acc = agreement(
            ours["bf16"], {p: m for p, m in ours.items() if p.startswith("int")}, text_ids, tokens
        )
        for p, a in acc.items():
            print(
                f"{p} against bf16 over bf16's {a['positions']} greedy tokens (teacher-forced): top-1 agreement "
                f"{100 * a['top1_agreement']:.1f} %, mean KL {a['mean_kl']:.3g} nats"
            )
        print(f"(accuracy pass {time.perf_counter() - t0:.0f} s)")

    print(
        json.dumps(
            {
                "bench": "llamacpp",
                "config": asdict(cfg),
                "cpu": cpu,
                "torch": torch.__version__,
                "loadavg": [list(load_before), list(load_after)],
                "read_gb_s": {k: round(v / 1e9, 1) for k, v in rates.items()},
                "sides": rows,
                "accuracy": acc,
            }
        )
    )
    return 0


def time_rounds(cfg: Config, sides: dict, bin_dir, ggufs: dict) -> tuple[dict, dict, tuple, tuple]:
    """Warm every side up, then call each once a round: (the runs per side, the read rates, the load
    average before and after)."""
    # warm-up: compiles (the TTFT prompt first: its cache is the larger), page cache
    t0 = time.perf_counter()
    for side in sorted(sides, key=lambda s: not s.startswith("ttft")):
        if side.startswith("llama"):  # a short run: its own warm-up, and the file in the page cache
            llama_bench(bin_dir, ggufs[side.split()[1]], 8, cfg.threads)
        else:
            sides[side]()
    print(f"warm-up (compiles) {time.perf_counter() - t0:.0f} s")

    load_before, rates = os.getloadavg(), read_rate()
    runs = {side: [] for side in sides}
    for r in range(cfg.rounds):
        for side, fn in sides.items():
            runs[side].append(fn())
        print(
            f"round {r + 1}/{cfg.rounds}: "
            + ", ".join(
                f"{s} {1e3 * v[-1]:.0f} ms" if s.startswith("ttft") else f"{s} {v[-1]:.1f} tok/s"
                for s, v in runs.items()
            )
            + f"; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    # the rate drifts: the better of before and after
    rates = {k: max(v, read_rate()[k]) for k, v in rates.items()}
    return runs, rates, load_before, os.getloadavg()


def report(cfg: Config, runs: dict, nbytes: dict, rates: dict, load_before, load_after) -> dict:
    """Print the table (medians) and the floor's terms; return every side's row."""
    rate = max(rates.values())  # the best way of reading this machine showed
    rows = {}
    for side, v in runs.items():
        med = statistics.median(v)
        if side.startswith("ttft"):
            rows[f"ours {side.split()[1]}"]["ttft_ms"] = round(1e3 * med, 1)
            continue
        rows[side] = {
            "tok_s": round(med, 2),
            "tok_s_runs": [round(x, 2) for x in v],
            "step_mb": round(nbytes[side] / 1e6, 1),
            "gb_s": round(nbytes[side] * med / 1e9, 1),
            "of_floor": round(nbytes[side] * med / rate, 3),
        }
    print(
        f"\nmedians of {cfg.rounds} interleaved rounds; N = {cfg.new_tokens}, {cfg.threads} threads; load average "
        f"(1 / 5 min) {load_before[0]:.2f} / {load_before[1]:.2f} before, {load_after[0]:.2f} / {load_after[1]:.2f} "
        f"after"
    )
    head = (
        f"{'precision':<10}{'ours tok/s':>11}{'llama.cpp':>12}{'tok/s':>8}{'ours/llama':>12}{'ours floor':>12}"
        f"{'llama floor':>13}{'TTFT ms':>9}{'TTFT/bf16':>11}"
    )
    print(head + "\n" + "-" * len(head))
    bf16_ttft = rows.get("ours bf16", {}).get("ttft_ms")
    for p in cfg.precisions:
        o = rows[f"ours {p}"]
        for name in [n for n in LLAMA_SIDE[p] if f"llama.cpp {n}" in rows] or [None]:
            ll = rows.get(f"llama.cpp {name}", {"tok_s": float("nan"), "of_floor": float("nan")})
            if name:
                o.setdefault("vs_llama", {})[name] = round(o["tok_s"] / ll["tok_s"], 3)
            rel = o["ttft_ms"] / bf16_ttft if bf16_ttft else float("nan")
            print(
                f"{p:<10}{o['tok_s']:>11.2f}{name or '-':>12}{ll['tok_s']:>8.2f}{o['tok_s'] / ll['tok_s']:>11.2f}x"
                f"{100 * o['of_floor']:>11.0f}%{100 * ll['of_floor']:>12.0f}%{o['ttft_ms']:>9.0f}{rel:>10.2f}x"
            )
    sizes = ", ".join(f"{side.split()[-1]} {r['step_mb']:.0f}" for side, r in rows.items())
    print(
        f"floor: MB read per token ({sizes}) at {rate / 1e9:.1f} GB/s, the best of "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates.items())
        + " GB/s"
    )
    return rows


if __name__ == "__main__":
    sys.exit(main())
