"""ParVL branches: prefix attention, branch folding and aggregation, cached and shared-KV generation,
single-pair runs, saving and loading (ParVL, InternVL and ParScale layouts)."""

import json
import math
from dataclasses import replace

import pytest
import torch
from inputs import prompt_ids, random_pixels
from official import read_safetensors
from safetensors.torch import save_file

from aggregate import Aggregator, Rows
from config import PRESETS, LLMConfig, ParConfig, ParVLConfig, ViTConfig
from inference.engine import Engine, GenerateConfig
from llm import apply_rope, causal_mask, rope_tables
from loading.pretrained import load_pretrained, save_pretrained
from parvl import ParVL, pixel_shuffle
from vit import Attention as ViTAttention

TINY = PRESETS["tiny"]
IMG = TINY.image_token_id  # 300 in the tiny preset
PER_TILE, SIZE = TINY.tokens_per_tile, TINY.vit.image_size  # 256 tokens per 448 px tile
NEW = 8


# the tiny preset with Qwen3-MoE's routed layer 0 (6 experts, top 2) and a dense layer 1
TINY_MOE = replace(
    TINY,
    llm=replace(
        TINY.llm,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        mlp_only_layers=(1,),
    ),
)


def tiny(pv=1, pl=1, seed=0, moe=False, **par) -> ParVL:
    base = TINY_MOE if moe else TINY
    cfg = replace(base, par=ParConfig(pv=pv, pl=pl, vit_prefix_len=5, llm_prefix_len=4, **par))
    return ParVL.from_config(cfg, seed=seed).eval()


def prompt(
    tiles: int, text: int = 12, seed: int = 0, img: int = IMG
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random text ids below the image token id, with one image of `tiles` tiles after 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, img, (text,), generator=g)
    if tiles:
        ids = torch.cat([ids[:3], torch.full((PER_TILE * tiles,), img), ids[3:]])
    pv = torch.randn(tiles, 3, SIZE, SIZE, generator=g) if tiles else None
    return ids, pv


def same_prefixes(model: ParVL, vision: int, language: int) -> ParVL:
    """A copy of `model` whose every branch carries branch (vision, language)'s prefixes, mean-aggregated."""
    cfg = replace(model.cfg, par=replace(model.cfg.par, aggregation="mean"))
    copy = ParVL(cfg).eval()
    state = {k: v for k, v in model.state_dict().items() if "aggregator" not in k}
    for k, v in state.items():
        if k.endswith(("prefix_k", "prefix_v")):
            state[k] = v[vision if k.startswith("vision") else language].expand_as(v).clone()
    copy.load_state_dict(state)
    return copy


# -- Pv = Pl = 1 is InternVL -------------------------------------------------------------------


@torch.no_grad()
def test_one_one_is_internvl(checkpoint, reference):
    """ParVL asked for Pv = Pl = 1 (prefix lengths and aggregation set, as a 1:1 run of train.py does)
    adds no tensor and gives transformers' InternVL logits exactly, densely and as a per-sample pair."""
    folder = checkpoint("qwen3", "original")
    par = load_pretrained(folder, par=ParConfig(pv=1, pl=1, vit_prefix_len=96, llm_prefix_len=48))
    assert par.state_dict().keys() == read_safetensors(folder).keys()
    ids = prompt_ids(folder, [2])
    px = random_pixels(2, seed=1)
    want = reference("qwen3")(input_ids=ids[None], pixel_values=px).logits
    assert torch.equal(par(ids[None], px), want)
    assert torch.equal(par(ids[None], px, vision_branch=[0], language_branch=[0]), want)


def test_lora_branches_start_as_internvl_and_are_their_weight_updates(checkpoint, reference):
    """LoRA vision branches (Figure 3): started from the official checkpoint (B = 0) the model gives
    InternVL's logits; with random A and B, branch p of the ViT is a plain ViT whose qkv, proj, fc1
    and fc2 weights are W + 2 B_p A_p (alpha / r = 2), in fp64 to check the algorithm."""
    from vit import ViT

    folder = checkpoint("qwen3", "original")
    par = load_pretrained(folder, par=ParConfig(pv=2, pl=1, vision_branches="lora", lora_rank=4))
    extra = par.state_dict().keys() - read_safetensors(folder).keys()
    assert extra and all(
        k.endswith((".lora_A", ".lora_B")) or k.startswith("vision_aggregator.") for k in extra
    )
    ids, px = prompt_ids(folder, [2]), random_pixels(2, seed=1)
    # the two branch rows are the pretrained ViT's exactly and fuse with weights 1/2: fp32 matmuls of
    # 2N rather than N rows may block differently, hence a tolerance at fp32 noise, not equality
    torch.testing.assert_close(
        par(ids[None], px),
        reference("qwen3")(input_ids=ids[None], pixel_values=px).logits,
        atol=1e-5,
        rtol=1e-5,
    )
    cfg = ViTConfig(
        hidden_size=32,
        num_heads=4,
        intermediate_size=48,
        num_layers=2,
        image_size=28,
        patch_size=14,
    )
    torch.manual_seed(0)
    lora, plain = ViT(cfg, branches=3, lora_rank=2).double(), ViT(cfg).double()
    for p in lora.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 3, 28, 28, dtype=torch.float64)
    for branch in range(3):
        state = {k: v for k, v in lora.state_dict().items() if "lora" not in k}
        for i, layer in enumerate(lora.encoder.layers):
            for name, up in (
                ("attn.qkv", layer.attn.qkv_lora),
                ("attn.proj", layer.attn.proj_lora),
                ("mlp.fc1", layer.mlp.fc1_lora),
                ("mlp.fc2", layer.mlp.fc2_lora),
            ):
                key = f"encoder.layers.{i}.{name}.weight"
                state[key] = state[key] + 2.0 * up.lora_B[branch] @ up.lora_A[branch]
        plain.load_state_dict(state)
        with torch.no_grad():
            got = lora(x, Rows.choose(branch, 3, 2, "cpu"))
            dense = lora(x)  # all three, branch-major: rows branch * 2 + n
        torch.testing.assert_close(got, plain(x), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(dense[2 * branch : 2 * branch + 2], got, atol=1e-10, rtol=1e-10)


# -- prefix attention against an explicit reference --------------------------------------------


def test_vit_prefix_attention_equals_explicit():
    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=32, num_heads=4, intermediate_size=64, num_layers=1)
    # fp64: the comparison checks the algorithm
    attn = ViTAttention(cfg, branches=3, prefix_len=5).double()
    for p in attn.parameters():
        torch.nn.init.normal_(p)
    N, T, H, D = 2, 7, 4, 8
    x = torch.randn(3 * N, T, 32, dtype=torch.float64)  # branch-major rows
    q, k, v = attn.qkv(x).split(32, -1)
    q, k, v = (t.view(3 * N, T, H, D).transpose(1, 2) for t in (q, k, v))
    # row p*N+n: branch p
    pk, pv = (attn.prefix_k.repeat_interleave(N, 0), attn.prefix_v.repeat_interleave(N, 0))
    K, V = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
    ref = ((q @ K.transpose(-1, -2)) / math.sqrt(D)).softmax(-1) @ V  # no mask: bidirectional
    ref = attn.proj(ref.transpose(1, 2).reshape(3 * N, T, 32))
    torch.testing.assert_close(attn(x, Rows.choose(None, 3, N, "cpu")), ref, atol=1e-10, rtol=1e-10)
    # one branch alone sees only its own prefix
    torch.testing.assert_close(
        attn(x[N : 2 * N], Rows.choose(1, 3, N, "cpu")), ref[N : 2 * N], atol=1e-10, rtol=1e-10
    )


@pytest.mark.parametrize("padded", [False, True])
def test_llm_prefix_attention_equals_explicit(padded):
    """Whole decoder, 2 branches: every layer's attention written out by hand over [prefix; tokens]
    with an explicit mask (prefix always visible, tokens causal, padding hidden), no RoPE on prefixes."""
    model = tiny(pl=2, seed=3)
    lm, cfg = model.language_model, model.cfg.llm
    B, T, P, Lp = 2, 9, 2, 4
    x = torch.randn(B, T, cfg.hidden_size)
    valid = torch.ones(B, T, dtype=torch.bool)
    if padded:
        valid[1, :3] = False  # sample 1 is left-padded by 3
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    mask = causal_mask(valid, torch.arange(T)) if padded else None
    got = lm(x, positions, mask)  # [P*B,T,C]

    cos, sin = rope_tables(cfg.head_dim, 64, cfg.rope_theta)
    cos, sin = cos[positions].repeat(P, 1, 1), sin[positions].repeat(P, 1, 1)
    allowed = torch.zeros(P * B, T, Lp + T, dtype=torch.bool)
    for r in range(P * B):
        for i in range(T):
            allowed[r, i, :Lp] = True  # every prefix slot
            for j in range(i + 1):
                allowed[r, i, Lp + j] = bool(valid[r % B, j]) or j == i
    h = x.repeat(P, 1, 1)
    G = cfg.num_heads // cfg.num_kv_heads
    for layer in lm.model.layers:
        a = layer.self_attn
        y = layer.input_layernorm(h)
        q = a.q_norm(a.q_proj(y).view(P * B, T, -1, cfg.head_dim)).transpose(1, 2)
        k = a.k_norm(a.k_proj(y).view(P * B, T, -1, cfg.head_dim)).transpose(1, 2)
        v = a.v_proj(y).view(P * B, T, -1, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        K = torch.cat([a.prefix_k.repeat_interleave(B, 0), k], 2).repeat_interleave(G, 1)
        V = torch.cat([a.prefix_v.repeat_interleave(B, 0), v], 2).repeat_interleave(G, 1)
        s = (q @ K.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        o = (s.softmax(-1) @ V).transpose(1, 2).reshape(P * B, T, -1)
        h = h + a.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    ref = lm.model.norm(h)
    rows = valid.repeat(P, 1)  # compare real tokens (padded rows only attend to themselves)
    torch.testing.assert_close(got[rows], ref[rows], atol=2e-5, rtol=1e-5)


# -- folding and aggregation -------------------------------------------------------------------


def test_identical_prefixes_with_mean_equal_one_branch():
    model = tiny(pv=2, pl=2, seed=4)
    copy = same_prefixes(model, 1, 0)
    ids, pv = prompt(2, seed=2)
    with torch.no_grad():
        full = copy(ids[None], pv)
        one = model(ids[None], pv, vision_branch=1, language_branch=0)
    torch.testing.assert_close(full, one, atol=1e-5, rtol=1e-5)


def test_folded_equals_branches_alone_aggregated_by_hand():
    model = tiny(pv=2, pl=3, seed=5)
    ids, pv = prompt(1, seed=3)
    with torch.no_grad():
        h, wv, wl = model.hidden_from_ids(ids[None], pv)
        # vision: each branch alone, then Eq. 2 by hand (branch-major concat, softmax, smoothing)
        # [N,T,C] each
        zs = [model.vision_model(pv, Rows.choose(p, 2, pv.shape[0], "cpu")) for p in range(2)]
        agg = model.vision_aggregator
        a = agg.mlp(torch.cat(zs, -1)).float().softmax(-1)
        a = (1 - agg.smoothing) * a + agg.smoothing / 2
        z = sum(a[..., p : p + 1] * zs[p] for p in range(2))
        feats = model.mlp1(
            pixel_shuffle(z[:, 1:].reshape(1, 32, 32, -1), model.cfg.downsample_ratio)
        )
        emb = model.language_model.model.embed_tokens(ids[None]).masked_scatter(
            (ids == IMG)[None, :, None], feats
        )
        pos = torch.arange(len(ids))[None]
        hs = [
            model.language_model(emb, pos, rows=Rows.choose(p, 3, emb.shape[0], "cpu"))
            for p in range(3)
        ]
        agg = model.language_aggregator
        b = agg.mlp(torch.cat(hs, -1)).float().softmax(-1)
        b = (1 - agg.smoothing) * b + agg.smoothing / 3
        h = sum(b[..., p : p + 1] * hs[p] for p in range(3))
        ref = model.language_model.lm_head(h)
    torch.testing.assert_close(model.language_model.lm_head(h), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wv, a, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(wl, b, atol=1e-6, rtol=1e-6)
    # lambda_l default: weights never collapse
    assert agg.smoothing == 0.1 and wl.min() >= 0.1 / 3 - 1e-7


def test_parvl_init_is_uniform_and_small(checkpoint):
    folder = checkpoint("qwen3", "original")
    model = load_pretrained(folder, pv=2, pl=4)
    ids, pv = prompt(1, seed=4, img=model.cfg.image_token_id)
    _, wv, wl = model.hidden_from_ids(ids[None], pv)
    assert torch.equal(wv, torch.full_like(wv, 0.5)) and torch.equal(wl, torch.full_like(wl, 0.25))
    prefix = model.language_model.model.layers[0].self_attn.prefix_k
    assert prefix.shape == (4, 2, 48, 32) and 0.01 < prefix.std() < 0.03
    assert model.vision_model.encoder.layers[0].attn.prefix_k.shape == (2, 4, 96, 16)


# -- generation with branches -------------------------------------------------------------------


def greedy_recompute(model: ParVL, ids, pv, n: int, **branches) -> list[int]:
    out = []
    with torch.no_grad():
        base, _ = model.embed(ids[None], pv, branches.get("vision_branch"))
        for _ in range(n):
            gen = model.language_model.model.embed_tokens(torch.tensor([out], dtype=torch.long))
            x = torch.cat([base, gen], 1)
            h, _ = model.hidden_from_embeds(
                x,
                torch.arange(x.shape[1])[None],
                rows=model.language_rows(branches.get("language_branch"), 1, "cpu"),
            )
            out.append(int(model.language_model.lm_head(h[0, -1]).argmax()))
    return out


def test_cached_branches_equal_recompute_and_batching():
    model = tiny(pv=2, pl=2, seed=6)
    (ids1, pv1), (ids2, _) = prompt(1, seed=5), prompt(0, text=20, seed=6)
    cfg = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
    engine = Engine(model)
    alone = [
        engine.generate([i.tolist()], p, cfg, []).tokens[0] for i, p in ((ids1, pv1), (ids2, None))
    ]
    assert alone[0] == greedy_recompute(model, ids1, pv1, NEW)
    assert alone[1] == greedy_recompute(model, ids2, None, NEW)
    assert engine.generate([ids1.tolist(), ids2.tolist()], pv1, cfg, []).tokens == alone


def test_shared_kv():
    cfg = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
    (ids1, pv1), (ids2, _) = prompt(1, seed=8), prompt(0, text=20, seed=9)
    batch = [ids1.tolist(), ids2.tolist()]
    # P = 1: one branch, nothing to share: identical to the standard cache
    one = tiny(seed=8)
    assert (
        Engine(one, shared_kv=True).generate(batch, pv1, cfg, []).tokens
        == Engine(one).generate(batch, pv1, cfg, []).tokens
    )
    # identical branches: the mean of identical K/V is exact, so shared KV must equal standard decoding
    model = same_prefixes(tiny(pv=2, pl=3, seed=9), 0, 2)
    cache = lambda: model.language_model.model.layers[0].self_attn.kv_cache.k  # noqa: E731
    shared_tokens = Engine(model, shared_kv=True).generate(batch, pv1, cfg, []).tokens
    shared_rows = cache().shape[0]
    assert shared_tokens == Engine(model).generate(batch, pv1, cfg, []).tokens
    # one token cache per sample instead of per branch
    assert (shared_rows, cache().shape[0]) == (2, 3 * 2)
    # distinct branches: an approximation of dense decoding, checked against Appendix C.2 written out
    distinct = tiny(pl=3, seed=10)
    distinct.init_branches(std=0.5)
    from inference.engine import prefill

    for ids, pv in ((ids1, pv1), (ids2, None)):
        want, first = shared_kv_greedy_by_hand(distinct, ids, pv, NEW)
        assert (
            Engine(distinct, shared_kv=True).generate([ids.tolist()], pv, cfg, []).tokens[0] == want
        )
        logits = {}
        for shared in (True, False):  # the prefill logits: the approximation is visible there
            rows = distinct.language_rows(None, 1, "cpu", shared)
            distinct.language_model.setup_cache(rows, len(ids))
            with torch.no_grad():
                logits[shared] = prefill(
                    distinct,
                    ids[None],
                    pv,
                    torch.ones(1, len(ids), dtype=torch.bool),
                    False,
                    None,
                    rows,
                )[0]
        torch.testing.assert_close(logits[True], first, atol=2e-5, rtol=1e-5)
        assert (logits[True] - logits[False]).abs().max() > 1e-3  # shared KV is not dense decoding


@torch.no_grad()
def shared_kv_greedy_by_hand(model: ParVL, ids, pv, n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding under Appendix C.2 without a cache: in every layer each branch's token K/V are
    replaced by their fp32 mean over the P branches; branch p's queries attend to [prefix_p; mean
    token K/V] causally, with every prefix slot visible. Recomputed from scratch for each token.
    Returns the tokens and the logits of the first one [V]."""
    lm, cfg = model.language_model, model.cfg.llm
    P, G = model.cfg.par.pl, cfg.num_heads // cfg.num_kv_heads
    base, _ = model.embed(ids[None], pv)
    out, first = [], None
    for _ in range(n):
        x = torch.cat([base, lm.model.embed_tokens(torch.tensor([out], dtype=torch.long))], 1)
        T = x.shape[1]
        cos, sin = lm.model.rope_cos[:T][None], lm.model.rope_sin[:T][None]
        h = x.repeat(P, 1, 1)  # [P,T,C]: the P branches of the one sample
        for layer in lm.model.layers:
            a = layer.self_attn
            y = layer.input_layernorm(h)
            q = apply_rope(
                a.q_norm(a.q_proj(y).view(P, T, -1, cfg.head_dim)).transpose(1, 2), cos, sin
            )
            k = apply_rope(
                a.k_norm(a.k_proj(y).view(P, T, -1, cfg.head_dim)).transpose(1, 2), cos, sin
            )
            v = a.v_proj(y).view(P, T, -1, cfg.head_dim).transpose(1, 2)
            # shared tokens
            k, v = (k.mean(0, keepdim=True).expand_as(k), v.mean(0, keepdim=True).expand_as(v))
            K = torch.cat([a.prefix_k, k], 2).repeat_interleave(G, 1)
            V = torch.cat([a.prefix_v, v], 2).repeat_interleave(G, 1)
            s = (q @ K.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
            Lp = a.prefix_k.shape[2]
            allowed = torch.ones(T, Lp + T, dtype=torch.bool)
            allowed[:, Lp:] = torch.ones(T, T, dtype=torch.bool).tril()
            o = (
                (s.masked_fill(~allowed, float("-inf")).softmax(-1) @ V)
                .transpose(1, 2)
                .reshape(P, T, -1)
            )
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        fused, _ = model.language_aggregator(lm.model.norm(h)[:, -1:])
        logits = lm.lm_head(fused[0, -1])
        first = logits if first is None else first
        out.append(int(logits.argmax()))
    return out, first


def test_single_pair_equals_model_with_that_pairs_prefixes():
    model = tiny(pv=2, pl=2, seed=11)
    copy = same_prefixes(model, 0, 1)
    ids, pv = prompt(1, seed=10)
    cfg = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
    pair = (
        Engine(model, vision_branch=0, language_branch=1)
        .generate([ids.tolist()], pv, cfg, [])
        .tokens
    )
    assert pair == Engine(copy).generate([ids.tolist()], pv, cfg, []).tokens
    assert pair[0] == greedy_recompute(model, ids, pv, NEW, vision_branch=0, language_branch=1)


# -- saving and loading -------------------------------------------------------------------------


def test_save_round_trip_bit_exact(tmp_path):
    model = tiny(pv=2, pl=2, seed=12)
    save_pretrained(model, tmp_path / "m")
    back = load_pretrained(tmp_path / "m")
    assert back.cfg.par == model.cfg.par
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values())
    )
    ids, pv = prompt(1, seed=11)
    assert torch.equal(model(ids[None], pv), back(ids[None], pv))
    with pytest.raises(ValueError, match="2:2"):
        load_pretrained(tmp_path / "m", pv=4)


def test_one_one_save_is_an_internvl_checkpoint(checkpoint, tmp_path):
    folder = checkpoint("qwen3", "original")
    save_pretrained(load_pretrained(folder), tmp_path / "out")
    ours, theirs = read_safetensors(tmp_path / "out"), read_safetensors(folder)
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (
        cfg["architectures"] == ["InternVLChatModel"] and cfg["llm_config"]["model_type"] == "qwen3"
    )
    assert (tmp_path / "out" / "vocab.json").exists()  # tokenizer files travel with the weights


# -- ParScale ----------------------------------------------------------------------------------


def parscale_model(P=3, seed=13) -> ParVL:
    llm = LLMConfig(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=80,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        qkv_bias=True,
        qk_norm=False,
        max_position_embeddings=512,
    )
    cfg = ParVLConfig(
        vit=None, llm=llm, par=ParConfig(pl=P, llm_prefix_len=6, lambda_l=0.05), image_token_id=-1
    )
    return ParVL.from_config(cfg, seed=seed).eval()


def write_parscale(model: ParVL, folder) -> None:
    """The ParScale checkpoint layout, written independently of the loader: Qwen2 keys, per-layer
    prefix_k/prefix_v, model.aggregate_layer.{0,2} whose input is the (h p) hidden-major concat."""
    P, C = model.cfg.par.pl, model.cfg.llm.hidden_size
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("language_aggregator.mlp."):
            key = "model.aggregate_layer." + k.removeprefix("language_aggregator.mlp.")
            if key.endswith("0.weight"):  # ours: column p*C + h; ParScale: column h*P + p
                v = v.view(C, P, C).transpose(1, 2).reshape(C, P * C)
            state[key] = v.contiguous()
        else:
            state[k.removeprefix("language_model.")] = v.contiguous()
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"))
    t = model.cfg.llm
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen2ParScaleForCausalLM"],
                "model_type": "qwen2_parscale",
                "vocab_size": t.vocab_size,
                "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_layers,
                "num_attention_heads": t.num_heads,
                "num_key_value_heads": t.num_kv_heads,
                "rms_norm_eps": t.rms_norm_eps,
                "rope_theta": t.rope_theta,
                "max_position_embeddings": t.max_position_embeddings,
                "tie_word_embeddings": False,
                "parscale_n": P,
                "parscale_n_tokens": model.cfg.par.llm_prefix_len,
                "parscale_attn_smooth": model.cfg.par.lambda_l,
            }
        )
    )


def test_parscale_checkpoint_loads_to_identical_outputs(tmp_path):
    model = parscale_model()
    write_parscale(model, tmp_path / "ps")
    back = load_pretrained(tmp_path / "ps")
    assert back.cfg.par == model.cfg.par and back.cfg.vit is None
    ids = torch.randint(0, 256, (2, 17))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    assert torch.equal(model(ids, attention_mask=mask), back(ids, attention_mask=mask))
    cfg = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
    assert (
        Engine(back).generate([ids[0].tolist()], None, cfg, []).tokens
        == Engine(model).generate([ids[0].tolist()], None, cfg, []).tokens
    )


def test_parscale_hidden_major_aggregation_by_hand():
    """ParScale's rule, written with its own (h p) concat: weights from the ParScale-layout matrix."""
    P, B, T, C = 3, 2, 5, 8
    agg = Aggregator(P, C, smoothing=0.05)
    torch.nn.init.normal_(agg.mlp[2].weight)
    z = torch.randn(P * B, T, C)
    w0 = agg.mlp[0].weight.view(C, P, C).transpose(1, 2).reshape(C, P * C)  # ParScale layout
    concat = z.view(P, B, T, C).permute(1, 2, 3, 0).reshape(B, T, C * P)  # "(p b) t h -> b t (h p)"
    logits = torch.nn.functional.linear(
        torch.nn.functional.silu(torch.nn.functional.linear(concat, w0, agg.mlp[0].bias)),
        agg.mlp[2].weight,
        agg.mlp[2].bias,
    )
    a = logits.float().softmax(-1) * (1 - 0.05) + 0.05 / P  # [B,T,P]
    ref = (z.view(P, B, T, C).permute(1, 2, 0, 3) * a[..., None]).sum(2)
    fused, w = agg(z)
    torch.testing.assert_close(fused, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w, a, atol=1e-7, rtol=1e-6)


def test_cli_takes_branches_from_the_checkpoint(checkpoint, tmp_path, capsys):
    """generate.py on a saved 2:2 ParVL checkpoint (its main, in this process: a new interpreter per
    call only adds imports): the answer equals the in-process engine's, with standard, shared-KV and
    single-pair decoding."""
    import numpy as np
    from PIL import Image

    import generate
    from data.processor import Tokenizer, build_prompt, load_image

    model = load_pretrained(checkpoint("qwen3", "original"), pv=2, pl=2)
    model.init_branches(std=0.5)  # larger prefixes, so the branches visibly matter
    folder = tmp_path / "parvl22"
    save_pretrained(model, folder)
    png = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 500, 3), dtype=np.uint8)).save(
        png
    )
    tok = Tokenizer.from_pretrained(folder)
    pv = load_image(png, max_tiles=2)
    ids = tok.encode(build_prompt("What is this?", [pv.shape[0]]))
    for flags, engine in [
        ([], Engine(model)),
        (["--shared-kv"], Engine(model, shared_kv=True)),
        (
            ["--vision-branch", "1", "--language-branch", "0"],
            Engine(model, vision_branch=1, language_branch=0),
        ),
    ]:
        rc = generate.main(
            [
                str(png),
                "What is this?",
                "--model",
                str(folder),
                "--max-new-tokens",
                str(NEW),
                "--max-tiles",
                "2",
                "--json",
                *flags,
            ]
        )
        out = capsys.readouterr()
        assert rc == 0, out.err
        want = engine.generate([ids], pv, GenerateConfig(max_new_tokens=NEW), tok.eos_ids).tokens[0]
        assert json.loads(out.out)["answer"] == tok.answer(want), flags
        assert "Pv:Pl = 2:2" in out.err


# -- a branch pair per sample ----------------------------------------------------------------------


def left_padded(samples):
    """[(ids [T_b], pixels or None)] -> ids [B,T] left-padded with 0, attention mask [B,T], all tiles."""
    T = max(len(ids) for ids, _ in samples)
    ids = torch.zeros(len(samples), T, dtype=torch.long)
    mask = torch.zeros(len(samples), T, dtype=torch.long)
    for b, (s, _) in enumerate(samples):
        ids[b, T - len(s) :], mask[b, T - len(s) :] = s, 1
    tiles = [p for _, p in samples if p is not None]
    return ids, mask, torch.cat(tiles) if tiles else None


def count_rows(model: ParVL):
    """Forward pre-hooks on the first ViT and LLM block: how many rows enter each tower per call."""
    seen = {"vit": [], "llm": []}
    blocks = {"llm": model.language_model.model.layers[0]}
    if model.cfg.vit is not None:
        blocks["vit"] = model.vision_model.encoder.layers[0]
    for name, block in blocks.items():
        block.register_forward_pre_hook(
            lambda _m, args, name=name: seen[name].append(args[0].shape[0])
        )
    return seen


@torch.no_grad()
def make_branches_matter(model: ParVL) -> ParVL:
    """Large prefixes, and ViT attention with weight (a tiny random ViT's blocks barely move the
    patch embedding: ls = 0.1, weights ~ N(0, 0.02^2)), so running the wrong branch shows in the logits."""
    model.init_branches(std=0.5)
    # 5 prefix slots among 1025 tokens: they need large keys to be heard
    if model.cfg.vit is not None:
        for layer in model.vision_model.encoder.layers:
            torch.nn.init.normal_(layer.attn.qkv.weight, std=0.3)
            layer.ls1.fill_(1.0)
            for lora in (
                layer.attn.qkv_lora,
                layer.attn.proj_lora,
                layer.mlp.fc1_lora,
                layer.mlp.fc2_lora,
            ):
                # LoRA branches start equal (B = 0): large updates set them apart
                if lora is not None:
                    torch.nn.init.normal_(lora.lora_B, std=0.3)
            if layer.attn.prefix_k is not None:
                torch.nn.init.normal_(layer.attn.prefix_k, std=3.0)
                torch.nn.init.normal_(layer.attn.prefix_v, std=3.0)
    return model


# mixed tile counts, a text-only sample, left padding (lengths differ), a repeated pair
SAMPLES = [(2, 10), (0, 23), (1, 6), (3, 8), (1, 14)]  # (tiles, text tokens)


@pytest.mark.parametrize(
    "pv,pl,vision,moe",
    [
        (2, 1, "prefix", False),
        (1, 3, "prefix", False),
        (4, 4, "prefix", False),
        (3, 2, "lora", False),
        pytest.param(2, 3, "prefix", True, marks=pytest.mark.slow),  # Qwen3-MoE (test_moe.py's too)
    ],
)
def test_per_sample_pairs_equal_each_sample_alone(pv, pl, vision, moe):
    """A batch whose samples carry their own (v, l) pair equals each sample run alone with that pair:
    logits within fp32 noise, greedy tokens identical; B rows enter the ViT (one per tile) and the LLM
    blocks, not P*B; and one tower per sample with the other dense equals it alone too. The same for
    LoRA vision branches (Figure 3), which run through the same rows."""
    model = make_branches_matter(
        tiny(pv=pv, pl=pl, seed=20 + pv + pl, moe=moe, vision_branches=vision, lora_rank=3)
    )
    samples = [prompt(t, text=n, seed=30 + k) for k, (t, n) in enumerate(SAMPLES)]
    g = torch.Generator().manual_seed(pv * 10 + pl)
    vb = torch.randint(0, pv, (len(samples),), generator=g).tolist()
    lb = torch.randint(0, pl, (len(samples),), generator=g).tolist()
    vb[4], lb[4] = vb[0], lb[0]  # a repeated pair
    ids, mask, pixels = left_padded(samples)
    seen = count_rows(model)
    cfg = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
    for v_choice, l_choice in [(vb, lb), (vb, None), (None, lb)]:
        seen["vit"].clear(), seen["llm"].clear()
        with torch.no_grad():
            batch = model(ids, pixels, mask, vision_branch=v_choice, language_branch=l_choice)
        tiles = sum(t for t, _ in SAMPLES)
        assert seen["vit"] == [tiles if v_choice is not None else pv * tiles]
        assert seen["llm"] == [len(samples) if l_choice is not None else pl * len(samples)]
        for b, (s_ids, s_pix) in enumerate(samples):
            one_v = None if v_choice is None else v_choice[b]
            one_l = None if l_choice is None else l_choice[b]
            with torch.no_grad():
                alone = model(s_ids[None], s_pix, vision_branch=one_v, language_branch=one_l)[0]
            # padded vs unpadded attention: the same sums in another order (fp32 noise, ~1e-6)
            torch.testing.assert_close(
                batch[b, ids.shape[1] - len(s_ids) :], alone, atol=2e-5, rtol=1e-5
            )
    # greedy generation: the batch with per-sample pairs equals each prompt alone with its pair
    engine = Engine(model)
    got = engine.generate(
        [s.tolist() for s, _ in samples], pixels, cfg, [], vision_branch=vb, language_branch=lb
    ).tokens
    want = [
        Engine(model, vision_branch=v, language_branch=l)
        .generate([s.tolist()], p, cfg, [])
        .tokens[0]
        for (s, p), v, l in zip(samples, vb, lb)
    ]
    assert got == want
    assert got[0] == greedy_recompute(
        model, *samples[0], NEW, vision_branch=vb[0], language_branch=lb[0]
    )


def test_per_sample_pairs_differ_where_the_branches_differ():
    """The per-sample path must really run each sample's own branch: swapping two samples' language
    branches moves their logits by far more than the fp32 noise the equality tests allow."""
    model = make_branches_matter(tiny(pv=2, pl=2, seed=40))
    ids, mask, pixels = left_padded([prompt(1, seed=41), prompt(1, text=9, seed=42)])
    with torch.no_grad():
        a = model(ids, pixels, mask, vision_branch=[0, 1], language_branch=[0, 1])
        b = model(ids, pixels, mask, vision_branch=[0, 1], language_branch=[1, 0])
        c = model(ids, pixels, mask, vision_branch=[1, 0], language_branch=[0, 1])
    real = mask.bool()
    assert (a - b)[real].abs().max() > 1e-2 and (a - c)[real].abs().max() > 1e-2


@pytest.mark.slow
def test_compiled_decode_equals_eager_in_every_branch_mode():
    """decode_one_token compiled as Engine compiles it on CPU (fullgraph, the gemv backend) against
    eager on the same cache state: logits and the generated tokens, for per-sample pairs, dense and
    shared KV, three left-padded samples: the pairs' 3 rows are within GEMV_ROWS (the gemv path), the
    dense modes' 9 rows past it (the BLAS). One sample at 1:1 is test_generate's compiled test. (Each
    mode is a graph of its own, compiled cold in CI: three is what this costs.)"""
    from inference.cpu_decode import GEMV_ROWS, cpu_backend
    from inference.engine import decode_one_token, prefill

    batch = 3  # one LLM layer: the graphs are compiled cold in CI, and a second layer adds compile time, not cases
    cfg = replace(
        TINY,
        llm=replace(TINY.llm, num_layers=1),
        par=ParConfig(pv=2, pl=3, vit_prefix_len=5, llm_prefix_len=4),
    )
    model = make_branches_matter(ParVL.from_config(cfg, seed=43).eval())
    samples = [prompt(1, text=7, seed=44), prompt(0, text=12, seed=45), prompt(2, text=5, seed=46)][
        :batch
    ]
    prompts = [s.tolist() for s, _ in samples]
    ids, mask, pixels = left_padded(samples)
    valid, vb = mask.bool(), [1, 0, 1][:batch]
    compiled = torch.compile(decode_one_token, backend=cpu_backend, fullgraph=True)
    for lb, shared in [([2, 0, 1][:batch], False), (None, False), (None, True)]:
        rows = model.language_rows(lb, batch, "cpu", shared)
        # the path each case takes: gemv for one sample and for pairs, the BLAS for 3 samples x 3 dense rows
        assert (len(rows.branch) <= GEMV_ROWS) == (batch == 1 or lb is not None), len(rows.branch)
        S = ids.shape[1] + 8
        model.language_model.setup_cache(rows, S)
        with torch.no_grad():
            logits = prefill(model, ids, pixels, valid, batch > 1, vb, rows)
            token = logits.argmax(-1, keepdim=True)
            key_valid = torch.ones(batch, S, dtype=torch.bool)
            key_valid[:, : ids.shape[1]] = valid
            pos, positions = torch.tensor([ids.shape[1]]), valid.sum(-1, keepdim=True)
            eager = decode_one_token(model, token, pos, positions, key_valid, rows)
            fast = compiled(model, token, pos, positions, key_valid, rows)  # rewrites the same slot
        torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)
        cfg = GenerateConfig(max_new_tokens=NEW, ignore_eos=True)
        kw = dict(vision_branch=vb, language_branch=lb)
        assert (
            Engine(model, compile=True, shared_kv=shared)
            .generate(prompts, pixels, cfg, [], **kw)
            .tokens
            == Engine(model, shared_kv=shared).generate(prompts, pixels, cfg, [], **kw).tokens
        )


def test_bad_branch_choices_are_refused():
    model = tiny(pv=2, pl=2, seed=47)
    ids, mask, pixels = left_padded([prompt(1, seed=48), prompt(0, seed=49)])
    with pytest.raises(ValueError, match="out of range"):
        model(ids, pixels, mask, language_branch=[0, 2])
    with pytest.raises(ValueError, match="need 2 branch indices"):
        model(ids, pixels, mask, vision_branch=[0, 1, 1])
    with pytest.raises(ValueError, match="needs the tiles of each sample"):
        model.extract_features(pixels, vision_branch=[0])
    with pytest.raises(ValueError, match="sums to 2"):
        model.extract_features(pixels, vision_branch=[0, 1], num_tiles=[1, 1])
    with pytest.raises(ValueError, match=r"out of range: the model has 2 branches$"):
        model(ids, pixels, mask, vision_branch=[0, 2])


def test_branch_flag_out_of_range_names_the_tower_and_its_count():
    """--vision-branch / --language-branch beyond the checkpoint's branches: one line naming the flag, the
    tower's count in words that fit it (1 branch, 2 branches) and the range to pick from."""
    from inference.flags import check_branch_choice
    from shell.cli import UsageError

    par = ParConfig(pv=1, pl=4)
    with pytest.raises(UsageError) as e:
        check_branch_choice(par, 1, None)
    assert (
        str(e.value)
        == "--vision-branch 1 out of range: the checkpoint has 1 vision branch (0 to 0)"
    )
    with pytest.raises(UsageError) as e:
        check_branch_choice(par, 0, 4)
    assert (
        str(e.value)
        == "--language-branch 4 out of range: the checkpoint has 4 language branches (0 to 3)"
    )
    check_branch_choice(par, 0, 3)  # the last of each is a choice


@pytest.mark.slow
def test_length_buckets_equal_full_cache_attention():
    """Decode attends over the written slots rounded up to a bucket: the same logits as over the whole
    cache (the masked slots weigh exactly 0), eager and compiled as Engine compiles it, and the same
    tokens, for dense, shared-KV and per-sample rows with left padding."""
    from inference.cpu_decode import cpu_backend
    from inference.engine import decode_one_token, prefill

    compiled = torch.compile(decode_one_token, backend=cpu_backend, fullgraph=True)

    model = make_branches_matter(tiny(pv=2, pl=2, seed=50))
    samples = [prompt(1, text=7, seed=51), prompt(0, text=12, seed=52)]
    ids, mask, pixels = left_padded(samples)
    valid, T, S = mask.bool(), ids.shape[1], ids.shape[1] + 300
    for lb, shared in [(None, False), (None, True), ([1, 0], False)]:
        rows = model.language_rows(lb, 2, "cpu", shared)
        model.language_model.setup_cache(rows, S)
        with torch.no_grad():
            token = prefill(model, ids, pixels, valid, True, None, rows).argmax(-1, keepdim=True)
            key_valid = torch.ones(2, S, dtype=torch.bool)
            key_valid[:, :T] = valid
            step = (token, torch.tensor([T]), valid.sum(-1, keepdim=True))
            full = decode_one_token(model, *step, key_valid, rows)
            # rewrites the same slot
            bucketed = decode_one_token(model, *step, key_valid[:, : T + 7], rows)
            bucketed_compiled = compiled(model, *step, key_valid[:, : T + 7], rows)
        torch.testing.assert_close(bucketed, full, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(bucketed_compiled, full, atol=1e-5, rtol=1e-5)
        prompts = [s.tolist() for s, _ in samples]
        tokens = [
            Engine(model, shared_kv=shared)
            .generate(
                prompts,
                pixels,
                GenerateConfig(max_new_tokens=NEW, ignore_eos=True, bucket=bucket),
                [],
                language_branch=lb,
            )
            .tokens
            for bucket in (4, 0)
        ]
        assert tokens[0] == tokens[1]


def test_lora_dropout_trains_as_internvl_and_recomputes_alike():
    """Issue 47, item 5: LoRA vision branches as InternVL's wrap_backbone_lora builds them, dropout 0.05 on the
    update's input while training (train.py --lora-dropout sets it; none in eval, none on W x). A ViT block
    that draws those masks must recompute them alike under activation checkpointing: with its RNG state kept
    (fsdp.build_model's preserve_rng_state for the ViT of a LoRA run) the gradients equal the plain block's;
    without it (the setting of blocks with no randomness) they do not."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from aggregate import LoRA
    from vit import Block

    cfg = ViTConfig(hidden_size=32, num_heads=4, intermediate_size=48, num_layers=1)
    torch.manual_seed(0)
    block = Block(cfg, 0.0, branches=2, lora_rank=4).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x, rows = torch.randn(2, 5, 32, dtype=torch.float64), Rows.choose(1, 2, 2, "cpu")

    def dropout(p: float) -> None:
        for m in block.modules():
            if isinstance(m, LoRA):
                m.dropout = p

    with torch.no_grad():
        eval_out = block.eval()(x, rows)
        torch.testing.assert_close(block.train()(x, rows), eval_out)  # a module built alone: none
        dropout(0.05)
        assert not torch.equal(block(x, rows), eval_out)  # masks drawn while training
        torch.testing.assert_close(block.eval()(x, rows), eval_out)  # and none in eval
    block.train()

    def grads(module) -> list[torch.Tensor]:
        block.zero_grad()
        torch.manual_seed(1)
        module(x, rows).square().sum().backward()
        return [p.grad.clone() for p in block.parameters()]

    plain = grads(block)
    kept = grads(checkpoint_wrapper(block, preserve_rng_state=True))
    lost = grads(checkpoint_wrapper(block, preserve_rng_state=False))
    assert all(torch.equal(a, b) for a, b in zip(plain, kept))
    assert not all(torch.allclose(a, b) for a, b in zip(plain, lost))
