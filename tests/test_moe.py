"""The Qwen3-MoE decoder (moe.py) on its own and under ParVL branches: the sparse block against a plain
loop over experts, each row (a branch, a sample) routed on its own, the block traced whole by dynamo,
cached decoding with branches equal to recomputing, a save that loads back bit for bit in the
per-expert layout, and config.json's MoE fields checked against the tensors. The model against
transformers, in every checkpoint layout, is test_equivalence.py's (family "qwen3_moe")."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from commands import COMMON, metrics, run_train, train_here
from safetensors import safe_open
from test_branches import TINY_MOE, greedy_recompute, prompt

from config import LLMConfig, ParConfig
from inference.engine import Engine, GenerateConfig
from loading.checkpoint import CheckpointError
from loading.pretrained import load_pretrained, save_pretrained
from moe import SparseMoE
from parvl import ParVL


def moe_block(renormalise: bool = True, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    cfg = replace(TINY_MOE.llm, norm_topk_prob=renormalise)
    block = SparseMoE(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block.eval()


def loop_over_experts(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The official block's arithmetic written plainly: every token, every chosen expert, in turn."""
    flat = x.reshape(-1, x.shape[-1])
    probs = F.softmax(block.gate(flat).float(), dim=-1)
    weights, experts = probs.topk(block.top_k, dim=-1)
    if block.renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    E = block.experts
    for n in range(flat.shape[0]):
        for w, e in zip(weights[n].to(x.dtype), experts[n]):
            gate, up = (E.gate_up_proj[e] @ flat[n]).chunk(2)
            out[n] += w * (E.down_proj[e] @ (F.silu(gate) * up))
    return out.reshape(x.shape)


@pytest.mark.parametrize("renormalise", [True, False])
@torch.no_grad()
def test_sparse_block_equals_a_loop_over_experts(renormalise):
    block = moe_block(renormalise)
    x = torch.randn(3, 5, TINY_MOE.llm.hidden_size)
    torch.testing.assert_close(block(x), loop_over_experts(block, x), atol=1e-5, rtol=1e-5)
    # bf16: the routing weights cast to the activation dtype, as the official block does
    block16, x16 = moe_block(renormalise).bfloat16(), x.bfloat16()
    torch.testing.assert_close(
        block16(x16).float(), loop_over_experts(block16, x16).float(), atol=3e-2, rtol=3e-2
    )


@torch.no_grad()
def test_each_row_routes_its_own_tokens():
    """No capacity, no balancing across the batch: a row's output is the block run on that row alone,
    so a branch (a row of its own) routes its tokens on its own states, whatever rows run beside it."""
    block = moe_block()
    x = torch.randn(4, 7, TINY_MOE.llm.hidden_size)
    route = lambda x: block.gate(x).topk(block.top_k).indices  # noqa: E731
    assert torch.equal(route(x), torch.cat([route(x[r : r + 1]) for r in range(4)]))
    alone = torch.cat([block(x[r : r + 1]) for r in range(4)])
    torch.testing.assert_close(block(x), alone, atol=1e-5, rtol=1e-5)  # the products' blocking only


@torch.no_grad()
def test_branches_choose_their_own_experts():
    """Two language branches of one sample: their prefixes make their states differ, and so do the experts
    their tokens are routed to (recorded at the gate of the routed layer)."""
    cfg = replace(TINY_MOE, par=ParConfig(pv=1, pl=2, llm_prefix_len=4))
    model = ParVL.from_config(cfg, seed=3).eval()
    for p in (model.language_model.model.layers[0].self_attn.prefix_k,):
        p.normal_(std=3.0)  # prefixes far apart, so that the branches' states differ a lot
    chosen = []
    gate = model.language_model.model.layers[0].mlp.gate
    hook = gate.register_forward_hook(lambda m, i, out: chosen.append(out.topk(2).indices))
    ids, _ = prompt(0, text=16, seed=4)
    model(ids[None], None)
    hook.remove()
    per_branch = chosen[0].reshape(2, -1, 2)  # rows branch-major: [P, T, K]
    assert not torch.equal(per_branch[0], per_branch[1])


def test_sparse_block_traces_whole():
    """One graph, no graph break (fullgraph), no host sync: the decode step compiles it whole."""
    for dtype in (torch.bfloat16, torch.float32):  # grouped_mm, and the gathered weights
        block = moe_block().to(dtype)
        x = torch.randn(2, 1, TINY_MOE.llm.hidden_size, dtype=dtype)
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-5)


def test_cached_branches_equal_recompute_on_moe():
    model = ParVL.from_config(
        replace(TINY_MOE, par=ParConfig(pv=2, pl=2, vit_prefix_len=5, llm_prefix_len=4)), seed=6
    ).eval()
    (ids1, pv1), (ids2, _) = prompt(1, seed=5), prompt(0, text=20, seed=6)
    cfg = GenerateConfig(max_new_tokens=6, ignore_eos=True)
    engine = Engine(model)
    alone = [
        engine.generate([i.tolist()], p, cfg, []).tokens[0] for i, p in ((ids1, pv1), (ids2, None))
    ]
    assert alone[0] == greedy_recompute(model, ids1, pv1, 6)
    assert alone[1] == greedy_recompute(model, ids2, None, 6)
    assert engine.generate([ids1.tolist(), ids2.tolist()], pv1, cfg, []).tokens == alone


def test_save_writes_one_key_per_expert_and_loads_back_bit_exact(tmp_path):
    model = ParVL.from_config(
        replace(TINY_MOE, par=ParConfig(pv=2, pl=2, vit_prefix_len=5, llm_prefix_len=4)), seed=7
    ).eval()
    save_pretrained(model, tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    expert = "language_model.model.layers.0.mlp.experts."
    assert {
        f"{expert}5.gate_proj.weight",
        f"{expert}5.up_proj.weight",
        f"{expert}0.down_proj.weight",
    } <= keys
    assert f"{expert}gate_up_proj" not in keys
    raw = json.loads((tmp_path / "m" / "config.json").read_text())["llm_config"]
    assert raw["architectures"] == ["Qwen3MoeForCausalLM"] and raw["mlp_only_layers"] == [1]
    back = load_pretrained(tmp_path / "m")
    assert back.cfg == model.cfg
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values())
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"num_experts": 6},
            "the language model's num_experts is 6, but in .* language_model.model.layers.0.mlp.gate.weight "
            r"has shape \[8, 64\]",
        ),
        (
            {"num_experts_per_tok": 9},
            "llm_config.num_experts_per_tok 9 is more than llm_config.num_experts 8",
        ),
        ({"moe_intermediate_size": 16}, "moe_intermediate_size is 32, but in"),
        ({"num_experts": 0}, "llm_config.num_experts must be a positive integer, got 0"),
    ],
)
def test_config_moe_fields_checked_against_the_tensors(checkpoint, tmp_path, change, message):
    folder = tmp_path / "m"
    shutil.copytree(checkpoint("qwen3_moe", "original"), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["llm_config"].update(change)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message) as e:
        load_pretrained(folder)
    assert "\n" not in str(e.value)


def test_dense_layers_where_the_config_says():
    cfg = LLMConfig(
        num_layers=6,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        decoder_sparse_step=2,
        mlp_only_layers=(3,),
    )
    assert [cfg.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not LLMConfig().is_sparse(0)  # a dense decoder


@pytest.mark.slow
def test_train_on_moe_and_6b_encoder_two_ranks_equal_one_and_resume(checkpoint, meta, tmp_path):
    """train.py 2:2 on the Qwen3-MoE + InternViT-6B-style checkpoint (241B-A28B in small): FSDP2 on two
    ranks (the stacked experts sharded on the expert dimension, read per rank) gives one process's
    losses and gradient norms; a run stopped after step 2 and resumed is bit-identical; its export
    writes the per-expert layout and loads back."""
    model = checkpoint("qwen3_moe+vit6b", "original")
    args = ["--model", model, "--data", meta, "--pv", "2", "--pl", "2", "--max-steps", "3"]
    args += ["--save-every", "1", *COMMON]
    train_here(*args, "--out", tmp_path / "one")
    run_train(*args, "--out", tmp_path / "two", nproc=2)
    run_train(*args, "--out", tmp_path / "cut", fault="stop-after=2")
    train_here(*args, "--out", tmp_path / "cut", "--resume")
    one, two, cut = (metrics(tmp_path / name) for name in ("one", "two", "cut"))
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert [(m["loss"], m["grad_norm"]) for m in cut] == [(m["loss"], m["grad_norm"]) for m in one]
    back = load_pretrained(tmp_path / "one" / "export")
    assert back.cfg.llm.num_experts == 8 and back.cfg.vit.norm_type == "rms_norm"


@pytest.mark.slow
def test_every_command_runs_on_moe_and_6b_encoder(checkpoint, bench, meta, tmp_path, capsys):
    """generate.py, evaluate.py run, router.py label and train, and profiling.py params on a 2:2 ParVL of
    the Qwen3-MoE + InternViT-6B-style checkpoint (241B-A28B in small); generate.py's answer is the
    engine's, compiled (fp32 on CPU: the gathered experts) equal to eager."""
    import evaluate
    import generate
    import profiling
    import router

    model = load_pretrained(checkpoint("qwen3_moe+vit6b", "original"), pv=2, pl=2)
    torch.manual_seed(0)
    model.init_branches(std=0.5)
    folder = tmp_path / "m22"
    save_pretrained(model, folder)
    _, tsv, _, _ = bench
    question = ["Hi?"]  # text only
    answers = []
    for extra in ([], ["--compile"]):
        assert (
            generate.main(
                [*question, "--model", str(folder), "--max-new-tokens", "4", "--json", *extra]
            )
            == 0
        )
        answers.append(json.loads(capsys.readouterr().out.splitlines()[-1])["answer"])
    assert answers[0] == answers[1]
    out = tmp_path / "pred.jsonl"
    run = ["run", "--benchmark", "MMMU_DEV_VAL", "--data", str(tsv), "--model", str(folder)]
    assert (
        evaluate.main([*run, "--out", str(out), "--batch-size", "3", "--max-new-tokens", "3"]) == 0
    )
    # every row answered but the one whose image is corrupt
    assert {json.loads(x)["index"] for x in out.read_text().splitlines()} == {
        "10",
        "11",
        "12",
        "14",
    }
    label = ["--num-workers", "0", "--max-tiles", "2", "--max-bad-frac", "0.5", "--batch-size", "2"]
    assert (
        router.main(
            [
                "label",
                "--model",
                str(folder),
                "--data",
                str(meta),
                "--out",
                str(tmp_path / "L"),
                *label,
            ]
        )
        == 0
    )
    train = ["train", "--model", str(folder), "--labels", str(tmp_path / "L"), "--steps", "2"]
    assert router.main([*train, "--global-batch", "4", "--out", str(tmp_path / "R")]) == 0
    assert profiling.main(["params", "--arch", "241b-a28b", "--pv", "2", "--pl", "2"]) == 0
    assert "241b-a28b" in capsys.readouterr().out


def test_training_refuses_a_config_that_asks_for_the_router_loss(checkpoint, meta, tmp_path):
    """The released Qwen3-MoE configs say output_router_logits false and the official SFT adds no
    load-balancing loss then (train.py neither); one that says true is refused in one line, not trained
    without the loss the official code would add."""
    folder = tmp_path / "m"
    shutil.copytree(checkpoint("qwen3_moe", "original"), folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["llm_config"]["output_router_logits"] = True
    (folder / "config.json").write_text(json.dumps(raw))
    res = train_here(
        "--model", folder, "--data", meta, "--out", tmp_path / "run", *COMMON, check=False
    )
    line = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and "llm_config.output_router_logits is true" in line, res.stderr
    assert "router_aux_loss_coef 0.001" in line and "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_study_plans_the_new_scales(tmp_path, capsys):
    """study.py --plan takes the new presets as --arch and as another scale (Table 1's rows)."""
    import study

    base = [
        "--model",
        "M",
        "--data",
        "d.json",
        "--tsv",
        "T",
        "--out",
        str(tmp_path / "s"),
        "--plan",
    ]
    assert (
        study.main(
            [
                *base,
                "--arch",
                "241b-a28b",
                "--scale-model",
                "30b-a3b=M30",
                "--scale-model",
                "38b=M38",
            ]
        )
        == 0
    )
    plan = capsys.readouterr().out
    assert "--arch 241b-a28b" in plan and "--model M30" in plan and "--model M38" in plan


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_experts_and_compiled_decode():
    """On CUDA (bench/h200.sh's tests step): the block in bf16 (grouped_mm's CUDA kernel) and in fp32 (the
    gathered weights) against the loop, forward and backward; a 2:2 MoE ParVL's greedy tokens with the
    decode step compiled (reduce-overhead: CUDA graphs) equal eager's, recorded and replayed (fp32: see
    test_gpu.py on bf16 ties)."""
    for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float32, 1e-5)):
        block = moe_block().to("cuda", dtype)
        x = torch.randn(3, 5, TINY_MOE.llm.hidden_size, device="cuda", dtype=dtype)
        x.requires_grad_()
        y = block(x)
        want = loop_over_experts(block, x.detach()).float()
        torch.testing.assert_close(y.float(), want, atol=tol, rtol=tol)
        y.float().square().sum().backward()  # grouped_mm's backward on the GPU
        assert (
            torch.isfinite(block.experts.gate_up_proj.grad).all() and torch.isfinite(x.grad).all()
        )
    par = ParConfig(pv=2, pl=2, vit_prefix_len=5, llm_prefix_len=4)
    model = ParVL.from_config(replace(TINY_MOE, par=par), torch.float32, "cuda", seed=6).eval()
    model.init_branches(std=0.5)
    (ids1, pv1), (ids2, _) = prompt(1, seed=5), prompt(0, text=20, seed=6)
    prompts, pixels = [ids1.tolist(), ids2.tolist()], pv1.to("cuda")
    cfg = GenerateConfig(max_new_tokens=8, ignore_eos=True)
    with torch.no_grad():
        eager = Engine(model).generate(prompts, pixels, cfg, []).tokens
        fast = Engine(model, compile=True)
        assert fast.generate(prompts, pixels, cfg, []).tokens == eager
        assert fast.generate(prompts, pixels, cfg, []).tokens == eager  # a replay


@torch.no_grad()
def test_per_sample_pairs_on_moe_equal_each_sample_alone():
    """A batch whose samples run their own (vision, language) pair equals each sample alone with it, on a
    Qwen3-MoE decoder (every LLM row routes its own tokens); test_branches.py's full version is slow."""
    par = ParConfig(pv=2, pl=3, vit_prefix_len=5, llm_prefix_len=4)
    model = ParVL.from_config(replace(TINY_MOE, par=par), seed=9).eval()
    model.init_branches(std=0.5)
    samples = [prompt(1, text=6, seed=11), prompt(0, text=14, seed=12)]
    vb, lb = [1, 0], [2, 1]
    T = max(len(ids) for ids, _ in samples)
    ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for b, (s, _) in enumerate(samples):
        ids[b, T - len(s) :], mask[b, T - len(s) :] = s, 1
    batch = model(ids, samples[0][1], mask, vision_branch=vb, language_branch=lb)
    for b, (s, px) in enumerate(samples):
        alone = model(s[None], px, vision_branch=vb[b], language_branch=lb[b])[0]
        torch.testing.assert_close(batch[b, T - len(s) :], alone, atol=2e-5, rtol=1e-5)
