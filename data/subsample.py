"""The paper's SFT data: a seeded subsample of a whole SFT collection, the study's first piece (`python study.py
subsample`). Setup: "we use a 1/20 subsample of the InternVL3.5 SFT collection"; Limitations: "a single data
mixture"; Table S1: "Approximate SFT data composition by instance count. Categories are estimated from task
metadata and dataset names; percentages are rounded"; A.1: "the approximate instance-level composition of the
4.62M-instance sampling manifest: 15% mathematical reasoning, 15% OCR and document understanding, and 70%
general".

    python study.py subsample --data internvl35_sft.json --fraction 0.05 --out sub/    # sub/meta.json
    python study.py subsample ... --mixture math=0.15 ocr=0.15 general=0.70            # stratified instead

The rows are those train.py would read (sft.py: after repeat_time). By default the subsample is the paper's
plain draw: round(fraction x rows) rows drawn without replacement from the whole collection, seeded (--seed,
42: the paper's), so each domain gets what the draw gives it, and its composition is reported as Table S1 (the
paper reports its composition, an estimate, rounded; it does not draw to it). With --mixture the draw is
stratified instead: the rows split over the domains by the shares (largest remainders), each domain's share
over its datasets in proportion to their rows (largest remainders); a domain with fewer rows than its share is
one line naming it, nothing written. Either way each dataset's rows are drawn without replacement, seeded,
kept in file order. A dataset's domain is its meta entry's own "domain" (task metadata: math, ocr or
general), else read from its name (DOMAIN_WORDS: a word of the name, split at anything not a letter or digit,
that begins with one of a domain's words; general otherwise: "geoqa+" is math, "geography" is not). OUT holds
one JSONL per dataset (NNNN_NAME.jsonl) of the chosen lines, byte for byte, and meta.json naming them
(absolute paths; repeat_time 1, the repeats already drawn), with Table S1 printed and the counts per domain
kept in subsample.json.
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
# the beginnings of the words of dataset names by domain (InternVL's SFT sources: geoqa+, mavis_math, mathv360k,
# ...; chartqa, docvqa, textvqa, ocrvqa, infographicsvqa, ...); a name with none is general
DOMAIN_WORDS = {
    "math": (
        "math",
        "geoqa",
        "geometry",
        "geos",
        "unigeo",
        "mavis",
        "gsm",
        "tabmwp",
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
        help="a stratified draw instead: each domain's share, DOMAIN=SHARE for math, ocr, general (Table "
        f"S1's rounded estimate: {' '.join(PAPER_MIXTURE)})",
        factory=list,
        shown="none: the paper's plain seeded draw",
    )
    seed: int = flag(SEED, "seed of the draw", range=SEEDS, shown=f"{SEED}, the paper's")

    def check(self) -> None:
        if self.mixture:
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
    tokens = re.split(r"[^a-z0-9]+", name.lower())
    return next(
        (
            d
            for d, words in DOMAIN_WORDS.items()
            if any(t.startswith(w) for t in tokens for w in words)
        ),
        "general",
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


def draw(
    datasets: list[dict], fraction: float, shares: dict[str, float] | None, seed: int
) -> dict[str, int]:
    """{dataset name: rows to keep}, round(fraction x rows) in all. shares None: the plain draw, rows drawn
    without replacement from the whole collection (how many fall in each dataset: a multivariate
    hypergeometric draw, seeded; which ones: write_dataset). Else stratified: split by the shares, then over
    each domain's datasets by their rows; a domain with too few rows is refused."""
    total = round(fraction * sum(d["rows"] for d in datasets))
    if shares is None:
        # the counts' stream; each dataset's rows have their own
        rng = np.random.default_rng([seed, 0])
        counts = rng.multivariate_hypergeometric([d["rows"] for d in datasets], total)
        return {d["name"]: int(k) for d, k in zip(datasets, counts)}
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


# Table S1's category names
CATEGORIES = {
    "math": "Mathematical reasoning",
    "ocr": "OCR and document understanding",
    "general": "General multimodal and other data",
}


def table_s1(summary: dict) -> list[str]:
    """Table S1 of a subsample (subsample.json): each domain's share of the instances drawn, rounded as the
    paper rounds it, then the counts behind it."""
    kept = {d: v["kept"] for d, v in summary["domains"].items()}
    total = sum(kept.values())
    how = (
        "a plain seeded draw"
        if not summary.get("mixture")
        else "stratified to --mixture "
        + " ".join(f"{d}={x}" for d, x in summary["mixture"].items())
    )
    md = [
        "Table S1: Approximate SFT data composition by instance count. Categories are estimated from task "
        "metadata and dataset names; percentages are rounded.",
        "",
        "| Category | Approx. Share |",
        "| --- | --- |",
    ]
    md += [f"| {CATEGORIES[d]} | {100 * kept[d] / total if total else 0:.0f}% |" for d in DOMAINS]
    return md + [
        "",
        f"{total:,} instances: {summary['fraction']} of {summary['data']}, {how}, seed {summary['seed']} ("
        + ", ".join(f"{d} {kept[d]:,} of {summary['domains'][d]['rows']:,}" for d in DOMAINS)
        + ").",
    ]


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
    shares = parse_mixture(cfg.mixture) if cfg.mixture else None
    counts = draw(datasets, cfg.fraction, shares, cfg.seed)
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
            "mixture": shares,  # None: the plain draw
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
    print("\n" + "\n".join(table_s1(summary)))
    (out / "subsample.json").write_text(json.dumps(summary, indent=1) + "\n")
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    tmp.replace(out / "meta.json")
    log(f"subsample of {total} rows written to {out / 'meta.json'}")
    return 0
