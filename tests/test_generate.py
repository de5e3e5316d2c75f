"""The engine and generate.py. The engine: cached decoding equals a full recompute, batched equals alone,
stopping, compiled equals eager, the CPU decode backend, sampling reproducible by seed, streaming. InternVL's
chat() / batch_chat() on the engine. The command: one answer end to end (transformers' greedy tokens), its
bad inputs and devices, answers decoded as the official chat() decodes them; --chat (refused turns, text
only, Ctrl-C in an answer and at the prompt, SIGTERM); --batch (equal to one-by-one answers, resumable,
interrupted, bad rows). Greedy tokens against transformers' generate: test_equivalence.py; ParVL branches
in generation: test_branches.py."""

import copy
import io
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from commands import gen_main, one_line, parse_flags, run_main
from inputs import first_decode_step, random_pixels
from official import hf_greedy
from PIL import Image

import generate
from data.processor import Tokenizer, build_prompt, load_image
from generate import Streamer
from inference import chat, engine
from inference.cpu_decode import GEMV_ROWS, cpu_backend
from inference.engine import Engine, GenerateConfig, decode_one_token
from loading.pretrained import load_pretrained

ROOT = Path(__file__).resolve().parents[1]


NEW = 10  # new tokens per test: enough to cover several cached steps, cheap on CPU


@pytest.fixture(scope="module")
def qwen3(checkpoint):
    folder = checkpoint("qwen3", "original")
    return folder, load_pretrained(folder), Tokenizer.from_pretrained(folder)


# -- the engine ----------------------------------------------------------------------------------------


def test_cached_decode_equals_full_recompute(qwen3, monkeypatch):
    from inference import engine as engine_module

    _, model, tok = qwen3
    ids = tok.encode(build_prompt("Describe the image.", [2]))
    pv = random_pixels(2, seed=2)
    engine = Engine(model)
    logits_seen = []
    # the eager step calls it by name: record every step's logits
    orig = engine_module.decode_one_token
    monkeypatch.setattr(
        engine_module,
        "decode_one_token",
        lambda *a: logits_seen.append(orig(*a)) or logits_seen[-1],
    )
    tokens = engine.generate(
        [ids], pv, GenerateConfig(max_new_tokens=NEW, ignore_eos=True), tok.eos_ids
    ).tokens[0]
    # full recompute: the whole sequence (prompt with image features + generated tokens) every step
    with torch.no_grad():
        prompt, _ = model.embed(torch.tensor([ids]), pv)
        for i, t in enumerate(tokens):
            gen = model.language_model.model.embed_tokens(
                torch.tensor([tokens[:i]], dtype=torch.long)
            )
            x = torch.cat([prompt, gen], dim=1)
            logits = model.language_model.lm_head(
                model.hidden_from_embeds(x, torch.arange(x.shape[1])[None])[0]
            )[0, -1]
            assert int(logits.argmax()) == t, f"step {i}"
            if i > 0:  # decode step i-1 produced the logits for token i
                # fp32, same ops in a different order (SDPA over a masked cache vs causal kernel): ~1e-6
                torch.testing.assert_close(logits_seen[i - 1][0], logits, atol=1e-4, rtol=1e-4)


def test_batched_equals_alone(qwen3):
    _, model, tok = qwen3
    prompts = [([2], "Describe the image in detail, please."), ([], "Hi"), ([1], "What?")]
    engine = Engine(model)
    cfg = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
    ids = [tok.encode(build_prompt(q, t)) for t, q in prompts]
    pvs = [random_pixels(sum(t), seed=3 + i) if t else None for i, (t, _) in enumerate(prompts)]
    alone = [engine.generate([i], pv, cfg, tok.eos_ids).tokens[0] for i, pv in zip(ids, pvs)]
    batched = engine.generate(
        ids, torch.cat([p for p in pvs if p is not None]), cfg, tok.eos_ids
    ).tokens
    assert batched == alone


def test_stops_on_eos_and_budget(qwen3):
    _, model, tok = qwen3
    ids = tok.encode(build_prompt("Hi", []))
    engine = Engine(model)
    free = engine.generate(
        [ids], None, GenerateConfig(max_new_tokens=NEW, ignore_eos=True), tok.eos_ids
    ).tokens[0]
    # declare the 4th generated token a stop token: generation ends right before it
    stop = free[3]
    first = free.index(stop)
    cut = engine.generate(
        [ids], None, GenerateConfig(max_new_tokens=NEW, check_every=1), [stop]
    ).tokens[0]
    assert cut == free[:first]
    forced = engine.generate(
        [ids], None, GenerateConfig(max_new_tokens=NEW, ignore_eos=True), [stop]
    ).tokens[0]
    assert forced == free and len(forced) == NEW


def test_compiled_decode_equals_eager(qwen3):
    _, model, tok = qwen3
    ids = tok.encode(build_prompt("Describe the image.", [1]))
    pv = random_pixels(1, seed=4)
    cfg = GenerateConfig(max_new_tokens=6, ignore_eos=True)
    eager = Engine(model).generate([ids], pv, cfg, tok.eos_ids).tokens
    assert Engine(model, compile=True).generate([ids], pv, cfg, tok.eos_ids).tokens == eager
    # and the step itself, compiled with fullgraph=True (no graph break), on the same cache state
    step = first_decode_step(model, ids, pv)
    with torch.no_grad():
        eager_logits = decode_one_token(model, *step)
        # as Engine on CPU
        compiled = torch.compile(decode_one_token, backend=cpu_backend, fullgraph=True)
        compiled_logits = compiled(model, *step)  # rewrites the same slot
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5)


def test_compiled_bf16_decode_step_equals_eager(qwen3):
    """In bf16 the compiled step reads the weights as words (cpu_decode.bf16_gemv), eager through ATen's
    gemv; both sum in fp32 and round each linear's output to bf16 once, in another order: the logits
    differ where a rounding fell the other way."""
    _, model, tok = qwen3
    model = copy.deepcopy(model).to(torch.bfloat16)
    ids = tok.encode(build_prompt("Describe the image.", [1]))
    step = first_decode_step(model, ids, random_pixels(1, seed=4).bfloat16())
    with torch.no_grad():
        eager_logits = decode_one_token(model, *step)
        # as Engine on CPU
        compiled = torch.compile(decode_one_token, backend=cpu_backend, fullgraph=True)
        compiled_logits = compiled(model, *step)
    # the logits are bf16: two units in the last place at their largest magnitude (one rounding of the
    # head's output on each side, and the head's input a bf16 rounding apart)
    ulp = 2.0 ** (torch.floor(torch.log2(eager_logits.float().abs().max())) - 7)
    torch.testing.assert_close(
        compiled_logits.float(), eager_logits.float(), atol=2 * ulp.item(), rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_backend_rewrites_few_row_linears(dtype):
    """The CPU decode backend turns exactly the fp32 and bf16 linears of <= GEMV_ROWS rows into gemv /
    bf16_gemv (a graph that stops matching would silently lose the speed-up; fp16 keeps ATen's), and
    each equals F.linear computed in fp32 on the same weights, with and without bias, rounded once to
    the dtype: within half a unit in the last place of the dtype (2^-8 relative for bf16) plus fp32's
    summation error."""
    from inference.cpu_decode import bf16_gemv, gemv

    torch.manual_seed(0)
    w, b = torch.randn(48, 32, dtype=dtype), torch.randn(48, dtype=dtype)
    x_few, x_many = (
        torch.randn(1, GEMV_ROWS, 32, dtype=dtype),
        torch.randn(3, GEMV_ROWS, 32, dtype=dtype),
    )
    targets = []

    def spy(gm, example_inputs):
        compiled = cpu_backend(gm, example_inputs)  # rewrites gm in place
        targets.extend(
            n.target
            for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (gemv, bf16_gemv, F.linear)
        )
        return compiled

    def linears(x_few, x_many):
        return F.linear(x_few, w), F.linear(x_few, w, b), F.linear(x_many, w, b)

    got = torch.compile(linears, backend=spy, fullgraph=True)(x_few, x_many)
    # the 3 x GEMV_ROWS rows stay with the BLAS
    few = {torch.float32: gemv, torch.bfloat16: bf16_gemv, torch.float16: F.linear}[dtype]
    assert targets == [few, few, F.linear], targets
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
    for have, (x, bias) in zip(got, [(x_few, None), (x_few, b), (x_many, b)]):
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        torch.testing.assert_close(have.float(), want, atol=1e-5, rtol=rtol)
    if few is not F.linear:  # any rows, eager too
        torch.testing.assert_close(few(x_many, w, b), F.linear(x_many, w, b), atol=1e-5, rtol=rtol)


def test_seed_reproduces_sampling_and_stream_concatenates(qwen3):
    _, model, tok = qwen3
    ids = tok.encode(build_prompt("Write a poem.", []))
    engine = Engine(model)
    cfg = GenerateConfig(max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.9)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        pieces = []
        streamer = Streamer(tok, write=pieces.append)
        res = engine.generate([ids], None, cfg, tok.eos_ids, callback=streamer)
        streamer.finish()
        runs.append((res.tokens[0], pieces))
    assert runs[0][0] == runs[1][0]
    torch.manual_seed(124)
    other = engine.generate([ids], None, cfg, tok.eos_ids).tokens[0]
    assert other != runs[0][0], "a different seed should sample differently"
    assert "".join(runs[0][1]) == tok.answer(runs[0][0]) + "\n"


# -- chat() and batch_chat() ---------------------------------------------------------------------------


CFG = dict(max_new_tokens=6, do_sample=False)  # as InternVL's examples pass it


def engine_answer(model, tok, prompts: list[str], pixels, n: int = 6) -> list[str]:
    out = Engine(model).generate(
        [tok.encode(p) for p in prompts], pixels, GenerateConfig(max_new_tokens=n), tok.eos_ids
    )
    return [tok.decode(t, skip_special_tokens=True).strip() for t in out.tokens]


def test_chat_equals_the_engine_and_keeps_the_official_history(qwen3, monkeypatch):
    _, model, tok = qwen3
    pv = random_pixels(2, seed=5)
    seen = []  # the prompts chat() hands the engine (the tiny model's answers alone tell little apart)
    real_generate = Engine.generate
    monkeypatch.setattr(
        Engine,
        "generate",
        lambda self, prompts, *a, **k: (
            seen.append(prompts) or real_generate(self, prompts, *a, **k)
        ),
    )
    first, history = chat.chat(model, tok, pv, "What is it?", dict(CFG), return_history=True)
    q1 = "<image>\nWhat is it?"  # as the official chat() stores a first question without a placeholder
    assert history == [(q1, first)] and seen[0] == [tok.encode(build_prompt(q1, [2]))]
    assert [first] == engine_answer(model, tok, [build_prompt(q1, [2])], pv)
    engine = model.engine
    second, history2 = chat.chat(
        model, tok, pv, "And the colour?", dict(CFG), history=history, return_history=True
    )
    assert history2 == [(q1, first), ("And the colour?", second)] and history == [(q1, first)]
    assert [second] == engine_answer(
        model, tok, [build_prompt("And the colour?", [2], history=history)], pv
    )
    assert seen[2] == seen[3]  # chat's second turn and the engine call of the expected prompt
    assert model.engine is engine  # one engine per model
    multi = "Image-1: <image>\nImage-2: <image>\nWhat differs?"
    pv3 = random_pixels(3, seed=6)
    assert [chat.chat(model, tok, pv3, multi, CFG, num_patches_list=[2, 1])] == engine_answer(
        model, tok, [build_prompt(multi, [2, 1])], pv3
    )
    assert [chat.chat(model, tok, None, "Hi", CFG)] == engine_answer(
        model, tok, [build_prompt("Hi", [])], None
    )
    with pytest.raises(ValueError, match="sums to 2"):
        chat.chat(model, tok, pv3, "q", CFG, num_patches_list=[1, 1])
    with pytest.raises(ValueError, match="num_beams"):
        chat.chat(model, tok, pv, "q", dict(CFG, num_beams=4))


def test_generation_config_maps_like_transformers():
    to = chat.to_generate_config
    assert to(dict(max_new_tokens=9, do_sample=False, temperature=0.7)) == GenerateConfig(
        max_new_tokens=9
    )
    assert to(dict(do_sample=True, temperature=0.7)) == GenerateConfig(
        temperature=0.7, top_k=50, top_p=1.0
    )
    assert to(dict(do_sample=True, top_p=0.8, top_k=None)) == GenerateConfig(
        temperature=1.0, top_k=50, top_p=0.8
    )
    with pytest.raises(ValueError, match="repetition_penalty"):
        to(dict(repetition_penalty=1.1))


def test_batch_chat_equals_one_by_one_chat_and_the_engine(qwen3, monkeypatch):
    _, model, tok = qwen3
    seen = []  # (prompts, pixels) of each engine call
    real_generate = Engine.generate
    monkeypatch.setattr(
        Engine,
        "generate",
        lambda self, prompts, pv, *a, **k: (
            seen.append((prompts, pv)) or real_generate(self, prompts, pv, *a, **k)
        ),
    )
    pv = torch.cat([random_pixels(2, seed=7), random_pixels(1, seed=8)])
    questions = ["Describe the image in detail.", "Hi", "<image>\nWhat?"]
    got = chat.batch_chat(model, tok, pv, questions, dict(CFG), num_patches_list=[2, 0, 1])
    assert got == [
        chat.chat(model, tok, pv[:2], questions[0], CFG),
        chat.chat(model, tok, None, questions[1], CFG),
        chat.chat(model, tok, pv[2:], questions[2], CFG),
    ]
    prompts = [
        build_prompt("<image>\n" + questions[0], [2]),
        build_prompt("Hi", []),
        build_prompt(questions[2], [1]),
    ]
    assert got == engine_answer(model, tok, prompts, pv)
    # one batch: the expected prompts
    assert seen[0][0] == seen[-1][0] and torch.equal(seen[0][1], seen[-1][1])
    with pytest.raises(ValueError, match="no history"):
        chat.batch_chat(model, tok, pv, questions, CFG, num_patches_list=[2, 0, 1], history=[])
    with pytest.raises(ValueError, match="num_patches_list"):
        chat.batch_chat(model, tok, pv, questions, CFG)


# -- the command: one answer ---------------------------------------------------------------------------


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.fixture(scope="module")
def wide_png(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "photo.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (300, 700, 3), dtype=np.uint8)).save(path)
    return path


def test_cli_end_to_end(qwen3, reference, wide_png, capsys):
    folder, model, tok = qwen3
    res = run_cli(
        wide_png,
        "What is in the picture?",
        "--model",
        folder,
        "--max-new-tokens",
        NEW,
        "--max-tiles",
        2,
    )
    assert res.returncode == 0, res.stderr
    # the expected answer: transformers' greedy generate on the same prompt and pixels, stopped at eos
    pv = load_image(wide_png, max_tiles=2)
    ids = tok.encode(build_prompt("What is in the picture?", [pv.shape[0]]))
    ref = hf_greedy(reference("qwen3"), ids, pv, NEW)
    stop = next((i for i, t in enumerate(ref) if t in tok.eos_ids), len(ref))
    # as the official chat() decodes: special tokens skipped
    assert res.stdout.strip() == tok.answer(ref[:stop])
    assert "ttft_s=" in res.stderr and "decode_tok_s=" in res.stderr
    # --json in this process (one real start above is the end-to-end; a second adds only imports)
    assert (
        generate.main(
            [
                str(wide_png),
                "What is in the picture?",
                "--model",
                str(folder),
                "--max-new-tokens",
                str(NEW),
                "--max-tiles",
                "2",
                "--json",
            ]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out)
    assert (
        line["answer"] == res.stdout.strip()
        and line["new_tokens"] == stop
        and line["prompt_tokens"] == len(ids)
    )


def test_cli_bad_inputs(qwen3, wide_png, tmp_path, capsys):
    """In process (generate.main): the same exit code and stderr as the command, without five starts."""
    folder = qwen3[0]
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "model.safetensors").unlink()
    cases = {
        "missing.png": (tmp_path / "missing.png", "q", "--model", folder),
        "corrupt.png": (corrupt, "q", "--model", folder),
        "nowhere": (wide_png, "q", "--model", tmp_path / "nowhere"),
        "model.safetensors": (wide_png, "q", "--model", broken),
        "context": (wide_png, "q", "--model", folder, "--max-new-tokens", 40960),
    }
    for needle, args in cases.items():
        code = generate.main([str(a) for a in args])
        err = capsys.readouterr().err
        assert code != 0, needle
        lines = err.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (needle, err)


@pytest.mark.parametrize(
    "device",
    [
        "tpu9",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                torch.cuda.is_available(), reason="--device cuda is a good device where CUDA exists"
            ),
        ),
        "cuda:99",
    ],
)
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
    assert parse_flags(generate, ["What is in cat.jpg", "--model", str(model_dir)]).inputs == [
        "What is in cat.jpg"
    ]


def test_a_typed_img_context_is_refused_in_one_line(model_dir, capsys):
    """<IMG_CONTEXT> typed in a question, the token an image's features fill: one line saying to write
    <image> where an image goes."""
    code, err = run_main(
        capsys, generate.main, ["What is <IMG_CONTEXT> here?", "--model", model_dir]
    )
    assert code == 1 and err[-1] == (
        "error: the question holds <IMG_CONTEXT>, the token an image's features fill; "
        "write <image> where an image goes"
    ), err


def test_answers_skip_special_tokens_as_the_official_chat_does(model_dir, png, capsys, monkeypatch):
    """A special token the model generates (<img> here) is not printed: generate.py decodes answers as
    InternVL's chat() and evaluate.py do (processor.Tokenizer.answer: skip_special_tokens, the text
    before <|im_end|>, stripped)."""
    from inference import engine
    from loading.config_json import open_checkpoint

    _, tok = open_checkpoint(model_dir)
    ids = tok.encode("Hello") + [tok.token_to_id("<img>")] + tok.encode(" there")
    monkeypatch.setattr(
        engine.Engine, "generate", lambda self, *a, **kw: engine.Result(tokens=[ids])
    )
    code, out, err = gen_main(capsys, png, "q", "--model", model_dir, "--json")
    answer = json.loads(out.splitlines()[-1])["answer"]
    assert (
        code == 0
        and "<img>" not in answer
        and answer == tok.decode(ids, skip_special_tokens=True).strip()
    ), (answer, err)


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
    code, out, err = gen_main(
        capsys,
        png,
        "What is it?",
        "--model",
        model_dir,
        "--max-new-tokens",
        8,
        "--max-tiles",
        1,
        "--json",
    )
    assert (
        code == 130
        and "Traceback" not in err
        and err.strip().splitlines()[-1] == "interrupted by SIGINT"
    ), err
    line = json.loads(out)
    # at most the three tokens before Ctrl-C
    assert line["interrupted"] is True and line["new_tokens"] <= 3


# -- --chat --------------------------------------------------------------------------------------------


def test_chat_session_interrupts_through_the_shell(qwen3, capsys, monkeypatch):
    """--chat under cli.shell: Ctrl-C in an answer stops that answer and the session goes on; SIGTERM in
    an answer and Ctrl-C at the prompt end it, with the shell's line and code (143, 130)."""
    from shell import cli

    _, model, tok = qwen3
    args = SimpleNamespace(system=None, seed=0, json=False)
    real = generate.Streamer.__call__

    # answer number -> the signal raised at its step 1
    def session(questions: str, signals: dict[int, int]):
        answers = {"n": 0}

        def call(self, i, tokens):
            if i == 0:
                answers["n"] += 1
            if i == 1 and answers["n"] in signals:
                raise cli.Interrupted(signals[answers["n"]])
            return real(self, i, tokens)

        monkeypatch.setattr(generate.Streamer, "__call__", call)
        monkeypatch.setattr(sys, "stdin", io.StringIO(questions))
        code = cli.shell(
            lambda: generate.chat_session(
                Engine(model), tok, None, [], GenerateConfig(max_new_tokens=4), args
            )
        )
        return code, answers["n"], capsys.readouterr().err

    code, answered, err = session("Hello?\nAgain?\n", {1: signal.SIGINT})
    assert (code, answered) == (0, 2) and err.count(
        "interrupted: answer stopped (the conversation goes on)"
    ) == 1, err
    code, answered, err = session("Hello?\nAgain?\n", {1: signal.SIGTERM})
    assert (code, answered) == (143, 1) and err.splitlines()[-1] == "interrupted by SIGTERM", err
    assert "answer stopped" not in err

    def ctrl_c(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", ctrl_c)
    code, answered, err = session("", {})
    assert (code, answered) == (130, 0) and err == "\ninterrupted by SIGINT\n", err


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
    code, out, err = gen_main(
        capsys, "--chat", "--model", model_dir, "--max-new-tokens", 4, "--max-tiles", 1
    )
    assert code == 0 and "Traceback" not in err, err
    notes = [x for x in err.splitlines() if x.startswith(("error", "interrupted"))]
    assert len(notes) == 2 and "placeholder" in notes[0] and "turn dropped" in notes[0], notes
    assert notes[1] == "interrupted: answer stopped (the conversation goes on)", notes
    tok = Tokenizer.from_pretrained(model_dir)
    assert len(prompts) == 3  # every turn but the refused one reached the engine
    last = tok.decode(prompts[-1])
    assert (
        "Hello?" in last
        and "Tell me more." in last
        and "Last one." in last
        and "<image>" not in last
    )


def test_chat_refuses_a_too_long_turn_and_goes_on(model_dir, capsys, monkeypatch):
    # > the 40960-position context
    monkeypatch.setattr(sys, "stdin", io.StringIO("x " * 41000 + "\nAgain\n"))
    code, out, err = gen_main(capsys, "--chat", "--model", model_dir, "--max-new-tokens", 3)
    notes = [x for x in err.splitlines() if x.startswith("error")]
    assert code == 0 and "Traceback" not in err and len(notes) == 1, err
    assert "exceeds the model context" in notes[0] and "turn dropped" in notes[0], notes
    # the next turn was answered
    assert len([x for x in err.splitlines() if x.startswith("load_s=")]) == 1


def test_ctrl_c_at_the_chat_prompt_ends_the_session(model_dir, capsys, monkeypatch):
    def ctrl_c(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", ctrl_c)
    code, _, err = gen_main(capsys, "--chat", "--model", model_dir, "--max-new-tokens", 3)
    assert (
        code == 130
        and err.strip().splitlines()[-1] == "interrupted by SIGINT"
        and "Traceback" not in err
    )


# -- --batch -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    (root / "img").mkdir()
    rng = np.random.default_rng(1)
    for name, size in (("a.png", (60, 90)), ("b.png", (90, 40))):
        Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(root / "img" / name)
    rows = [
        {"image": "img/a.png", "question": "What is it?"},
        {"question": "Tell me a joke."},
        {"image": ["img/a.png", str(root / "img" / "b.png")], "question": "What differs?"},
        {"image": "img/b.png", "question": "Colour?"},
        {"image": "img/b.png", "question": "Shape?"},
    ]
    path = root / "questions.jsonl"
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in rows[:2])
        + "\n"
        + "".join(json.dumps(r) + "\n" for r in rows[2:])
    )
    return path, rows


FLAGS = ["--max-new-tokens", "5", "--max-tiles", "1"]


def test_batch_equals_one_by_one_and_resumes(qwen3, questions, tmp_path, capsys, monkeypatch):
    folder = qwen3[0]
    path, rows = questions
    out = tmp_path / "answers.jsonl"
    calls = []  # (prompts, pixel_values) of every engine call: the tiny model's answers alone tell little apart
    real_generate = Engine.generate
    monkeypatch.setattr(
        Engine,
        "generate",
        lambda self, prompts, pv, *a, **k: (
            calls.append((prompts, pv)) or real_generate(self, prompts, pv, *a, **k)
        ),
    )
    assert (
        generate.main(
            [
                "--batch",
                str(path),
                "--out",
                str(out),
                "--batch-size",
                "2",
                "--model",
                str(folder),
                *FLAGS,
            ]
        )
        == 0
    )
    batched, calls[:] = list(calls), []
    assert [len(p) for p, _ in batched] == [2, 2, 1]  # --batch-size rows per engine call
    err = capsys.readouterr().err
    assert "answered 5/5" in err and "samples/s" in err and "eta 0:00:00" in err
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["line"] for g in got] == [1, 2, 4, 5, 6]  # input order; the blank line 3 is skipped
    for g, row in zip(got, rows):  # every answer is the command's answer to that one question
        images = [row["image"]] if isinstance(row.get("image"), str) else row.get("image", [])
        assert (
            generate.main(
                [
                    *(str(path.parent / i) for i in images),
                    row["question"],
                    "--json",
                    "--model",
                    str(folder),
                    *FLAGS,
                ]
            )
            == 0
        )
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
    assert (
        generate.main(
            [
                "--batch",
                str(path),
                "--out",
                str(out),
                "--batch-size",
                "2",
                "--model",
                str(folder),
                *FLAGS,
            ]
        )
        == 0
    )
    assert "2 of 5 questions already answered; 3 to go" in capsys.readouterr().err
    assert out.read_text() == full
    out.write_text(lines[3] + lines[0])  # not a prefix: the result is still in input order
    assert (
        generate.main(
            [
                "--batch",
                str(path),
                "--out",
                str(out),
                "--batch-size",
                "4",
                "--model",
                str(folder),
                *FLAGS,
            ]
        )
        == 0
    )
    assert out.read_text() == full
    # default: stdout, the same rows
    assert (
        generate.main(["--batch", str(path), "--batch-size", "3", "--model", str(folder), *FLAGS])
        == 0
    )
    assert capsys.readouterr().out == full


def test_batch_interrupted_keeps_its_answers_and_says_how_to_resume(
    qwen3, questions, tmp_path, capsys, monkeypatch
):
    """Ctrl-C during the second batch: the first batch's answers stay, one line says so (130), and the
    same command answers the rest, giving the file an uninterrupted run gives."""
    folder, (path, _) = qwen3[0], questions
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
    assert (
        last == "interrupted by SIGINT: the answers written so far stay; the same command resumes"
    ), last
    assert len(out.read_text().splitlines()) == 2  # the first batch, whole
    monkeypatch.setattr(Engine, "generate", real_generate)
    assert generate.main([*flags, "--out", str(out)]) == 0
    assert out.read_text() == (tmp_path / "full.jsonl").read_text()


def test_batch_bad_input_is_one_line(qwen3, questions, tmp_path, capsys):
    folder = qwen3[0]
    path, _ = questions
    bad = tmp_path / "bad.jsonl"
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"line": 1, "question": "Something else", "answer": "x"}) + "\n")
    cases = {
        f"{bad} line 2: not JSON": ('{"question": "ok"}\n{"question": \n', "--batch", bad),
        f"{bad} line 1: no image file {tmp_path / 'gone.png'}": (
            '{"image": "gone.png", "question": "q"}\n',
            "--batch",
            bad,
        ),
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
    bad.write_text(
        json.dumps({"image": "broken.png", "question": "q"})
        + "\n"
        + json.dumps({"question": "Hi?"})
        + "\n"
    )
    out = tmp_path / "answers.jsonl"
    assert (
        generate.main(["--batch", str(bad), "--out", str(out), "--model", str(folder), *FLAGS]) == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[1].startswith(
        f"{bad} line 1: cannot read image {tmp_path / 'broken.png'}: "
    ) and err[1].endswith("; skipped")
    assert err[-1] == f"error: 1 of 2 rows not answered, their images unreadable: {bad} line 1", err
    assert [json.loads(x)["line"] for x in out.read_text().splitlines()] == [2]
    with pytest.raises(SystemExit) as e:
        generate.main(["--batch", str(path), "question?", "--model", str(folder)])
    assert e.value.code == 2 and "--batch reads images and questions" in one_line(
        capsys.readouterr().err
    )
