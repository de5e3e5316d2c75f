"""`evaluate.py report` on synthetic score files: Eq. A3's domain scores, Table S4's grids, the best
configuration and its FLOPs tie-break, fixed pairs (Table S9), shared KV (Table 4's choice, Table S6 and its
delta), Figure 3's sweeps and variants, a reference model in a row of its own, one checkpoint per
configuration."""
import json

import pytest

from conftest import main_out, write_scores
from evaluation import scoring as S


SCORES = {  # (pv, pl) -> the nine benchmark scores, in scoring.BENCHMARKS order
    (1, 1): [40.0, 44.0, 21.0, 27.0, 12.0, 72.0, 71.0, 82.0, 76.0],
    (1, 2): [41.0, 45.0, 22.0, 28.0, 12.0, 72.0, 71.5, 82.0, 77.0],
    (2, 1): [41.0, 46.0, 20.0, 30.0, 12.0, 73.0, 71.5, 83.0, 76.0],
    (2, 2): [39.0, 48.0, 24.0, 29.0, 13.0, 72.0, 70.0, 82.5, 77.0],
}


def test_report_grid_aggregates_and_flops_tie_break(tmp_path, capsys):
    from flops import profile_params as flops_of

    files = []
    for (pv, pl), values in SCORES.items():
        for bench, v in zip(S.BENCHMARKS, values):
            f = tmp_path / f"{pv}{pl}_{bench}.json"
            f.write_text(json.dumps({"benchmark": bench, "score": v, "n": 10, "pv": pv, "pl": pl}) + "\n")
            files.append(f)
    pair = tmp_path / "pair.json"  # a fixed-pair diagnostic (Table S9) with a high score: never "best"
    pair.write_text(json.dumps({"benchmark": "MMMU_DEV_VAL", "score": 99.0, "pv": 2, "pl": 2, "vision_branch": 0,
                                "language_branch": 1}))
    pairs = []  # Table S9: all four pairs of a 2:2 checkpoint on OCRBench
    for (vb, lb), v in {(0, 0): 70.0, (0, 1): 74.0, (1, 0): 72.0, (1, 1): 76.0}.items():
        pairs.append(tmp_path / f"pair{vb}{lb}.json")
        pairs[-1].write_text(json.dumps({"benchmark": "OCRBench", "score": v, "pv": 2, "pl": 2,
                                         "vision_branch": vb, "language_branch": lb}))
    shared = tmp_path / "shared.json"  # a shared-KV 2:2 run (another decoder, Table 4) with the best WeMath
    shared.write_text(json.dumps({"benchmark": "WeMath", "score": 90.0, "pv": 2, "pl": 2, "shared_kv": True}))
    lora = tmp_path / "lora.json"  # a Figure 3 variant at 2:2: its own row, not in the grids, never "best"
    lora.write_text(json.dumps({"benchmark": "MMMU_DEV_VAL", "score": 98.0, "pv": 2, "pl": 2,
                                "branches": {"vision_branches": "lora", "lora_rank": 8}}))
    rc, out, err = main_out(capsys, "report", *files, pair, *pairs, shared, lora, "--out", tmp_path / "rep")
    assert rc == 0
    # matplotlib is optional: without it one line says so, with it every grid gets a heatmap
    assert "matplotlib is not installed" in err or (tmp_path / "rep" / "heatmap_All.png").exists()
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    by = {(c["pv"], c["pl"],
           c["vision_branch"]): c for c in data["configs"] if not c["shared_kv"] and not c["branches"]}
    variant = next(c for c in data["configs"] if c["branches"])
    assert variant["label"] == "2:2 lora_rank=8 vision_branches=lora" and variant["scores"]["MMMU_DEV_VAL"] == 98.0
    assert variant["gflops"] == flops_of("1b", 2, 2, vision_branches="lora", lora_rank=8)["total_gflops"]
    s22 = by[(2, 2, None)]["scores"]
    assert s22["General"] == 39.0  # Eq. A3
    assert s22["Math"] == pytest.approx((48 + 24 + 29 + 13) / 4)
    assert s22["OCR"] == pytest.approx((72 + 70 + 82.5 + 77) / 4)
    assert s22["All"] == pytest.approx(sum(SCORES[(2, 2)]) / 9)
    assert by[(2, 2, 0)]["scores"]["All"] is None  # one benchmark only: no aggregate
    profile_params = flops_of
    assert by[(2, 2, 0)]["gflops"] == profile_params("1b", 1, 1)["total_gflops"]  # one pair runs: a pair's cost
    assert by[(2, 2, None)]["gflops"] == profile_params("1b", 2, 2)["total_gflops"]
    # Table S4's orientation: rows Pl 1, 2; columns Pv 1, 2
    assert data["grids"]["MathVista_MINI"] == [[44.0, 46.0], [45.0, 48.0]]
    best = data["best"]
    # MMMU: 1:2 and 2:1 tie at 41.0 -> 1:2 (4262.6 < 5113.9 GFLOPs for 1B); TextVQA the same tie
    assert best["MMMU_DEV_VAL"] == "1:2" and best["TextVQA_VAL"] == "1:2"
    # WeMath: 2:2 alone at 13.0; ChartQA: 2:1 alone; OCRBench: 1:2 and 2:2 tie -> 1:2
    assert best["WeMath"] == "2:2" and best["ChartQA_TEST"] == "2:1" and best["OCRBench"] == "1:2"
    # 2:2 All = 50.5, 2:1 All = 50.2778 -> 2:2
    assert best["All"] == "2:2"
    assert "| Pl \\ Pv | 1 | 2 |" in (tmp_path / "rep" / "report.md").read_text()
    assert "| 2 | 45.0 | 48.0 |" in (tmp_path / "rep" / "report.md").read_text()
    rc, _, _ = main_out(capsys, "report", *files, shared, "--best-with-shared-kv", "--out", tmp_path / "rep2")
    assert rc == 0 and json.loads((tmp_path / "rep2" / "report.json").read_text())["best"]["WeMath"] == "2:2 sharedKV"
    ocr = data["pairs"]["OCRBench"]
    assert ocr["grid"] == [[70.0, 74.0], [72.0, 76.0]] and ocr["best"] == [[1, 1]]
    assert ocr["vision_mean"] == [72.0, 74.0] and ocr["language_mean"] == [71.0, 75.0]
    assert data["pairs"]["MMMU_DEV_VAL"]["vision_mean"] == [None, None]  # one pair of four run: no marginals


TABLE_S6 = {"Standard": [39.0, 48.0, 22.4, 29.3, 12.3, 72.1, 71.9, 82.7, 77.0],  # the paper's Table S6
            "Shared": [39.8, 47.1, 19.4, 30.6, 11.8, 72.0, 71.7, 82.8, 77.1]}


def test_report_keeps_checkpoints_apart_and_draws_figure_3_and_table_s6(tmp_path, capsys):
    """Table 1: two checkpoints of one Pv:Pl are never one row: among the study's runs refused, a
    reference model (--reference) a row of its own, out of the grids and the best choice. Figure 3:
    the 4:1 runs at vision prefix lengths 72, 96 (the dense run) and 128, and LoRA ranks 8 and 16, as
    series of domain scores. Table S6: the standard and shared-KV rows of the paper and their Δ, cell
    by cell Shared - Standard; Math (47.1 + 19.4 + 30.6 + 11.8) / 4 - (48.0 + 22.4 + 29.3 + 12.3) / 4 =
    -0.775; OCR 303.6 / 4 - 303.7 / 4 = -0.025, printed 0.0 as the paper prints it; All -2.4 / 9 = -0.27
    from these rounded cells (the paper's -0.2 is of its unrounded scores)."""
    d = tmp_path / "scores"
    base = write_scores(d, "11", [40.0] * 9)
    instruct = write_scores(d, "instruct", [50.0] * 8 + [None], model="OpenGVLab/InternVL3_5-1B-Instruct")
    instruct = instruct[:8]  # no OCRBench: before, its eight scores and the 1:1 run's would share a row
    rc, _, err = main_out(capsys, "report", *base, *instruct, "--out", tmp_path / "bad")
    assert rc == 1 and "one checkpoint per configuration" in err and "fp-instruct" in err and "fp-11" in err
    study = [*base]
    study += write_scores(d, "41", [41.0] * 9, pv=4)  # the dense 4:1 run: prefix length 96
    for length, v in ((72, 42.0), (128, 43.0)):
        study += write_scores(d, f"41p{length}", [v] * 9, pv=4, branches={"vit_prefix_len": length})
    for rank, v in ((8, 44.0), (16, 45.0)):
        lora = {"vision_branches": "lora"} | ({"lora_rank": rank} if rank != 16 else {})
        study += write_scores(d, f"41r{rank}", [v] * 9, pv=4, branches=lora)
    study += write_scores(d, "44", TABLE_S6["Standard"], pv=4, pl=4)
    study += write_scores(d, "44", TABLE_S6["Shared"], pv=4, pl=4, shared_kv=True)
    rc, out, err = main_out(capsys, "report", *study, "--reference", *instruct, "--out", tmp_path / "rep")
    assert rc == 0, err
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    ref = [c for c in data["configs"] if c["reference"]]
    assert [c["label"] for c in ref] == ["1:1 [OpenGVLab/InternVL3_5-1B-Instruct]"]
    assert ref[0]["scores"]["MMMU_DEV_VAL"] == 50.0 and ref[0]["model"] == "fp-instruct"
    one = next(c for c in data["configs"] if c["label"] == "1:1")
    assert one["scores"]["MMMU_DEV_VAL"] == 40.0 and one["model"] == "fp-11"
    assert data["best"]["MMMU_DEV_VAL"] != "1:1 [OpenGVLab/InternVL3_5-1B-Instruct]" and data["grid_pv"] == [1, 4]
    fig = data["figure3"]["4:1"]
    assert [(p["vit_prefix_len"], p["scores"]["All"]) for p in fig["prefix"]] == [(72, 42.0), (96, 41.0), (128, 43.0)]
    assert [(p["lora_rank"], p["scores"]["Math"]) for p in fig["lora"]] == [(8, 44.0), (16, 45.0)]
    assert list(data["figure3"]) == ["4:1"]  # the other Pv:Pl have no sweep
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Figure 3, 4:1: domain scores against the vision prefix length" in md and "| 128 | 43.0 | 43.0 |" in md
    assert "matplotlib is not installed" in err or (tmp_path / "rep" / "figure3_4x1.png").stat().st_size > 0
    delta = data["table_s6"]["4:4"]["delta"]
    want = [0.8, -0.9, -3.0, 1.3, -0.5, -0.1, -0.2, 0.1, 0.1]
    assert [delta[b] for b in S.BENCHMARKS] == pytest.approx(want, abs=1e-9)
    assert delta["Math"] == pytest.approx(-0.775) and delta["OCR"] == pytest.approx(-0.025)
    assert delta["All"] == pytest.approx(-2.4 / 9)
    assert ("| Δ (Shared − Standard) | +0.8 | -0.9 | -3.0 | +1.3 | -0.5 | -0.1 | -0.2 | +0.1 | +0.1 | +0.8 | -0.8 "
            "| 0.0 | -0.3 |") in md


def test_a_foreign_score_file_is_named_not_the_genuine_one(tmp_path, capsys):
    """A configuration's nine score files and one of another checkpoint: whichever came first, the one line names
    the foreign file, not a genuine one (the file read second was blamed: the foreign one given first made every
    genuine file the culprit; issue 38, item 22). A tie names both sides. Exit 1, nothing written."""
    d = tmp_path / "scores"
    genuine = write_scores(d, "11", [40.0] * 9)
    foreign = write_scores(tmp_path / "other", "x", [50.0], model_fingerprint="fp-other")
    for order in ([*foreign, *genuine], [*genuine, *foreign]):
        rc, _, err = main_out(capsys, "report", *order, "--out", tmp_path / "r")
        assert rc == 1 and err.strip().splitlines() == [
            f"error: {foreign[0]}: score(s) of checkpoint fp-other for configuration 1:1, whose other 9 score files "
            f"({genuine[0]}, ...) are checkpoint fp-11's: one checkpoint per configuration (pass a reference model "
            f"with --reference; other model sizes in a report of their own)"], err
    rc, _, err = main_out(capsys, "report", genuine[0], *foreign, "--out", tmp_path / "r")
    assert rc == 1 and err.strip() == (
        f"error: configuration 1:1 holds scores of 2 checkpoints: checkpoint fp-11 ({genuine[0]}); checkpoint fp-other "
        f"({foreign[0]}): one checkpoint per configuration (pass a reference model with --reference; other model sizes "
        f"in a report of their own)"), err
    assert not (tmp_path / "r").exists()
