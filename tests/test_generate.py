"""Generation engine and CLI: greedy tokens equal transformers' generate, cached decoding equals a
full recompute, batching, compile, sampling reproducibility, streaming, and the command's errors."""
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
from PIL import Image

from conftest import random_pixels
from cpu_decode import GEMV_ROWS, cpu_backend
from engine import Engine, GenerateConfig, decode_one_token, prefill
from generate import Streamer
from parvl import ParVL
from processor import Tokenizer, build_prompt, load_image

ROOT = Path(__file__).resolve().parents[1]
NEW = 10  # new tokens per test: enough to cover several cached steps, cheap on CPU


@pytest.fixture(scope="module")
def qwen3(checkpoint):
    folder = checkpoint("qwen3", "original")
    return folder, ParVL.from_pretrained(folder), Tokenizer.from_pretrained(folder)


def hf_greedy(ref, ids: list[int], pixel_values, n: int) -> list[int]:
    """transformers' greedy generate, forced to n tokens (no eos) so both sides run every step."""
    images = {} if pixel_values is None else {"pixel_values": pixel_values}  # None trips transformers 5.24
    out = ref.generate(input_ids=torch.tensor([ids]), **images, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


PROMPTS = {  # name -> (num_tiles per image, question, history)
    "single-image": ([3], "Describe the image.", []),
    "multi-image": ([2, 1], "Image-1: <image>\nImage-2: <image>\nWhat differs?", []),
    "multi-turn": ([1], "And the colour?", [("<image>\nWhat is it?", "A cat.")]),
    "text-only": ([], "Tell me a story about the sea.", []),
}


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
@pytest.mark.parametrize("case", list(PROMPTS))
def test_greedy_matches_transformers(checkpoint, reference, family, case):
    folder = checkpoint(family, "original")
    model, tok = ParVL.from_pretrained(folder), Tokenizer.from_pretrained(folder)
    tiles, question, history = PROMPTS[case]
    ids = tok.encode(build_prompt(question, tiles, history=history))
    pv = random_pixels(sum(tiles), seed=1) if tiles else None
    ours = Engine(model).generate([ids], pv, GenerateConfig(max_new_tokens=NEW, ignore_eos=True), tok.eos_ids)
    assert ours.tokens[0] == hf_greedy(reference(family), ids, pv, NEW)


def test_cached_decode_equals_full_recompute(qwen3, monkeypatch):
    import engine as engine_module

    _, model, tok = qwen3
    ids = tok.encode(build_prompt("Describe the image.", [2]))
    pv = random_pixels(2, seed=2)
    engine = Engine(model)
    logits_seen = []
    orig = engine_module.decode_one_token  # the eager step calls it by name: record every step's logits
    monkeypatch.setattr(engine_module, "decode_one_token", lambda *a: logits_seen.append(orig(*a)) or logits_seen[-1])
    tokens = engine.generate([ids], pv, GenerateConfig(max_new_tokens=NEW, ignore_eos=True), tok.eos_ids).tokens[0]
    # full recompute: the whole sequence (prompt with image features + generated tokens) every step
    with torch.no_grad():
        prompt, _ = model.embed(torch.tensor([ids]), pv)
        for i, t in enumerate(tokens):
            gen = model.language_model.model.embed_tokens(torch.tensor([tokens[:i]], dtype=torch.long))
            x = torch.cat([prompt, gen], dim=1)
            logits = model.language_model.lm_head(model.hidden_from_embeds(x, torch.arange(x.shape[1])[None])[0])[0, -1]
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
    batched = engine.generate(ids, torch.cat([p for p in pvs if p is not None]), cfg, tok.eos_ids).tokens
    assert batched == alone


def test_stops_on_eos_and_budget(qwen3):
    _, model, tok = qwen3
    ids = tok.encode(build_prompt("Hi", []))
    engine = Engine(model)
    free = engine.generate([ids], None, GenerateConfig(max_new_tokens=NEW, ignore_eos=True), tok.eos_ids).tokens[0]
    # declare the 4th generated token a stop token: generation ends right before it
    stop = free[3]
    first = free.index(stop)
    cut = engine.generate([ids], None, GenerateConfig(max_new_tokens=NEW, check_every=1), [stop]).tokens[0]
    assert cut == free[:first]
    forced = engine.generate([ids], None, GenerateConfig(max_new_tokens=NEW, ignore_eos=True), [stop]).tokens[0]
    assert forced == free and len(forced) == NEW


def test_compiled_decode_equals_eager(qwen3):
    _, model, tok = qwen3
    ids = tok.encode(build_prompt("Describe the image.", [1]))
    pv = random_pixels(1, seed=4)
    cfg = GenerateConfig(max_new_tokens=6, ignore_eos=True)
    eager = Engine(model).generate([ids], pv, cfg, tok.eos_ids).tokens
    assert Engine(model, compile=True).generate([ids], pv, cfg, tok.eos_ids).tokens == eager
    # and the step itself, compiled with fullgraph=True (no graph break), on the same cache state
    rows = model.language_rows(None, 1, "cpu")
    T = len(ids)
    model.language_model.setup_cache(rows, T + 4)
    with torch.no_grad():
        logits = prefill(model, torch.tensor([ids]), pv, torch.ones(1, T, dtype=torch.bool), False, None, rows)
        step = (logits.argmax(-1, keepdim=True), torch.tensor([T]), torch.tensor([[T]]),
                torch.ones(1, T + 4, dtype=torch.bool), rows)
        eager_logits = decode_one_token(model, *step)
        compiled = torch.compile(decode_one_token, backend=cpu_backend, fullgraph=True)  # as Engine on CPU
        compiled_logits = compiled(model, *step)  # rewrites the same slot
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_backend_rewrites_few_row_linears(dtype):
    """The CPU decode backend turns exactly the linears of <= GEMV_ROWS rows into gemv (a graph that
    stops matching would silently lose the speed-up), and gemv equals F.linear, with and without bias."""
    from cpu_decode import gemv

    torch.manual_seed(0)
    w, b = torch.randn(48, 32, dtype=dtype), torch.randn(48, dtype=dtype)
    x_few, x_many = torch.randn(1, GEMV_ROWS, 32, dtype=dtype), torch.randn(3, GEMV_ROWS, 32, dtype=dtype)
    targets = []

    def spy(gm, example_inputs):
        compiled = cpu_backend(gm, example_inputs)  # rewrites gm in place
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in (gemv, F.linear))
        return compiled

    def linears(x_few, x_many):
        return F.linear(x_few, w), F.linear(x_few, w, b), F.linear(x_many, w, b)

    got = torch.compile(linears, backend=spy, fullgraph=True)(x_few, x_many)
    assert targets == [gemv, gemv, F.linear], targets  # the 3 x GEMV_ROWS rows stay with the BLAS
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # bf16: one rounding
    for have, want in zip(got, linears(x_few, x_many)):
        torch.testing.assert_close(have, want, **tol)
    torch.testing.assert_close(gemv(x_many, w, b), F.linear(x_many, w, b), **tol)  # any rows, eager too


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


def test_chat_session_interrupts_through_the_shell(qwen3, capsys, monkeypatch):
    """--chat under cli.shell: Ctrl-C in an answer stops that answer and the session goes on; SIGTERM in
    an answer and Ctrl-C at the prompt end it, with the shell's line and code (143, 130)."""
    import cli
    import generate

    _, model, tok = qwen3
    args = SimpleNamespace(system=None, seed=0, json=False)
    real = generate.Streamer.__call__

    def session(questions: str, signals: dict[int, int]):  # answer number -> the signal raised at its step 1
        answers = {"n": 0}

        def call(self, i, tokens):
            if i == 0:
                answers["n"] += 1
            if i == 1 and answers["n"] in signals:
                raise cli.Interrupted(signals[answers["n"]])
            return real(self, i, tokens)

        monkeypatch.setattr(generate.Streamer, "__call__", call)
        monkeypatch.setattr(sys, "stdin", io.StringIO(questions))
        code = cli.shell(lambda: generate.chat_session(Engine(model), tok, None, [], GenerateConfig(max_new_tokens=4),
                                                       args))
        return code, answers["n"], capsys.readouterr().err

    code, answered, err = session("Hello?\nAgain?\n", {1: signal.SIGINT})
    assert (code, answered) == (0, 2) and err.count("interrupted: answer stopped (the conversation goes on)") == 1, err
    code, answered, err = session("Hello?\nAgain?\n", {1: signal.SIGTERM})
    assert (code, answered) == (143, 1) and err.splitlines()[-1] == "interrupted by SIGTERM", err
    assert "answer stopped" not in err

    def ctrl_c(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", ctrl_c)
    code, answered, err = session("", {})
    assert (code, answered) == (130, 0) and err == "\ninterrupted by SIGINT\n", err


# -- the command -------------------------------------------------------------------------------


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "photo.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (300, 700, 3), dtype=np.uint8)).save(path)
    return path


def test_cli_end_to_end(qwen3, reference, png, capsys):
    import generate

    folder, model, tok = qwen3
    res = run_cli(png, "What is in the picture?", "--model", folder, "--max-new-tokens", NEW, "--max-tiles", 2)
    assert res.returncode == 0, res.stderr
    # the expected answer: transformers' greedy generate on the same prompt and pixels, stopped at eos
    pv = load_image(png, max_tiles=2)
    ids = tok.encode(build_prompt("What is in the picture?", [pv.shape[0]]))
    ref = hf_greedy(reference("qwen3"), ids, pv, NEW)
    stop = next((i for i, t in enumerate(ref) if t in tok.eos_ids), len(ref))
    assert res.stdout.strip() == tok.answer(ref[:stop])  # as the official chat() decodes: special tokens skipped
    assert "ttft_s=" in res.stderr and "decode_tok_s=" in res.stderr
    # --json in this process (one real start above is the end-to-end; a second adds only imports)
    assert generate.main([str(png), "What is in the picture?", "--model", str(folder), "--max-new-tokens", str(NEW),
                          "--max-tiles", "2", "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["answer"] == res.stdout.strip() and line["new_tokens"] == stop and line["prompt_tokens"] == len(ids)


def test_cli_bad_inputs(qwen3, png, tmp_path, capsys):
    """In process (generate.main): the same exit code and stderr as the command, without five starts."""
    import generate

    folder = qwen3[0]
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "model.safetensors").unlink()
    cases = {
        "missing.png": (tmp_path / "missing.png", "q", "--model", folder),
        "corrupt.png": (corrupt, "q", "--model", folder),
        "nowhere": (png, "q", "--model", tmp_path / "nowhere"),
        "model.safetensors": (png, "q", "--model", broken),
        "context": (png, "q", "--model", folder, "--max-new-tokens", 40960),
    }
    for needle, args in cases.items():
        code = generate.main([str(a) for a in args])
        err = capsys.readouterr().err
        assert code != 0, needle
        lines = err.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (needle, err)
