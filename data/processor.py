"""Turn images and chat turns into the pixel tensors and token ids InternVL3.5 expects.

Follows the official InternVL code: dynamic tiling and ImageNet normalisation as in
internvl/train/dataset.py (`dynamic_preprocess`, `build_transform`), the special tokens and the
"internvl2_5" chat template (conversation.py) that `InternVLChatModel.chat()` uses, with only PIL, numpy, torch and the
`tokenizers` library, so the model side never imports transformers or torchvision.

    pixels = load_image("cat.jpg", max_tiles=12)                 # [N, 3, 448, 448] float32
    tok = Tokenizer.from_pretrained("/ckpt/InternVL3_5-1B")
    prompt = build_prompt("Describe the image.", [pixels.shape[0]])
    ids = tok.encode(prompt)        # <IMG_CONTEXT> appears 256 * N times; see tok.img_context_id

Test: python -m pytest tests/test_processor.py -q
"""

import base64
import binascii
import io
import json
import os
import sys

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _BackendTokenizer

IMG_START = "<img>"
IMG_END = "</img>"
IMG_CONTEXT = "<IMG_CONTEXT>"
IMAGE_PLACEHOLDER = "<image>"  # what users write; expanded by build_prompt
IMAGE_SIZE = 448  # tile side in pixels, the ViT input size
# The most tiles InternVL's own pipelines give a sample's images together (total_max_num: its MPDocVQA evaluation,
# VLMEvalKit's set_max_num for InternVL); a tile budget past it means nothing to them, and tile_grid's candidates
# grow with it (10**9 filled the memory). Every tile budget (--max-tiles, max_dynamic_patch) is bounded by it.
MAX_TILES = 64
NUM_IMAGE_TOKENS = 256  # (448 / 14)^2 patches, pixel-shuffled by 0.5 -> 16 x 16 tokens per tile
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_SYSTEM_MESSAGE = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位"
    "联合开发的多模态大语言模型。"
)

# Chat template "internvl2_5": MPT-style turns separated by "<|im_end|>\n" (InternVL conversation.py).
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
_SEP = IM_END + "\n"

# Qwen2-family pre-tokenizer split (shared by Qwen2.5 and Qwen3).
_QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class ImageError(ValueError):
    """An image file is missing, unreadable, not an image, or truncated."""


# ---------------------------------------------------------------------------------------------
# Images (InternVL internvl/train/dataset.py: dynamic_preprocess, build_transform)


def tile_grid(
    width: int, height: int, max_tiles: int = 12, min_tiles: int = 1, image_size: int = IMAGE_SIZE
) -> tuple[int, int]:
    """Pick the (cols, rows) grid whose aspect ratio is closest to width / height.

    Candidates are all grids with min_tiles <= cols * rows <= max_tiles, visited in increasing
    tile count. A strictly smaller aspect error wins; on an exact tie the later (larger) grid wins
    only if the image covers more than half of that grid's canvas, so small images stay small.
    """
    if not 1 <= min_tiles <= max_tiles:
        raise ValueError(
            f"need 1 <= min_tiles <= max_tiles, got min_tiles={min_tiles}, max_tiles={max_tiles}"
        )
    if width < 1 or height < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")

    # The official code builds a Python set with a triple loop (n, then cols and rows up to n) and
    # stably sorts it by tile count, so grids with the same count keep the set's iteration order,
    # which decides some exact ties. A set's layout depends only on the order in which its distinct
    # members first arrive (a repeat changes nothing), so we insert them in that same first-arrival
    # order: grids with cols, rows <= min_tiles, then for each larger m those with max(cols, rows) = m
    # ((1, m) .. (m-1, m), then (m, 1) .. (m, m)). That is O(max_tiles log max_tiles) candidates,
    # not the triple loop's O(max_tiles^3) steps.
    def first_arrivals():
        for c in range(1, min_tiles + 1):
            for r in range(1, min(min_tiles, max_tiles // c) + 1):
                if c * r >= min_tiles:
                    yield c, r
        for m in range(min_tiles + 1, max_tiles + 1):
            yield from (
                (c, m) for c in range(1, min(m - 1, max_tiles // m) + 1) if c * m >= min_tiles
            )
            yield from ((m, r) for r in range(1, min(m, max_tiles // m) + 1) if m * r >= min_tiles)

    grids = set(first_arrivals())
    grids = sorted(grids, key=lambda g: g[0] * g[1])

    aspect = width / height
    best, best_err = (1, 1), float("inf")
    for cols, rows in grids:
        err = abs(aspect - cols / rows)
        if err < best_err:
            best, best_err = (cols, rows), err
        elif err == best_err and width * height > 0.5 * image_size * image_size * cols * rows:
            best = (cols, rows)
    return best


def tile_count(
    img: Image.Image, max_tiles: int = 12, image_size: int = IMAGE_SIZE, use_thumbnail: bool = True
) -> int:
    """How many tiles tile_image makes of img (the thumbnail included), without making them: a
    prompt's length is known, and checked against the context, before any pixels are resized."""
    cols, rows = tile_grid(img.width, img.height, max_tiles, 1, image_size)
    return cols * rows + (use_thumbnail and cols * rows != 1)


def tile_image(
    img: Image.Image, max_tiles: int = 12, image_size: int = IMAGE_SIZE, use_thumbnail: bool = True
) -> list[Image.Image]:
    """Split an (RGB) image into grid tiles, row-major, plus a whole-image thumbnail last."""
    cols, rows = tile_grid(img.width, img.height, max_tiles, 1, image_size)
    # Stretch the original (no letterboxing) to the grid canvas. PIL's default filter is bicubic
    # for RGB, which is what the official code relies on by not passing one.
    canvas = img.resize((cols * image_size, rows * image_size))
    tiles = [
        canvas.crop((c * image_size, r * image_size, (c + 1) * image_size, (r + 1) * image_size))
        for r in range(rows)
        for c in range(cols)
    ]
    # A single tile already shows the whole image, so only multi-tile grids get a thumbnail.
    if use_thumbnail and len(tiles) != 1:
        tiles.append(img.resize((image_size, image_size)))
    return tiles


_NOTED: set[str] = set()  # files already reported as multi-frame, once per process


def _to_rgb(img: Image.Image, name: str) -> Image.Image:
    """RGB of the current (first) frame. Deviation from the official transform, which calls
    convert("RGB") on everything: 16-bit greyscale ("I;16*", or "I" holding values above 255) is
    scaled to 8 bits as value >> 8, where convert would clip every value above 255 to white. An
    animated GIF or multi-page TIFF uses its first frame, as the official code does, but says so."""
    frames = getattr(img, "n_frames", 1)
    if frames > 1 and name not in _NOTED:
        _NOTED.add(name)
        print(
            f"note: {name} has {frames} frames (animated or multi-page); using the first",
            file=sys.stderr,
        )
    if img.mode.startswith("I;16") or (img.mode == "I" and img.getextrema()[1] > 255):
        grey = np.asarray(img).astype(np.uint32).clip(0, 65535) >> 8  # [H, W], 0..255
        return Image.fromarray(grey.astype(np.uint8), mode="L").convert("RGB")
    return img.convert("RGB")


def open_rgb(path_or_pil, name: str | None = None) -> Image.Image:
    """Decode fully and convert to RGB, turning every decoder failure into an ImageError. A path, a
    PIL image or a binary file object (named by `name` in errors)."""
    if name is None:
        name = "<PIL image>" if isinstance(path_or_pil, Image.Image) else os.fspath(path_or_pil)
    if (
        isinstance(path_or_pil, (str, os.PathLike))
        and os.path.exists(path_or_pil)
        and not os.path.isfile(path_or_pil)
    ):
        # a FIFO would block Image.open until some process writes it, maybe forever; a folder holds no image
        raise ImageError(
            f"cannot read image {name}: not a regular file (a folder, a FIFO or a device)"
        )
    try:
        if isinstance(path_or_pil, Image.Image):
            return _to_rgb(path_or_pil, name)
        with Image.open(path_or_pil) as f:
            # Image.open only reads the header; load() decodes every byte, so a truncated file
            # fails here instead of silently yielding grey pixels later.
            f.load()
            return _to_rgb(f, name)
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        detail = " ".join(str(e).split())  # decoder messages may span lines; keep one line
        raise ImageError(f"cannot read image {name}: {type(e).__name__}: {detail}") from e


def open_base64(cell: str, name: str) -> Image.Image:
    """An image as a benchmark TSV holds it (VLMEvalKit writes PNG or JPEG bytes as base64), decoded
    fully to RGB; anything unreadable is an ImageError naming `name`."""
    try:
        data = base64.b64decode(cell)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"cannot read image {name}: not base64 ({e})") from None
    if not data:
        raise ImageError(f"cannot read image {name}: empty")
    return open_rgb(io.BytesIO(data), name)


def load_image(
    path_or_pil, max_tiles: int = 12, use_thumbnail: bool = True, image_size: int = IMAGE_SIZE
) -> torch.Tensor:
    """Load an image into normalised tiles: float32 [N, 3, px, px], N = tiles (+ thumbnail), px =
    image_size (the model's vit.image_size, 448 for InternVL3.5)."""
    img = open_rgb(path_or_pil)
    tiles = tile_image(img, max_tiles, image_size, use_thumbnail)
    x = torch.from_numpy(np.stack([np.asarray(t) for t in tiles]))  # [N, 448, 448, 3] uint8
    # Same float32 ops, in the same order, as torchvision's ToTensor then Normalize, so the
    # result is bit-identical: x / 255, then (x - mean) / std with [3, 1, 1] float32 stats.
    x = x.permute(0, 3, 1, 2).contiguous().float().div(255)  # [N, 3, 448, 448]
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32).view(3, 1, 1)
    return x.sub(mean).div(std)


# ---------------------------------------------------------------------------------------------
# Tokenizer (the checkpoint's Qwen2/Qwen3 tokenizer files and InternVL's added tokens)


def _qwen2_pipeline(tok: _BackendTokenizer) -> _BackendTokenizer:
    """Normalizer, pre-tokenizer and decoder of the Qwen2 family (what tokenizer.json holds)."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _from_vocab_files(folder: str) -> _BackendTokenizer:
    """Rebuild a Qwen tokenizer from vocab.json + merges.txt + added tokens."""
    tok = _qwen2_pipeline(
        _BackendTokenizer(
            models.BPE.from_file(
                os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
            )
        )
    )
    # Added tokens: tokenizer_config.json carries the special flags; added_tokens.json only ids.
    # Tokens known only from added_tokens.json count as special (InternVL adds its tags that way).
    added = {}  # id -> AddedToken
    config_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config_path):
        for i, t in _read_json(config_path).get("added_tokens_decoder", {}).items():
            added[int(i)] = AddedToken(
                t["content"],
                special=t.get("special", True),
                normalized=t.get("normalized", False),
                lstrip=t.get("lstrip", False),
                rstrip=t.get("rstrip", False),
                single_word=t.get("single_word", False),
            )
    added_path = os.path.join(folder, "added_tokens.json")
    if os.path.isfile(added_path):
        for content, i in _read_json(added_path).items():
            added.setdefault(int(i), AddedToken(content, special=True, normalized=False))
    # The backend numbers new tokens consecutively, so add them in id order and check each id.
    for i in sorted(added):
        tok.add_tokens([added[i]])
        if tok.token_to_id(added[i].content) != i:
            raise ValueError(
                f"added token {added[i].content!r} should have id {i} but got "
                f"{tok.token_to_id(added[i].content)}; ids must be contiguous"
            )
    return tok


class Tokenizer:
    """A Qwen byte-level BPE tokenizer (Qwen2.5 or Qwen3 plus InternVL's image tags)."""

    def __init__(self, backend: _BackendTokenizer, folder: str = ""):
        self.backend = backend
        self.folder = folder

    @classmethod
    def from_pretrained(cls, folder, slow_files: bool = False) -> "Tokenizer":
        """Load tokenizer.json if present, else vocab.json + merges.txt (+ added tokens). slow_files: those two
        first, the files transformers' slow Qwen2Tokenizer (use_fast=False) reads, as Tables S2 and S5 count
        tokens (Appendix B.1); tokenizer.json where they are absent."""
        folder = os.fspath(folder)
        json_path = os.path.join(folder, "tokenizer.json")
        vocab = all(os.path.isfile(os.path.join(folder, f)) for f in ("vocab.json", "merges.txt"))
        try:
            if os.path.isfile(json_path) and not (slow_files and vocab):
                backend = _BackendTokenizer.from_file(json_path)
            elif os.path.isfile(os.path.join(folder, "vocab.json")):
                backend = _from_vocab_files(folder)
            else:
                raise ValueError("found neither tokenizer.json nor vocab.json + merges.txt")
        # The Rust backend reports bad files as a plain Exception, so catch broadly but re-raise
        # as one clear line that names the folder.
        except Exception as e:
            raise ValueError(f"cannot load tokenizer from {folder}: {type(e).__name__}: {e}") from e
        return cls(backend, folder)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised; no BOS. Text that is
        not valid Unicode is a ValueError saying so (the tokenizer's own is a TypeError)."""
        if why := not_unicode(text):
            raise ValueError(f"the text {why}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def answer(self, ids) -> str:
        """The text of a generated answer, the one rule for every command: InternVL's chat() decodes
        with skip_special_tokens=True, keeps what comes before the template's separator (<|im_end|>)
        and strips it."""
        return self.decode(ids, skip_special_tokens=True).split(IM_END)[0].strip()

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _required_id(self, token: str) -> int:
        i = self.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer in {self.folder or '<memory>'} has no {token} token")
        return i

    @property
    def img_context_id(self) -> int:
        return self._required_id(IMG_CONTEXT)

    @property
    def im_end_id(self) -> int:
        return self._required_id(IM_END)

    @property
    def eos_ids(self) -> list[int]:
        """Stop ids: <|im_end|> ends a chat turn; <|endoftext|> ends a document (chat()'s eos_token_id)."""
        ids = (self.token_to_id(IM_END), self.token_to_id(ENDOFTEXT))
        return [i for i in ids if i is not None]

    @property
    def vocab_size(self) -> int:
        """Tokens including added ones; the model's embedding table may be larger."""
        return self.backend.get_vocab_size(with_added_tokens=True)


# ---------------------------------------------------------------------------------------------
# Prompts (InternVLChatModel.chat() and conversation.py's internvl2_5 template)


def not_unicode(text: str) -> str | None:
    """Why `text` is not valid Unicode, or None. Python holds the bytes of a command-line argument or a
    terminal line that are not UTF-8 as lone surrogates (U+DC80 + byte, "surrogateescape"), and JSON's
    "\\udcff" escape makes one too; no tokenizer takes them, no file is written with them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        byte = (
            f" (the byte 0x{c - 0xDC00:02x} of text that is not UTF-8?)"
            if 0xDC80 <= c <= 0xDCFF
            else ""
        )
        return f"is not valid Unicode: character {e.start + 1} is a lone surrogate U+{c:04X}{byte}"
    return None


def check_text(text: str, what: str) -> None:
    """A text a user wrote for a prompt (a question, a system message, a turn): valid Unicode, and without
    the <IMG_CONTEXT> token, which only an image's placeholder may put there (the model fills every such
    slot with image features, in order, so a typed one would shift them all or find no image)."""
    if why := not_unicode(text):
        raise ValueError(f"{what} {why}")
    if IMG_CONTEXT in text:
        raise ValueError(
            f"{what} holds {IMG_CONTEXT}, the token an image's features fill; write "
            f"{IMAGE_PLACEHOLDER} where an image goes"
        )


def turn(role: str, text: str) -> str:
    """One turn of the "internvl2_5" template: <|im_start|>{role}\n{text}<|im_end|>\n, role one of
    system, user, assistant. The one place the template's turn layout is written (chat and SFT)."""
    return f"{IM_START}{role}\n{text}{_SEP}"


def image_tokens(num_tiles: int, tokens_per_tile: int = NUM_IMAGE_TOKENS) -> str:
    """What one <image> placeholder becomes: <img> + <IMG_CONTEXT> * tokens_per_tile * tiles + </img>."""
    if num_tiles < 1:
        raise ValueError(f"each image needs at least one tile, got {num_tiles}")
    return IMG_START + IMG_CONTEXT * (tokens_per_tile * num_tiles) + IMG_END


def expand_images(
    texts: list[str], num_tiles: list[int], tokens_per_tile: int = NUM_IMAGE_TOKENS
) -> list[str]:
    """Replace the <image> placeholders of `texts`, in reading order across them, by the tokens of
    image 0, 1, ...; the placeholders must match the images one to one."""
    n_slots = sum(t.count(IMAGE_PLACEHOLDER) for t in texts)
    if n_slots != len(num_tiles):
        raise ValueError(
            f"prompt has {n_slots} {IMAGE_PLACEHOLDER} placeholders but num_tiles "
            f"lists {len(num_tiles)} images"
        )
    images = iter(image_tokens(n, tokens_per_tile) for n in num_tiles)
    out = []
    for text in texts:
        pieces = text.split(IMAGE_PLACEHOLDER)
        out.append(pieces[0] + "".join(next(images) + piece for piece in pieces[1:]))
    return out


def place_images(question: str, n_images: int, always: bool = False) -> str:
    """The placeholder rule, the one place it is written: a question with images that places none
    itself gets "<image>\n" in front for one image (InternVL's chat()) and "Image-1: <image>\n...
    Image-n: <image>\n" for several (VLMEvalKit's reorganize_prompt for InternVL); a question that
    places its images, or has none, stays as it is. always: one image's placeholder goes in front
    even when the question holds one, as reorganize_prompt does."""
    if n_images == 0 or (IMAGE_PLACEHOLDER in question and not (always and n_images == 1)):
        return question
    if n_images == 1:
        return IMAGE_PLACEHOLDER + "\n" + question
    return "".join(f"Image-{k + 1}: {IMAGE_PLACEHOLDER}\n" for k in range(n_images)) + question


def build_prompt(
    question: str,
    num_tiles: list[int] = (),
    history: list[tuple[str, str]] = (),
    system: str | None = None,
    tokens_per_tile: int = NUM_IMAGE_TOKENS,
) -> str:
    """The prompt string of the official `chat()`, with every <image> expanded to its tokens.

    num_tiles has one entry per image, in order of the <image> placeholders across the history
    and the question; image i becomes <img> + <IMG_CONTEXT> * tokens_per_tile * num_tiles[i] + </img>.
    """
    num_tiles = list(num_tiles)
    for text, what in [
        (question, "the question"),
        (system, "the system message"),
        *((t, "an earlier turn") for q, a in history for t in (q, a)),
    ]:
        if text:
            check_text(text, what)
    # Like chat(): a first-turn question with images but no placeholder gets one in front.
    if not history and num_tiles:
        question = place_images(question, 1)
    system = DEFAULT_SYSTEM_MESSAGE if system is None else system

    # The system turn is always emitted, even when empty. A turn whose text is empty (or the final
    # assistant slot) contributes only its role header, because the chat template tests truthiness
    # (the official Conversation.get_prompt; the SFT preprocessing writes every turn whole).
    turns = [m for q, a in history for m in (("user", q), ("assistant", a))] + [("user", question)]
    parts = [turn("system", system)] + [
        turn(role, text) if text else f"{IM_START}{role}\n" for role, text in turns
    ]
    prompt = "".join(parts) + f"{IM_START}assistant\n"
    return expand_images([prompt], num_tiles, tokens_per_tile)[0]
