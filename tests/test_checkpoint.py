"""Reading a checkpoint folder: the layouts' state dicts, shards, a bf16 checkpoint kept as stored, load errors;
config.json's spellings and its checks against the tensors (before any module is built), the decoder and the
tokenizer against config.json, an export's "parvl" block; git-LFS pointers and training run folders given as
models; the model a command loads when --model names none (the hub cache offline, no network, no
huggingface_hub, a cache that cannot be made). Every refusal is one line naming the file and the field, by
every command that loads a model. That what is read computes what transformers' InternVL computes:
test_equivalence.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from commands import ROOT, gen_main, one_line, run_main, tree
from inputs import png_b64, prompt_ids, random_pixels, write_dataset, write_tsv
from official import FAMILIES, LAYOUTS, hf_to_original, read_safetensors
from safetensors import safe_open
from safetensors.torch import save_file

import generate
from data.processor import Tokenizer
from loading.checkpoint import CheckpointError
from loading.hub import DEFAULT_MODEL, resolve_model
from loading.pretrained import load_pretrained, save_pretrained
from loading.weights import unstack_experts

# bf16 against fp32 on the same weights: the bf16 checkpoint loaded as stored and once more upcast to
# fp32, so the difference is bf16 arithmetic alone. Measured on the tiny qwen3 model (one 1-tile
# prompt, 285 positions, logits std ~1 and |max| ~5), weight seeds 0-3 x 2 pixel seeds: max abs error
# 0.043-0.068, mean abs error 0.006-0.0075, greedy argmax equal on 97.5-98.6 % of the positions (the
# rest are near-ties of a random model). The bounds sit 3-4x above the worst of those. Wrong bf16
# maths (a missed cast, a skipped or mis-scaled tensor) moves these logits by O(1) and leaves ~1/640
# of the argmaxes equal.
BF16_MAX_ABS, BF16_MEAN_ABS, BF16_ARGMAX_AGREE = 0.25, 0.025, 0.9


# -- the layouts, shards and bf16 ----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_give_identical_state_dicts(parvl, family):
    base = parvl(family, "original").state_dict()
    for layout in ("hf", "hf_legacy"):
        other = parvl(family, layout).state_dict()
        assert list(other) == list(base), layout
        for k in base:
            assert torch.equal(other[k], base[k]), f"{layout}: {k}"


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_keys_are_the_original_layout(checkpoint, parvl, family):
    with safe_open(str(checkpoint(family, "original") / "model.safetensors"), framework="pt") as f:
        file_keys = set(f.keys())
    # Qwen3-MoE: the experts stacked in the model are one key per expert in the file (and in a save)
    model_keys = set(unstack_experts(parvl(family, "hf").state_dict()))
    assert model_keys == file_keys, (sorted(model_keys - file_keys), sorted(file_keys - model_keys))


@pytest.mark.parametrize(
    "family", ["qwen3", "qwen3_moe+vit6b"]
)  # a MoE's experts over the shards too
@pytest.mark.parametrize("layout", ["original", "hf"])
@torch.no_grad()
def test_sharded_equals_unsharded(checkpoint, parvl, layout, family):
    sharded = load_pretrained(
        checkpoint(family, layout, shards=3), dtype=torch.float32, device="cpu"
    )
    whole = parvl(family, layout)
    a, b = sharded.state_dict(), whole.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids, px = prompt_ids(checkpoint(family, layout), [2]), random_pixels(2, seed=4)
    assert torch.equal(sharded(ids[None], px), whole(ids[None], px))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_checkpoint_stays_bf16(checkpoint, reference, layout):
    model = load_pretrained(
        checkpoint("qwen3", layout, dtype=torch.bfloat16), dtype=None, device="cpu"
    )
    not_bf16 = [n for n, p in model.named_parameters() if p.dtype != torch.bfloat16]
    assert not not_bf16, f"parameters not bf16: {not_bf16[:5]}"
    want = hf_to_original(reference("qwen3").state_dict())
    for k, v in model.state_dict().items():  # exactly the stored bf16 values
        assert torch.equal(v, want[k].to(torch.bfloat16)), k
    fp32 = load_pretrained(
        checkpoint("qwen3", layout, dtype=torch.bfloat16), dtype=torch.float32, device="cpu"
    )
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    ids, px = prompt_ids(checkpoint("qwen3", layout), [1]), random_pixels(1)
    with torch.no_grad():
        logits = model(ids[None], px)[0]  # fp32 pixels: the model casts them itself
        ref_logits = fp32(ids[None], px)[0]
    assert logits.dtype == torch.bfloat16 and ref_logits.dtype == torch.float32
    err = (logits.float() - ref_logits).abs()
    agree = (logits.float().argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    print(
        f"bf16 vs fp32 [{layout}]: max abs err {err.max().item():.4f}, mean {err.mean().item():.5f}, "
        f"argmax agree {agree:.4f}, |fp32| max {ref_logits.abs().max().item():.2f}"
    )
    assert err.max().item() < BF16_MAX_ABS and err.mean().item() < BF16_MEAN_ABS, (
        err.max().item(),
        err.mean().item(),
    )
    assert agree >= BF16_ARGMAX_AGREE, agree


# -- load errors ---------------------------------------------------------------------------------------


LOAD_ERRORS = (ValueError, FileNotFoundError)


def broken_copy(checkpoint, tmp_path, **kw):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint("qwen3", **kw), folder)
    return folder


def assert_one_line_naming(exc: pytest.ExceptionInfo, name: str) -> None:
    msg = str(exc.value)
    print(f"{type(exc.value).__name__}: {msg}")
    assert name in msg, f"message does not name {name!r}: {msg}"
    assert "\n" not in msg.strip(), f"message is not one line: {msg!r}"


def test_error_missing_shard(checkpoint, tmp_path):
    folder = broken_copy(checkpoint, tmp_path, layout="original", shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(LOAD_ERRORS) as exc:
        load_pretrained(folder, dtype=torch.float32)
    assert_one_line_naming(exc, "model-00002-of-00003.safetensors")


@pytest.mark.parametrize("layout", ["original", "hf"])
def test_error_no_config(checkpoint, tmp_path, layout):
    folder = broken_copy(checkpoint, tmp_path, layout=layout)
    (folder / "config.json").unlink()
    with pytest.raises(LOAD_ERRORS) as exc:
        load_pretrained(folder, dtype=torch.float32)
    assert_one_line_naming(exc, "config.json")


def _rewrite(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = read_safetensors(folder)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["original", "hf"])
def test_error_unexpected_key(checkpoint, tmp_path, layout):
    folder = broken_copy(checkpoint, tmp_path, layout=layout)
    key = "vision_model.bogus_tensor" if layout == "original" else "model.vision_tower.bogus_tensor"
    _rewrite(folder, lambda t: t.__setitem__(key, torch.zeros(3)))
    with pytest.raises(LOAD_ERRORS) as exc:
        load_pretrained(folder, dtype=torch.float32)
    assert_one_line_naming(exc, "bogus_tensor")


@pytest.mark.parametrize(
    "key",
    [
        "mlp1.1.bias",
        "vision_model.encoder.layers.1.ls2",
        "language_model.model.layers.0.self_attn.q_norm.weight",
    ],
)
def test_error_missing_key(checkpoint, tmp_path, key):
    # (language_model.lm_head.weight is not in this list: a missing head legitimately means tied.)
    folder = broken_copy(checkpoint, tmp_path, layout="original")
    _rewrite(folder, lambda t: t.pop(key))
    with pytest.raises(LOAD_ERRORS) as exc:
        load_pretrained(folder, dtype=torch.float32)
    assert_one_line_naming(exc, key)


# -- config.json against the tensors, before any module is built ---------------------------------------


SPOILED_CONFIGS = {  # what is changed in the tiny checkpoint's config.json -> the line that names it
    "layers 10**6": (
        lambda c: c["llm_config"].update(num_hidden_layers=10**6),
        "config.json: the language model's num_hidden_layers is 1000000, but the tensors in {d} hold 2 "
        "language model layers",
    ),
    "vision layers": (
        lambda c: c["vision_config"].update(num_hidden_layers=3),
        "config.json: the vision model's num_hidden_layers is 3, but the tensors in {d} hold 2 vision "
        "model layers",
    ),
    "width": (
        lambda c: c["llm_config"].update(hidden_size=128),
        "config.json: the language model's hidden_size is 128, but in {d} language_model.model.embed_tokens."
        "weight has shape [640, 64]",
    ),
    "mlp": (
        lambda c: c["vision_config"].update(intermediate_size=256),
        "config.json: the vision model's intermediate_size is 256, but in {d} vision_model.encoder.layers.0.mlp."
        "fc1.weight has shape [128, 64]",
    ),
    "negative heads": (
        lambda c: c["llm_config"].update(num_attention_heads=-4),
        "config.json: llm_config.num_attention_heads must be a positive integer, got -4",
    ),
    "zero heads": (
        lambda c: c["vision_config"].update(num_attention_heads=0),
        "config.json: vision_config.num_attention_heads must be a positive integer, got 0",
    ),
    "string size": (
        lambda c: c["llm_config"].update(hidden_size="64"),
        "config.json: llm_config.hidden_size must be a positive integer, got '64'",
    ),
    "kv heads": (
        lambda c: c["llm_config"].update(num_key_value_heads=3),
        "config.json: llm_config.num_attention_heads 4 is not a multiple of llm_config.num_key_value_heads 3",
    ),
    "ratio": (
        lambda c: c.update(downsample_ratio=0.3),
        "config.json: downsample_ratio must be 1/k for a k that divides the 32-patch grid, got 0.3",
    ),
    "a list": (
        lambda c: [c],
        "{d}/config.json: a JSON list, not the object of names and values it must be",
    ),
    "block a list": (
        lambda c: c.update(llm_config=[1]),
        "config.json: llm_config must be a JSON object, got list",
    ),
    "tiles 10**9": (
        lambda c: c.update(
            max_dynamic_patch=10**9
        ),  # issue 38, item 13: every command's default budget
        "config.json: max_dynamic_patch must be in [1, 64] (the most tiles InternVL's pipelines give), got "
        "1000000000",
    ),
    "parvl a string": (
        lambda c: c.update(parvl="x"),  # issue 38, item 15: an AttributeError traceback
        "{d}/config.json: parvl must be an object of par and language_only, got 'x'",
    ),
}


@pytest.mark.parametrize("case", list(SPOILED_CONFIGS))
def test_a_config_that_disagrees_with_its_tensors_is_refused_before_building(
    model_dir, tmp_path, capsys, monkeypatch, case
):
    """A config.json whose sizes or counts are not the tensors' (read from the safetensors headers), or
    whose values cannot size a model, is one line naming config.json and the field, before any module
    is built (a million layers used to be built for minutes)."""
    import shutil

    import parvl

    spoil, line = SPOILED_CONFIGS[case]
    d = tmp_path / "ckpt"
    shutil.copytree(model_dir, d)
    config = json.loads((d / "config.json").read_text())
    config = spoil(config) or config
    (d / "config.json").write_text(json.dumps(config))
    # counts: refused before the model's constructor runs
    if case in ("layers 10**6", "vision layers"):
        monkeypatch.setattr(
            parvl.ParVL, "__init__", lambda *a, **k: pytest.fail("a module was built")
        )
    code, err = run_main(capsys, generate.main, ["Hi", "--model", d, "--max-new-tokens", 1])
    assert code == 1 and err[-1] == "error: " + line.format(d=d), err


# -- a decoder or tokenizer this code does not run, a bad parvl block ----------------------------------


@pytest.fixture(scope="module")
def spoiled(model_dir, tmp_path_factory):
    """Copies of the tiny checkpoint with one thing wrong in config.json, and what each refusal names."""
    tok = Tokenizer.from_pretrained(model_dir)
    img = tok.token_to_id("<IMG_CONTEXT>")
    cases = {
        "llama": (
            lambda c: c["llm_config"].update(architectures=["LlamaForCausalLM"]),
            [
                "llm_config.architectures 'LlamaForCausalLM' is not a supported decoder",
                "Qwen3ForCausalLM",
                "Qwen2ForCausalLM",
            ],
        ),
        "qwen2-named-qwen3": (
            lambda c: c["llm_config"].update(architectures=["Qwen2ForCausalLM"]),
            ["llm_config.model_type 'qwen3'", "does not match architectures 'Qwen2ForCausalLM'"],
        ),
        "other-tokenizer": (
            lambda c: c.update(image_token_id=img + 1),
            [
                f"<IMG_CONTEXT> = {img}",
                f"image_token_id = {img + 1}",
                "config.json",
                "tokenizer in",
            ],
        ),
        "small-vocabulary": (
            lambda c: c["llm_config"].update(vocab_size=tok.vocab_size - 1),
            [f"has {tok.vocab_size} tokens", f"embeds only {tok.vocab_size - 1}"],
        ),
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


@pytest.mark.parametrize(
    "case", ["llama", "qwen2-named-qwen3", "other-tokenizer", "small-vocabulary"]
)
def test_a_checkpoint_this_code_cannot_run_is_refused_by_every_command(
    spoiled, png, tmp_path, capsys, case
):
    import evaluate
    import router
    import train

    folder, needles = spoiled[case]
    meta = write_dataset(tmp_path / "d", rows=4)
    tsv = write_tsv(
        tmp_path / "t.tsv",
        [{"index": "0", "question": "Read it.", "answer": "['x']", "image": png_b64(16, 16, 5)}],
    )
    commands = {
        "generate.py": lambda: generate.main([str(png), "q", "--model", str(folder)]),
        "train.py": lambda: train.main(
            ["--validate-data", "--model", str(folder), "--data", str(meta), "--num-workers", "0"]
        ),
        "evaluate.py run": lambda: evaluate.main(
            [
                "run",
                "--benchmark",
                "TextVQA_VAL",
                "--data",
                str(tsv),
                "--model",
                str(folder),
                "--out",
                str(tmp_path / "p.jsonl"),
            ]
        ),
        "router.py label": lambda: router.main(
            [
                "label",
                "--model",
                str(folder),
                "--data",
                str(meta),
                "--out",
                str(tmp_path / "labels"),
                "--num-workers",
                "0",
            ]
        ),
    }
    for name, command in commands.items():
        code = command()
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            code == 1
            and len(err) == 1
            and err[0].startswith("error: ")
            and "Traceback" not in err[0]
        ), (name, err)
        assert all(n in err[0] for n in needles), (name, err[0])
    assert not (tmp_path / "p.jsonl").exists() and not (tmp_path / "labels").exists()


def test_a_bad_branch_value_in_an_export_config_names_the_file_and_the_field(
    model_dir, png, tmp_path, capsys
):
    """Issue 29, item 10: the "parvl" block an export's config.json carries, with a value out of range, of
    the wrong type or a field that does not exist: exit 1, one line naming config.json and the field
    (main: "lora_rank must be >= 1, got 0" naming no file, or a TypeError traceback)."""
    folder = tmp_path / "export"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    path = folder / "config.json"
    for par, line in [
        ({"lora_rank": 0}, f"error: {path}: parvl.par.lora_rank must be >= 1, got 0"),
        ({"pv": "2"}, f"error: {path}: parvl.par.pv must be a number (an integer), got '2'"),
        (
            {"pv": 2, "prefix": 3},
            f"error: {path}: parvl.par has no field 'prefix' (its fields: pv, pl, "
            "vit_prefix_len, llm_prefix_len, lambda_v, lambda_l, aggregation, vision_branches, lora_rank)",
        ),
    ]:
        path.write_text(json.dumps(config | {"parvl": {"par": par}}))
        code, _, err = gen_main(capsys, png, "q", "--model", folder)
        assert (code, err.strip()) == (1, line)


def test_language_only_on_an_export_with_vision_branches_names_config_json(
    model_dir, tmp_path, capsys
):
    """ "language_only": true in a 2:2 export's parvl block said "a language-only model has no vision branches: pv
    must be 1", naming no file (issue 38, item 22): the file and both fields are named, exit 1."""
    folder = tmp_path / "export"
    save_pretrained(load_pretrained(model_dir, pv=2, pl=2), folder)
    config = json.loads((folder / "config.json").read_text())
    config["parvl"]["language_only"] = True
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = gen_main(capsys, "q", "--model", folder, "--max-new-tokens", 1)
    assert (code, err.strip()) == (
        1,
        f"error: {folder / 'config.json'}: parvl.language_only is true, but "
        f"parvl.par.pv is 2: a language-only model has no vision branches",
    )


# -- folders that are not a model ----------------------------------------------------------------------


def test_a_git_lfs_pointer_is_named(model_dir, png, tmp_path, capsys):
    lfs = tmp_path / "lfs"
    shutil.copytree(model_dir, lfs)
    (lfs / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 42\n"
    )
    code, _, err = gen_main(capsys, png, "q", "--model", lfs)
    assert code == 1 and "git-LFS pointer" in one_line(err) and "header too large" not in err, err


def test_a_run_folder_given_as_a_model_names_its_export(model_dir, png, tmp_path, capsys):
    run = tmp_path / "run"  # what train.py --out leaves: checkpoints, and the export at the end
    shutil.copytree(model_dir, run / "export")
    (run / "checkpoints" / "step_3").mkdir(parents=True)
    (run / "checkpoints" / "step_3" / "done").write_text("")
    # train.py's, not a model's
    (run / "config.json").write_text(json.dumps({"model": str(model_dir), "out": str(run)}))
    before = tree(run)
    code, _, err = gen_main(capsys, png, "q", "--model", run)
    assert code == 1 and one_line(err) == (
        f"error: {run}: a training run folder, not a model; its model is {run / 'export'}"
    )
    shutil.rmtree(run / "export")
    with pytest.raises(CheckpointError, match="no export yet"):
        resolve_model(str(run))
    assert tree(run) == {k: v for k, v in before.items() if not k.startswith("export")}


# -- the default model: a local folder, $PARVL_MODEL, the hub cache ------------------------------------


def run_python(code: str, env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter from the repo root (the hub cache settings are read at import)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def hub_env(cache) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PARVL_MODEL", "HF_HOME", "HF_HUB_CACHE")
    }
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def test_local_folder_and_env_var(model_dir, monkeypatch, tmp_path):
    folder = model_dir
    assert resolve_model(str(folder)) == folder
    monkeypatch.setenv("PARVL_MODEL", str(folder))
    assert resolve_model(None) == folder  # $PARVL_MODEL before the default
    with pytest.raises(ValueError, match="local folder, not a hub model"):
        resolve_model(str(folder), revision="v1")
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        resolve_model(str(tmp_path / "a" / "b" / "c"))


def fake_snapshot(
    cache, repo: str, rev: str, source, ref: str | None = "main", weights: bool = True
):
    """huggingface_hub's cache layout: models--owner--name/snapshots/<rev>/..., refs/<ref> -> rev."""
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(source, root / "snapshots" / rev)
    if not weights:  # what an interrupted download leaves
        (root / "snapshots" / rev / "model.safetensors").unlink()
    if ref:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(rev)
    return root / "snapshots" / rev


def test_default_model_from_the_hub_cache_offline(model_dir, tmp_path, capsys):
    folder = model_dir
    cache = tmp_path / "hub"
    main_rev, pinned = "a" * 40, "b" * 40
    snap = fake_snapshot(cache, DEFAULT_MODEL, main_rev, folder)
    other = fake_snapshot(cache, DEFAULT_MODEL, pinned, folder, ref=None)
    fake_snapshot(cache, "Someone/partial", "c" * 40, folder, weights=False)
    # the two commands: no --model, no $PARVL_MODEL; the model comes from the cache, with no network
    res = subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), "Hello?", "--max-new-tokens", "4", "--json"],
        env=hub_env(cache),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert f"loaded {snap}" in res.stderr and "download" not in res.stderr
    assert generate.main(["Hello?", "--model", str(folder), "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(res.stdout)["answer"] == json.loads(capsys.readouterr().out)["answer"]
    res = run_python(
        f"""
        import json, sys, generate
        from loading.checkpoint import CheckpointError
        from loading.hub import resolve_model
        out = {{"main": str(resolve_model()), "pinned": str(resolve_model(None, "{pinned}"))}}
        for name in ("OpenGVLab/Missing", "Someone/partial"):
            try:
                resolve_model(name)
            except CheckpointError as e:
                out[name] = str(e)
        print(json.dumps(out), flush=True)
        sys.exit(generate.main(["Hello?", "--model", "OpenGVLab/Missing"]))  # offline, not cached: one line, 1
    """,
        hub_env(cache),
    )
    assert res.returncode == 1 and "hf download OpenGVLab/Missing" in one_line(res.stderr), (
        res.stderr
    )
    out = json.loads(res.stdout)
    assert out["main"] == str(snap) and out["pinned"] == str(other)
    assert "not in the hub cache, and HF_HUB_OFFLINE is set" in out["OpenGVLab/Missing"]
    assert "incomplete in the hub cache" in out["Someone/partial"]
    assert "hf download OpenGVLab/Missing --local-dir Missing" in out["OpenGVLab/Missing"]
    # incomplete copy in the cache: not loaded
    assert "hf download Someone/partial" in out["Someone/partial"]


def test_no_network_is_one_error_line(tmp_path):
    env = {k: v for k, v in hub_env(tmp_path / "empty").items() if k != "HF_HUB_OFFLINE"}
    # a port nothing listens on: refused at once
    env |= {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), "Hello?"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = res.stderr.strip().splitlines()
    # issue 46: no "downloading ..." where nothing can be downloaded, the error alone
    assert res.returncode == 1 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    assert lines[0] == (
        "error: OpenGVLab/InternVL3_5-1B: not in the hub cache and the hub cannot be reached; download "
        "it "
        "where the hub is reachable (hf download OpenGVLab/InternVL3_5-1B --local-dir InternVL3_5-1B) "
        "and pass --model InternVL3_5-1B"
    )


def test_without_huggingface_hub_one_line_says_how(tmp_path):
    res = run_python(
        """
        import sys
        sys.modules["huggingface_hub"] = None  # as if not installed: its import raises ImportError
        import generate
        sys.exit(generate.main(["Hello?"]))
    """,
        hub_env(tmp_path / "empty"),
    )
    line = one_line(res.stderr)
    assert (
        res.returncode == 1
        and "huggingface_hub is not installed" in line
        and "pip install huggingface_hub" in line
    )
    assert (
        "hf download OpenGVLab/InternVL3_5-1B --local-dir InternVL3_5-1B" in line
        and "huggingface-cli" not in line
    )


def test_hub_cache_under_a_file_is_named_with_its_variable(tmp_path, capsys, monkeypatch):
    """HOME or HF_HOME set to a file: the hub cache cannot be made there; said with the variable, not as a
    failed download that blames the network."""
    from huggingface_hub import constants

    blocker = tmp_path / "home"
    blocker.write_text("not a folder")
    for var, cache, fix in (
        ("HF_HOME", blocker / "hub", "point HF_HOME at a folder"),
        ("HOME", blocker / ".cache" / "huggingface" / "hub", "set HF_HOME to a folder"),
    ):
        for v in (
            "HF_HUB_CACHE",
            "HUGGINGFACE_HUB_CACHE",
            "HF_HOME",
            "XDG_CACHE_HOME",
            "PARVL_MODEL",
        ):
            monkeypatch.delenv(v, raising=False)
        monkeypatch.setenv(var, str(blocker))
        # what huggingface_hub derives at import
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        code, err = run_main(capsys, generate.main, ["Hi"])
        assert code == 1 and err == [
            f"error: OpenGVLab/InternVL3_5-1B: the hub cache {cache} (from {var}={blocker}) "
            f"cannot be a folder: {blocker} is a file; {fix}, or pass --model a local "
            f"checkpoint folder"
        ], err
