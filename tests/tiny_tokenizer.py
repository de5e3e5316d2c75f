"""A tiny Qwen-style byte-level BPE tokenizer for tests.

The real Qwen2.5/Qwen3 tokenizers have ~151k tokens and live on the model hub, which tests cannot
reach. This module trains a few hundred BPE merges on a short built-in English + Chinese text and
writes a folder that looks like the real ones: the same normalizer (NFC), pre-tokenizer (the Qwen2
split regex, then byte-level without a prefix space) and decoder, and the added tokens appended
after the BPE vocabulary in the real order (Qwen specials, then InternVL's `<img>` ... `</box>`).

Two layouts are written, because checkpoints ship either one:
  "json"  -> tokenizer.json + tokenizer_config.json + added_tokens.json
  "vocab" -> vocab.json + merges.txt + added_tokens.json + tokenizer_config.json

Usage:  ids = write_tiny_tokenizer(tmp_path, layout="json", family="qwen3")
"""

import functools
import json
import os

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# The split regex of the Qwen2 family (also used by Qwen2.5 and Qwen3).
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Training text: enough repeated English and Chinese for a few hundred merges, plus the words the
# chat template uses, so prompts tokenize into a mix of merged and single-byte tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Please describe the image in detail.",
    "What is shown in this picture? There is a cat sitting on a red chair near the window.",
    "Image-1: compare the two images. Image-2: what are the differences between them?",
    "user assistant system You are a helpful assistant. Answer the question briefly.",
    "It's a sunny day; they're walking in the park and we've seen 3 birds, 42 trees.",
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。",
    "请详细描述这张图片。图片里有一只猫坐在红色的椅子上。这两张图片有什么不同？",
    "上海 人工智能 实验室 清华大学 模型 图片 描述 问题 回答 你好 世界",
    "def main():\n    print('hello world')\n\n\nif __name__ == '__main__':\n    main()\n",
]

# Added tokens in id order, as (content, special). Qwen marks its tool/think tags non-special; the
# InternVL image/grounding tags are added with special=True by the training code.
QWEN_SPECIALS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
]
QWEN3_EXTRAS = [
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
INTERNVL_TOKENS = [
    (t, True)
    for t in (
        "<img>",
        "</img>",
        "<IMG_CONTEXT>",
        "<quad>",
        "</quad>",
        "<ref>",
        "</ref>",
        "<box>",
        "</box>",
    )
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _pipeline(tok: Tokenizer) -> Tokenizer:
    """Attach the Qwen2 normalizer, pre-tokenizer, decoder and post-processor."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


@functools.cache
def _train_bpe(vocab_size: int = 560) -> tuple[tuple, tuple]:
    """Train merges once per process; return (vocab items, merges) in a fixed, real-looking order."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok = _pipeline(Tokenizer(models.BPE()))
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    # Re-number like a real GPT-2/Qwen vocab: the 256 byte characters first, then one id per merge
    # in merge order. This makes ids independent of how the trainer happens to number its alphabet.
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode().values())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return tuple(vocab.items()), tuple(merges)


def _added_tokens(family: str) -> list[tuple[str, bool]]:
    assert family in ("qwen2", "qwen3"), f"family must be 'qwen2' or 'qwen3', got {family!r}"
    return QWEN_SPECIALS + (QWEN3_EXTRAS if family == "qwen3" else []) + INTERNVL_TOKENS


def write_tiny_tokenizer(folder, layout: str = "json", family: str = "qwen3") -> dict:
    """Write a tiny Qwen-style tokenizer into `folder`; return the ids tests need."""
    assert layout in ("json", "vocab"), f"layout must be 'json' or 'vocab', got {layout!r}"
    os.makedirs(folder, exist_ok=True)
    vocab_items, merges = _train_bpe()
    vocab = dict(vocab_items)
    added = _added_tokens(family)
    added_ids = {content: len(vocab) + k for k, (content, _) in enumerate(added)}

    def dump(name, obj):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=2)

    if layout == "json":
        tok = _pipeline(Tokenizer(models.BPE(vocab=vocab, merges=list(merges))))
        # normalized=False: added tokens are matched on the raw text, as in the real tokenizer.json.
        for content, special in added:
            tok.add_tokens([AddedToken(content, special=special, normalized=False)])
        assert tok.token_to_id(added[-1][0]) == added_ids[added[-1][0]], "added ids drifted"
        tok.save(os.path.join(folder, "tokenizer.json"))
    else:
        dump("vocab.json", vocab)
        with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))

    dump("added_tokens.json", added_ids)
    dump(
        "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": {
                str(added_ids[c]): {
                    "content": c,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": s,
                }
                for c, s in added
            },
            "additional_special_tokens": [c for c, s in added if s and c != "<|endoftext|>"],
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 40960,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )

    return {
        "vocab_size_tokenizer": len(vocab) + len(added),
        "bpe_vocab_size": len(vocab),
        "endoftext_id": added_ids["<|endoftext|>"],
        "im_start_id": added_ids["<|im_start|>"],
        "im_end_id": added_ids["<|im_end|>"],
        "img_start_id": added_ids["<img>"],
        "img_end_id": added_ids["</img>"],
        "img_context_id": added_ids["<IMG_CONTEXT>"],
        "added_token_ids": dict(added_ids),
    }
