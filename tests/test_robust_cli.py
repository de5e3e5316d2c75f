"""Nothing lost, nothing raw, for generate.py, profiling.py and images: one line (no traceback) for every failure, the
exit codes (0 ok, 1 bad input or failure, 2 usage, 130 interrupted), Ctrl-C that stops an answer
and not the chat, refused chat turns that keep the session, text-only chat, 16-bit greyscale and
multi-frame images. In-process (generate.main, profiling.main) where it can be: much cheaper."""
import io
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import engine
import generate
import processor
import profiling
from checkpoint import CheckpointError
from conftest import ROOT, one_line, parse_flags, tree
from hub import resolve_model
from processor import Tokenizer, load_image, open_rgb


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8)).save(path)
    return path


def gen_main(capsys, *args) -> tuple[int, str, str]:
    code = generate.main([str(a) for a in args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.parametrize("device", ["tpu9", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="--device cuda is a good device where CUDA exists")), "cuda:99"])
def test_bad_device_is_one_precise_line(model_dir, png, capsys, device):
    """A --device that names no device is a bad flag (exit 2, as in every command); one this machine lacks is
    found at the start (exit 1), before any checkpoint file is read."""
    if device == "tpu9":
        with pytest.raises(SystemExit) as e:
            gen_main(capsys, png, "q", "--model", model_dir, "--device", device)
        code, err = e.value.code, capsys.readouterr().err
    else:
        code, _, err = gen_main(capsys, png, "q", "--model", model_dir, "--device", device)
    line = one_line(err)
    assert code == (2 if device == "tpu9" else 1), line
    assert f"--device {device}" in line.replace("'", "") and "safetensors" not in line, line
    assert ("not a device" if device == "tpu9" else "CUDA") in line


def test_image_without_question_is_a_usage_error(model_dir, png, capsys):
    with pytest.raises(SystemExit) as e:
        generate.main([str(png), "--model", str(model_dir)])
    line = one_line(capsys.readouterr().err)
    assert e.value.code == 2 and "no question" in line, line
    assert parse_flags(generate, ["What is in cat.jpg", "--model", str(model_dir)]).inputs == ["What is in cat.jpg"]


def test_lfs_pointer_and_run_folder_are_named(model_dir, png, tmp_path, capsys):
    lfs = tmp_path / "lfs"
    shutil.copytree(model_dir, lfs)
    (lfs / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 42\n")
    code, _, err = gen_main(capsys, png, "q", "--model", lfs)
    assert code == 1 and "git-LFS pointer" in one_line(err) and "header too large" not in err, err
    run = tmp_path / "run"  # what train.py --out leaves: checkpoints, and the export at the end
    shutil.copytree(model_dir, run / "export")
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    (run / "checkpoints" / "step_3" / "done").write_text("")
    (run / "config.json").write_text(json.dumps({"model": str(model_dir),
                                                 "out": str(run)}))  # train.py's, not a model's
    before = tree(run)
    code, _, err = gen_main(capsys, png, "q", "--model", run)
    assert code == 1 and one_line(err) == (f"error: {run}: a training run folder, not a model; "
                                           f"its model is {run / 'export'}")
    shutil.rmtree(run / "export")
    with pytest.raises(CheckpointError, match="no export yet"):
        resolve_model(str(run))
    assert tree(run) == {k: v for k, v in before.items() if not k.startswith("export")}


def test_sixteen_bit_grey_png_is_scaled_not_clipped(tmp_path):
    grey = (np.arange(48 * 64, dtype=np.uint32).reshape(48, 64) * 21).astype(np.uint16)  # 0..64491
    Image.fromarray(grey).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    rgb = np.asarray(open_rgb(tmp_path / "g16.png"))
    assert rgb.shape == (48, 64, 3) and (rgb == (grey >> 8)[..., None]).all()  # value >> 8, every channel
    assert (rgb == 255).mean() < 0.01  # convert("RGB") made 99.6 % of it white
    assert load_image(tmp_path / "g16.png", max_tiles=1).shape == (1, 3, 448, 448)


@pytest.mark.parametrize("fmt", ["gif", "tiff"])
def test_multi_frame_images_use_the_first_frame_and_say_so(tmp_path, capsys, fmt):
    frames = [Image.new("RGB", (40, 30), (200 * (k == 0), 100 * k, 0)) for k in range(3)]
    path = tmp_path / f"anim.{fmt}"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    rgb = np.asarray(open_rgb(path))
    assert tuple(rgb[0, 0]) == (200, 0, 0)  # the first frame
    assert one_line(capsys.readouterr().err) == f"note: {path} has 3 frames (animated or multi-page); using the first"


# -- generation and chat: Ctrl-C, refused turns, text only ------------------------------------------


def interrupt_at(monkeypatch, step: int, on_call: int = 1):
    """Ctrl-C in the middle of the `on_call`-th answer, after `step` streamed tokens."""
    real, calls = generate.Streamer.__call__, {"n": 0}
    real_init = generate.Streamer.__init__

    def init(self, *a, **k):
        calls["n"] += 1
        self.call_no = calls["n"]
        real_init(self, *a, **k)

    def call(self, i, tokens):
        if self.call_no == on_call and i == step:
            raise KeyboardInterrupt
        return real(self, i, tokens)

    monkeypatch.setattr(generate.Streamer, "__init__", init)
    monkeypatch.setattr(generate.Streamer, "__call__", call)


def test_ctrl_c_stops_the_answer_cleanly(model_dir, png, capsys, monkeypatch):
    interrupt_at(monkeypatch, step=3)
    code, out, err = gen_main(capsys, png, "What is it?", "--model", model_dir, "--max-new-tokens", 8, "--max-tiles", 1,
                              "--json")
    assert code == 130 and "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted by SIGINT", err
    line = json.loads(out)
    assert line["interrupted"] is True and line["new_tokens"] <= 3  # at most the three tokens before Ctrl-C


def test_chat_text_only_survives_refused_turns_and_ctrl_c(model_dir, capsys, monkeypatch):
    prompts = []
    real_generate = engine.Engine.generate

    def spy(self, batch, *a, **k):
        prompts.append(batch[0])
        return real_generate(self, batch, *a, **k)

    monkeypatch.setattr(engine.Engine, "generate", spy)
    interrupt_at(monkeypatch, step=2, on_call=2)  # the second answer is cut short
    questions = ["Hello?", "Where is <image> here?", "Tell me more.", "Last one."]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(q + "\n" for q in questions)))
    # no image: a text-only session
    code, out, err = gen_main(capsys, "--chat", "--model", model_dir, "--max-new-tokens", 4, "--max-tiles", 1)
    assert code == 0 and "Traceback" not in err, err
    notes = [x for x in err.splitlines() if x.startswith(("error", "interrupted"))]
    assert len(notes) == 2 and "placeholder" in notes[0] and "turn dropped" in notes[0], notes
    assert notes[1] == "interrupted: answer stopped (the conversation goes on)", notes
    tok = Tokenizer.from_pretrained(model_dir)
    assert len(prompts) == 3  # every turn but the refused one reached the engine
    last = tok.decode(prompts[-1])
    assert "Hello?" in last and "Tell me more." in last and "Last one." in last and "<image>" not in last


def test_chat_refuses_a_too_long_turn_and_goes_on(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("x " * 41000 + "\nAgain\n"))  # > the 40960-position context
    code, out, err = gen_main(capsys, "--chat", "--model", model_dir, "--max-new-tokens", 3)
    notes = [x for x in err.splitlines() if x.startswith("error")]
    assert code == 0 and "Traceback" not in err and len(notes) == 1, err
    assert "exceeds the model context" in notes[0] and "turn dropped" in notes[0], notes
    assert len([x for x in err.splitlines() if x.startswith("load_s=")]) == 1  # the next turn was answered


def test_ctrl_c_at_the_chat_prompt_ends_the_session(model_dir, capsys, monkeypatch):
    def ctrl_c(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", ctrl_c)
    code, _, err = gen_main(capsys, "--chat", "--model", model_dir, "--max-new-tokens", 3)
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted by SIGINT" and "Traceback" not in err


# -- profiling.py ----------------------------------------------------------------------------------


def test_profiling_closed_pipe_and_bad_device(capsys):
    proc = subprocess.Popen([sys.executable, str(ROOT / "profiling.py"), "params"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head` that has read enough
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == "", err
    with pytest.raises(SystemExit) as e:  # a flag that names no device: exit 2, as in every command
        profiling.main(["latency", "--device", "tpu9"])
    assert e.value.code == 2 and "not a device" in one_line(capsys.readouterr().err)


# -- a checkpoint whose decoder or tokenizer this code does not run: refused at load, by every command ---


@pytest.fixture(scope="module")
def spoiled(model_dir, tmp_path_factory):
    """Copies of the tiny checkpoint with one thing wrong in config.json, and what each refusal names."""
    tok = Tokenizer.from_pretrained(model_dir)
    img = tok.token_to_id("<IMG_CONTEXT>")
    cases = {
        "llama": (lambda c: c["llm_config"].update(architectures=["LlamaForCausalLM"]),
                  ["llm_config.architectures 'LlamaForCausalLM' is not a supported decoder", "Qwen3ForCausalLM",
                   "Qwen2ForCausalLM"]),
        "qwen2-named-qwen3": (lambda c: c["llm_config"].update(architectures=["Qwen2ForCausalLM"]),
                              ["llm_config.model_type 'qwen3'", "does not match architectures 'Qwen2ForCausalLM'"]),
        "other-tokenizer": (lambda c: c.update(image_token_id=img + 1),
                            [f"<IMG_CONTEXT> = {img}", f"image_token_id = {img + 1}", "config.json", "tokenizer in"]),
        "small-vocabulary": (lambda c: c["llm_config"].update(vocab_size=tok.vocab_size - 1),
                             [f"has {tok.vocab_size} tokens", f"embeds only {tok.vocab_size - 1}"]),
    }
    out = {}
    for name, (spoil, needles) in cases.items():
        folder = tmp_path_factory.mktemp(name) / "ckpt"
        shutil.copytree(model_dir, folder)
        config = json.loads((folder / "config.json").read_text())
        spoil(config)
        (folder / "config.json").write_text(json.dumps(config))
        out[name] = (folder, needles)
    return out


@pytest.mark.parametrize("case", ["llama", "qwen2-named-qwen3", "other-tokenizer", "small-vocabulary"])
def test_a_checkpoint_this_code_cannot_run_is_refused_by_every_command(spoiled, png, tmp_path, capsys, case):
    import evaluate
    import router
    import train
    from conftest import png_b64, write_dataset, write_tsv

    folder, needles = spoiled[case]
    meta = write_dataset(tmp_path / "d", rows=4)
    tsv = write_tsv(tmp_path / "t.tsv",
                    [{"index": "0", "question": "Read it.", "answer": "['x']", "image": png_b64(16, 16, 5)}])
    commands = {
        "generate.py": lambda: generate.main([str(png), "q", "--model", str(folder)]),
        "train.py": lambda: train.main(["--validate-data", "--model", str(folder), "--data", str(meta),
                                        "--num-workers", "0"]),
        "evaluate.py run": lambda: evaluate.main(["run", "--benchmark", "TextVQA_VAL", "--data", str(tsv), "--model",
                                                  str(folder),
                                                  "--out", str(tmp_path / "p.jsonl")]),
        "router.py label": lambda: router.main(["label", "--model", str(folder), "--data", str(meta), "--out",
                                                str(tmp_path / "labels"), "--num-workers", "0"]),
    }
    for name, command in commands.items():
        code = command()
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], (name, err)
        assert all(n in err[0] for n in needles), (name, err[0])
    assert not (tmp_path / "p.jsonl").exists() and not (tmp_path / "labels").exists()


def test_answers_skip_special_tokens_as_the_official_chat_does(model_dir, png, capsys, monkeypatch):
    """A special token the model generates (<img> here) is not printed: generate.py decodes answers as
    InternVL's chat() and evaluate.py do (processor.Tokenizer.answer: skip_special_tokens, the text
    before <|im_end|>, stripped)."""
    import engine
    from checkpoint import open_checkpoint

    _, tok = open_checkpoint(model_dir)
    ids = tok.encode("Hello") + [tok.token_to_id("<img>")] + tok.encode(" there")
    monkeypatch.setattr(engine.Engine, "generate", lambda self, *a, **kw: engine.Result(tokens=[ids]))
    code, out, err = gen_main(capsys, png, "q", "--model", model_dir, "--json")
    answer = json.loads(out.splitlines()[-1])["answer"]
    assert code == 0 and "<img>" not in answer and answer == tok.decode(ids,
                                                                        skip_special_tokens=True).strip(), (answer, err)


def test_a_flag_out_of_range_exits_2_in_every_command(model_dir, png, tmp_path, capsys):
    """One convention: a flag's value out of range (or flags that exclude each other) is a usage error,
    exit 2 with one line naming the flag, as argparse's own are; a file that is wrong is bad input, 1."""
    import evaluate
    import router
    import train

    m, d = str(model_dir), str(tmp_path / "meta.json")
    cases = {
        "generate.py": (generate.main, [str(png), "q", "--model", m, "--max-new-tokens", "0"], "--max-new-tokens"),
        "train.py": (train.main, ["--model", m, "--data", d, "--out", str(tmp_path / "r"), "--warmup-ratio", "1"],
                     "--warmup-ratio"),
        "train.py frac": (train.main,
                          ["--model", m, "--data", d, "--out", str(tmp_path / "r"), "--max-bad-frac", "1.5"],
                          "--max-bad-frac must be in [0, 1], got 1.5"),
        "train.py resume": (train.main,
                            ["--model", m, "--data", d, "--out", str(tmp_path / "r"), "--resume", "--overwrite"],
                            "pass one of them"),
        "router.py label": (router.main,
                            ["label", "--model", m, "--data", d, "--out", str(tmp_path / "l"), "--batch-size", "0"],
                            "--batch-size"),
        "router.py label frac": (router.main, ["label", "--model", m, "--data", d, "--out", str(tmp_path / "l"),
                                               "--max-bad-frac", "-0.1"], "--max-bad-frac"),
        "router.py train": (router.main,
                            ["train", "--model", m, "--labels", m, "--out", str(tmp_path / "t"), "--tau", "0"],
                            "--tau"),
        "evaluate.py run": (evaluate.main, ["run", "--benchmark", "TextVQA_VAL", "--data", d, "--model", m, "--out",
                                            str(tmp_path / "p.jsonl"), "--batch-size", "0"], "--batch-size"),
        "profiling.py": (profiling.main, ["latency", "--batch", "0"], "--batch"),
        "profiling.py params": (profiling.main, ["params", "--pv", "0"], "--pv"),
        "evaluate.py lengths": (evaluate.main, ["lengths", "--model", m, "--a", d, "--b", d, "--resamples", "0"],
                                "--resamples"),
        "evaluate.py run --random-pair": (evaluate.main,
                                          ["run", "--benchmark", "TextVQA_VAL", "--data", d, "--model", m, "--out",
                                                          str(tmp_path / "p.jsonl"), "--random-pair", "--shared-kv"],
                                                          "--shared-kv"),
    }
    for name, (main, argv, needle) in cases.items():
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and needle in err[0] and err[0].endswith("(see --help)"), (name, err)
    assert not any((tmp_path / n).exists() for n in ("r", "l", "t", "p.jsonl"))


def test_branch_flags_that_cannot_mean_anything_exit_2(model_dir, tmp_path, capsys):
    """Issue 29, item 4: LoRA vision branches at Pv 1 (there is no branch to adapt), no prefix tokens at
    Pv or Pl > 1 with prefix branches (every branch computes the same states: the aggregator only weighs
    them), a LoRA rank above the ViT's width (a low-rank update of a C-wide linear has rank <= C). One
    line, exit 2, at parse time where the flags alone say it, else once the checkpoint's values are read
    (named as its own), before anything is written. main accepted each of them."""
    import train

    width = json.loads((model_dir / "config.json").read_text())["vision_config"]["hidden_size"]
    args = ["--model", str(model_dir), "--data", str(tmp_path / "meta.json"), "--out", str(tmp_path / "r")]
    (tmp_path / "meta.json").write_text("{}")
    lora1 = "needs --pv 2 or more: LoRA vision branches are one low-rank update of the ViT per branch, and at --pv 1"
    cases = [(["--vision-branches", "lora", "--pv", "1"], f"error: --vision-branches lora {lora1} there is "
              "no branch to create one for (see --help)"),
             (["--vision-branches", "lora"], f"error: --vision-branches lora {lora1} ({model_dir}'s) there is no "
              "branch to create one for"),
             (["--vit-prefix-len", "0", "--pv", "2"], "error: --vit-prefix-len 0 at --pv 2: with no prefix tokens "
              "every vision branch computes the same states; give --vit-prefix-len 1 or more, or --vision-branches "
              "lora"),
             (["--llm-prefix-len", "0", "--pl", "3"], "error: --llm-prefix-len 0 at --pl 3: with no prefix "
              "tokens every language branch computes the same states; give --llm-prefix-len 1 or more (see --help)"),
             (["--pv", "2", "--vision-branches", "lora", "--lora-rank", str(width + 1)],
              f"error: --lora-rank {width + 1} is more than the ViT's width {width}: a low-rank update of a "
              f"{width}-wide linear has rank at most {width}")]
    for flags, line in cases:
        try:
            code = train.main(args + flags)
        except SystemExit as e:
            code = e.code
        got = capsys.readouterr().err.strip()  # a flag error found while parsing starts with the program's name
        assert code == 2 and (got == line or got.endswith(f": {line}") and line.endswith("(see --help)")), got
    with pytest.raises(SystemExit) as e:
        profiling.main(["params", "--vision-branches", "lora"])
    assert e.value.code == 2 and f"--vision-branches lora {lora1} there is no" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    # what does differentiate branches passes: LoRA branches need no prefix, and a rank of the width is whole
    assert parse_flags(train, args + ["--pv", "2", "--vision-branches", "lora", "--vit-prefix-len", "0"]).pv == 2
    assert profiling.main(["params", "--pv", "2", "--vision-branches", "lora", "--lora-rank", "1024", "--json"]) == 0


def test_a_bad_branch_value_in_an_export_config_names_the_file_and_the_field(model_dir, png, tmp_path, capsys):
    """Issue 29, item 10: the "parvl" block an export's config.json carries, with a value out of range, of
    the wrong type or a field that does not exist: exit 1, one line naming config.json and the field
    (main: "lora_rank must be >= 1, got 0" naming no file, or a TypeError traceback)."""
    folder = tmp_path / "export"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    path = folder / "config.json"
    for par, line in [({"lora_rank": 0}, f"error: {path}: parvl.par.lora_rank must be >= 1, got 0"),
                      ({"pv": "2"}, f"error: {path}: parvl.par.pv must be a number (an integer), got '2'"),
                      ({"pv": 2, "prefix": 3}, f"error: {path}: parvl.par has no field 'prefix' (its fields: pv, pl, "
                       "vit_prefix_len, llm_prefix_len, lambda_v, lambda_l, aggregation, vision_branches, lora_rank)")]:
        path.write_text(json.dumps(config | {"parvl": {"par": par}}))
        code, _, err = gen_main(capsys, png, "q", "--model", folder)
        assert (code, err.strip()) == (1, line)


def test_a_tile_budget_past_the_context_is_refused_before_tiling(model_dir, tmp_path, capsys, monkeypatch):
    """--max-tiles 10000 on a 2000:1 image (a 2000 x 1 grid): the grid is chosen in
    O(max_tiles log max_tiles) and the prompt's length, known from it, is refused against the context
    before one tile is resized (the triple loop and the 2001 tiles took minutes and gigabytes)."""
    from checkpoint import open_checkpoint

    wide = tmp_path / "wide.png"
    Image.fromarray(np.full((2, 4000, 3), 128, dtype=np.uint8)).save(wide)
    monkeypatch.setattr(processor, "tile_image", lambda *a, **k: pytest.fail("tiled before the context check"))
    mcfg, _ = open_checkpoint(model_dir)
    code, _, err = gen_main(capsys, wide, "q", "--model", model_dir, "--max-tiles", 10000, "--max-new-tokens", 4)
    line = one_line(err)
    n = int(line.split("prompt of ")[1].split()[0])
    assert code == 1 and line == (f"error: prompt of {n} tokens (image tokens included) + 4 new tokens exceeds the "
                                  f"model context of {mcfg.llm.max_position_embeddings}"), line
    assert processor.tile_grid(4000, 2, 10000) == (2000,
                                                   1) and n > 2001 * mcfg.tokens_per_tile  # 2000 tiles + thumbnail


def test_tile_grid_large_budgets_keep_the_official_candidate_order():
    """The grid enumeration that replaced the official triple loop gives the official answer past
    the budgets the other tests sweep, exact ties included (aspects midway between two grids)."""
    from test_processor import ref_grid

    for max_tiles, min_tiles in ((64, 1), (90, 7), (120, 30)):
        for w, h in ((5, 2), (7, 3), (3, 1), (1, 9), (448 * 5, 448 * 4), (13, 12), (2000, 3), (59, 2)):
            for k in (1, 300):
                assert processor.tile_grid(w * k, h * k, max_tiles, min_tiles) == ref_grid(w * k, h * k, min_tiles,
                                                                                           max_tiles)
