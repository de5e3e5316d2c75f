"""Supervised fine-tuning data in the official InternVL format (internvl/train/dataset.py,
internvl_chat_finetune.py of OpenGVLab/InternVL): rows in, samples out.

A meta JSON names the datasets; each is a JSONL annotation file of chat rows, optionally with
images. `SFTData` turns row i into token ids, labels and pixel tiles exactly as the official
`preprocess_internvl2_5` does; batches.py cuts them into global batches, ranks and micro-batches.
Bad rows and the rule for how many may be bad are bad_rows.py's.

    data = SFTData("meta.json", Tokenizer.from_pretrained(ckpt), max_tiles=12, max_seq_len=32768)
    sample = data[0]  # Sample(input_ids [T], labels [T], pixel_values [N,3,448,448], num_tiles), or a BadRow

Meta file: {name: {"root", "annotation", "repeat_time", "length", "data_augment",
"max_dynamic_patch"?}}. A relative "annotation" or "root" is taken relative to the meta file's
folder (the official code uses the working directory; a meta file is more portable this way).
Rows that cannot be used come back as `BadRow(reason, detail)` and are skipped by the trainer,
never raised. Run the tests: python -m pytest tests/test_data.py -q
"""

import errno
import io
import json
import os
from array import array
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from data.processor import (
    DEFAULT_SYSTEM_MESSAGE,
    IM_START,
    IMAGE_PLACEHOLDER,
    IMAGE_SIZE,
    IMG_CONTEXT,
    MAX_TILES,
    NUM_IMAGE_TOKENS,
    ImageError,
    expand_images,
    load_image,
    not_unicode,
    open_rgb,  # the decoder processor.load_image uses, with its error handling
    tile_image,
    turn,
)
from loss import IGNORE
from shell.cli import one_line
from shell.files import regular_file

BAD_REASONS = ("missing_image", "corrupt_image", "placeholder_mismatch", "too_long", "bad_row")
JPEG_QUALITIES = (75, 100)  # inclusive range of the official JPEG-degradation augmentation


@dataclass
class Sample:
    input_ids: torch.Tensor  # [T] int64
    labels: torch.Tensor  # [T] int64, IGNORE where no loss
    pixel_values: torch.Tensor  # [N, 3, 448, 448] float32, all images' tiles in order
    num_tiles: list[int]  # tiles per image (thumbnail included), sums to N
    row: int  # global row index in the SFTData


@dataclass
class BadRow:
    reason: str  # one of BAD_REASONS
    detail: str  # one line naming the dataset, line and cause
    row: int = -1


def repeat_rule(meta_path, name: str, m: dict, lines: int) -> tuple[int, int]:
    """A dataset's (kept, repeat) from its meta entry m and its annotation's line count, as InternVL's
    LazySupervisedDataset reads repeat_time r: r < 1 keeps the first floor(lines * r) lines, r > 1 repeats them
    int(r) times; r <= 0 is refused."""
    r = float(m.get("repeat_time", 1))
    if r <= 0:
        raise ValueError(f"{meta_path}: dataset {name!r} has repeat_time={r}, need > 0")
    return (int(lines * r) if r < 1 else lines), (int(r) if r > 1 else 1)


class SFTData(torch.utils.data.Dataset):
    """All rows of all datasets in a meta file, in meta order, after repeat_time."""

    def __init__(
        self,
        meta_path,
        tokenizer,
        max_tiles: int = 12,
        max_seq_len: int = 32768,
        system: str | None = None,
        image_token_id: int | None = None,
        num_image_token: int = NUM_IMAGE_TOKENS,
        image_size: int = IMAGE_SIZE,
        seed: int = 0,
        max_positions: int | None = None,
    ):
        """max_positions: the model's rotary table (max_position_embeddings); a longer sample is
        too_long whatever max_seq_len says (a packed row may be longer: positions restart per sample)."""
        if (
            min(
                max_tiles,
                max_seq_len,
                num_image_token,
                1 if max_positions is None else max_positions,
            )
            < 1
            or seed < 0
        ):
            raise ValueError(
                f"need max_tiles, max_seq_len, num_image_token, max_positions >= 1 and seed >= 0, got "
                f"{max_tiles}, {max_seq_len}, {num_image_token}, {max_positions}, {seed}"
            )
        self.tokenizer, self.max_seq_len, self.max_positions, self.seed = (
            tokenizer,
            max_seq_len,
            max_positions,
            seed,
        )
        self.system = DEFAULT_SYSTEM_MESSAGE if system is None else system
        # the model's tokens_per_tile, tile side
        self.num_image_token, self.image_size = (num_image_token, image_size)
        self.image_token_id = tokenizer.img_context_id
        if image_token_id is not None and image_token_id != self.image_token_id:
            raise ValueError(
                f"model image_token_id={image_token_id} but the tokenizer's "
                f"{IMG_CONTEXT} is {self.image_token_id}"
            )
        # Official masking: the first len(tokenize("<|im_start|>assistant\n")) tokens of every gpt
        # segment are ignored, whatever the response starts with (preprocess_internvl2_5).
        self.ignore_len = len(tokenizer.encode(IM_START + "assistant\n"))

        meta = _read_meta(os.fspath(meta_path))
        self.meta_path = os.path.abspath(meta_path)
        folder = os.path.dirname(self.meta_path)
        # dicts: name, root, path, offsets, lines, kept, repeat, augment, max_tiles
        self.datasets = [
            _dataset(meta_path, folder, name, m, max_tiles) for name, m in meta.items()
        ]
        sizes = [d["kept"] * d["repeat"] for d in self.datasets]
        # global row range of dataset k: starts[k:k+2]
        self.starts = np.cumsum([0] + sizes).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def epoch_order(self, seed: int) -> torch.Tensor:
        """A permutation of range(len(self)) [len] int64, the same for the same seed."""
        return torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))

    def locate(self, i: int) -> tuple[dict, int]:
        """(dataset, line number) of global row i; repeats cycle through the kept lines."""
        assert 0 <= i < len(self), f"row {i} out of range [0, {len(self)})"
        k = bisect_right(self.starts, i) - 1
        d = self.datasets[k]
        return d, (i - self.starts[k]) % d["kept"]

    def __getitem__(self, i: int) -> "Sample | BadRow":
        d, line = self.locate(i)
        # in the file, blank lines counted
        lineno = line + 1 if d["lines"] is None else int(d["lines"][line])
        where = f"{d['name']} line {lineno} of {d['path']}"
        try:
            return self._build(i, d, line)
        except _Bad as e:
            return BadRow(e.reason, f"{where}: {e}", i)

    # -- one row -------------------------------------------------------------------------------

    def _build(self, i: int, d: dict, line: int) -> Sample:
        with open(d["path"], "rb") as f:  # reopen per row: safe in forked DataLoader workers
            f.seek(int(d["offsets"][line]))
            raw = f.readline()
        try:
            item = json.loads(raw)
        except (ValueError, RecursionError) as e:  # ValueError covers bad JSON and bad UTF-8
            raise _Bad("bad_row", f"not JSON: {type(e).__name__}: {e}") from None
        system, turns = self._parse_turns(item)
        images = _image_list(item)

        # Placeholders live in human turns only; a first human turn without any gets one per image
        # in front: the official SFT preprocessing's rule, not the chat rule of processor.place_images
        # (training data is written one "<image>\n" per image). Every image must own one placeholder.
        human = [k for k, (role, _) in enumerate(turns) if role == "human"]
        if images and human and IMAGE_PLACEHOLDER not in turns[human[0]][1]:
            turns[human[0]] = (
                "human",
                (IMAGE_PLACEHOLDER + "\n") * len(images) + turns[human[0]][1],
            )
        n_slots = sum(text.count(IMAGE_PLACEHOLDER) for role, text in turns if role == "human")
        if n_slots != len(images):
            raise _Bad(
                "placeholder_mismatch",
                f"{n_slots} {IMAGE_PLACEHOLDER} placeholders in "
                f"human turns for {len(images)} images",
            )

        pixels, num_tiles = self._load_images(i, d, images)
        # placeholders in reading order across the human turns become each image's tokens
        expanded = iter(
            expand_images([turns[k][1] for k in human], num_tiles, self.num_image_token)
        )
        turns = [(role, next(expanded) if role == "human" else text) for role, text in turns]

        # Tokenize turn by turn, as the official preprocess_internvl2_5 does: each turn is encoded
        # on its own (no BOS) and the ids are concatenated.
        ids, labels = [], []
        for role, text in [("system", system)] + turns:
            seg = self.tokenizer.encode(
                turn({"system": "system", "human": "user", "gpt": "assistant"}[role], text)
            )
            ids += seg
            if role == "gpt":  # supervise the response and <|im_end|>, not the header nor "\n"
                labels += [IGNORE] * self.ignore_len + seg[self.ignore_len : -1] + [IGNORE]
            else:
                labels += [IGNORE] * len(seg)
        if len(ids) > self.max_seq_len:  # the official code truncates; we skip, never cut images
            raise _Bad("too_long", f"{len(ids)} tokens > max_seq_len={self.max_seq_len}")
        if self.max_positions is not None and len(ids) > self.max_positions:
            raise _Bad(
                "too_long",
                f"{len(ids)} tokens > the model's max_position_embeddings={self.max_positions}",
            )
        input_ids, labels = (
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(labels, dtype=torch.long),
        )
        # Text that spells <IMG_CONTEXT> itself would shift every image feature (the model fills the slots in order).
        n_img = int((input_ids == self.image_token_id).sum())
        if n_img != self.num_image_token * sum(num_tiles):
            raise _Bad(
                "placeholder_mismatch",
                f"{n_img} {IMG_CONTEXT} tokens for {sum(num_tiles)} "
                f"tiles (the text contains image tags)",
            )
        if not (labels != IGNORE).any():
            raise _Bad("bad_row", "no supervised token")
        return Sample(input_ids, labels, pixels, num_tiles, i)

    def _parse_turns(self, item) -> tuple[str, list[tuple[str, str]]]:
        """(system message, [(role, text)]) from a row; a leading system turn overrides the default.

        A conversation whose first turn is from gpt keeps it, supervised, right after the system
        message: that is what the official `preprocess_internvl2_5` (the template of InternVL2.5 to
        3.5) does. Only the older templates' `preprocess` functions drop a first turn that is not
        from human."""
        conv = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(conv, list) or not conv:
            other = next(
                (k for k in ("messages", "conversation") if isinstance(item, dict) and k in item),
                None,
            )
            raise _Bad(
                "bad_row",
                "no 'conversations' list"
                + (
                    f" (found {other!r}: the InternVL format is 'conversations' of from/value turns)"
                    if other
                    else ""
                ),
            )
        if all(
            isinstance(t, dict) and {"role", "content"} <= set(t) and "value" not in t for t in conv
        ):
            raise _Bad(
                "bad_row",
                "turns have role/content; the InternVL format is from/value, "
                'e.g. {"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}',
            )
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in conv):
            raise _Bad("bad_row", "every turn needs a string 'value'")
        for k, t in enumerate(conv):  # the tokenizer takes no lone surrogate ("\udcff" in the JSON)
            if why := not_unicode(t["value"]):
                raise _Bad("bad_row", f"turn {k + 1} {why}")
        system = self.system
        if conv[0].get("from") == "system":
            system, conv = conv[0]["value"], conv[1:]
        turns = [(t.get("from"), t["value"]) for t in conv]
        bad = sorted({str(r) for r, _ in turns} - {"human", "gpt"})
        if bad:  # a later system turn or "pretrain" rows have no meaning in this template
            raise _Bad("bad_row", f"unsupported role(s) {bad}")
        if "gpt" not in {r for r, _ in turns}:
            raise _Bad("bad_row", "no gpt turn")
        return system, turns

    def _load_images(self, i: int, d: dict, images: list[str]) -> tuple[torch.Tensor, list[int]]:
        """Tiles of every image [N,3,448,448] and the tile count of each, with the shared budget."""
        if not images:
            return torch.zeros(0, 3, self.image_size, self.image_size), []
        # images share the tile budget (official multi-image rule)
        budget = max(1, d["max_tiles"] // len(images))
        paths = [os.path.join(d["root"], p) for p in images]
        for p in paths:  # check all first, so a row with a missing file is always "missing_image"
            if not os.path.isfile(p):
                raise _Bad("missing_image", f"no file {p}")
        # One generator per (seed, row): the same row gets the same JPEG qualities after a resume,
        # in any worker; a repeated row (repeat_time > 1) has another index, so other qualities.
        rng = np.random.default_rng([self.seed, i]) if d["augment"] else None
        tiles = []
        try:
            for p in paths:
                if rng is None:
                    tiles.append(load_image(p, max_tiles=budget, image_size=self.image_size))
                    continue
                # The official transform re-encodes each tile (thumbnail included) as JPEG with its
                # own random quality, after tiling; load_image(tile, 1) then normalises it as is.
                parts = tile_image(open_rgb(p), budget, self.image_size)
                q = rng.integers(JPEG_QUALITIES[0], JPEG_QUALITIES[1] + 1, size=len(parts))
                tiles.append(
                    torch.cat(
                        [
                            load_image(_jpeg(t, int(qk)), max_tiles=1, image_size=self.image_size)
                            for t, qk in zip(parts, q)
                        ]
                    )
                )
        except ImageError as e:
            raise _Bad("corrupt_image", str(e)) from None
        return torch.cat(tiles), [t.shape[0] for t in tiles]


# ---------------------------------------------------------------------------------------------
# Validation


# ---------------------------------------------------------------------------------------------
# Helpers


class _Bad(Exception):
    """Internal: why a row is unusable; __getitem__ turns it into a BadRow."""

    def __init__(self, reason: str, detail: str):
        assert reason in BAD_REASONS, reason
        super().__init__(one_line(detail))  # one line, whatever the cause printed
        self.reason = reason


def _outcome(s) -> str:
    return s.reason if isinstance(s, BadRow) else "good"


def _bad_or_good(s) -> "BadRow | str":
    # a BadRow is small; a Sample's tiles need not travel
    return s if isinstance(s, BadRow) else "good"


def _dataset(meta_path, folder: str, name: str, m: dict, max_tiles: int) -> dict:
    """One dataset of the meta file: its annotation file indexed (line offsets), its repeat_time rule, its
    tile budget (the meta file's max_dynamic_patch, checked; else the caller's) and its image root."""
    path = os.path.join(folder, m["annotation"])  # join keeps an absolute path as is
    offsets, lines = _index_lines(path)
    kept, repeat = repeat_rule(meta_path, name, m, len(offsets))
    # the meta file's, checked; else the caller's
    tiles = m.get("max_dynamic_patch", max_tiles)
    if "max_dynamic_patch" in m and (
        isinstance(tiles, bool) or not isinstance(tiles, int) or not 1 <= tiles <= MAX_TILES
    ):
        raise ValueError(
            f"{meta_path}: dataset {name!r} has max_dynamic_patch={tiles!r}, need an integer in "
            f"[1, {MAX_TILES}] (the most tiles InternVL's pipelines give)"
        )
    root = os.path.join(folder, m["root"])
    # every image under it would be a "missing_image" bad row, the root unnamed
    if _link_loop(root):
        raise ValueError(
            f"{meta_path}: dataset {name!r} has root {root}, a symbolic link loop (links that "
            f"point at each other, never at a folder)"
        )
    return dict(
        name=name,
        root=root,
        path=path,
        offsets=offsets,
        lines=lines,
        kept=kept,
        repeat=repeat,
        augment=bool(m.get("data_augment", False)),
        max_tiles=tiles,
    )


def _read_meta(path: str) -> dict:
    regular_file(path, "meta file")  # a FIFO would block the read
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        meta = json.loads(text)
    except (
        OSError,
        ValueError,
        RecursionError,
    ) as e:  # RecursionError: nested deeper than the JSON reader goes
        hint = ""
        if isinstance(e, json.JSONDecodeError) and e.msg == "Extra data" and _looks_like_rows(text):
            hint = (
                " (this looks like a JSONL annotation file; --data takes the meta JSON that names it: "
                '{"name": {"root": "images/", "annotation": "train.jsonl"}})'
            )
        raise ValueError(f"cannot read meta file {path}: {type(e).__name__}: {e}{hint}") from None
    if _looks_like_rows(text):
        raise ValueError(
            f"meta file {path} holds a conversation row, not datasets: this looks like a JSONL "
            f"annotation file; --data takes the meta JSON that names it"
        )
    if not isinstance(meta, dict) or not meta:
        raise ValueError(f"meta file {path} must be a non-empty JSON object of datasets")
    for name, m in meta.items():
        if not isinstance(m, dict) or not {"root", "annotation"} <= set(m):
            raise ValueError(f"meta file {path}: dataset {name!r} needs 'root' and 'annotation'")
    return meta


def _looks_like_rows(text: str) -> bool:
    """Whether a would-be meta file starts with an annotation row (a JSONL file given by mistake)."""
    try:
        first = json.loads(text.lstrip().split("\n", 1)[0])
    except (ValueError, RecursionError):
        return False
    return isinstance(first, dict) and ("conversations" in first or "image" in first)


def _index_lines(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Byte offsets of the non-blank lines of a JSONL file (rows are parsed only when read), and their
    1-based line numbers in the file when blank lines make them differ from the row numbers."""
    offsets, lines, pos, n = array("q"), array("q"), 0, 0  # 8 bytes a line, not a parsed row
    regular_file(path, "annotation")  # a FIFO would block the read
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    offsets.append(pos)
                    lines.append(n)
                pos += len(line)
            if offsets:  # a file that is not JSON Lines at all fails here, not row by row
                f.seek(offsets[0])
                first = json.loads(f.readline())
                if not isinstance(first, dict):
                    raise ValueError(f"first line is a {type(first).__name__}, not an object")
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"cannot read annotation {path}: {type(e).__name__}: {e}") from None
    dense = len(lines) == 0 or lines[-1] == len(lines)  # no blank line before the last row
    return np.frombuffer(offsets, dtype=np.int64), None if dense else np.frombuffer(
        lines, dtype=np.int64
    )


def _link_loop(path: str) -> bool:
    """Whether resolving a link never ends (a link to itself, or links that point at each other)."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def _image_list(item: dict) -> list[str]:
    """The row's image paths; an absent, null, "" or [] image means a text-only row."""
    image = item.get("image")
    if not image:
        if item.get("video"):
            raise _Bad("bad_row", "video rows are not supported")
        return []
    images = [image] if isinstance(image, str) else image
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise _Bad("bad_row", f"'image' must be a path or a list of paths, got {image!r}")
    return images


def _jpeg(tile: Image.Image, quality: int) -> Image.Image:
    """Re-encode a tile as JPEG at `quality` and decode it again (the official degradation)."""
    buf = io.BytesIO()
    tile.save(buf, format="JPEG", quality=quality)
    buf.seek(0)
    with Image.open(buf) as f:
        f.load()
        return f.convert("RGB")
