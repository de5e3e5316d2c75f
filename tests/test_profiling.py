"""evaluation/flops.py (printed by profiling.py) against the paper's Table S3 (Appendix B.2): every parameter
entry to 0.01 M, every FLOP entry to 0.03 GFLOPs (the table rounds to 0.01 and its ViT entries
carry a constant 0.016 GFLOPs this count leaves out, see evaluation/flops.py), i.e. within 1e-5 relative for
every entry above 1000 GFLOPs and 2e-3 for the connector's 8.07: far inside 2 %, and tight enough
to pin the counting convention; the totals against the table's own parts added up. The tiny preset
counted by hand (parameters from the module shapes, checked against a materialised model; FLOPs
as 2 * tokens * fan_in * fan_out per linear, written out). Then the JSON lines of the CLI, and
that counting builds only meta tensors. Last, the `latency` and `forward` commands (Appendix C.1,
C.2) on the tiny preset: the synthetic C.1 sample, the row layout, and the exact KV-cache bytes,
cache ratios and GFLOPs, all as literal figures worked out by hand; the latency plot (with and without
matplotlib), compile_s, an allocation failure and a --device that is not one.

Run: python -m pytest tests/test_profiling.py -q -s   (-s prints the relative errors)
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commands import one_line, png_ok, run_main

import profiling
from evaluation import flops, latency
from parvl import ParVL

REPO = Path(__file__).resolve().parents[1]
FLOP_ATOL = 0.03  # GFLOPs

# Table S3: (arch, Pv, Pl) -> ViT GFLOPs, ViT M, LLM GFLOPs, LLM M, total GFLOPs, total M
TABLE_S3 = {
    ("1b", 1, 1): (1861.71, 304.01, 1373.25, 751.63, 3243.03, 1060.90),
    ("1b", 1, 2): (1861.71, 304.01, 2392.87, 759.24, 4262.65, 1068.50),
    ("1b", 1, 4): (1861.71, 304.01, 4427.28, 766.84, 6297.06, 1076.11),
    ("1b", 2, 1): (3732.62, 315.55, 1373.25, 751.63, 5113.94, 1072.44),
    ("1b", 2, 2): (3732.62, 315.55, 2392.87, 759.24, 6133.56, 1080.04),
    ("1b", 2, 4): (3732.62, 315.55, 4427.28, 766.84, 8167.96, 1087.64),
    ("1b", 4, 1): (7461.52, 327.09, 1373.25, 751.63, 8842.83, 1083.97),
    ("1b", 4, 2): (7461.52, 327.09, 2392.87, 759.24, 9862.46, 1091.58),
    ("1b", 4, 4): (7461.52, 327.09, 4427.28, 766.84, 11896.86, 1099.18),
    ("2b", 1, 1): (1861.71, 304.01, 3964.12, 2031.74, 5845.17, 2348.35),
    ("2b", 2, 2): (3732.62, 315.55, 7230.65, 2045.64, 10982.61, 2373.78),
    ("8b", 1, 1): (1861.71, 304.01, 17437.41, 8190.74, 19350.68, 8528.32),
    ("8b", 2, 2): (3732.62, 315.55, 33518.30, 8231.38, 37302.47, 8580.50),
}
# The caption's projector (mlp1) entries: arch -> (GFLOPs, M)
CONNECTOR = {"1b": (8.07, 5.25), "2b": (19.34, 12.60), "8b": (51.56, 33.57)}


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, int, int], dict]:
    return {key: flops.profile_params(*key) for key in TABLE_S3}


def check(what: str, params: int, gflops: float, paper_m: float, paper_g: float) -> None:
    rel = (gflops - paper_g) / paper_g
    print(
        f"{what:<16} {params / 1e6:9.2f} M (paper {paper_m:9.2f})  {gflops:10.2f} GFLOPs "
        f"(paper {paper_g:10.2f}, rel err {rel:+.1e})"
    )
    assert round(params / 1e6, 2) == paper_m, (
        f"{what}: {params / 1e6:.4f} M, Table S3 says {paper_m} M"
    )
    assert abs(gflops - paper_g) < FLOP_ATOL, (
        f"{what}: {gflops:.3f} GFLOPs, Table S3 says {paper_g}"
    )


@pytest.mark.parametrize("key", list(TABLE_S3), ids=[f"{a}-{pv}:{pl}" for a, pv, pl in TABLE_S3])
def test_table_s3_row(rows, key):
    vit_g, vit_m, llm_g, llm_m, total_g, total_m = TABLE_S3[key]
    r = rows[key]
    check(f"{key} vit", r["vit_params"], r["vit_gflops"], vit_m, vit_g)
    check(f"{key} llm", r["llm_params"], r["llm_gflops"], llm_m, llm_g)
    check(f"{key} total", r["total_params"], r["total_gflops"], total_m, total_g)


@pytest.mark.parametrize("arch", list(CONNECTOR))
def test_table_s3_connector(rows, arch):
    for pv, pl in ((1, 1), (2, 2)):  # the connector does not depend on the branch counts
        r = rows[(arch, pv, pl)]
        check(
            f"{arch} {pv}:{pl} mlp1",
            r["connector_params"],
            r["connector_gflops"],
            *CONNECTOR[arch][::-1],
        )


def test_totals_match_the_papers_parts(rows):
    """Each total against the paper's own parts added up (ViT + connector + LLM of Table S3 and its
    caption), not against this code's parts: each part is rounded to 0.01, so three of them sum to
    within 0.015 of the exact total (measured: <= 0.008 M); the FLOP parts also carry the ViT's
    0.016 GFLOPs, so FLOP_ATOL (measured: <= 0.024 GFLOPs). A total that left out a part or counted
    one twice is off by >= 5.25 M / 8.07 GFLOPs (the smallest part, 1B's connector)."""
    for key, (vit_g, vit_m, llm_g, llm_m, total_g, total_m) in TABLE_S3.items():
        con_g, con_m = CONNECTOR[key[0]]
        r = rows[key]
        assert abs(r["total_params"] / 1e6 - (vit_m + con_m + llm_m)) <= 0.015, (
            key,
            r["total_params"],
        )
        assert abs(r["total_gflops"] - (vit_g + con_g + llm_g)) < FLOP_ATOL, (
            key,
            r["total_gflops"],
        )
        # the transcription itself: the table's totals are its parts' sums, to its rounding
        assert (
            abs(total_m - (vit_m + con_m + llm_m)) <= 0.015
            and abs(total_g - (vit_g + con_g + llm_g)) <= 0.015
        ), key


# -- the tiny preset by hand ----------------------------------------------------------------------
# config.PRESETS["tiny"]: ViT width 64, MLP 128, 2 blocks, 4 heads of 16, 448 px tiles of 14 px
# patches (1024 patches + CLS = 1025 tokens a tile); connector LayerNorm(256) -> 256x64 -> GELU ->
# 64x64; LLM width 64, MLP 96, 2 layers, 4 query heads and 2 KV heads of 32, vocabulary 512, untied
# lm_head; learned prefixes 96 (ViT) and 48 (LLM) per layer and branch.

# Parameters per top-level module, from the shapes:
#   vision_model 1:1: CLS 64 + positions 1025*64 = 65600 + patch conv 64*3*14*14 = 37632 + bias 64
#       = 103360; a block: ls1, ls2 2*64 + norm1, norm2 2*(64+64) + qkv 64*192+192 = 12480
#       + proj 64*64+64 = 4160 + fc1 64*128+128 = 8320 + fc2 128*64+64 = 8256 = 33600; 103360 + 2*33600 = 170560
#     2:2 adds K and V prefixes per block, 2 * (2 branches * 4 heads * 96 * 16) = 24576: 170560 + 2*24576 = 219712
#   an aggregator (2 branches, width 64): Linear(128, 64) 8192+64 + Linear(64, 2) 128+2 = 8386
#   mlp1: LayerNorm 256+256 + Linear(256, 64) 16384+64 + Linear(64, 64) 4096+64 = 21120
#   language_model 1:1: embed 512*64 = 32768; a layer: 2 RMSNorms 2*64 + q 64*128 = 8192 + k, v
#       2*64*64 = 8192 + o 128*64 = 8192 + q/k norms 2*32 + gate, up, down 3*64*96 = 18432 = 43200;
#       final norm 64; lm_head 512*64 = 32768: 32768 + 2*43200 + 64 + 32768 = 152000
#     2:2 adds 2 * (2 branches * 2 KV heads * 48 * 32) = 12288 per layer: 152000 + 2*12288 = 176576
TINY_MODULE_PARAMS = {
    (1, 1): {"vision_model": 170560, "mlp1": 21120, "language_model": 152000},
    (2, 2): {
        "vision_model": 219712,
        "vision_aggregator": 8386,
        "mlp1": 21120,
        "language_model": 176576,
        "language_aggregator": 8386,
    },
}
# -> Table S3's columns (aggregators belong to their modality): (vit, connector, llm, total)
TINY_PARAMS = {(1, 1): (170560, 21120, 152000, 343680), (2, 2): (228098, 21120, 184962, 434180)}


def tiny_flops_by_hand(tiles: int, llm_tokens: int, p: int) -> tuple[int, int, int]:
    """(ViT, connector, LLM) FLOPs of tiny at Pv = Pl = p: a linear 2 * tokens * fan_in * fan_out, an
    affine LayerNorm 5 per element, GELU / SiLU / softmax 1 per element (evaluation/flops.py's calflops convention)."""
    patches, vt, it, lt = 1024 * tiles, 1025 * tiles, 256 * tiles, llm_tokens
    # conv 3*14*14 = 588 -> 64, as a linear, + bias
    patch_embed = 2 * patches * 588 * 64 + patches * 64
    vit_block = (
        2 * vt * 64 * 192
        + 2 * vt * 64 * 64  # qkv, proj
        + 2 * vt * 64 * 128
        + 2 * vt * 128 * 64  # fc1, fc2
        + 2 * 5 * vt * 64
    )  # norm1, norm2
    # LayerNorm, fc1, GELU, fc2
    connector = 5 * it * 256 + 2 * it * 256 * 64 + it * 64 + 2 * it * 64 * 64
    llm_layer = (
        2 * lt * 64 * 128
        + 2 * 2 * lt * 64 * 64
        + 2 * lt * 128 * 64  # q, k and v, o
        + 3 * 2 * lt * 64 * 96
        + lt * 96
    )  # gate, up, down, SiLU
    lm_head = 2 * lt * 64 * 512

    def aggregator(t):  # Linear(2*64, 64), SiLU, Linear(64, 2), softmax; none for one branch
        return 0 if p == 1 else 2 * t * 128 * 64 + t * 64 + 2 * t * 64 * 2 + t * 2

    return (
        patch_embed + p * 2 * vit_block + aggregator(vt),
        connector,
        p * 2 * llm_layer + aggregator(lt) + lm_head,
    )


# Table S3's workload (3 tiles; 768 image + 256 text + 128 response = 1152 LLM tokens), worked out:
#   patch embed 2*3072*588*64 + 3072*64 = 231407616; a ViT block 75571200 + 25190400 + 2*50380800
#   + 1968000 = 203491200; connector 983040 + 25165824 + 49152 + 6291456 = 32489472; an LLM layer
#   18874368 + 18874368 + 18874368 + 42467328 + 110592 = 99201024; lm_head 75497472; aggregator
#   16706 per token: 51370950 over 3075 ViT tokens, 19245312 over 1152 LLM tokens
TINY_S3_FLOPS = {
    (1, 1): (
        231407616 + 2 * 203491200,
        32489472,
        2 * 99201024 + 75497472,
    ),  # 638390016, 32489472, 273899520
    (2, 2): (231407616 + 4 * 203491200 + 51370950, 32489472, 4 * 99201024 + 19245312 + 75497472),
}
TINY_S3_TOTAL = {(1, 1): 944779008, (2, 2): 1620779718}


@pytest.mark.parametrize("pv, pl", list(TINY_PARAMS))
def test_tiny_params_by_hand_and_by_a_real_model(pv, pl):
    r = flops.profile_params("tiny", pv, pl)
    assert (
        r["vit_params"],
        r["connector_params"],
        r["llm_params"],
        r["total_params"],
    ) == TINY_PARAMS[pv, pl], r
    # real tensors, counted per module
    model = ParVL.from_config(flops.build_config("tiny", pv, pl))
    per_module: dict[str, int] = {}
    for name, t in model.named_parameters():
        per_module[name.split(".")[0]] = per_module.get(name.split(".")[0], 0) + t.numel()
    assert per_module == TINY_MODULE_PARAMS[pv, pl]
    assert sum(t.numel() for t in model.parameters()) == TINY_PARAMS[pv, pl][3]


@pytest.mark.parametrize("pv, pl", list(TINY_S3_FLOPS))
def test_tiny_flops_by_hand(pv, pl):
    # the helper against the worked figures
    assert tiny_flops_by_hand(3, 1152, pv) == TINY_S3_FLOPS[pv, pl]
    assert sum(TINY_S3_FLOPS[pv, pl]) == TINY_S3_TOTAL[pv, pl]
    r = flops.profile_params("tiny", pv, pl)
    got = (r["vit_gflops"], r["connector_gflops"], r["llm_gflops"], r["total_gflops"])
    want = [f / 1e9 for f in (*TINY_S3_FLOPS[pv, pl], TINY_S3_TOTAL[pv, pl])]
    assert got == pytest.approx(want, rel=1e-12, abs=0), r


def test_cli_json_lines():
    out = subprocess.run(
        [sys.executable, "profiling.py", "params", "--all", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    grid = {("1b", pv, pl) for pv in (1, 2, 4) for pl in (1, 2, 4)}
    assert {(r["arch"], r["pv"], r["pl"]) for r in lines} == grid
    ints = ("pv", "pl", "vit_params", "connector_params", "llm_params", "total_params")
    ints += ("llm_active_params", "total_active_params")
    floats = ("vit_gflops", "connector_gflops", "llm_gflops", "total_gflops")
    for r in lines:
        assert set(r) == {"arch", "vision_branches", *ints, *floats}, sorted(r)
        assert isinstance(r["arch"], str)
        assert all(type(r[k]) is int for k in ints), r
        assert all(type(r[k]) is float for k in floats), r
        # the CLI prints the function's rows
        assert r == flops.profile_params("1b", r["pv"], r["pl"])


def test_counting_allocates_nothing():
    model = flops.meta_model(flops.build_config("1b", 4, 4))
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.is_meta for t in tensors), [t.device for t in tensors if not t.is_meta][:3]
    names = {n for n, _ in model.named_parameters()}
    assert "vision_model.encoder.layers.0.attn.prefix_k" in names  # the branch tensors are counted
    assert "language_model.model.layers.0.self_attn.prefix_v" in names
    # 8B 2:2 holds 8.6 G parameters (34 GB in fp32): counting them must not move the peak RSS
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    flops.profile_params("8b", 2, 2)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kb < 512 * 1024  # < 512 MiB


def test_4b_branch_tensors_by_hand():
    """4B is not in Table S3: its 2:2 adds to 1:1 exactly the branch tensors, counted by hand.
    ViT (24 blocks, 16 heads of 64, width 1024): K and V prefixes 24 * 2 * 2 branches * 16 * 96 * 64
    = 9437184, aggregator Linear(2048, 1024) 2098176 + Linear(1024, 2) 2050 = 2100226: 11537410.
    LLM (36 layers, 8 KV heads of 128, width 2560): 36 * 2 * 2 * 8 * 48 * 128 = 7077888, aggregator
    Linear(5120, 2560) 13109760 + Linear(2560, 2) 5122 = 13114882: 20192770."""
    one, two = flops.profile_params("4b", 1, 1), flops.profile_params("4b", 2, 2)
    assert two["vit_params"] - one["vit_params"] == 11537410
    assert two["connector_params"] == one["connector_params"]
    assert two["llm_params"] - one["llm_params"] == 20192770
    assert two["total_params"] - one["total_params"] == 31730180


# -- latency and forward (Appendix C.1, C.2) on the tiny preset -----------------------------------


def run_cli(*args: str) -> dict:
    """Run a profiling.py subcommand on CPU (one thread: tiny ops on two busy cores crawl); the last
    line of its output is the one JSON object."""
    out = subprocess.run(
        [sys.executable, "profiling.py", *args, "--device", "cpu", "--threads", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert not any(line.startswith("{") for line in lines[:-1]), out  # one JSON line, at the end
    return json.loads(lines[-1])


def test_synthetic_inputs():
    cfg = flops.build_config("tiny", 2, 2)
    work = flops.Workload(tiles=3, text_tokens=40, response_tokens=8)
    ids, pixels = latency.synthetic_inputs(cfg, work, 2, torch.float32, torch.device("cpu"))
    is_img = ids == cfg.image_token_id
    assert ids.shape == (2, 3 * 256 + 40) and is_img.sum(1).tolist() == [768, 768], ids.shape
    assert (ids[0] == ids[1]).all() and pixels.shape == (6, 3, 448, 448)  # identical samples
    assert (pixels == pixels[:1]).all()  # one tile repeated, as C.1 builds it


def test_latency_cli_tiny():
    """Baseline, standard and shared KV in one run: rows, ratios, and the exact cache bytes."""
    tiles, text, new, P = 1, 32, 4, 2
    res = run_cli(
        "latency",
        "--arch",
        "tiny",
        "--pv",
        str(P),
        "--pl",
        str(P),
        "--batch",
        "1",
        "2",
        "--baseline",
        "--compare-shared",
        "--warmup",
        "1",
        "--iters",
        "1",
        "--new-tokens",
        str(new),
        "--tiles",
        str(tiles),
        "--text-tokens",
        str(text),
    )
    rows = {(r["pv"], r["shared_kv"], r["batch"]): r for r in res["rows"]}
    assert list(rows) == [
        (1, False, 1),
        (1, False, 2),
        (P, False, 1),
        (P, False, 2),
        (P, True, 1),
        (P, True, 2),
    ]
    # Worked by hand for tiny (2 layers, 2 KV heads of 32, fp32): k and v take 2 * 2 * 2 * 32 * 4 = 1024
    # bytes per cache row and slot. 256 + 32 + 4 = 292 tokens, rounded up to 512 slots (the engine
    # allocates in 256s); prefixes 48 slots per branch, in front. Per sample (times the batch size b):
    #   1:1           1 row  x 512 slots             524288 bytes, all token slots
    #   2:2 standard  2 rows x (48 + 512) slots     1146880 bytes, 2 x 512 x 1024 = 1048576 token bytes
    #   2:2 shared    1 row  x (2 * 48 + 512) slots  622592 bytes, 1 x 512 x 1024 =  524288 token bytes
    # so the cache ratios against 1:1 are 1146880 / 524288 = 2.1875 and 622592 / 524288 = 1.1875.
    want = {
        1: (524288, 524288, 1.0),
        (P, False): (1146880, 1048576, 2.1875),
        (P, True): (622592, 524288, 1.1875),
    }
    for (pv, shared, b), r in rows.items():
        cache, token_bytes, ratio = want[1 if pv == 1 else (pv, shared)]
        assert (r["kv_cache_bytes"], r["kv_token_bytes"], r["kv_cache_x"]) == (
            cache * b,
            token_bytes * b,
            ratio,
        ), r
        assert r["memory"] == "cpu_rss" and 0 < r["resident_gib"] <= r["peak_gib"], r
        # C.2's incremental peak: the static cache warm-up left in the resident memory counts as generation's
        assert r["resident_kv_cache_bytes"] == r["kv_cache_bytes"], r
        assert r["incremental_peak_gib"] == pytest.approx(
            r["peak_gib"] - r["resident_gib"] + cache * b / 2**30
        ), r
        # one timed call holds its prefill and its decode steps; the throughput is the step time inverted
        assert (
            r["iter_s"][0] + 1e-4 >= (r["prefill_ms"] + r["decode_ms_per_step"] * (new - 1)) / 1e3
        ), r
        assert r["decode_tok_s"] * r["decode_ms_per_step"] / 1e3 == pytest.approx(b), r
        assert r["latency_s"] == pytest.approx(r["iter_s"][0] / b, abs=1e-4), r
        # latency_x against the raw timings it comes from (iter_s, one timed call, rounded to 1e-4 s):
        # the baseline row is 1 exactly, the others within the ratio's rounding interval
        base = rows[(1, False, b)]["iter_s"][0]
        lo, hi = (r["iter_s"][0] - 5e-5) / (base + 5e-5), (r["iter_s"][0] + 5e-5) / (base - 5e-5)
        if pv == 1:
            assert r["latency_x"] == 1.0, r
        else:
            assert lo - 1e-9 <= r["latency_x"] <= hi + 1e-9, (r, base)
    # Shared KV keeps one token cache per sample instead of one per language branch (C.2)
    assert rows[(P, True, 2)]["kv_token_bytes"] * P == rows[(P, False, 2)]["kv_token_bytes"]


def test_forward_cli_tiny(tmp_path):
    res = run_cli(
        "forward",
        "--arch",
        "tiny",
        "--configs",
        "1:1",
        "2:2",
        "--repeats",
        "2",
        "--warmup",
        "0",
        "--trace",
        str(tmp_path),
    )
    rows = res["rows"]
    for name in ("forward_1x1.json", "forward_2x2.json"):  # Chrome traces, one per configuration
        assert "traceEvents" in json.loads((tmp_path / name).read_text()), name
    assert [(r["pv"], r["pl"]) for r in rows] == [(1, 1), (2, 2)] and rows[0]["time_x"] == 1.0
    # forward's defaults, the prompt only: 1 tile, 256 image + 128 text = 384 LLM tokens, worked out as
    # in tiny_flops_by_hand: 1:1 212796672 + 10829824 + 91299840 = 314926336,
    # 2:2 365581122 + 10829824 + 163848960 = 540259906
    gflops = {(1, 1): 0.314926336, (2, 2): 0.540259906}
    assert {p: sum(tiny_flops_by_hand(1, 384, p[0])) / 1e9 for p in gflops} == pytest.approx(
        gflops, rel=1e-12
    )
    for r in rows:
        assert len(r["ms"]) == 2 and r["min_ms"] <= r["median_ms"], r
        assert r["gflops"] == pytest.approx(gflops[r["pv"], r["pl"]], rel=1e-12), r
    assert rows[1]["gflops_x"] == pytest.approx(540259906 / 314926336, rel=1e-12)
    # --pair: each config with branches also runs one pair per sample, counted at the 1:1 workload
    rows = run_cli(
        "forward",
        "--arch",
        "tiny",
        "--configs",
        "1:1",
        "2:2",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--pair",
    )["rows"]
    assert [(r["pv"], r["pl"], r["pair"]) for r in rows] == [
        (1, 1, None),
        (2, 2, None),
        (2, 2, "0,0"),
    ]
    assert rows[2]["gflops"] == pytest.approx(0.314926336, rel=1e-12) and rows[2]["gflops_x"] == 1.0


def test_lora_vision_branches_count_their_updates():
    """Figure 3's LoRA branches in Table S3's terms: the vision prefixes go, each of the Pv branches
    adds r x (fan_in + fan_out) parameters per adapted linear (qkv, proj, fc1, fc2) and twice that
    per token in FLOPs, counted as the two linears they are; the CLI prints the same row."""
    pre, lora = (
        flops.profile_params("1b", 4, 1),
        flops.profile_params("1b", 4, 1, vision_branches="lora", lora_rank=16),
    )
    v = flops.ARCHS["1b"].vit
    C, I, L, Lp = (
        v.hidden_size,
        v.intermediate_size,
        v.num_layers,
        flops.ARCHS["1b"].par.vit_prefix_len,
    )
    per_layer = 16 * ((C + 3 * C) + (C + C) + (C + I) + (I + C))
    assert lora["vit_params"] == pre["vit_params"] - 4 * L * 2 * Lp * C + 4 * L * per_layer
    assert lora["llm_params"] == pre["llm_params"] and lora["vision_branches"] == "lora"
    tokens = 3 * (1 + v.grid**2)  # the workload's 3 tiles
    assert lora["vit_gflops"] * 1e9 == pytest.approx(
        pre["vit_gflops"] * 1e9 + 4 * L * 2 * tokens * per_layer, rel=1e-12
    )
    out = subprocess.run(
        [
            sys.executable,
            "profiling.py",
            "params",
            "--pv",
            "4",
            "--pl",
            "1",
            "--vision-branches",
            "lora",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out) == lora


TABLE_S7 = {  # the paper's Table S7: (latency s, memory GB) at batch sizes 1, 2, 4, 8
    (1, False): [(1.963, 2.310), (0.977, 2.458), (0.498, 2.760), (0.256, 3.361)],
    (4, False): [(2.048, 2.837), (1.061, 3.456), (0.558, 4.677), (0.313, 7.117)],
    (4, True): [(2.422, 2.571), (1.288, 2.908), (0.681, 3.585), (0.414, 4.927)],
}


def test_table_4_and_the_shared_kv_delta_from_table_s7():
    """Table S7's absolute numbers give Table 4's ratios (4:4 latency 2.048 / 1.963 = 1.04x ... 0.313 /
    0.256 = 1.22x; memory 2.837 / 2.310 = 1.23x ... 7.117 / 3.361 = 2.12x) and the Δ of shared KV
    against standard 4:4 per batch size (C.2): memory 2.571 / 2.837 - 1 = -9.4 %, 2.908 / 3.456 - 1 =
    -15.9 %, 3.585 / 4.677 - 1 = -23.3 %, 4.927 / 7.117 - 1 = -30.8 %; latency 2.422 / 2.048 - 1 =
    +18.3 %, 1.288 / 1.061 - 1 = +21.4 %, 0.681 / 0.558 - 1 = +22.0 %, 0.414 / 0.313 - 1 = +32.3 %
    (the paper's 15.8 and 22.1 are of its unrounded measurements). C.2's incremental peak (issue 37, item 4)
    subtracts "the resident allocation measured immediately before timed generation" as the paper's path has
    it, with no KV cache allocated yet; the Engine's static cache is resident by then, so it is taken out of
    the resident and counts in the increment. With 2.0 GB resident everywhere, of which a static cache of
    0.4 GB (standard 4:4) and 0.1 GB (shared), at batch 1: 2.837 - (2.0 - 0.4) = 1.237 and 2.571 - (2.0 - 0.1)
    = 0.671, a change of 0.671 / 1.237 - 1 = -45.8 % (peak - resident alone gave 0.571 / 0.837 - 1 = -31.8 %)."""
    # GiB of static KV cache in the resident memory
    cache = {(1, False): 0.05, (4, False): 0.4, (4, True): 0.1}
    rows = [
        {
            "pv": pv,
            "pl": pv,
            "shared_kv": shared,
            "batch": b,
            "latency_s": lat,
            "peak_gib": mem,
            "resident_gib": 2.0,
            "kv_cache_bytes": 1,
            "memory": "cuda_allocated",
            "branches": {},
            "incremental_peak_gib": mem - (2.0 - cache[pv, shared]),
        }
        for (pv, shared), cells in TABLE_S7.items()
        for b, (lat, mem) in zip((1, 2, 4, 8), cells)
    ]
    latency.add_ratios(rows)
    delta = latency.shared_vs_standard(rows)
    assert [round(d["peak_pct"], 1) for d in delta] == [-9.4, -15.9, -23.3, -30.8]
    assert [round(d["latency_pct"], 1) for d in delta] == [18.3, 21.4, 22.0, 32.3]
    assert delta[0]["incremental_peak_pct"] == pytest.approx(100 * (0.671 / 1.237 - 1))
    md = latency.paper_layout(rows, delta)
    assert "| 4:4 | ✗ | Latency | 1.04× | 1.09× | 1.12× | 1.22× |" in md  # Table 4, first row
    assert "| 4:4 | ✗ | Memory | 1.23× | 1.41× | 1.69× | 2.12× |" in md
    assert "| 4:4 | ✓ | Memory | 1.11× | 1.18× | 1.30× | 1.47× |" in md
    assert "| 1:1 | ✗ | Latency (s) | 1.963 | 0.977 | 0.498 | 0.256 |" in md  # Table S7's layout
    assert (
        md.startswith("Table S7: Absolute profiling results.")
        and "\nTable 4: Relative inference costs." in md
    )
    # issue 47, item 1: the paper's titles for the eager regime only, the compiled one titled as this project's
    assert "Decode: eager, the paper's regime (C.1" in md and "compiled" not in md
    compiled = latency.paper_layout([r | {"compiled": True} for r in rows], delta)
    assert compiled.startswith("Table S7's layout: Absolute profiling results.")
    assert "\nTable 4's layout: Relative" in compiled and "Table 4:" not in compiled
    assert "Decode: compiled, CUDA graphs (this project's regime, not the paper's" in compiled
    assert "| 4:4 | Peak memory | -9.4 % | -15.9 % | -23.3 % | -30.8 % |" in md
    assert "| 4:4 | Latency | +18.3 % | +21.4 % | +22.0 % | +32.3 % |" in md
    assert "| 4:4 | Incremental peak (C.2) | -45.8 % |" in md


def test_latency_profiles_a_checkpoints_own_configuration(checkpoint, capsys):
    """--model: the checkpoint's config.json (its backbone, Pv:Pl and branches) on random weights; every
    row records its branches and architecture. Branch flags beside --model are refused (exit 2)."""
    from loading.config_json import config_from_json

    folder = checkpoint("qwen3", "original")
    par = config_from_json(json.loads((folder / "config.json").read_text()), folder).par
    rc = profiling.main(
        [
            "latency",
            "--model",
            str(folder),
            "--batch",
            "1",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--new-tokens",
            "2",
            "--tiles",
            "1",
            "--text-tokens",
            "8",
            "--device",
            "cpu",
            "--json",
        ]
    )
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    assert rc == 0 and [(r["pv"], r["pl"]) for r in rows] == [(par.pv, par.pl)]
    from config import branch_variant

    assert rows[0]["branches"] == branch_variant(par) and rows[0]["arch"]
    with pytest.raises(SystemExit) as e:
        profiling.main(["latency", "--model", str(folder), "--vit-prefix-len", "72"])
    assert e.value.code == 2 and "drop --vit-prefix-len" in capsys.readouterr().err


# -- the latency command: its plot, compile_s, failures ------------------------------------------------


def test_latency_plot_draws_every_row(tmp_path, capsys):
    # requirements-dev.txt has matplotlib; test_latency_plot_without_matplotlib_is_one_line covers its absence
    pytest.importorskip("matplotlib")
    png = tmp_path / "latency.png"
    assert (
        profiling.main(
            [
                "latency",
                "--arch",
                "tiny",
                "--pv",
                "2",
                "--pl",
                "2",
                "--baseline",
                "--batch",
                "1",
                "2",
                "--new-tokens",
                "2",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--tiles",
                "1",
                "--text-tokens",
                "8",
                "--plot",
                str(png),
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {(r["pv"], r["batch"]) for r in rows} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    png_ok(png, (1000, 400))


def test_latency_plot_into_a_missing_folder_is_made_before_the_measurement(
    tmp_path, capsys, monkeypatch
):
    """--plot into a folder that is not there failed after the whole profile: the folder is made before the
    measurement starts (issue 38, item 22)."""
    pytest.importorskip("matplotlib")
    png, seen = tmp_path / "new" / "deep" / "latency.png", []

    # what the measurement finds, then a stop: the profile itself is not the point
    def measured(*args, **kwargs):
        seen.append(png.parent.is_dir())
        raise ValueError("measured")

    monkeypatch.setattr(profiling, "run_latency", measured)
    assert profiling.main(["latency", "--arch", "tiny", "--plot", str(png)]) == 1
    assert seen == [True] and one_line(capsys.readouterr().err) == "error: measured"


def test_latency_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    # before measuring
    assert profiling.main(["latency", "--arch", "tiny", "--plot", str(tmp_path / "l.png")]) == 1
    assert "pip install matplotlib" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "l.png").exists()


def test_latency_compile_s_is_null_without_compile(capsys):
    """compile_s is null without --compile (the first call minus the steady state was noise, even negative)."""
    code = profiling.main(
        [
            "latency",
            "--arch",
            "tiny",
            "--tiles",
            "0",
            "--text-tokens",
            "8",
            "--new-tokens",
            "2",
            "--batch",
            "1",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--device",
            "cpu",
            "--json",
        ]
    )
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert code == 0 and [r["compile_s"] for r in rows] == [None]


def test_latency_out_of_memory_is_one_line_with_the_flags_that_lower_it(capsys, monkeypatch):
    """An allocation failure is one line with the flags that lower it (the allocator's traceback before)."""

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(latency.Engine, "generate", no_memory)
    code, err = run_main(
        capsys,
        profiling.main,
        [
            "latency",
            "--arch",
            "tiny",
            "--tiles",
            1,
            "--text-tokens",
            8,
            "--new-tokens",
            2,
            "--batch",
            64,
            "--device",
            "cpu",
        ],
    )
    assert code == 1 and err[-1] == (
        "error: out of memory at Pv:Pl 1:1 --batch 64 (1 tiles, 8 text tokens, 2 new "
        "tokens per sample); lower --batch, --tiles, --text-tokens or --new-tokens"
    ), err


def test_a_device_that_is_not_one_is_a_flag_error(capsys):
    with pytest.raises(SystemExit) as e:  # a flag that names no device: exit 2, as in every command
        profiling.main(["latency", "--device", "tpu9"])
    assert e.value.code == 2 and "not a device" in one_line(capsys.readouterr().err)


# Every released InternVL3.5 (Qwen3 decoders; the GPT-OSS one is not implemented): the model card's
# vision / language / total parameters in billions, as published (0.1 B).
PUBLISHED = {
    "1b": (0.3, 0.8, 1.1),
    "2b": (0.3, 2.0, 2.3),
    "4b": (0.3, 4.4, 4.7),
    "8b": (0.3, 8.2, 8.5),
    "14b": (0.3, 14.8, 15.1),
    "38b": (5.5, 32.8, 38.4),
    "30b-a3b": (0.3, 30.5, 30.8),
    "241b-a28b": (5.5, 235.1, 240.7),
}


@pytest.mark.parametrize("arch", PUBLISHED)
def test_presets_have_the_published_parameter_counts(arch):
    r = flops.profile_params(arch, 1, 1)
    got = tuple(round(r[f"{k}_params"] / 1e9, 1) for k in ("vit", "llm", "total"))
    assert got == PUBLISHED[arch], r
    active_b, llm_active_b = r["total_active_params"] / 1e9, r["llm_active_params"] / 1e9
    if "-a" not in arch:  # dense: every parameter runs for every token
        assert r["total_active_params"] == r["total_params"], r
    elif arch == "30b-a3b":  # Qwen3-30B-A3B's card: "3.3B activated" (3.35 B here, embeddings and
        assert 3.3 <= llm_active_b < 3.4, r  # lm_head included); the whole model runs 3.67 B
    else:  # Qwen3-235B-A22B's card: "22B activated"; InternVL3.5-241B-A28B: 27.8 B with the 6B ViT
        assert (round(llm_active_b), round(active_b)) == (22, 28), r


def test_the_6b_encoder_widens_the_connector():
    """InternViT-6B's width 3200, pixel-shuffled 2 x 2: the connector of 38B and 241B-A28B reads 12,800
    channels (mlp1's LayerNorm and first Linear), into the decoder's width."""
    for arch, width in (("38b", 5120), ("241b-a28b", 4096), ("30b-a3b", 2048)):
        mlp1 = flops.meta_model(flops.build_config(arch, 1, 1)).mlp1
        vit = 3200 if arch != "30b-a3b" else 1024
        assert mlp1[0].normalized_shape == (4 * vit,) and mlp1[1].in_features == 4 * vit, arch
        assert mlp1[1].out_features == mlp1[3].out_features == width, arch
