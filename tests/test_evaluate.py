"""`evaluate.py run` and `score`: the TSV format and the prompts `run` builds; `run` end to end on a tiny
checkpoint (equal to the engine's answers, resumable, only its own run resumed, branch options, the router
and the random pair, a row that cannot be asked skipped by name, out of memory, interrupted, a device that
is not there, an --out that cannot be written); `score` (its line and files, its bad input, a partial or
foreign predictions file, a TSV read as pandas reads it). The scorers themselves: test_scoring.py; `report`:
test_report.py; lengths, descriptors, cost and the law fit: test_analysis.py; two nodes: test_cluster.py.
The bench TSV and its predictions (`bench`, `full_run`) are conftest's: test_analysis.py and test_cluster.py
read them too."""

import base64
import io
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from commands import main_out, read_preds, run_main
from conftest import BENCH_NEW as NEW
from inputs import png_b64, write_tsv
from PIL import Image

import evaluate
from data.processor import Tokenizer, build_prompt, load_image
from evaluation import predict, prompts
from evaluation import tsv as T
from inference.engine import Engine, GenerateConfig
from loading.pretrained import load_pretrained, save_pretrained


def test_read_tsv_quoting_strings_missing_and_image_references(tmp_path):
    img = png_b64(8, 8, 0)
    write_tsv(
        tmp_path / "a.tsv",
        [
            {
                "index": "0",
                "question": 'say "hi"\tplease\nnow',
                "answer": "05",
                "A": "None",
                "B": "x",
                "image": img,
            },
            {"index": "1", "question": "q", "answer": "1.0", "A": "", "B": "y", "image": "0"},
            {"index": "2", "question": "q", "answer": "a", "A": "z", "B": "", "image": ""},
        ],
    )
    rows = T.read_tsv(tmp_path / "a.tsv")
    assert [r["index"] for r in rows] == ["0", "1"]  # the row without an image is dropped
    assert rows[0]["question"] == 'say "hi"\tplease\nnow'
    # numeric-looking answers stay strings
    assert rows[0]["answer"] == "05" and rows[1]["answer"] == "1.0"
    # pandas reads "None" as missing
    assert rows[0]["A"] is None and T.options(rows[0]) == {"B": "x"}
    assert rows[1]["image"] == img  # a short cell is another row's index
    with pytest.raises(T.DataError, match="missing required column"):
        T.read_tsv(tmp_path / "a.tsv", ("index", "category"))
    # an image cell of 64 characters or fewer names a row; 65 or more is image data itself
    key = "k" * 64
    write_tsv(
        tmp_path / "b.tsv",
        [
            {"index": key, "question": "q", "answer": "a", "image": img},
            {"index": "1", "question": "q", "answer": "a", "image": key},  # 64: a reference
            {"index": "2", "question": "q", "answer": "a", "image": "x" * 65},
        ],
    )  # 65: kept as it is
    rows = T.read_tsv(tmp_path / "b.tsv")
    assert [r["image"] for r in rows] == [img, img, "x" * 65]


def test_mcq_prompt_text():
    row = {"question": "Which?", "hint": "Look.", "A": "cat", "B": "dog", "C": None}
    assert prompts.question_text("WeMath", row) == (
        "Look.\nWhich?\nA. cat\nB. dog\nAnswer with the option's letter from the given choices directly."
    )
    assert (
        prompts.question_text("MMMU_DEV_VAL", {"question": "多少?", "A": None})
        == "多少?\n请直接回答问题。"
    )
    assert (
        prompts.question_text("DocVQA_VAL", {"question": "Date?"})
        == "Date?\nAnswer the question using a single word or phrase."
    )
    assert prompts.question_text("MathVista_MINI", {"question": "Hint: x\nQ"}) == "Hint: x\nQ"


def test_tsv_cells_as_pandas_reads_them_and_the_benchmark_columns(bench, tmp_path, capsys):
    """A quoted cell keeps its tab (pandas read_csv(sep="\\t"), csv quoting); a row with more cells
    than the header is refused (pandas: "Expected 3 fields"), never read with its columns shifted;
    a short row's last cells are missing. A TSV run or scored under another benchmark's name (MMMU
    on ChartQA's columns) is refused before anything runs."""
    quoted = tmp_path / "q.tsv"
    quoted.write_text('index\tquestion\tanswer\n1\t"Read\tthis"\t5\n2\tshort\n')
    assert T.read_tsv(quoted) == [
        {"index": "1", "question": "Read\tthis", "answer": "5"},
        {"index": "2", "question": "short", "answer": None},
    ]
    shifted = tmp_path / "s.tsv"
    shifted.write_text("index\tquestion\tanswer\n1\tRead\tthis\t5\n")
    with pytest.raises(T.DataError, match="line 2 has 4 cells, the header 3"):
        T.read_tsv(shifted)
    folder = bench[0]
    chart = write_tsv(
        tmp_path / "ChartQA_TEST.tsv",
        [{"index": "1", "question": "Max?", "answer": "5", "image": png_b64(8, 8, 0)}],
    )
    preds = tmp_path / "p.jsonl"
    preds.write_text(json.dumps({"index": "1", "prediction": "5"}) + "\n")
    for argv in (
        [
            "run",
            "--benchmark",
            "MMMU_DEV_VAL",
            "--data",
            chart,
            "--model",
            folder,
            "--out",
            tmp_path / "o.jsonl",
        ],
        ["score", "--benchmark", "MMMU_DEV_VAL", "--data", chart, "--predictions", preds],
    ):
        rc, _, err = main_out(capsys, *argv)
        assert (
            rc == 1
            and "missing required column(s) A, B, split" in err
            and not (tmp_path / "o.jsonl").exists()
        )
    rc, out, _ = main_out(
        capsys, "score", "--benchmark", "ChartQA_TEST", "--data", chart, "--predictions", preds
    )
    assert rc == 0 and json.loads(out.splitlines()[-1])["score"] == 100.0


# -- run end to end ------------------------------------------------------------------------------------


def expected_answers(folder: Path, rows: list[dict]) -> dict[str, str]:
    """What VLMEvalKit's InternVL path would generate, built here by hand, one prompt at a time."""
    model, tok = load_pretrained(folder), Tokenizer.from_pretrained(folder)
    engine, out = Engine(model), {}
    texts = {
        "10": "<image>\nWhat is shown?\nA. cat\nB. dog\nAnswer with the option's letter from the given choices "
        "directly.",
        "11": "Image-1: <image>\nImage-2: <image>\nCompare <image 1> and <image 2>.\nA. same\nB. different\n"
        "Answer with the option's letter from the given choices directly.",
        "12": "<image>\nCount them.\nHow many?\nAnswer the question directly.",
        "14": "<image>\nWide picture?\nA. yes\nB. no\nAnswer with the option's letter from the given choices "
        "directly.",
    }
    by_index = {r["index"]: r for r in rows}
    for index, text in texts.items():
        cell = by_index[index]["image"] if index != "12" else by_index["10"]["image"]
        b64s = T.as_list(cell)
        pils = [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for b in b64s]
        # MMMU's first image
        pils[0] = pils[0].resize((pils[0].width * 2, pils[0].height * 2), Image.BILINEAR)
        # MMMU: 12 tiles (min(12, 64 // images))
        tiles = [load_image(p, max_tiles=12) for p in pils]
        ids = tok.encode(build_prompt(text, [t.shape[0] for t in tiles]))
        res = engine.generate(
            [ids], torch.cat(tiles), GenerateConfig(max_new_tokens=NEW), tok.eos_ids
        )
        out[index] = tok.decode(res.tokens[0], skip_special_tokens=True).strip()
    return out


def test_a_benchmark_is_read_in_a_stream_and_a_shared_image_held_once(tmp_path):
    """tsv.Benchmark: the rows read_tsv reads, yielded one at a time; what it holds between them is the rows'
    indices and the cells other rows name, each once: every row naming it gets that very string (issue 38,
    item 12)."""
    img = png_b64(8, 8, 0)
    tsv = write_tsv(
        tmp_path / "t.tsv",
        [
            {"index": "a", "question": "q", "image": img},
            {"index": "b", "question": "r", "image": "a"},
            {"index": "c", "question": "s", "image": None},
            {"index": "d", "question": "t", "image": "a"},
        ],
    )
    bench = T.Benchmark(tsv, ("index", "question", "image"))
    assert (bench.order, bench.shared) == ({"a": 0, "b": 1, "d": 2}, {"a": img})
    rows = bench.rows()
    # a stream: a generator of rows
    assert next(rows) == {"index": "a", "question": "q", "image": img}
    rest = list(rows)
    assert [r["index"] for r in rest] == ["b", "d"] and rest[0]["image"] is rest[1][
        "image"
    ] is bench.shared["a"]


def test_run_decodes_a_shared_image_once_and_answers_as_if_each_row_held_it(
    bench, tmp_path, capsys, monkeypatch
):
    """Rows that name another row's image by index: `run` decoded it twice a row and held every row (memory grew
    with the rows: bench/bench_rows.py). It is decoded once for the whole run, rows are read WINDOW_ROWS at a time
    (here 2), and every row's answer is the one it gets holding its own copy of the image (issue 38, item 12)."""
    from evaluation import prompts as P

    folder, _, _, imgs = bench
    rows = [
        {
            "index": str(k),
            "question": f"What is shown {k}?",
            "A": "cat",
            "B": "dog",
            "answer": "A",
            "split": "validation",
            "image": imgs[0] if k == 10 else "10",
        }
        for k in (10, 12, 15, 16, 17)
    ]
    shared = write_tsv(tmp_path / "shared.tsv", rows)
    own = write_tsv(tmp_path / "own.tsv", [r | {"image": imgs[0]} for r in rows])
    decoded, decode = [], P.open_base64
    monkeypatch.setattr(
        P, "open_base64", lambda cell, name: decoded.append(cell) or decode(cell, name)
    )
    monkeypatch.setattr(predict, "WINDOW_ROWS", 2)
    answers = {}
    for name, tsv in (("shared", shared), ("own", own)):
        decoded.clear()
        rc, _, err = main_out(
            capsys,
            "run",
            "--benchmark",
            "MMMU_DEV_VAL",
            "--data",
            tsv,
            "--model",
            folder,
            "--out",
            tmp_path / f"{name}.jsonl",
            "--batch-size",
            2,
            "--max-new-tokens",
            NEW,
        )
        assert rc == 0, err
        answers[name] = [
            (p["index"], p["prediction"]) for p in read_preds(tmp_path / f"{name}.jsonl")
        ]
        if name == "shared":
            assert len(decoded) == 1, len(decoded)
    assert answers["shared"] == answers["own"] and len(answers["own"]) == 5


def test_run_matches_engine_answers_and_skips_corrupt_rows(bench, full_run):
    folder, _, rows, _ = bench
    preds = read_preds(full_run)
    assert [p["index"] for p in preds] == ["10", "11", "12", "14"]  # TSV order; corrupt 13 skipped
    assert {p["index"]: p["prediction"] for p in preds} == expected_answers(folder, rows)
    assert all(p["pv"] == 1 and p["pl"] == 1 and p["benchmark"] == "MMMU_DEV_VAL" for p in preds)
    assert all(p["branches"] == {} for p in preds)  # the paper's parameterisation


def test_run_resume_gives_the_same_file(bench, full_run, tmp_path, capsys):
    folder, tsv, _, _ = bench
    out = tmp_path / "pred.jsonl"
    lines = full_run.read_text().splitlines()
    # one row done, one cut mid-line
    out.write_text(lines[2] + "\n" + lines[0][: len(lines[0]) // 2])
    rc, stdout, err = main_out(
        capsys,
        "run",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--model",
        folder,
        "--out",
        out,
        "--batch-size",
        "2",
        "--max-new-tokens",
        NEW,
    )
    assert rc == 0 and json.loads(stdout.splitlines()[-1])["new"] == 3
    assert "row 13: corrupt image" in err
    assert out.read_text() == full_run.read_text()


def test_run_drops_the_torn_last_line_of_its_part_and_goes_on(bench, full_run, tmp_path, capsys):
    """Issue 38, item 4: a part file whose last line a kill -9 or a full disk cut short was appended to without a
    newline, and every later rerun stopped on "line 2 is not JSON". The rerun drops the torn line, says so in
    a line, answers its row again and ends with the file a run never interrupted writes."""
    folder, tsv, _, _ = bench
    out = tmp_path / "pred.jsonl"
    lines = full_run.read_text().splitlines(keepends=True)
    part = out.with_name("pred.jsonl.part0")
    # a whole line, then one cut before its newline (still JSON)
    part.write_text(lines[0] + lines[1][:-1])
    rc, stdout, err = main_out(
        capsys,
        "run",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--model",
        folder,
        "--out",
        out,
        "--batch-size",
        "2",
        "--max-new-tokens",
        NEW,
    )
    assert rc == 0 and json.loads(stdout.splitlines()[-1])["new"] == 3, err
    torn = len(lines[1][:-1].encode())
    assert (
        f"{part}: dropped its last {torn} bytes, a line cut short by an interrupted run; its row is redone"
        in err.splitlines()
    )
    assert out.read_text() == full_run.read_text() and not part.exists()


def test_run_resumes_only_its_own_run(bench, full_run, checkpoint, tmp_path, capsys):
    """Every prediction records what produced it (predict.RECORD_FIELDS); a rerun into the same --out
    with another generation budget or another model is refused with one line naming the difference,
    and the file is left as it was."""
    folder, tsv, _, _ = bench
    out = tmp_path / "pred.jsonl"
    out.write_text(full_run.read_text())
    record = read_preds(out)[0]
    assert {k: record[k] for k in ("benchmark", "max_new_tokens", "dtype")} == {
        "benchmark": "MMMU_DEV_VAL",
        "max_new_tokens": NEW,
        "dtype": "float32",
    }
    for model, flag, what in [
        (folder, NEW + 1, f"max_new_tokens {NEW!r} there, {NEW + 1!r} now"),
        (checkpoint("qwen3", "original", seed=1), NEW, "model_fingerprint"),
    ]:
        rc, _, err = main_out(
            capsys,
            "run",
            "--benchmark",
            "MMMU_DEV_VAL",
            "--data",
            tsv,
            "--model",
            model,
            "--out",
            out,
            "--max-new-tokens",
            flag,
        )
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert (
            rc == 1
            and len(lines) == 1
            and lines[0].startswith(f"error: {out}: holds predictions of another run (")
        )
        assert what in lines[0] and lines[0].endswith("; remove it or pick another --out"), lines
        assert out.read_text() == full_run.read_text()


@pytest.mark.parametrize(
    "options", [dict(vision_branch=1, language_branch=0), dict(shared_kv=True)]
)
def test_run_branch_options_pass_through(checkpoint, tmp_path, capsys, monkeypatch, options):
    """A 2:2 ParVL checkpoint: a fixed pair (Table S9) and shared KV reach the engine and give its answers."""
    from inference import (
        flags as inference,  # evaluate.py run builds its Engine there (load_engine)
    )

    seen = []
    monkeypatch.setattr(
        inference, "Engine", lambda model, **kw: seen.append(kw) or Engine(model, **kw)
    )
    torch.manual_seed(0)
    model = load_pretrained(checkpoint("qwen3", "original"), pv=2, pl=2)
    model.init_branches(std=2.0)  # large prefixes: a single pair answers differently from all four
    save_pretrained(model, tmp_path / "parvl")
    tsv = write_tsv(
        tmp_path / "t.tsv",
        [{"index": "0", "question": "Read it.", "answer": "['x']", "image": png_b64(16, 16, 5)}],
    )
    flags = [
        f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in options.items()
    ]
    rc, _, _ = main_out(
        capsys,
        "run",
        "--benchmark",
        "TextVQA_VAL",
        "--data",
        tsv,
        "--model",
        tmp_path / "parvl",
        "--out",
        tmp_path / "p.jsonl",
        "--max-new-tokens",
        NEW,
        *flags,
    )
    (pred,) = read_preds(tmp_path / "p.jsonl")
    model, tok = load_pretrained(tmp_path / "parvl"), Tokenizer.from_pretrained(tmp_path / "parvl")
    pil = Image.open(io.BytesIO(base64.b64decode(png_b64(16, 16, 5)))).convert("RGB")
    tiles = load_image(pil, max_tiles=6)  # TextVQA_VAL: 6 tiles
    ids = tok.encode(
        build_prompt(
            "<image>\nRead it.\nAnswer the question using a single word or phrase.",
            [tiles.shape[0]],
        )
    )
    want = (
        Engine(model, **options)
        .generate([ids], tiles, GenerateConfig(max_new_tokens=NEW), tok.eos_ids)
        .tokens[0]
    )
    dense = (
        Engine(model)
        .generate([ids], tiles, GenerateConfig(max_new_tokens=NEW), tok.eos_ids)
        .tokens[0]
    )
    assert rc == 0 and pred["prediction"] == tok.decode(want, skip_special_tokens=True).strip()
    assert (pred["pv"], pred["pl"]) == (2, 2) and all(pred[k] == v for k, v in options.items())
    assert all(seen[0][k] == v for k, v in options.items())
    # the pair changes the answer, so the comparison above is not vacuous
    if "vision_branch" in options:
        assert want != dense


def textvqa_prompt(row: dict, tok) -> tuple[list[int], torch.Tensor]:
    """A TextVQA row's prompt ids and tiles as `evaluate.py run` builds them (VLMEvalKit's InternVL path)."""
    tiles = load_image(
        Image.open(io.BytesIO(base64.b64decode(row["image"]))).convert("RGB"), max_tiles=6
    )
    return tok.encode(
        build_prompt(
            f"<image>\n{row['question']}\nAnswer the question using a single word or phrase.",
            [tiles.shape[0]],
        )
    ), tiles


def test_run_with_a_router_gives_the_routed_engines_answers(checkpoint, tmp_path, capsys):
    """--router: each row runs the pair the router picks; predictions and pairs equal Engine(router=...);
    --random-pair: each row its own seeded pair; report puts both beside the dense run (Table 3), out
    of the allocation grids."""
    import gates
    from loading.router import load_router, save_router

    torch.manual_seed(0)
    model = load_pretrained(checkpoint("qwen3", "original"), pv=2, pl=2)
    model.init_branches(std=2.0)
    save_pretrained(model, tmp_path / "parvl")
    model, tok = load_pretrained(tmp_path / "parvl"), Tokenizer.from_pretrained(tmp_path / "parvl")
    cfg = gates.RouterConfig(
        pv=2,
        pl=2,
        vision_width=model.cfg.vit.hidden_size,
        text_width=model.cfg.llm.hidden_size,
        hidden=16,
        im_start_id=tok.token_to_id("<|im_start|>"),
        fingerprint=gates.fingerprint(model),
    )
    torch.manual_seed(1)
    save_router(gates.Router(cfg), tmp_path / "R", {})
    rows = [
        {"index": str(k), "question": q, "answer": "['x']", "image": png_b64(16 + 8 * k, 16, k)}
        for k, q in enumerate(["Read it.", "What colour?", "Count them."])
    ]
    tsv = write_tsv(tmp_path / "t.tsv", rows)
    assert (
        main_out(
            capsys,
            "run",
            "--benchmark",
            "TextVQA_VAL",
            "--data",
            tsv,
            "--model",
            tmp_path / "parvl",
            "--out",
            tmp_path / "p.jsonl",
            "--max-new-tokens",
            NEW,
            "--router",
            tmp_path / "R",
            "--batch-size",
            1,
        )[0]
        == 0
    )
    preds = {p["index"]: p for p in read_preds(tmp_path / "p.jsonl")}
    engine = Engine(model, router=load_router(tmp_path / "R", model))
    for r in rows:
        ids, tiles = textvqa_prompt(r, tok)
        res = engine.generate([ids], tiles, GenerateConfig(max_new_tokens=NEW), tok.eos_ids)
        assert (
            preds[r["index"]]["prediction"]
            == tok.decode(res.tokens[0], skip_special_tokens=True).strip()
        )
        assert preds[r["index"]]["pair"] == list(res.pairs[0]) and preds[r["index"]][
            "router"
        ] == str(tmp_path / "R")
    score = tmp_path / "score.json"
    assert (
        main_out(
            capsys,
            "score",
            "--benchmark",
            "TextVQA_VAL",
            "--data",
            tsv,
            "--predictions",
            tmp_path / "p.jsonl",
            "--out",
            score,
        )[0]
        == 0
    )
    # Table 3's random pair: each row its own seeded pair, whatever the batch, equal to that pair alone
    run = [
        "run",
        "--benchmark",
        "TextVQA_VAL",
        "--data",
        tsv,
        "--model",
        tmp_path / "parvl",
        "--max-new-tokens",
        NEW,
    ]
    assert (
        main_out(
            capsys,
            *run,
            "--out",
            tmp_path / "r.jsonl",
            "--random-pair",
            "--seed",
            3,
            "--batch-size",
            3,
        )[0]
        == 0
    )
    drawn = {r["index"]: predict.random_pair(3, r["index"], 2, 2) for r in rows}
    assert len(set(drawn.values())) > 1  # the rows of one batch run different pairs
    plain = Engine(model)
    for p in read_preds(tmp_path / "r.jsonl"):
        ids, tiles = textvqa_prompt(rows[int(p["index"])], tok)
        v, l = drawn[p["index"]]
        res = plain.generate(
            [ids],
            tiles,
            GenerateConfig(max_new_tokens=NEW),
            tok.eos_ids,
            vision_branch=v,
            language_branch=l,
        )
        assert (
            p["pair"] == [v, l]
            and p["random_pair"] == 3
            and p["prediction"] == tok.answer(res.tokens[0])
        )
    rc, _, err = main_out(capsys, *run, "--out", tmp_path / "r.jsonl", "--random-pair", "--seed", 4)
    assert rc == 1 and "random_pair 3 there, 4 now" in err  # another seed is another run
    assert main_out(capsys, *run, "--out", tmp_path / "d.jsonl")[0] == 0
    for name in ("r", "d"):
        assert (
            main_out(
                capsys,
                "score",
                "--benchmark",
                "TextVQA_VAL",
                "--data",
                tsv,
                "--predictions",
                tmp_path / f"{name}.jsonl",
                "--out",
                tmp_path / f"{name}.json",
            )[0]
            == 0
        )
    rc, _, _ = main_out(
        capsys, "report", score, tmp_path / "r.json", tmp_path / "d.json", "--out", tmp_path / "rep"
    )
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    # the allocation tables: the dense run only
    assert rc == 0 and [c["label"] for c in data["configs"]] == ["2:2"]
    # Table 3 in the paper's row order (random pair, learned router, aggregation), all of one checkpoint
    assert [t["policy"] for t in data["table3"]] == [
        "Random pair (seed 3)",
        "Learned router",
        "Aggregation",
    ]
    assert [t["scores"]["TextVQA_VAL"] for t in data["table3"]] == [
        json.loads((tmp_path / f).read_text())["score"] for f in ("r.json", "score.json", "d.json")
    ]
    assert {t["checkpoint"] for t in data["table3"]} == {data["configs"][0]["model"]}


# -- run: rows and failures ----------------------------------------------------------------------------


def test_a_row_that_cannot_be_asked_is_skipped_by_name(model_dir, tmp_path, capsys):
    """evaluate.py run: a 100,000-character question (past the model's context) and a typed <IMG_CONTEXT>
    each skip their row, named; the other rows are answered (the long one aborted the whole run)."""
    img = png_b64(16, 16, 5)
    tsv = write_tsv(
        tmp_path / "t.tsv",
        [
            {"index": "0", "question": "Read it.", "answer": "['x']", "image": img},
            {"index": "1", "question": "word " * 20000, "answer": "['x']", "image": img},
            {"index": "2", "question": "Is <IMG_CONTEXT> it?", "answer": "['x']", "image": img},
        ],
    )
    out = tmp_path / "p.jsonl"
    code, err = run_main(
        capsys,
        evaluate.main,
        [
            "run",
            "--benchmark",
            "TextVQA_VAL",
            "--data",
            tsv,
            "--model",
            model_dir,
            "--out",
            out,
            "--max-new-tokens",
            2,
        ],
    )
    skipped = [x for x in err if x.startswith("row ")]
    assert code == 0 and len(skipped) == 2, err
    assert skipped[0].startswith("row 1: prompt of ") and skipped[0].endswith(
        "tokens (image tokens included) + 2 new tokens exceeds the model context of 40960; skipped"
    ), skipped
    assert skipped[1] == (
        "row 2: the question holds <IMG_CONTEXT>, the token an image's features fill; write <image> "
        "where an image goes; skipped"
    )
    assert [json.loads(x)["index"] for x in out.read_text().splitlines()] == ["0"]


def test_run_out_of_memory_is_one_line(bench, tmp_path, capsys, monkeypatch):
    """The CPU allocator's failure (a RuntimeError) in a batch: one line naming --batch-size and the
    longest prompt, exit 1, the rows written before it kept."""
    folder, tsv, _, _ = bench
    calls = []

    def generate(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 37591663152 bytes."
            )
        return real(self, *args, **kwargs)

    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", generate)
    out = tmp_path / "pred.jsonl"
    rc, _, err = main_out(
        capsys,
        "run",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--model",
        folder,
        "--out",
        out,
        "--batch-size",
        "2",
        "--max-new-tokens",
        NEW,
    )
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc == 1 and "Traceback" not in err and len(lines) == 1, err
    assert re.fullmatch(
        r"error: out of memory at --batch-size 2 \(longest prompt \d+ tokens, up to \d+ new\); lower "
        r"--batch-size, --max-tiles or --max-new-tokens",
        lines[0],
    ), lines[0]
    # the first batch stays; a rerun resumes from it
    assert len(read_preds(out.with_name("pred.jsonl.part0"))) == 2


def test_run_interrupted_keeps_whole_predictions_and_resumes(
    bench, full_run, tmp_path, capsys, monkeypatch
):
    """Ctrl-C (SIGINT, here sent during the second batch): exit 130, one line, the first batch's
    predictions kept as whole lines, and the same command finishes the file, equal to a run never
    interrupted."""
    folder, tsv, _, _ = bench
    calls = []

    def generate(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            # the real signal, through the handler evaluate.py installs
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *args, **kwargs)

    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", generate)
    out = tmp_path / "pred.jsonl"
    args = [
        "run",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--model",
        folder,
        "--out",
        out,
        "--batch-size",
        "2",
        "--max-new-tokens",
        NEW,
    ]
    rc, _, err = main_out(capsys, *args)
    assert (
        rc == 130
        and "Traceback" not in err
        and err.strip().splitlines()[-1]
        == ("interrupted by SIGINT: the predictions written so far stay; the same command resumes")
    ), err
    assert len(read_preds(out.with_name("pred.jsonl.part0"))) == 2
    monkeypatch.setattr(Engine, "generate", real)
    rc, stdout, _ = main_out(capsys, *args)
    assert (
        rc == 0
        and json.loads(stdout.splitlines()[-1])["new"] == 2
        and out.read_text() == full_run.read_text()
    )


def test_run_allocation_failures_beyond_generation_are_one_line(
    bench, tmp_path, capsys, monkeypatch
):
    """The CPU allocator's failure while loading the model or moving a batch's tiles to the device was a raw
    RuntimeError traceback, where docs/reliability.md promises one line (issue 38, item 15): one line naming
    what asked for the memory and what lowers it, exit 1."""
    from inference import flags as inference

    folder, tsv, _, _ = bench
    cannot = RuntimeError(
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 37591663152 bytes."
    )
    args = [
        "run",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--model",
        folder,
        "--batch-size",
        "2",
        "--max-new-tokens",
        NEW,
    ]

    def cannot_load(*args, **kwargs):
        raise cannot

    monkeypatch.setattr(inference, "load_pretrained", cannot_load)
    rc, _, err = main_out(capsys, *args, "--out", tmp_path / "a.jsonl")
    assert rc == 1 and err.strip().splitlines()[-1] == (
        f"error: out of memory at loading {folder} (float32 on cpu); lower the precision (--dtype bf16), or use a "
        f"device with more free memory"
    ), err
    monkeypatch.undo()
    real = torch.cat

    def cat(tensors, *a, **k):  # the batch's tiles, joined in predict to move them to the device
        if sys._getframe(1).f_code.co_name == "predict":
            raise cannot
        return real(tensors, *a, **k)

    monkeypatch.setattr(predict.torch, "cat", cat)
    rc, _, err = main_out(capsys, *args, "--out", tmp_path / "b.jsonl")
    assert rc == 1 and re.fullmatch(
        r"error: out of memory at --batch-size 2 \(longest prompt \d+ tokens, up to \d+ "
        r"new\); lower --batch-size, --max-tiles or --max-new-tokens",
        err.strip().splitlines()[-1],
    ), err


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_run_on_a_device_that_is_not_there_is_one_line(bench, tmp_path, capsys):
    """--device cuda without CUDA is refused in one line before the model loads (it ran on the CPU,
    silently); a device that is neither is argparse's exit 2."""
    folder, tsv, _, _ = bench
    args = [
        "run",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--model",
        folder,
        "--out",
        tmp_path / "p.jsonl",
    ]
    rc, _, err = main_out(capsys, *args, "--device", "cuda")
    lines = err.strip().splitlines()
    assert (
        rc == 1
        and len(lines) == 1
        and lines[0].startswith("error: --device cuda: CUDA is not available (")
    ), err
    with pytest.raises(SystemExit) as e:
        evaluate.main([str(a) for a in args] + ["--device", "tpu"])
    assert (
        e.value.code == 2
        and "--device" in capsys.readouterr().err
        and not (tmp_path / "p.jsonl").exists()
    )


def test_an_out_that_cannot_be_written_is_one_line(bench, full_run, tmp_path, capsys):
    """--out where a folder is a file (as a read-only file system, an OSError at the write): one line
    naming the path and the cause, exit 1, for run, score and report."""
    folder, tsv, _, _ = bench
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    for args, want in [
        (
            [
                "run",
                "--benchmark",
                "MMMU_DEV_VAL",
                "--data",
                tsv,
                "--model",
                folder,
                "--out",
                a_file / "p.jsonl",
            ],
            f"error: --out {a_file / 'p.jsonl'}: {a_file} is a file, not a folder",
        ),  # before the model
        (
            [
                "score",
                "--benchmark",
                "MMMU_DEV_VAL",
                "--data",
                tsv,
                "--predictions",
                full_run,
                "--out",
                a_file / "s.json",
            ],
            f"error: --out {a_file / 's.json'}: {a_file} is a file, not a folder",
        ),
    ]:
        rc, _, err = main_out(capsys, *args)
        assert rc == 1 and err.strip().splitlines()[-1:] == [want], (args, err)
    assert a_file.read_text() == "kept"


# -- score ---------------------------------------------------------------------------------------------


def test_score_writes_its_line_its_rows_and_its_file(bench, full_run, tmp_path, capsys):
    _, tsv, _, _ = bench
    rc, out, err = main_out(
        capsys,
        "score",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--predictions",
        full_run,
        "--rows-out",
        tmp_path / "rows.jsonl",
        "--out",
        tmp_path / "s.json",
    )
    line = json.loads(out.splitlines()[-1])
    assert (
        rc == 0
        and line["n"] == 3
        and line["benchmark"] == "MMMU_DEV_VAL"
        and 0 <= line["score"] <= 100
    )
    # row 13
    assert line["missing"] == 1 and len((tmp_path / "rows.jsonl").read_text().splitlines()) == 3
    assert json.loads((tmp_path / "s.json").read_text()) == line


def test_score_out_into_a_missing_folder_makes_it(bench, full_run, tmp_path, capsys):
    """score --out and --rows-out into a folder that is not there yet: made, as run makes its --out's (it failed
    with "no such file or folder" after scoring; issue 38, item 22)."""
    _, tsv, _, _ = bench
    out, rows = tmp_path / "new" / "deep" / "s.json", tmp_path / "other" / "rows.jsonl"
    rc, stdout, err = main_out(
        capsys,
        "score",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--predictions",
        full_run,
        "--out",
        out,
        "--rows-out",
        rows,
    )
    assert (
        rc == 0
        and json.loads(out.read_text()) == json.loads(stdout.splitlines()[-1])
        and rows.is_file()
    ), err


def test_score_and_run_bad_input_is_one_line(bench, full_run, tmp_path, capsys):
    """An unknown benchmark (score and run), a TSV without answers, a prediction of an index the TSV lacks."""
    _, tsv, _, _ = bench
    bad_pred = tmp_path / "bad.jsonl"
    bad_pred.write_text(json.dumps({"index": "999", "prediction": "A"}) + "\n")
    no_answer = write_tsv(
        tmp_path / "no_answer.tsv", [{"index": "10", "question": "q", "image": "x" * 80}]
    )
    cases = [
        (
            ["score", "--benchmark", "NoSuchBench", "--data", tsv, "--predictions", full_run],
            "unknown benchmark",
        ),
        (
            ["run", "--benchmark", "NoSuchBench", "--data", tsv, "--out", tmp_path / "x.jsonl"],
            "unknown benchmark",
        ),
        (
            [
                "score",
                "--benchmark",
                "MMMU_DEV_VAL",
                "--data",
                no_answer,
                "--predictions",
                full_run,
            ],
            "missing required column(s) answer",
        ),
        (
            ["score", "--benchmark", "MMMU_DEV_VAL", "--data", tsv, "--predictions", bad_pred],
            "prediction index '999' is not in",
        ),
    ]
    for argv, message in cases:
        rc, out, err = main_out(capsys, *argv)
        assert rc == 1 and err.count("\n") == 1 and message in err and "Traceback" not in err, (
            argv,
            err,
        )


def test_the_extractor_report_and_cost_flags_are_flag_errors(bench, full_run, tmp_path, capsys):
    """Issue 38, item 22: --judge-url without --judge-model (was exit 1), a --judge-url that is not a URL (was
    not named), the extractor's flags without --judge-url, `report --arch bogus` (was exit 1 after reading every
    score, where profiling.py exits 2) and `cost --column Foo`: each a flag error, exit 2, one line naming the
    flag, before any file is read."""
    _, tsv, _, _ = bench
    score = ["score", "--benchmark", "MMMU_DEV_VAL", "--data", tsv, "--predictions", full_run]
    kit = ["--vlmevalkit", tmp_path]
    cases = [
        ([*score, "--judge-url", "http://127.0.0.1:9/v1", *kit], "--judge-url needs --judge-model"),
        (
            [*score, "--judge-url", "127.0.0.1:9/v1", "--judge-model", "m", *kit],
            "--judge-url '127.0.0.1:9/v1': not an http(s) URL",
        ),
        (
            [*score, "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m"],
            "--judge-url needs --vlmevalkit",
        ),
        (
            [*score, "--judge-model", "m"],
            "--judge-model is the answer extractor's and needs --judge-url",
        ),
        (
            [
                *score,
                "--judge-url",
                "http://127.0.0.1:9/v1",
                "--judge-model",
                "m",
                *kit,
                "--judge-key-env",
                "A-B",
            ],
            "--judge-key-env 'A-B': not the name of an environment variable",
        ),
        (
            ["report", full_run, "--arch", "bogus", "--out", tmp_path / "r"],
            "argument --arch: invalid choice",
        ),
        (
            ["cost", "--report", full_run, "--latency", full_run, "--column", "Foo"],
            "argument --column: invalid choice: 'Foo'",
        ),
    ]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as e:
            evaluate.main([str(a) for a in argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and needle in err[0], (argv, err)
    assert not (tmp_path / "r").exists()


def test_score_refuses_a_file_without_predictions_and_counts_a_partial_one(
    bench, full_run, tmp_path, capsys
):
    """No prediction at all is a wrong path or a run that never started: one line, exit 1. A partial
    file still scores, its missing rows wrong: one of the 3 validation rows answered (row 10), so the
    score is 0 or 100/3."""
    _, tsv, _, _ = bench
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc, out, err = main_out(
        capsys, "score", "--benchmark", "MMMU_DEV_VAL", "--data", tsv, "--predictions", empty
    )
    assert rc == 1 and out == "" and err.count("\n") == 1 and "holds no prediction" in err
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(read_preds(full_run)[0]) + "\n")
    rc, out, _ = main_out(
        capsys, "score", "--benchmark", "MMMU_DEV_VAL", "--data", tsv, "--predictions", one
    )
    line = json.loads(out.splitlines()[-1])
    assert (
        rc == 0
        and line["n"] == 3
        and line["missing"] == 4
        and line["score"] in (0.0, round(100 / 3, 4))
    )


def test_score_checks_the_predictions_against_their_record(bench, full_run, tmp_path, capsys):
    """Another benchmark's predictions, another TSV, a duplicated index (in the predictions or the TSV)
    are refused; rows without a prediction count as wrong and are named."""
    _, tsv, rows, _ = bench
    preds = read_preds(full_run)

    def write(name: str, ps: list[dict]) -> Path:
        (tmp_path / name).write_text("".join(json.dumps(p) + "\n" for p in ps))
        return tmp_path / name

    other_tsv = write_tsv(
        tmp_path / "other.tsv", [dict(r, question=r["question"] + "!") for r in rows]
    )
    twice_tsv = write_tsv(tmp_path / "twice.tsv", rows + rows[:1])
    cases = [
        (
            [
                "--data",
                tsv,
                "--predictions",
                write("bench.jsonl", [dict(p, benchmark="TextVQA_VAL") for p in preds]),
            ],
            f"{tmp_path / 'bench.jsonl'}: predictions of TextVQA_VAL, not of --benchmark MMMU_DEV_VAL",
        ),
        (
            ["--data", tsv, "--predictions", write("dup.jsonl", preds + preds[:1])],
            "index '10' is predicted twice",
        ),
        (
            ["--data", other_tsv, "--predictions", full_run],
            f"made from another TSV than {other_tsv}",
        ),
        (
            ["--data", twice_tsv, "--predictions", full_run],
            f"{twice_tsv}: index '10' appears twice",
        ),
    ]
    for argv, message in cases:
        rc, _, err = main_out(capsys, "score", "--benchmark", "MMMU_DEV_VAL", *argv)
        assert rc == 1 and err.count("\n") == 1 and message in err and "Traceback" not in err, (
            argv,
            err,
        )
    rc, out, err = main_out(
        capsys,
        "score",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--predictions",
        write("one.jsonl", preds[:1]),
    )
    line = json.loads(out.splitlines()[-1])
    main_out(
        capsys,
        "score",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--predictions",
        full_run,
        "--rows-out",
        tmp_path / "r.jsonl",
    )
    hit = float(
        next(json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines() if '"10"' in x)[
            "hit"
        ]
    )
    # validation: 10, 11, 14
    assert rc == 0 and line["n"] == 3 and line["missing_indices"] == ["11", "12", "13", "14"]
    # 11 and 14 count as wrong, not dropped
    assert line["score"] == pytest.approx(round(100 * hit / 3, 4))
    assert "4 TSV rows have no prediction and count as wrong (index 11, 12, 13, 14)" in err


def test_score_reads_a_short_row_as_pandas_does(input_files, capsys):
    """A row with fewer cells than the header has missing values there, as pandas reads it (VLMEvalKit),
    not a KeyError: ChartQA's relaxed accuracy finds row 0's "yes" against its missing answer ("nan")
    wrong and row 1's "yes" against "yes" right, 1 of 2 rows."""
    code = evaluate.main(
        [
            "score",
            "--benchmark",
            "ChartQA_TEST",
            "--data",
            str(input_files["short_tsv"]),
            "--predictions",
            str(input_files["preds"]),
        ]
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and line["n"] == 2 and line["score"] == 50.0, line
