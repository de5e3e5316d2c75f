"""The `generate.py` command: answer questions about images (or text) with ParVL / InternVL3.5.

    python generate.py image.png "Describe the image."    # OpenGVLab/InternVL3_5-1B, fetched once into the hub cache
    python generate.py image.png "Describe the image." --model path/to/InternVL3_5-1B   # or a hub id, or $PARVL_MODEL
    python generate.py a.png b.png $'Image-1: <image>\\nImage-2: <image>\\nWhat differs?'
    python generate.py "A text-only question"
    python generate.py image.png --chat                 # interactive multi-turn session (no image: text only)
    python generate.py --batch questions.jsonl --out answers.jsonl   # resumable; rows {"image", "question"}

One answer (streamed), a --chat session or a --batch file, on the engine (inference/engine.py). The command
sits above the model: it resolves and loads the checkpoint, builds the prompts and prints.
"""

from __future__ import annotations

import shell.early  # noqa: F401  first: a Ctrl-C during the imports below is one line, exit 130

# isort: split

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data.processor import Tokenizer, build_prompt, load_image, open_rgb, place_images, tile_count
from inference.engine import Engine, GenerateConfig, context_check
from inference.flags import InferenceFlags, check_new_tokens, load_engine, open_model
from inference.questions import answer_file, answered_lines, read_questions
from shell import cli
from shell.cli import SEEDS, command, interrupt_handled, log, one_line
from shell.devices import peak_memory_gib, resolve_device
from shell.flags import Command, dispatch, flag

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp")


@dataclass
class GenerateFlags(InferenceFlags):
    """generate.py's flags, one field each (flags.flag): the inference flags (inference/flags.py), then its own."""

    inputs: list[str] = flag(
        help="zero or more image paths, then the question (with --chat: images only, or none "
        "for a text-only session; with --batch: nothing)",
        positional=True,
        nargs="*",
        factory=list,
    )
    max_new_tokens: int = flag(512, "token budget per answer", unit="tokens", range="[1, inf)")
    temperature: float = flag(0.0, "sampling temperature; 0 = greedy", range="[0, inf)")
    top_p: float = flag(1.0, "nucleus sampling probability mass, 1 = off", range="(0, 1]")
    top_k: int = flag(0, "sample among the k most likely tokens, 0 = off", range="[0, inf)")
    seed: int = flag(0, "random seed for sampling", range=SEEDS)
    system: str | None = flag(None, "system message text", shown="InternVL's own")
    chat: bool = flag(False, "interactive multi-turn session; images enter the first turn")
    json: bool = flag(False, "print one JSON line with the answer and metrics instead of text")
    batch: str | None = flag(
        None,
        'answer every row {"image": path or list of paths (optional, relative to the '
        'file), "question": ...} of a JSONL file; answers as JSONL in input order',
        metavar="QUESTIONS.jsonl",
        reads=True,
    )
    batch_size: int = flag(
        8, "--batch: questions per generate call, left-padded together", range="[1, inf)"
    )
    out: str | None = flag(
        None,
        "--batch: answers file, appended to; rows it already answers are skipped (resume)",
        metavar="FILE",
        shown="stdout, no resume",
        writes=True,
    )

    def check(self) -> None:
        """Flags that exclude each other, and a question that is missing or is an image path."""
        super().check()
        if self.batch is not None:
            if self.inputs or self.chat or self.json:
                raise ValueError(
                    "--batch reads images and questions from its file: no inputs, --chat or --json "
                    "with it"
                )
            return
        if self.out is not None:
            raise ValueError("--out goes with --batch")
        # the last input is the question; an image file there means it was left out
        if not self.chat:
            if not self.inputs:
                raise ValueError(
                    "no question: give zero or more images, then the question (or --chat for a session)"
                )
            last = self.inputs[-1]
            # "What is in cat.jpg" stays a question
            if (last.lower().endswith(IMAGE_SUFFIXES) and not any(c.isspace() for c in last)) or (
                len(last) < 4096 and Path(last).is_file()
            ):
                raise ValueError(
                    f"no question after {last!r}: the last argument is the question (or use --chat)"
                )


def respond(args: GenerateFlags) -> int:
    """The job: load the model once, then one answer, the --chat session or the --batch file."""
    images, question = (
        (args.inputs, None) if args.chat or args.batch else (args.inputs[:-1], args.inputs[-1])
    )
    device = resolve_device(args.device)
    # bad rows fail before any model is fetched
    rows = read_questions(Path(args.batch)) if args.batch else []
    done = (
        answered_lines(Path(args.out), rows, Path(args.batch)) if args.batch and args.out else set()
    )
    # a missing or bad image fails before the model is fetched (a download of gigabytes, or offline never)
    opened = [open_rgb(path) for path in images]
    # tiles and tokens as the model sees them, and its own tokenizer
    folder, mcfg, tok = open_model(args)
    check_new_tokens(args.max_new_tokens, mcfg)
    if any(r["paths"] for r in rows) and mcfg.vit is None:
        raise ValueError(f"{folder}: a language-only model takes no images ({args.batch} has some)")
    if images and mcfg.vit is None:
        raise ValueError(f"{folder}: a language-only model takes no images")
    tiling = (
        dict(
            max_tiles=args.max_tiles or mcfg.max_dynamic_patch,
            use_thumbnail=mcfg.use_thumbnail,
            image_size=mcfg.vit.image_size,
        )
        if images
        else {}
    )
    num_tiles = [tile_count(img, **tiling) for img in opened]
    t0 = time.perf_counter()
    prompt = None
    # a prompt that cannot fit is refused before any image is tiled or the weights are read
    if not args.chat:
        prompt = build_prompt(
            place_images(question, len(num_tiles)),
            num_tiles,
            system=args.system,
            tokens_per_tile=mcfg.tokens_per_tile,
        )
        context_check(
            len(tok.encode(prompt)), args.max_new_tokens, mcfg.llm.max_position_embeddings
        )
    else:  # the session's first turn holds the images' tokens at least
        context_check(
            sum(num_tiles) * mcfg.tokens_per_tile,
            args.max_new_tokens,
            mcfg.llm.max_position_embeddings,
        )
    pixel_list = [load_image(img, **tiling) for img in opened]
    engine = load_engine(args, folder, device)
    load_s = time.perf_counter() - t0
    cfg = GenerateConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
    )
    pixel_values = torch.cat(pixel_list).to(engine.dtype) if pixel_list else None
    if args.chat:
        return chat_session(engine, tok, pixel_values, num_tiles, cfg, args)
    if args.batch:
        return answer_file(engine, tok, rows, done, cfg, args)
    answer(engine, tok, prompt, pixel_values, cfg, args, load_s)
    return 0


# -- one answer, streamed, and the interactive session (--chat) ----------------------------------


class Interrupted(cli.Interrupted):
    """SIGINT (Ctrl-C) or SIGTERM during an answer: cli.Interrupted (code 130 or 143) carrying what was
    generated until then (already on stdout)."""

    def __init__(self, text: str, signum: int):
        super().__init__(signum)
        self.text = text


class Streamer:
    """Streams the answer as tokens arrive: decodes everything so far and writes what is new, holding
    back an incomplete UTF-8 character (decoded as U+FFFD) and trailing white space (the answer is
    stripped), so the pieces written concatenate to exactly the final answer."""

    def __init__(self, tok: Tokenizer, enabled: bool = True, write=None):
        self.tok, self.enabled, self.write = tok, enabled, write or sys.stdout.write
        self.ids: list[int] = []
        self.shown, self.stopped = "", False

    def __call__(self, step: int, tokens: list[int]) -> None:
        if self.stopped or tokens[0] in self.tok.eos_ids:
            self.stopped = True
            return
        self.ids.append(tokens[0])
        text = self.tok.answer(self.ids)
        if self.enabled and not text.endswith("\ufffd") and len(text) > len(self.shown):
            self.write(text[len(self.shown) :])
            self.shown = text
            sys.stdout.flush()

    def finish(self) -> None:
        if self.enabled:  # whatever was held back (a dangling partial character) goes out now
            text = self.tok.answer(self.ids)
            self.write(text[len(self.shown) :] + "\n")


def answer(
    engine: Engine,
    tok: Tokenizer,
    prompt: str,
    pixel_values,
    cfg: GenerateConfig,
    args: GenerateFlags,
    load_s: float = 0.0,
) -> str:
    """Generate one answer, streaming text to stdout (unless --json); metrics to stderr."""
    torch.manual_seed(args.seed)
    ids = tok.encode(prompt)
    streamed = Streamer(tok, enabled=not args.json)
    try:
        res = engine.generate([ids], pixel_values, cfg, stop_ids=tok.eos_ids, callback=streamed)
    except (
        KeyboardInterrupt
    ) as e:  # Ctrl-C (or SIGTERM): end the answer where it is, cleanly, and say so
        text = tok.answer(streamed.ids)
        streamed.finish()
        if args.json:
            print(
                json.dumps(
                    {"answer": text, "interrupted": True, "new_tokens": len(streamed.ids)},
                    ensure_ascii=False,
                )
            )
        # a plain KeyboardInterrupt: SIGINT
        raise Interrupted(text, getattr(e, "code", 130) - 128) from None
    text = tok.answer(res.tokens[0])
    streamed.finish()
    n = len(res.tokens[0])
    metrics = {
        "load_s": round(load_s, 3),
        "ttft_s": round(res.prefill_s, 4),
        "new_tokens": n,
        "decode_tok_s": round((res.decode_steps - 1) / res.decode_s, 2)
        if res.decode_steps > 1
        else None,
        "peak_gib": round(peak_memory_gib(engine.device), 3),
        "prompt_tokens": len(ids),
    }
    if res.pairs is not None:  # routed: the (vision, language) branch pair that ran
        metrics["pair"] = list(res.pairs[0])
    if args.json:
        print(json.dumps({"answer": text, **metrics}, ensure_ascii=False))
    else:
        log(" ".join(f"{k}={v}" for k, v in metrics.items()))
    return text


def chat_session(engine, tok, pixel_values, num_tiles, cfg, args) -> int:
    """Read questions until end of input (0). A turn that is refused (too long, a stray <image>)
    prints one line and is dropped; Ctrl-C during an answer stops it, and the part shown stays in the
    history, as it does in chat interfaces. Ctrl-C at the prompt, or SIGTERM at any time, ends the
    session: the interrupt goes on to the command's end (130, 143)."""
    history: list[tuple[str, str]] = []
    # bytes that are not UTF-8 reach the turn's check, not input()'s decoder
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            question = input("> " if sys.stdin.isatty() else "").strip()
        except EOFError:
            return 0
        except KeyboardInterrupt:  # at the prompt: end the line the prompt left open
            print(file=sys.stderr)
            raise
        if not question:
            continue
        if not history:  # the first turn carries the images, as the official chat() stores it
            question = place_images(question, len(num_tiles))
        try:
            # the whole history is re-sent each turn; its image tokens stay in the first turn
            prompt = build_prompt(
                question,
                num_tiles,
                history=history,
                system=args.system,
                tokens_per_tile=engine.model.cfg.tokens_per_tile,
            )
            history.append((question, answer(engine, tok, prompt, pixel_values, cfg, args)))
        except ValueError as e:  # this turn only; the session and its history go on
            print(f"error: {one_line(e)} (turn dropped; the conversation goes on)", file=sys.stderr)
        except Interrupted as e:
            if e.code != 128 + signal.SIGINT:  # SIGTERM: the session ends
                raise
            interrupt_handled()  # answered here: the session's end is not an interrupt's
            print("interrupted: answer stopped (the conversation goes on)", file=sys.stderr)
            history.append((question, e.text))


# -- the command -------------------------------------------------------------------------------------------


def resumable(args: GenerateFlags) -> Path | None:
    """The answers file a --batch --out run appends to: one writer (cli.one_writer), a rerun resumes it."""
    return Path(args.out) if args.batch is not None and args.out is not None else None


DESCRIPTION = "Answer a question about images (or text) with ParVL / InternVL3.5."
COMMANDS = {
    None: Command(
        GenerateFlags,
        respond,
        writes=resumable,
        interrupted=lambda args: (
            "the answers written so far stay; the same command resumes" if resumable(args) else ""
        ),
    )
}


def main(argv=None) -> int:
    """Exit codes and lines: cli.shell. In --chat, Ctrl-C stops the answer (the session goes on) and at the
    prompt the session; in --batch the answers written so far stay, and a rerun with the same --out resumes."""
    return dispatch(DESCRIPTION, COMMANDS, argv)


if __name__ == "__main__":
    command(main)
