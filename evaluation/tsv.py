"""VLMEvalKit's files, as its own code reads them: the benchmark TSVs (tab-separated, read with pandas'
rules), their cells (list literals, option columns), and JSON-lines prediction files.

TSV format: tab-separated with CSV quoting (what pandas writes and reads); every cell is kept as a
string (an answer "05" stays "05"); the cells pandas reads as missing (empty, "nan", "None", ...)
are None. `image` holds base64, a list literal of base64 strings (several images), or the index of
another row whose image it shares (64 characters or fewer).
"""

from __future__ import annotations

import ast
import csv
import json
import string
import sys
from pathlib import Path
from typing import Iterator

from shell.files import regular_file


class DataError(ValueError):
    """A TSV or prediction file that cannot be used; the message names the file and the problem."""


# -- reading VLMEvalKit TSVs --------------------------------------------------------------------

# pandas.read_csv's default missing-value strings: VLMEvalKit tests options and hints with pd.isna
PANDAS_NA = {
    "",
    "#N/A",
    "#N/A N/A",
    "#NA",
    "-1.#IND",
    "-1.#QNAN",
    "-NaN",
    "-nan",
    "1.#IND",
    "1.#QNAN",
    "<NA>",
    "N/A",
    "NA",
    "NULL",
    "NaN",
    "None",
    "n/a",
    "nan",
    "null",
}


def tsv_lines(path) -> Iterator[tuple[list[str], dict]]:
    """(header, row) for each row of a VLMEvalKit TSV, read in a stream: {column: str or None}, image references
    unresolved. The header and every row's cell count are checked as pandas reads them."""
    csv.field_size_limit(sys.maxsize)  # base64 images are far longer than csv's default limit
    regular_file(path)  # a FIFO would block the read
    read = 0  # the line the last whole row ended on
    try:
        with open(
            path, newline="", encoding="utf-8-sig"
        ) as f:  # -sig: a byte-order mark is not a column name
            # strict: a quote opened and never closed (a torn file) is an error, not the rest of the file in
            # one cell, which left every later row short of its image ("no row has an image")
            reader = csv.reader(f, delimiter="\t", strict=True)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{path}: empty file")
            yield header, None
            read = reader.line_num
            for line in reader:
                read = reader.line_num
                if not line:
                    continue
                # pandas: "Expected N fields in line L, saw M"; never a shifted row
                if len(line) > len(header):
                    raise DataError(
                        f"{path}: line {reader.line_num} has {len(line)} cells, the header {len(header)} "
                        f"(a tab inside a cell needs the cell quoted, as pandas writes it)"
                    )
                # a short row: its last cells missing, as pandas reads it
                line += [""] * (len(header) - len(line))
                yield header, {k: (None if v in PANDAS_NA else v) for k, v in zip(header, line)}
    except csv.Error as e:
        raise DataError(
            f"{path}: cannot read TSV: {e} (a quoted cell of line {read + 1} never closes: is the file cut "
            f"short?)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read TSV: {e}") from None


def is_reference(cell: str) -> bool:
    """An image cell that names the row whose image it shares (its index), not an image."""
    return len(cell) <= 64


class Benchmark:
    """A VLMEvalKit TSV read in a stream, as read_tsv reads it: `rows()` yields the same rows, one at a time, and
    a reference's cell is the very string of the row it names (held once, however many rows share it). Made by
    one pass that keeps no cell (the header, every index, the references checked), then, when rows share images,
    a second that keeps the cells they name. `order` maps each row's index to its place among the rows run."""

    def __init__(self, path, required: tuple[str, ...] = ("index", "question", "answer")):
        self.path, self.order, names, seen, holders = path, {}, {}, set(), set()
        header: list[str] = []
        for header, r in tsv_lines(path):
            if r is None:
                check_columns(path, header, required)
                continue
            # VLMEvalKit keys every row by its index: two rows of one index would lose one
            if r.get("index") in seen:
                raise DataError(f"{path}: index {r['index']!r} appears twice")
            seen.add(r.get("index"))
            cell = r.get("image") if "image" in header else ""
            if cell is not None:
                self.order[r.get("index")] = len(self.order)
                if is_reference(cell) if cell else False:
                    names.setdefault(cell, r["index"])  # the first row naming it, for the error
                else:
                    holders.add(r.get("index"))
        if not seen:  # nothing to run or score: not a benchmark of no rows
            raise DataError(f"{path}: a header and no rows")
        if not self.order:
            raise DataError(
                f"{path}: no row has an image (VLMEvalKit leaves such rows out)" + short_rows(path)
            )
        for ref, first in names.items():
            if ref not in holders:
                raise DataError(
                    f"{path}: row {first}: image refers to {ref!r}, which holds no image"
                )
        self.image = "image" in header
        self.shared = (
            {r["index"]: r["image"] for _, r in tsv_lines(path) if r and r["index"] in names}
            if names
            else {}
        )

    def rows(self) -> Iterator[dict]:
        """The rows with an image, in TSV order, each reference resolved to the shared cell."""
        for _, r in tsv_lines(self.path):
            if r is not None and (not self.image or r["image"] is not None):
                if self.image and is_reference(r["image"]):
                    r["image"] = self.shared[r["image"]]
                yield r


def short_rows(path) -> str:
    """Where rows lack their last cells (an image column among them), as the words that end the line of a TSV
    with no image: a cut or hand-edited file, rather than a benchmark without images."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter="\t")
        width = len(next(reader))
        short = [(reader.line_num, len(x)) for x in reader if x and len(x) < width]
    if not short:
        return ""
    line, cells = short[0]
    return (
        f"; {len(short)} row(s) have fewer cells than the header's {width}, the first on line {line} "
        f"({cells}): is the file cut short, or a tab missing?"
    )


def check_columns(path, header: list[str], required: tuple[str, ...]) -> None:
    missing = [c for c in required if c not in header]
    if missing:
        raise DataError(
            f"{path}: missing required column(s) {', '.join(missing)} (has {', '.join(header)})"
        )


def read_tsv(path, required: tuple[str, ...] = ("index", "question", "answer")) -> list[dict]:
    """Rows of a VLMEvalKit TSV as {column: str or None}, image references resolved, rows without an
    image dropped (image_base.py ImageBaseDataset.__init__, skip_noimg). Benchmark reads it in a stream."""
    return list(Benchmark(path, required).rows())


def read_jsonl(path: Path) -> list[dict]:
    """JSON lines; a last line cut short by an interrupted run is dropped (its row is redone)."""
    if not path.exists():
        return []
    regular_file(path)  # a FIFO would block the read
    lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    out = []
    for k, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if k < len(lines) - 1:
                raise DataError(f"{path}: line {k + 1} is not JSON") from None
            continue
        except RecursionError:  # Python's JSON reader recurses once per level
            raise DataError(
                f"{path}: line {k + 1} is nested deeper than Python's JSON reader goes"
            ) from None
        try:  # a "\udcff" escape decodes to a lone surrogate, which no tokenizer or file takes
            json.dumps(out[-1], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(
                f"{path}: line {k + 1} is not valid Unicode (a lone surrogate "
                f"U+{ord(e.object[e.start]):04X})"
            ) from None
    return out


def as_list(cell: str | None) -> list[str]:
    """A cell holding a Python list literal as that list of strings, any other cell as [cell]
    (smp/misc.py istype / toliststr, with literal_eval instead of eval)."""
    if cell is None:
        return ["nan"]  # what str(NaN) gives upstream
    if cell.startswith("[") and cell.endswith("]"):
        try:
            value = ast.literal_eval(cell)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return [cell]
        if isinstance(value, list):
            return [str(v) for v in value]
    return [cell]


def options(row: dict) -> dict[str, str]:
    """The option columns A, B, ... that are present (multiple_choice.py build_choices)."""
    return {c: row[c] for c in string.ascii_uppercase if row.get(c) is not None}
