"""`generate.py --batch FILE`: a JSONL file of questions about images, answered in batches of prompts of like
length, one JSON line out per question, resumable (a rerun with the same --out answers only what is left).
Every row is checked before any weight loads."""

from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from data.processor import (
    ImageError,
    Tokenizer,
    build_prompt,
    check_text,
    load_image,
    open_rgb,
    place_images,
    tile_count,
)
from inference.engine import Engine, GenerateConfig, context_check
from shell.cli import check_interrupt, error, hms, log
from shell.files import regular_file, write_text, writing


def read_questions(path: Path) -> list[dict]:
    """The rows of a --batch file: {"line", "image" (as written), "question", "paths"}; every image path
    (relative to the file) must exist. A bad row is one line naming it, before any weights load."""
    try:
        # a FIFO would block the read
        text = regular_file(path, "--batch").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--batch {path}: cannot read ({e})") from None
    rows = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n}: not JSON ({e.msg})") from None
        except RecursionError:  # Python's JSON reader recurses once per level
            raise ValueError(
                f"{path} line {n}: nested deeper than Python's JSON reader goes"
            ) from None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("question"), str)
            or not row["question"].strip()
        ):
            raise ValueError(f'{path} line {n}: needs a "question" string')
        check_text(row["question"], f"{path} line {n}: the question")  # before any weights load
        image = row.get("image")
        names = [] if image is None else [image] if isinstance(image, str) else image
        if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
            raise ValueError(f'{path} line {n}: "image" must be a path or a list of paths')
        paths = [path.parent / x for x in names]  # an absolute x stays itself
        for f in paths:
            if not f.is_file():
                raise ImageError(f"{path} line {n}: no image file {f}")
        rows.append({"line": n, "image": image, "question": row["question"], "paths": paths})
    if not rows:
        raise ValueError(f"--batch {path}: no questions")
    return rows


def answered_lines(out: Path, rows: list[dict], questions: Path) -> set[int]:
    """Question lines the answers file `out` already holds. A last line without its newline (the run
    was killed while writing it) is cut off; an answer to another file's question is refused."""
    if not out.is_file():
        return set()
    by_line, done, keep = {r["line"]: r["question"] for r in rows}, set(), 0
    data = out.read_bytes()
    for raw in data.splitlines(keepends=True):
        if not raw.endswith(b"\n"):
            break
        try:
            rec = json.loads(raw)
            line = rec["line"]
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError):
            raise ValueError(
                f"{out}: not an answers file of generate.py --batch; pass another --out"
            ) from None
        if by_line.get(line) != rec.get("question"):
            raise ValueError(
                f"{out}: answers another file (line {line} is not that question of {questions}); "
                f"pass another --out"
            )
        done.add(line)
        keep += len(raw)
    if keep < len(data):
        with open(out, "r+b") as f:
            f.truncate(keep)
    return done


def answer_file(
    engine: Engine, tok: Tokenizer, rows: list[dict], done: set[int], cfg: GenerateConfig, args
) -> int:
    """--batch: answer the rows not in `done` --batch-size at a time, in input order, each answer written
    and flushed as its batch ends ({"line", "image", "question", "answer"}), progress on stderr."""
    questions, out = Path(args.batch), Path(args.out) if args.out else None
    todo = [r for r in rows if r["line"] not in done]
    if done:
        log(f"{out}: {len(done)} of {len(rows)} questions already answered; {len(todo)} to go")
    torch.manual_seed(args.seed)
    sink = open(out, "a", encoding="utf-8") if out else sys.stdout
    t0, tty, unreadable = time.perf_counter(), sys.stderr.isatty(), []
    try:
        for start in range(0, len(todo), args.batch_size):
            batch, prompts, pixels = batch_inputs(
                todo[start : start + args.batch_size], engine.model.cfg, tok, cfg, args, unreadable
            )
            if not batch:
                continue
            res = engine.generate(
                prompts, torch.cat(pixels).to(engine.dtype) if pixels else None, cfg, tok.eos_ids
            )
            rows_out = [
                {
                    "line": r["line"],
                    **({"image": r["image"]} if r["image"] is not None else {}),
                    "question": r["question"],
                    "answer": tok.answer(ids),
                }
                for r, ids in zip(batch, res.tokens)
            ]
            check_interrupt()  # answers made after a signal are never kept (cli.check_interrupt)
            with writing(out) if out else nullcontext():  # a full disk names the answers file
                sink.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows_out))
                sink.flush()
            n, dt = min(start + args.batch_size, len(todo)), time.perf_counter() - t0
            eta = dt / n * (len(todo) - n)
            print(
                f"{chr(13) if tty else ''}answered {n}/{len(todo)}, {n / dt:.2f} samples/s, elapsed {hms(dt)}, "
                f"eta {hms(eta)}",
                end="" if tty and n < len(todo) else "\n",
                file=sys.stderr,
                flush=True,
            )
    finally:
        # the close flushes what a failed write left buffered: its full disk names the file too
        if out:
            with writing(out):
                sink.close()
    # the old file was no prefix
    if out and done and todo and min(r["line"] for r in todo) < max(done):
        ordered = sorted(
            out.read_text(encoding="utf-8").splitlines(keepends=True),
            key=lambda x: json.loads(x)["line"],
        )
        write_text(out, "".join(ordered))
    # every other row is answered; a rerun with the same --out tries only these again
    if unreadable:
        error(
            f"error: {len(unreadable)} of {len(todo)} rows not answered, their images unreadable: {questions} "
            f"line{'s' * (len(unreadable) > 1)} {', '.join(map(str, unreadable))}"
        )
        return 1
    return 0


def batch_inputs(
    rows: list[dict], mcfg, tok: Tokenizer, cfg: GenerateConfig, args, unreadable: list[int]
) -> tuple[list[dict], list[list[int]], list[torch.Tensor]]:
    """One --batch batch: the rows whose images open, their prompts' ids (the command's own prompt for one
    question, so each answer is the one-by-one answer) and their tiles. A row whose image cannot be read is named
    and skipped (its line goes into `unreadable`); a prompt past the context is an error naming its line."""
    questions, batch, prompts, pixels = Path(args.batch), [], [], []
    for r in rows:
        tiling = (
            dict(
                max_tiles=args.max_tiles or mcfg.max_dynamic_patch,
                use_thumbnail=mcfg.use_thumbnail,
                image_size=mcfg.vit.image_size,
            )
            if r["paths"]
            else {}
        )
        try:
            opened = [open_rgb(f) for f in r["paths"]]
        except (
            ImageError
        ) as e:  # found only now (images are decoded batch by batch): named, skipped
            log(f"{questions} line {r['line']}: {e}; skipped")
            unreadable.append(r["line"])
            continue
        batch.append(r)
        question = place_images(r["question"], len(opened))
        try:  # its length, known from the tile counts, is checked before any image is tiled
            prompts.append(
                tok.encode(
                    build_prompt(
                        question,
                        [tile_count(img, **tiling) for img in opened],
                        system=args.system,
                        tokens_per_tile=mcfg.tokens_per_tile,
                    )
                )
            )
            context_check(len(prompts[-1]), cfg.max_new_tokens, mcfg.llm.max_position_embeddings)
        except ValueError as e:
            raise ValueError(f"{questions} line {r['line']}: {e}") from None
        pixels += [load_image(img, **tiling) for img in opened]
    return batch, prompts, pixels
