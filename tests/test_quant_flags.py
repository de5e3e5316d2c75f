"""--quant and --group-size, the inference flags (inference/flags.py) of generate.py, `evaluate.py run` and
`profiling.py latency`: parsed with their range and their check (exit 2), and applied when the model
loads (inference.load_engine; latency's random weights too). The checkpoint's identity does not change
with them: a router trained for it still loads, and the predictions record the same fingerprint."""

import json

import pytest
import torch
from commands import gen_main, main_out, parse_flags, read_preds

import evaluate
import generate
import profiling
from data.processor import Tokenizer, build_prompt
from gates import Router, RouterConfig, fingerprint
from inference.engine import Engine, GenerateConfig
from inference.flags import InferenceFlags, load_engine
from inference.quant import Int4Linear, Int8Linear, quantize
from loading.pretrained import load_pretrained
from loading.router import save_router

COMMANDS = {  # each command's argv before the quant flags, as it parses them
    "generate": (generate, ["hello"]),
    "evaluate run": (
        evaluate,
        ["run", "--benchmark", "MMMU_DEV_VAL", "--data", "x.tsv", "--out", "p.jsonl"],
    ),
    "profiling latency": (profiling, ["latency"]),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_quant_flags_parse_and_are_checked(command, capsys):
    module, argv = COMMANDS[command]
    cfg = parse_flags(module, argv)
    assert (cfg.quant, cfg.group_size) == (None, None)
    assert (parse_flags(module, argv + ["--quant", "int8"]).quant) == "int8"
    cfg = parse_flags(module, argv + ["--quant", "int4", "--group-size", "64"])
    assert (cfg.quant, cfg.group_size) == ("int4", 64)
    for bad, says in (
        (["--quant", "int3"], "--quant"),
        (["--quant", "int4", "--group-size", "512"], "--group-size"),
        (["--quant", "int4", "--group-size", "48"], "groups of 32, 64, 128, 256"),
        (["--quant", "int8", "--group-size", "64"], "goes with --quant int4"),
        (["--group-size", "64"], "goes with --quant int4"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_flags(module, argv + bad)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and says in err and len(err.splitlines()) == 1, (bad, err)


def test_generate_applies_quant(checkpoint, capsys):
    """generate.py --quant int4 --group-size 32 answers what the quantized engine answers, and says so as it loads."""
    folder = checkpoint("qwen3", "original")
    rc, out, err = gen_main(
        capsys,
        "Tell me a story about the sea.",
        "--model",
        folder,
        "--dtype",
        "bf16",
        "--max-new-tokens",
        "6",
        "--quant",
        "int4",
        "--group-size",
        "32",
        "--json",
    )
    model = quantize(load_pretrained(folder, dtype=torch.bfloat16), "int4", 32)
    tok = Tokenizer.from_pretrained(folder)
    ids = tok.encode(build_prompt("Tell me a story about the sea.", []))
    want = (
        Engine(model).generate([ids], None, GenerateConfig(max_new_tokens=6), tok.eos_ids).tokens[0]
    )
    assert rc == 0 and json.loads(out)["answer"] == tok.answer(want)
    assert "bfloat16, int4-g32, cpu" in err, err


def test_evaluate_run_applies_quant_and_records_it(bench, tmp_path, capsys):
    """`evaluate.py run --quant int8`: every prediction records int8 and the checkpoint's own fingerprint (the
    quantized model is the same checkpoint), its score copies the format; resuming without --quant is another
    run, refused."""
    folder, tsv, rows, _ = bench
    out = tmp_path / "pred.jsonl"
    argv = [
        "run",
        "--benchmark",
        "MMMU_DEV_VAL",
        "--data",
        tsv,
        "--model",
        folder,
        "--out",
        out,
        "--max-new-tokens",
        "2",
        "--batch-size",
        "4",
    ]
    rc, _, err = main_out(capsys, *argv, "--quant", "int8")
    preds = read_preds(out)
    plain = fingerprint(load_pretrained(folder))
    assert (
        rc == 0
        and "int8" in err
        and {(p["quant"], p["model_fingerprint"]) for p in preds} == {("int8", plain)}
    )
    rc, line, _ = main_out(
        capsys, "score", "--benchmark", "MMMU_DEV_VAL", "--data", tsv, "--predictions", out
    )
    # the score says the weights' format it was predicted with
    score = json.loads(line.splitlines()[-1])
    assert rc == 0 and (score["quant"], score["dtype"]) == ("int8", preds[0]["dtype"])
    # one row done: the rest would resume
    out.write_text(out.read_text().splitlines(keepends=True)[0])
    rc, _, err = main_out(capsys, *argv)
    assert rc == 1 and "quant 'int8' there, None now" in err, err


def test_profiling_latency_applies_quant(capsys):
    """profiling.py latency --quant int4: random weights quantized as load_engine quantizes a checkpoint's;
    the row names the format and counts the packed weights (fewer bytes than fp32's)."""
    argv = [
        "latency",
        "--arch",
        "tiny",
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
        "--threads",
        "1",
    ]
    rows = []
    for quant in ([], ["--quant", "int4", "--group-size", "32"]):
        assert profiling.main(argv + quant) == 0
        rows += json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    assert [r["quant"] for r in rows] == [None, "int4-g32"] and rows[1]["weights_gib"] < rows[0][
        "weights_gib"
    ]


def test_load_engine_quantizes_the_language_model_only(checkpoint, tmp_path):
    """load_engine with --quant int8 and a --router: the router, trained for the checkpoint (its fingerprint),
    still loads and keeps its tensors and dtype; the branch prefixes, aggregators, norms, ViT and connector stay
    in --dtype; only the language model's linears are quantized."""
    folder = checkpoint("qwen3", "original")
    plain = load_pretrained(folder, dtype=torch.bfloat16)
    c = plain.cfg
    router = Router(
        RouterConfig(
            pv=c.par.pv,
            pl=c.par.pl,
            vision_width=c.vit.hidden_size,
            text_width=c.llm.hidden_size,
            hidden=8,
            fingerprint=fingerprint(plain),
        )
    )
    save_router(router, tmp_path / "router", {})
    flags = InferenceFlags(
        model=str(folder), dtype="bf16", device="cpu", router=str(tmp_path / "router"), quant="int8"
    )
    engine = load_engine(flags, folder, torch.device("cpu"))
    model = engine.model
    assert engine.router is not None and engine.dtype == torch.bfloat16
    for k, v in router.state_dict().items():
        assert (
            torch.equal(engine.router.state_dict()[k], v)
            and engine.router.state_dict()[k].dtype == v.dtype
        ), k
    quantized = {n for n, m in model.named_modules() if isinstance(m, (Int8Linear, Int4Linear))}
    assert quantized and all(n.startswith("language_model.") for n in quantized)
    # everything else: the checkpoint's tensors in --dtype
    for name, t in model.state_dict().items():
        if not any(name.startswith(q + ".") for q in quantized):
            assert t.dtype == torch.bfloat16, name
