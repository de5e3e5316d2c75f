"""The paper's SFT data: a seeded subsample of a whole SFT collection in one domain mixture, the study's
first piece (`python study.py subsample`). Setup: "we use a 1/20 subsample of the InternVL3.5 SFT
collection"; Limitations: "a single data mixture"; Table S1 / A.1: "15% mathematical reasoning, 15% OCR and
document understanding, and 70% general multimodal and other instruction-following data. The categories are
derived from task metadata and dataset names".

    python study.py subsample --data internvl35_sft.json --fraction 0.05 --out sub/    # sub/meta.json

A dataset's domain is its meta entry's own "domain" (task metadata: math, ocr or general), else read from its
name (DOMAIN_WORDS: the first domain one of whose words the name holds; general otherwise). The rows are those
train.py would read (sft.py: after repeat_time). The subsample has round(fraction x rows) rows, split over
the domains by the mixture (largest remainders), each domain's share over its datasets in proportion to their
rows (largest remainders), and each dataset's rows drawn without replacement, seeded (--seed, 42: the paper's),
kept in file order. OUT holds one JSONL per dataset (NNNN_NAME.jsonl) of the chosen lines, byte for byte, and
meta.json naming them (absolute paths; repeat_time 1, the repeats already drawn), with the counts per domain
printed and kept in subsample.json. A domain with fewer rows than its share is one line naming it, nothing written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.sft import (  # sft.py's own reading of a meta file and of its rows
    _index_lines,
    _read_meta,
    repeat_rule,
)
from shell.cli import SEED, SEEDS, log
from shell.flags import flag
from shell.outputs import check_folder

DOMAINS = ("math", "ocr", "general")  # Table S1's categories
PAPER_MIXTURE = ("math=0.15", "ocr=0.15", "general=0.70")
# words of dataset names by domain (InternVL's SFT sources: geoqa+, mavis_math, mathv360k, ...; chartqa, docvqa,
# textvqa, ocrvqa, infographicsvqa, ...); a name with none is general
DOMAIN_WORDS = {
    "math": (
        "math",
        "geo",
        "mavis",
        "gsm",
        "tabmwp",
        "clevr_math",
        "theorem",
        "arithmetic",
        "algebra",
        "calculus",
        "functionqa",
    ),
    "ocr": (
        "ocr",
        "doc",
        "chart",
        "text",
        "table",
        "infographic",
        "receipt",
        "invoice",
        "screen",
        "dvqa",
        "plotqa",
        "funsd",
        "sroie",
        "handwrit",
        "formula",
        "latex",
        "pdf",
        "slide",
        "poster",
    ),
}


@dataclass
class SubsampleConfig:
    """`study.py subsample`'s flags."""

    data: str = flag(
        None,
        "the whole SFT collection's meta JSON (official InternVL format)",
        required=True,
        reads=True,
    )
    out: str = flag(
        None,
        "folder for meta.json, one JSONL per dataset and subsample.json",
        required=True,
        writes=True,
    )
    fraction: float = flag(
        0.05,
        "fraction of the collection's rows kept",
        range="(0, 1]",
        shown="0.05, the paper's 1/20",
    )
    mixture: list[str] = flag(
        help="each domain's share of the subsample, DOMAIN=SHARE for math, ocr, general (Table S1)",
        factory=lambda: list(PAPER_MIXTURE),
        shown=" ".join(PAPER_MIXTURE),
    )
    seed: int = flag(SEED, "seed of the draw", range=SEEDS, shown=f"{SEED}, the paper's")

    def check(self) -> None:
        parse_mixture(self.mixture)


def parse_mixture(items: list[str]) -> dict[str, float]:
    """{domain: share} from DOMAIN=SHARE items: every domain once, shares in [0, 1] summing to 1 (a flag error)."""
    shares = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            share = float(value)
        except ValueError:
            share = -1.0
        if name not in DOMAINS or not 0 <= share <= 1 or name in shares:
            raise ValueError(
                f"--mixture {item}: write DOMAIN=SHARE once per domain of {', '.join(DOMAINS)}, a share "
                f"in [0, 1]"
            )
        shares[name] = share
    if set(shares) != set(DOMAINS) or abs(sum(shares.values()) - 1) > 1e-9:
        raise ValueError(
            f"--mixture {' '.join(items)}: give all of {', '.join(DOMAINS)}, shares summing to 1"
        )
    return shares


def domain_of(name: str, entry: dict) -> str:
    """A dataset's domain: its "domain" entry (task metadata), else the first domain a word of which its name holds."""
    if "domain" in entry:
        if entry["domain"] not in DOMAINS:
            raise ValueError(
                f"dataset {name!r}: domain {entry['domain']!r} is not one of {', '.join(DOMAINS)}"
            )
        return entry["domain"]
    return next(
        (d for d, words in DOMAIN_WORDS.items() if any(w in name.lower() for w in words)), "general"
    )


def largest_remainder(total: int, weights: dict[str, float]) -> dict[str, int]:
    """total split in proportion to weights, in integers summing to total (Hamilton's rule; ties to the first)."""
    s = sum(weights.values())
    exact = {k: total * w / s if s else 0.0 for k, w in weights.items()}
    out = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: -(exact[k] - out[k]))[: total - sum(out.values())]:
        out[k] += 1
    return out


def collection(meta_path: Path) -> list[dict]:
    """The datasets of a meta JSON with their domain, annotation path, rows as train.py counts them (sft.py's
    repeat_time rule) and non-blank line offsets."""
    meta, folder, out = _read_meta(str(meta_path)), meta_path.resolve().parent, []
    for name, m in meta.items():
        path = folder / m["annotation"]
        offsets, _ = _index_lines(str(path))
        kept, repeat = repeat_rule(meta_path, name, m, len(offsets))
        out.append(
            {
                "name": name,
                "entry": m,
                "domain": domain_of(name, m),
                "path": path,
                "root": folder / m["root"],
                "offsets": offsets,
                "kept": kept,
                "rows": kept * repeat,
            }
        )
    return out


def draw(datasets: list[dict], fraction: float, shares: dict[str, float]) -> dict[str, int]:
    """{dataset name: rows to keep}: round(fraction x rows) split by the mixture, then over each domain's
    datasets by their rows; a domain with too few rows is refused."""
    total = round(fraction * sum(d["rows"] for d in datasets))
    per_domain = largest_remainder(total, shares)
    counts = {}
    for domain in DOMAINS:
        mine = [d for d in datasets if d["domain"] == domain]
        have, names = (
            sum(d["rows"] for d in mine),
            ", ".join(d["name"] for d in mine) or "no dataset",
        )
        if per_domain[domain] > have:
            raise ValueError(
                f"domain {domain}: the collection has {have} rows ({names}), fewer than its share of the "
                f"subsample, {per_domain[domain]} of {total}; lower --fraction or change --mixture"
            )
        counts |= largest_remainder(per_domain[domain], {d["name"]: d["rows"] for d in mine})
    return counts


def write_dataset(d: dict, k: int, seed: int, file: Path) -> str:
    """The k drawn rows of dataset d (repeats are copies of its kept lines), in file order, into `file` byte for
    byte; returns its sha256."""
    # a stream per dataset
    salt = int.from_bytes(hashlib.sha256(d["name"].encode()).digest()[:4], "little")
    rows = np.random.default_rng([seed, salt]).choice(d["rows"], size=k, replace=False)
    lines, h = np.sort(rows % d["kept"]), hashlib.sha256()
    tmp = file.with_name(file.name + ".tmp")
    with open(d["path"], "rb") as src, open(tmp, "wb") as dst:
        for offset in d["offsets"][lines]:
            src.seek(int(offset))
            line = src.readline().rstrip(b"\r\n") + b"\n"
            h.update(line)
            dst.write(line)
    tmp.replace(file)
    return h.hexdigest()


def subsample(cfg: SubsampleConfig) -> int:
    """`study.py subsample`: the collection's counts per domain, the draw, the files; meta.json written last
    (the study's mark that the piece is done)."""
    out = Path(cfg.out)
    check_folder(out, "--out")
    # a meta.json this command did not write (no subsample.json beside it) is someone's data: never replaced
    if (out / "meta.json").exists() and not (out / "subsample.json").is_file():
        raise ValueError(
            f"--out {out}: holds a meta.json that study.py subsample did not write (no subsample.json "
            f"beside it); pick another --out"
        )
    datasets = collection(Path(cfg.data))
    counts = draw(datasets, cfg.fraction, parse_mixture(cfg.mixture))
    if not sum(counts.values()):
        raise ValueError(
            f"--fraction {cfg.fraction}: draws 0 of the {sum(d['rows'] for d in datasets)} rows of "
            f"{cfg.data}; raise --fraction"
        )
    out.mkdir(parents=True, exist_ok=True)
    meta, summary = (
        {},
        {
            "data": os.path.abspath(cfg.data),
            "fraction": cfg.fraction,
            "seed": cfg.seed,
            "mixture": parse_mixture(cfg.mixture),
            "domains": {},
            "datasets": {},
        },
    )
    for n, d in enumerate(datasets):
        k, file = (
            counts[d["name"]],
            out / f"{n:04d}_{re.sub(r'[^A-Za-z0-9._-]', '_', d['name'])}.jsonl",
        )
        if k:
            sha = write_dataset(d, k, cfg.seed, file)
            meta[d["name"]] = {
                **d["entry"],
                "root": str(d["root"].resolve()),
                "annotation": str(file.resolve()),
                "repeat_time": 1,
                "length": k,
            }
            summary["datasets"][d["name"]] = {
                "domain": d["domain"],
                "rows": d["rows"],
                "kept": k,
                "sha256": sha,
            }
    print(f"| domain | rows in {cfg.data} | in the subsample | share |\n| --- | --- | --- | --- |")
    total = sum(counts.values())
    for domain in DOMAINS:
        have = sum(d["rows"] for d in datasets if d["domain"] == domain)
        kept = sum(counts[d["name"]] for d in datasets if d["domain"] == domain)
        summary["domains"][domain] = {"rows": have, "kept": kept}
        print(f"| {domain} | {have} | {kept} | {100 * kept / total if total else 0:.1f} % |")
    (out / "subsample.json").write_text(json.dumps(summary, indent=1) + "\n")
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    tmp.replace(out / "meta.json")
    log(f"subsample of {total} rows written to {out / 'meta.json'}")
    return 0
