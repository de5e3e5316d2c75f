"""Where a model folder comes from: --model names a local checkpoint folder or a hub repo id, which is
fetched once into huggingface_hub's cache and read from there on later runs, offline too. huggingface_hub
is optional: it is imported only when a hub id is given, and its absence is one line.

    folder = resolve_model("OpenGVLab/InternVL3_5-1B")   # or a local folder; None: $PARVL_MODEL, else the default
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from loading.checkpoint import CheckpointError, check_not_run_folder
from shell.cli import log

DEFAULT_MODEL = "OpenGVLab/InternVL3_5-1B"  # the original layout, which parvl.py reads natively
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # owner/name, as the hub spells repo ids
# config, weights, tokenizer: not the remote code or example media
HUB_FILES = ["*.json", "*.safetensors", "*.txt"]


def resolve_model(name: str | None = None, revision: str | None = None) -> Path:
    """The checkpoint folder for --model: a local folder, else a hub repo id, fetched once into
    huggingface_hub's cache (HF_HUB_CACHE / HF_HOME) and read from there on later runs, offline too.
    No name: $PARVL_MODEL, else DEFAULT_MODEL. revision (a branch, tag or commit) pins a hub model."""
    name = name or os.environ.get("PARVL_MODEL") or DEFAULT_MODEL
    if Path(name).is_dir():
        if revision:
            raise ValueError(f"--revision {revision}: {name} is a local folder, not a hub model")
        # runs/22 instead of runs/22/export: say so before anything fails
        check_not_run_folder(Path(name))
        return Path(name)
    if Path(name).exists() or not HUB_ID.fullmatch(name) or name.startswith("."):
        raise CheckpointError(
            f"{name}: not a checkpoint folder (nor a hub model id such as {DEFAULT_MODEL})"
        )
    return hub_snapshot(name, revision)


def hub_snapshot(repo: str, revision: str | None) -> Path:
    """The cached snapshot of a hub model, downloaded (with huggingface_hub's progress bars) only if the
    cache lacks it or holds an incomplete copy. Every failure is one line naming the way out."""
    pin = f" --revision {revision}" if revision else ""
    local = repo.split("/")[-1]
    elsewhere = (
        f"download it where the hub is reachable (hf download {repo}{pin} --local-dir {local}) and pass "
        f"--model {local}"
    )
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise CheckpointError(
            f"{repo}: not a local folder, and huggingface_hub is not installed to fetch it "
            f"(pip install huggingface_hub); or {elsewhere}"
        ) from None
    check_hub_cache(Path(constants.HF_HUB_CACHE), repo)
    kw = dict(revision=revision, allow_patterns=HUB_FILES)
    try:  # the cache first: no network round trip, and it works offline
        cached = Path(snapshot_download(repo, local_files_only=True, **kw))
    except LocalEntryNotFoundError:
        cached = None
    if cached is not None and weights_complete(cached):
        return cached
    if constants.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE=1: no download to attempt
        state = "incomplete in" if cached is not None else "not in"
        raise CheckpointError(
            f"{repo}{pin}: {state} the hub cache, and HF_HUB_OFFLINE is set; {elsewhere}"
        )
    try:  # huggingface_hub's progress bars show the download; the line after it says where it went
        folder = Path(snapshot_download(repo, **kw))
    except GatedRepoError:
        raise CheckpointError(
            f"{repo}: a gated model; accept its terms on the hub and log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"{repo}: not a local folder, and no hub model of that name "
            f"(a private one needs hf auth login)"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{repo}: the hub has no revision {revision!r}") from None
    except (
        LocalEntryNotFoundError
    ):  # not cached, and offline (HF_HUB_OFFLINE) or the hub is unreachable
        raise CheckpointError(
            f"{repo}{pin}: not in the hub cache and the hub cannot be reached; {elsewhere}"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointError(
            f"{repo}: download failed ({type(e).__name__}: {e}); {elsewhere}"
        ) from None
    if not weights_complete(folder):
        raise CheckpointError(
            f"{folder}: the cached {repo} is incomplete (no config.json or weights); {elsewhere}"
        )
    # said once it is true: offline, nothing was downloaded and the error above is the only line
    log(f"downloaded {repo}{pin} into {folder} (once; later runs read it there)")
    return folder


def check_hub_cache(cache: Path, repo: str) -> None:
    """The hub cache must be a folder or be makeable as one: a file on its path (HOME or HF_HOME set to a
    file) is named with the variable it comes from, not reported as a failed download."""
    above = next(p for p in (cache, *cache.parents) if p.exists())
    if above.is_dir():
        return
    var = next(
        (
            v
            for v in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HOME")
            if os.environ.get(v) and cache.is_relative_to(os.environ[v])
        ),
        None,
    )
    source = f" (from {var}={os.environ[var]})" if var else ""
    fix = (
        f"point {var} at a folder"
        if var and var.startswith(("HF_", "HUGGINGFACE"))
        else "set HF_HOME to a folder"
    )
    raise CheckpointError(
        f"{repo}: the hub cache {cache}{source} cannot be a folder: {above} is a file; {fix}, "
        f"or pass --model a local checkpoint folder"
    )


def weights_complete(folder: Path) -> bool:
    """config.json and every weight file there (an interrupted download leaves a partial snapshot)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointError(
                f"{index}: not a safetensors index ({type(e).__name__}: {e})"
            ) from None
        return (folder / "config.json").is_file() and all((folder / s).is_file() for s in shards)
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
