"""What `evaluate.py run` asks of each benchmark row, as VLMEvalKit builds it for InternVL3.5 (vlm/internvl/
internvl_chat.py InternVLChat.build_prompt, set_max_num, generate_v2; vlm/internvl/utils.py
build_multi_choice_prompt, reorganize_prompt): the question text, the tile budget, the prompt and the tiles.

A row's image is decoded when its prompt is made (a corrupt one skips the row) and again when its batch runs
(only one batch of pixels is ever held); an image several rows share by index (tsv.Benchmark.shared) is decoded
once and its tiles made once per budget (RowImages), so a benchmark of many rows over one image costs one image.
Run the tests: python -m pytest tests/test_evaluate.py -q
"""

from __future__ import annotations

import re
from collections import OrderedDict

import torch
from PIL import Image

from data.processor import (
    MAX_TILES,
    ImageError,
    build_prompt,
    load_image,
    open_base64,
    place_images,
    tile_count,
)
from evaluation.tsv import as_list, options

# Per benchmark: prompt kind (InternVLChat.build_prompt by DATASET_TYPE), tile budget (set_max_num:
# 12 for ChartQA_TEST / MMMU_DEV_VAL, 18 for DocVQA_VAL, 24 for OCRBench, else 6). max_new_tokens
# is InternVLChat's default of 4096 for all nine (vlmeval/config.py passes none for InternVL3.5).
PROTOCOL = {
    "MMMU_DEV_VAL": ("mcq", 12),
    "MathVista_MINI": ("plain", 6),
    "MathVision_MINI": ("plain", 6),
    "LogicVista": ("plain", 6),
    "WeMath": ("mcq", 6),
    "ChartQA_TEST": ("short", 12),
    "TextVQA_VAL": ("short", 6),
    "DocVQA_VAL": ("short", 18),
    "OCRBench": ("short", 24),
}
TOTAL_MAX_TILES = MAX_TILES  # set_max_num's total_max_num: a row's images share 64 tiles
_CJK = re.compile("[\u4e00-\u9fa5]")  # smp/misc.py cn_string
KEEP = 8  # shared images (and their tiles) kept decoded: rows that share one mostly come together


def question_text(benchmark: str, row: dict) -> str:
    """The text InternVLChat.build_prompt produces for one TSV row."""
    kind = PROTOCOL[benchmark][0]
    q = row["question"] or "nan"
    if kind == "short":  # VQA datasets listed for a one-word answer
        return q + "\nAnswer the question using a single word or phrase."
    if kind == "plain":  # MathVista, MathVision, LogicVista: the question as stored
        return q
    # utils.py build_multi_choice_prompt: hint, question, "\nA. ...", then the instruction
    if row.get("hint") is not None:
        q = row["hint"] + "\n" + q
    opts = options(row)
    q += "".join(f"\n{k}. {v}" for k, v in opts.items())
    cn = _CJK.search(q) is not None
    if opts:
        return q + (
            "\n请直接回答选项字母。"
            if cn
            else "\nAnswer with the option's letter from the given choices directly."
        )
    return q + ("\n请直接回答问题。" if cn else "\nAnswer the question directly.")


def decode_images(cell: str) -> list:
    """A row's image cell as RGB PIL images (VLMEvalKit writes them to PNG first: lossless)."""
    return [open_base64(b64, str(k)) for k, b64 in enumerate(as_list(cell))]


class RowImages:
    """The images of a benchmark's rows: a cell in `shared` (the cells rows name by index) is decoded once and its
    tiles made once per budget, the KEEP most recent kept; any other cell is decoded for its row alone."""

    def __init__(self, shared=(), keep: int = KEEP):
        self.shared, self.keep = set(shared), keep
        # (cell,) -> images, (cell, k, tiles) -> tiles; least recent first
        self.cache: OrderedDict = OrderedDict()

    def cached(self, key: tuple, make):
        if key[0] not in self.shared:
            return make()
        if key not in self.cache:
            self.cache[key] = make()
            if len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        return self.cache[key]

    def images(self, benchmark: str, row: dict) -> list:
        """The row's images, MMMU's first upscaled 2x as generate_v2 does; a corrupt image raises ValueError."""
        cell = row.get("image")
        try:
            images = (
                list(self.cached((cell,), lambda: decode_images(cell))) if cell is not None else []
            )
            # a new image: the cached one stays as decoded
            if images and benchmark == "MMMU_DEV_VAL":
                images[0] = images[0].resize(
                    (images[0].width * 2, images[0].height * 2), Image.BILINEAR
                )
        except (ImageError, OSError, ValueError) as e:
            raise ValueError(f"corrupt image: {' '.join(str(e).split())[:200]}") from None
        return images

    def inputs(self, benchmark: str, row: dict, max_tiles: int | None, mcfg, tiles: bool = True):
        """(prompt string, pixel tiles [N,3,px,px] or None) for one row, as generate_v2 builds them; tile size,
        thumbnail and tokens per tile from the model config mcfg. With tiles=False the tiles are counted, not
        made (the prompt alone). A corrupt image raises ValueError."""
        images = self.images(benchmark, row)
        per_image = max(
            1, min(max_tiles or PROTOCOL[benchmark][1], TOTAL_MAX_TILES // max(1, len(images)))
        )
        size, thumb = mcfg.vit.image_size if images else 0, mcfg.use_thumbnail
        counts = [tile_count(img, per_image, size, thumb) for img in images]
        # reorganize_prompt's
        text = place_images(question_text(benchmark, row), len(images), always=True)
        prompt = build_prompt(text, counts, tokens_per_tile=mcfg.tokens_per_tile)
        if not tiles or not images:
            return prompt, None
        made = [
            self.cached(
                (row["image"], k, per_image),
                lambda img=img: load_image(
                    img, max_tiles=per_image, use_thumbnail=thumb, image_size=size
                ),
            )
            for k, img in enumerate(images)
        ]
        return prompt, torch.cat(made) if len(made) > 1 else made[0]
