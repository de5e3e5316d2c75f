"""The conveniences: the default model through a (fake, offline) huggingface_hub cache and
the one line when it cannot be had, InternVL's chat() / batch_chat() on the engine, `generate.py
--batch` (equal to one-by-one answers, resumable), the training progress line, --dtype auto and
--num-workers, and the plot commands with and without matplotlib."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

import chat
import cli
import generate
from checkpoint import CheckpointError
from conftest import ROOT, one_line, parse_flags, random_pixels
from engine import Engine, GenerateConfig
from hub import DEFAULT_MODEL, resolve_model
from parvl import ParVL
from processor import Tokenizer, build_prompt

CFG = dict(max_new_tokens=6, do_sample=False)  # as InternVL's examples pass it


@pytest.fixture(scope="module")
def tiny(checkpoint):
    folder = checkpoint("qwen3", "original")
    return folder, ParVL.from_pretrained(folder), Tokenizer.from_pretrained(folder)


def run_python(code: str, env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter from the repo root (the hub cache settings are read at import)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def hub_env(cache) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PARVL_MODEL", "HF_HOME", "HF_HUB_CACHE")}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


# -- 1. the default model -------------------------------------------------------------------------


def test_local_folder_and_env_var(tiny, monkeypatch, tmp_path):
    folder = tiny[0]
    assert resolve_model(str(folder)) == folder
    monkeypatch.setenv("PARVL_MODEL", str(folder))
    assert resolve_model(None) == folder  # $PARVL_MODEL before the default
    with pytest.raises(ValueError, match="local folder, not a hub model"):
        resolve_model(str(folder), revision="v1")
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        resolve_model(str(tmp_path / "a" / "b" / "c"))


def fake_snapshot(cache, repo: str, rev: str, source, ref: str | None = "main", weights: bool = True):
    """huggingface_hub's cache layout: models--owner--name/snapshots/<rev>/..., refs/<ref> -> rev."""
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(source, root / "snapshots" / rev)
    if not weights:  # what an interrupted download leaves
        (root / "snapshots" / rev / "model.safetensors").unlink()
    if ref:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(rev)
    return root / "snapshots" / rev


def test_default_model_from_the_hub_cache_offline(tiny, tmp_path, capsys):
    folder, _, _ = tiny
    cache = tmp_path / "hub"
    main_rev, pinned = "a" * 40, "b" * 40
    snap = fake_snapshot(cache, DEFAULT_MODEL, main_rev, folder)
    other = fake_snapshot(cache, DEFAULT_MODEL, pinned, folder, ref=None)
    fake_snapshot(cache, "Someone/partial", "c" * 40, folder, weights=False)
    # the two commands: no --model, no $PARVL_MODEL; the model comes from the cache, with no network
    res = subprocess.run([sys.executable, str(ROOT / "generate.py"), "Hello?", "--max-new-tokens", "4", "--json"],
                         env=hub_env(cache), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"loaded {snap}" in res.stderr and "downloading" not in res.stderr
    assert generate.main(["Hello?", "--model", str(folder), "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(res.stdout)["answer"] == json.loads(capsys.readouterr().out)["answer"]
    res = run_python(f"""
        import json, sys, generate
        from checkpoint import CheckpointError
        from hub import resolve_model
        out = {{"main": str(resolve_model()), "pinned": str(resolve_model(None, "{pinned}"))}}
        for name in ("OpenGVLab/Missing", "Someone/partial"):
            try:
                resolve_model(name)
            except CheckpointError as e:
                out[name] = str(e)
        print(json.dumps(out), flush=True)
        sys.exit(generate.main(["Hello?", "--model", "OpenGVLab/Missing"]))  # offline, not cached: one line, 1
    """, hub_env(cache))
    assert res.returncode == 1 and "hf download OpenGVLab/Missing" in one_line(res.stderr), res.stderr
    out = json.loads(res.stdout)
    assert out["main"] == str(snap) and out["pinned"] == str(other)
    assert "not in the hub cache, and HF_HUB_OFFLINE is set" in out["OpenGVLab/Missing"]
    assert "incomplete in the hub cache" in out["Someone/partial"]
    assert "hf download OpenGVLab/Missing --local-dir Missing" in out["OpenGVLab/Missing"]
    assert "hf download Someone/partial" in out["Someone/partial"]  # incomplete copy in the cache: not loaded


def test_no_network_is_one_error_line(tmp_path):
    env = {k: v for k, v in hub_env(tmp_path / "empty").items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_ETAG_TIMEOUT": "2"}  # a port nothing listens on: refused at once
    res = subprocess.run([sys.executable, str(ROOT / "generate.py"), "Hello?"], env=env, capture_output=True, text=True,
                         timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(lines) == 2, res.stderr
    assert lines[0].startswith("downloading OpenGVLab/InternVL3_5-1B into")  # the attempt, announced
    assert lines[1] == ("error: OpenGVLab/InternVL3_5-1B: not in the hub cache and the hub cannot be reached; download "
                        "it "
                        "where the hub is reachable (hf download OpenGVLab/InternVL3_5-1B --local-dir InternVL3_5-1B) "
                        "and pass --model InternVL3_5-1B")


def test_without_huggingface_hub_one_line_says_how(tmp_path):
    res = run_python("""
        import sys
        sys.modules["huggingface_hub"] = None  # as if not installed: its import raises ImportError
        import generate
        sys.exit(generate.main(["Hello?"]))
    """, hub_env(tmp_path / "empty"))
    line = one_line(res.stderr)
    assert res.returncode == 1 and "huggingface_hub is not installed" in line and "pip install huggingface_hub" in line
    assert "hf download OpenGVLab/InternVL3_5-1B --local-dir InternVL3_5-1B" in line and "huggingface-cli" not in line


# -- 2. chat() and batch_chat() ---------------------------------------------------------------------


def engine_answer(model, tok, prompts: list[str], pixels, n: int = 6) -> list[str]:
    out = Engine(model).generate([tok.encode(p) for p in prompts], pixels, GenerateConfig(max_new_tokens=n),
                                 tok.eos_ids)
    return [tok.decode(t, skip_special_tokens=True).strip() for t in out.tokens]


def test_chat_equals_the_engine_and_keeps_the_official_history(tiny, monkeypatch):
    _, model, tok = tiny
    pv = random_pixels(2, seed=5)
    seen = []  # the prompts chat() hands the engine (the tiny model's answers alone tell little apart)
    real_generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompts, *a, **k: seen.append(prompts)
                        or real_generate(self, prompts, *a, **k))
    first, history = model.chat(tok, pv, "What is it?", dict(CFG), return_history=True)
    q1 = "<image>\nWhat is it?"  # as the official chat() stores a first question without a placeholder
    assert history == [(q1, first)] and seen[0] == [tok.encode(build_prompt(q1, [2]))]
    assert [first] == engine_answer(model, tok, [build_prompt(q1, [2])], pv)
    engine = model.engine
    second, history2 = model.chat(tok, pv, "And the colour?", dict(CFG), history=history, return_history=True)
    assert history2 == [(q1, first), ("And the colour?", second)] and history == [(q1, first)]
    assert [second] == engine_answer(model, tok, [build_prompt("And the colour?", [2], history=history)], pv)
    assert seen[2] == seen[3]  # chat's second turn and the engine call of the expected prompt
    assert model.engine is engine  # one engine per model
    multi = "Image-1: <image>\nImage-2: <image>\nWhat differs?"
    pv3 = random_pixels(3, seed=6)
    assert [model.chat(tok, pv3, multi, CFG, num_patches_list=[2, 1])] == engine_answer(model, tok,
                                                                                        [build_prompt(multi, [2, 1])],
                                                                                        pv3)
    assert [model.chat(tok, None, "Hi", CFG)] == engine_answer(model, tok, [build_prompt("Hi", [])], None)
    with pytest.raises(ValueError, match="sums to 2"):
        model.chat(tok, pv3, "q", CFG, num_patches_list=[1, 1])
    with pytest.raises(ValueError, match="num_beams"):
        model.chat(tok, pv, "q", dict(CFG, num_beams=4))


def test_generation_config_maps_like_transformers():
    to = chat.to_generate_config
    assert to(dict(max_new_tokens=9, do_sample=False, temperature=0.7)) == GenerateConfig(max_new_tokens=9)
    assert to(dict(do_sample=True, temperature=0.7)) == GenerateConfig(temperature=0.7, top_k=50, top_p=1.0)
    assert to(dict(do_sample=True, top_p=0.8, top_k=None)) == GenerateConfig(temperature=1.0, top_k=50, top_p=0.8)
    with pytest.raises(ValueError, match="repetition_penalty"):
        to(dict(repetition_penalty=1.1))


def test_batch_chat_equals_one_by_one_chat_and_the_engine(tiny, monkeypatch):
    _, model, tok = tiny
    seen = []  # (prompts, pixels) of each engine call
    real_generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompts, pv, *a, **k: seen.append((prompts, pv))
                        or real_generate(self, prompts, pv, *a, **k))
    pv = torch.cat([random_pixels(2, seed=7), random_pixels(1, seed=8)])
    questions = ["Describe the image in detail.", "Hi", "<image>\nWhat?"]
    got = model.batch_chat(tok, pv, questions, dict(CFG), num_patches_list=[2, 0, 1])
    assert got == [model.chat(tok, pv[:2], questions[0], CFG), model.chat(tok, None, questions[1], CFG),
                   model.chat(tok, pv[2:], questions[2], CFG)]
    prompts = [build_prompt("<image>\n" + questions[0], [2]), build_prompt("Hi", []), build_prompt(questions[2], [1])]
    assert got == engine_answer(model, tok, prompts, pv)
    assert seen[0][0] == seen[-1][0] and torch.equal(seen[0][1], seen[-1][1])  # one batch: the expected prompts
    with pytest.raises(ValueError, match="no history"):
        model.batch_chat(tok, pv, questions, CFG, num_patches_list=[2, 0, 1], history=[])
    with pytest.raises(ValueError, match="num_patches_list"):
        model.batch_chat(tok, pv, questions, CFG)


# -- 3. --batch ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    (root / "img").mkdir()
    rng = np.random.default_rng(1)
    for name, size in (("a.png", (60, 90)), ("b.png", (90, 40))):
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(root / "img" / name)
    rows = [{"image": "img/a.png", "question": "What is it?"},
            {"question": "Tell me a joke."},
            {"image": ["img/a.png", str(root / "img" / "b.png")], "question": "What differs?"},
            {"image": "img/b.png", "question": "Colour?"},
            {"image": "img/b.png", "question": "Shape?"}]
    path = root / "questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + "\n"
                    + "".join(json.dumps(r) + "\n" for r in rows[2:]))
    return path, rows


FLAGS = ["--max-new-tokens", "5", "--max-tiles", "1"]


def test_batch_equals_one_by_one_and_resumes(tiny, questions, tmp_path, capsys, monkeypatch):
    folder = tiny[0]
    path, rows = questions
    out = tmp_path / "answers.jsonl"
    calls = []  # (prompts, pixel_values) of every engine call: the tiny model's answers alone tell little apart
    real_generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompts, pv, *a, **k: calls.append((prompts, pv))
                        or real_generate(self, prompts, pv, *a, **k))
    assert generate.main(["--batch", str(path), "--out", str(out), "--batch-size", "2", "--model", str(folder),
                          *FLAGS]) == 0
    batched, calls[:] = list(calls), []
    assert [len(p) for p, _ in batched] == [2, 2, 1]  # --batch-size rows per engine call
    err = capsys.readouterr().err
    assert "answered 5/5" in err and "samples/s" in err and "eta 0:00:00" in err
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["line"] for g in got] == [1, 2, 4, 5, 6]  # input order; the blank line 3 is skipped
    for g, row in zip(got, rows):  # every answer is the command's answer to that one question
        images = [row["image"]] if isinstance(row.get("image"), str) else row.get("image", [])
        assert generate.main([*(str(path.parent / i) for i in images), row["question"], "--json", "--model",
                              str(folder),
                              *FLAGS]) == 0
        assert g["answer"] == json.loads(capsys.readouterr().out)["answer"], g
        assert g["question"] == row["question"] and g.get("image") == row.get("image")
    # the engine saw exactly the one-by-one prompts and tiles, in order
    assert [p for ps, _ in batched for p in ps] == [p for ps, _ in calls for p in ps]
    cat = lambda cs: torch.cat([pv for _, pv in cs if pv is not None])  # noqa: E731
    assert torch.equal(cat(batched), cat(calls))
    full = out.read_text()
    # killed during the third answer: two whole lines and a torn one; the rerun answers the rest
    lines = full.splitlines(keepends=True)
    out.write_text(lines[0] + lines[1] + lines[2][:15])
    assert generate.main(["--batch", str(path), "--out", str(out), "--batch-size", "2", "--model", str(folder),
                          *FLAGS]) == 0
    assert "2 of 5 questions already answered; 3 to go" in capsys.readouterr().err
    assert out.read_text() == full
    out.write_text(lines[3] + lines[0])  # not a prefix: the result is still in input order
    assert generate.main(["--batch", str(path), "--out", str(out), "--batch-size", "4", "--model", str(folder),
                          *FLAGS]) == 0
    assert out.read_text() == full
    # default: stdout, the same rows
    assert generate.main(["--batch", str(path), "--batch-size", "3", "--model", str(folder), *FLAGS]) == 0
    assert capsys.readouterr().out == full


def test_batch_interrupted_keeps_its_answers_and_says_how_to_resume(tiny, questions, tmp_path, capsys, monkeypatch):
    """Ctrl-C during the second batch: the first batch's answers stay, one line says so (130), and the
    same command answers the rest, giving the file an uninterrupted run gives."""
    folder, (path, _) = tiny[0], questions
    flags = ["--batch", str(path), "--batch-size", "2", "--model", str(folder), *FLAGS]
    assert generate.main([*flags, "--out", str(tmp_path / "full.jsonl")]) == 0
    real_generate, calls = Engine.generate, []

    def second_is_interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_generate(self, *a, **k)

    monkeypatch.setattr(Engine, "generate", second_is_interrupted)
    out = tmp_path / "answers.jsonl"
    capsys.readouterr()
    assert generate.main([*flags, "--out", str(out)]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "interrupted by SIGINT: the answers written so far stay; the same command resumes", last
    assert len(out.read_text().splitlines()) == 2  # the first batch, whole
    monkeypatch.setattr(Engine, "generate", real_generate)
    assert generate.main([*flags, "--out", str(out)]) == 0
    assert out.read_text() == (tmp_path / "full.jsonl").read_text()


def test_batch_bad_input_is_one_line(tiny, questions, tmp_path, capsys):
    folder = tiny[0]
    path, _ = questions
    bad = tmp_path / "bad.jsonl"
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"line": 1, "question": "Something else", "answer": "x"}) + "\n")
    cases = {
        f"{bad} line 2: not JSON": ('{"question": "ok"}\n{"question": \n', "--batch", bad),
        f"{bad} line 1: no image file {tmp_path / 'gone.png'}": ('{"image": "gone.png", "question": "q"}\n',
                                                                 "--batch", bad),
        f'{bad} line 1: needs a "question" string': ('{"image": "gone.png"}\n', "--batch", bad),
        f"{other}: answers another file": (None, "--batch", path, "--out", other),
    }
    for needle, (text, *args) in cases.items():
        if text is not None:
            bad.write_text(text)
        assert generate.main([*map(str, args), "--model", str(folder), *FLAGS]) == 1, needle
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"error: {needle}"), (needle, line)
    # a corrupt image is found at its batch: that row is named and skipped, every other row answered,
    # exit 1 naming what is left; a rerun tries only that row again
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    bad.write_text(json.dumps({"image": "broken.png", "question": "q"}) + "\n" + json.dumps({"question": "Hi?"}) + "\n")
    out = tmp_path / "answers.jsonl"
    assert generate.main(["--batch", str(bad), "--out", str(out), "--model", str(folder), *FLAGS]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert (err[1].startswith(f"{bad} line 1: cannot read image {tmp_path / 'broken.png'}: ")
            and err[1].endswith("; skipped"))
    assert err[-1] == f"error: 1 of 2 rows not answered, their images unreadable: {bad} line 1", err
    assert [json.loads(x)["line"] for x in out.read_text().splitlines()] == [2]
    with pytest.raises(SystemExit) as e:
        generate.main(["--batch", str(path), "question?", "--model", str(folder)])
    assert e.value.code == 2 and "--batch reads images and questions" in one_line(capsys.readouterr().err)


# -- 5. training progress and defaults; 6. plots ------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(checkpoint, tmp_path_factory):
    """A 3-step tiny training run with --dtype auto (the default): its folder and stderr."""
    from conftest import COMMON, train_here, write_dataset

    root = tmp_path_factory.mktemp("run")
    meta = write_dataset(root / "data", rows=12)
    res = train_here("--model", checkpoint("qwen3", "original"), "--data", meta, "--out", root / "run", "--pl", "2",
                     "--max-steps", "3", *COMMON, "--dtype", "auto")
    return root / "run", res.stderr


def test_human_progress_line_and_dtype_auto(run_dir):
    out, stderr = run_dir
    human = [x for x in stderr.splitlines() if x.startswith("step ")]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(human) == len(metrics) == 3, stderr
    for k, (line, m) in enumerate(zip(human, metrics), 1):
        fields = line.split(" | ")
        assert fields[0] == f"step {k}/3" and fields[1] == f"loss {m['loss']:.4f}", line
        assert fields[2] == f"grad norm {m['grad_norm']:.3f}"
        assert fields[3] == f"lr branches {m['lr']['branches']:.2e} pretrained {m['lr']['pretrained']:.2e}"
        assert fields[4] == f"{m['tokens_per_s']:,.0f} tokens/s" and fields[5] == "MFU n/a"  # no peak known on CPU
        assert fields[6] == f"peak {m['peak_gib']:.1f} GiB" and len(fields) == 9
        assert re.fullmatch(r"elapsed \d+:\d\d:\d\d", fields[7]) and fields[8] == f"eta {cli.hms(m['eta_s'])}"
    assert human[-1].endswith("eta 0:00:00")
    assert json.loads((out / "config.json").read_text())["dtype"] == "fp32"  # auto on CPU
    assert cli.hms(3725.9) == "1:02:05"


def test_num_workers_default_fits_the_cpus(monkeypatch):
    import train

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for cpus, ranks, want in ((1, None, 1), (2, None, 2), (16, None, 4), (16, "8", 2), (4, "8", 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        if ranks:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert train.default_workers() == want, (cpus, ranks)
    assert train.TrainConfig().dtype == "auto"


def png_ok(path, size) -> None:
    img = Image.open(path)
    assert img.format == "PNG" and img.size == size
    assert np.asarray(img.convert("L")).std() > 5  # something is drawn


def test_train_plot_and_latency_plot(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # requirements-dev.txt has it; test_plots_without_matplotlib covers its absence
    import profiling
    import train

    out, _ = run_dir
    assert train.main(["plot", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "metrics.png")
    png_ok(out / "metrics.png", (1000, 650))
    png = tmp_path / "latency.png"
    assert profiling.main(["latency", "--arch", "tiny", "--pv", "2", "--pl", "2", "--baseline", "--batch", "1", "2",
                           "--new-tokens", "2", "--iters", "1", "--warmup", "0", "--tiles", "1", "--text-tokens", "8",
                           "--plot", str(png), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {(r["pv"], r["batch"]) for r in rows} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    png_ok(png, (1000, 400))


def test_plots_without_matplotlib_are_one_line(run_dir, tmp_path, capsys, monkeypatch):
    import profiling
    import train

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    out, _ = run_dir
    assert train.main(["plot", str(out), "--out", str(tmp_path / "m.png")]) == 1
    assert one_line(capsys.readouterr().err) == ("error: matplotlib is not installed (it draws the plot): "
                                                 "pip install matplotlib")
    assert profiling.main(["latency", "--arch", "tiny", "--plot", str(tmp_path / "l.png")]) == 1  # before measuring
    assert "pip install matplotlib" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "m.png").exists() and not (tmp_path / "l.png").exists()
    assert train.main(["plot", str(tmp_path)]) == 1
    assert "metrics.jsonl: no such file" in one_line(capsys.readouterr().err)


def test_every_flag_has_help(monkeypatch, capsys):
    import profiling
    import train

    seen, command = [], [None]
    real = __import__("argparse").ArgumentParser.add_argument

    def record(self, *names, **kw):
        seen.append((command[0], names, kw.get("help")))
        return real(self, *names, **kw)

    monkeypatch.setattr("argparse.ArgumentParser.add_argument", record)
    for command[0], module, argv in (("generate", generate, ["--help"]), ("train", train, ["--help"]),
                                     ("profiling", profiling, ["--help"]), ("plot", train, ["plot", "--help"])):
        with pytest.raises(SystemExit):
            parse_flags(module, argv)
    capsys.readouterr()
    assert {c for c, _, _ in seen} == {"generate", "train", "profiling", "plot"}
    assert len([1 for c, _, _ in seen if c == "profiling"]) > 30  # every subcommand's flags, built before --help exits
    missing = [(c, names) for c, names, help_ in seen if names != ("-h", "--help") and not help_]
    assert not missing, missing  # train's test-only flags carry argparse.SUPPRESS, which is a help value
    generate_help = {names[0]: h for c, names, h in seen if c == "generate"}
    assert "tokens" in generate_help["--max-new-tokens"] and "(0, 1]" in generate_help["--top-p"]
