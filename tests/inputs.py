"""What the tests feed the model and the commands: prompts and tiles, a left-padded batch, the first decode
step's inputs, an SFT data set, a VLMEvalKit TSV and its images."""

from __future__ import annotations

import base64
import csv
import functools
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch
from official import IMAGE_SIZE, TOKENS_PER_TILE  # noqa: E402
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import parvl`


@functools.cache
def _tokenizer(folder: str):
    # Qwen2Tokenizer reads either file layout; AutoTokenizer would stop at the original config's
    # auto_map (remote code) and ask for trust_remote_code.
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer.from_pretrained(folder)


def prompt_ids(
    folder: Path, tiles_per_image: list[int], question: str = "Please describe the image."
) -> torch.Tensor:
    """1-D input ids of a chat prompt with one `<img>` + 256·n `<IMG_CONTEXT>` + `</img>` per image.

    Encoded with the checkpoint's own tokenizer files (chat() layout, no system turn).
    """
    images = "".join(
        f"Image-{i + 1}: <img>" + "<IMG_CONTEXT>" * (TOKENS_PER_TILE * n) + "</img>\n"
        for i, n in enumerate(tiles_per_image)
    )
    text = f"<|im_start|>user\n{images}{question}<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor(_tokenizer(str(folder))(text)["input_ids"], dtype=torch.long)
    img_context = _tokenizer(str(folder)).convert_tokens_to_ids("<IMG_CONTEXT>")
    assert int((ids == img_context).sum()) == TOKENS_PER_TILE * sum(tiles_per_image), (
        "image tokens miscounted"
    )
    return ids


def left_pad(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors into (input_ids [B,T], attention_mask [B,T]), as batch_chat does."""
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, t - len(s) :] = s
        mask[b, t - len(s) :] = 1
    return ids, mask


def random_pixels(n: int, seed: int = 0) -> torch.Tensor:
    """[n,3,448,448] fp32 pixel values, roughly ImageNet-normalized scale."""
    return torch.randn(
        (n, 3, IMAGE_SIZE, IMAGE_SIZE), generator=torch.Generator().manual_seed(seed)
    )


def first_decode_step(model, ids: list[int], pv: torch.Tensor, room: int = 4) -> tuple:
    """The inputs of engine.decode_one_token's first step after a prefill of one prompt (ids, its images pv)
    on a fresh cache of len(ids) + room slots: (token, position, positions, mask, rows)."""
    from inference.engine import prefill

    rows, T = model.language_rows(None, 1, "cpu"), len(ids)
    model.language_model.setup_cache(rows, T + room)
    with torch.no_grad():
        logits = prefill(
            model, torch.tensor([ids]), pv, torch.ones(1, T, dtype=torch.bool), False, None, rows
        )
    return (
        logits.argmax(-1, keepdim=True),
        torch.tensor([T]),
        torch.tensor([[T]]),
        torch.ones(1, T + room, dtype=torch.bool),
        rows,
    )


QA = [
    ("What colour dominates?", "Mostly red with some blue."),
    ("Describe it.", "A noisy square."),
    ("Is it bright?", "Fairly bright."),
    ("Count the shapes.", "There are none, only noise."),
]


def write_dataset(folder: Path, rows: int = 8, bad: int = 0, repeat: float = 1.0) -> Path:
    """A meta JSON + JSONL in the official format: images (1 or 2 per row), text-only rows, and
    `bad` rows whose image is missing."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for k in range(3):
        Image.fromarray(rng.integers(0, 255, (60 + 40 * k, 90, 3), dtype=np.uint8)).save(
            folder / f"img{k}.png"
        )
    lines = []
    for i in range(rows):
        q, a = QA[i % len(QA)]
        if i % 4 == 3:
            lines.append(
                {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            )
        elif i % 4 == 2:
            lines.append(
                {
                    "image": ["img0.png", "img1.png"],
                    "conversations": [
                        {"from": "human", "value": f"<image>\n<image>\n{q}"},
                        {"from": "gpt", "value": a},
                        {"from": "human", "value": "And then?"},
                        {"from": "gpt", "value": "Nothing more."},
                    ],
                }
            )
        else:
            lines.append(
                {
                    "image": f"img{i % 3}.png",
                    "conversations": [
                        {"from": "human", "value": f"<image>\n{q}"},
                        {"from": "gpt", "value": a},
                    ],
                }
            )
    for i in range(bad):
        lines.insert(
            1 + 3 * i,
            {
                "image": "missing.png",
                "conversations": [
                    {"from": "human", "value": "<image>\nHi"},
                    {"from": "gpt", "value": "Hello."},
                ],
            },
        )
    (folder / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    meta = {
        "tiny": {
            "root": str(folder),
            "annotation": str(folder / "train.jsonl"),
            "repeat_time": repeat,
            "length": len(lines),
            "data_augment": False,
        }
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / "meta.json"


def write_tsv(path: Path, rows: list[dict]) -> Path:
    """A TSV the way VLMEvalKit writes one (pandas to_csv(sep='\\t'): csv quoting, minimal)."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(cols)
        for r in rows:
            w.writerow([r.get(c, "") for c in cols])
    return path


def png_b64(w: int, h: int, seed: int) -> str:
    arr = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()
