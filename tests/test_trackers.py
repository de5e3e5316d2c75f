"""Experiment trackers (train.py --tracker): the events TensorBoard reads back and an offline W&B run hold
metrics.jsonl, every number at its step, and go on across a resume; a tracker whose package is missing is
one line, before anything is written. The readers (conftest.expected_scalars, event_scalars) serve the
router's curves too (test_router.py)."""

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from commands import COMMON, event_scalars, expected_scalars, train_here


def test_tensorboard_curves_equal_metrics_and_continue_on_resume(run3, model_dir, tmp_path):
    """--tracker tensorboard: the events read back by TensorBoard equal metrics.jsonl, every number at
    its step. The run is then cut back to its step-2 checkpoint (step 3's events were logged already)
    and resumed into the same folder: the curves hold steps 1, 2, 3 once each, step 3 being the resumed
    run's (its timing differs), in the same OUT/tensorboard."""
    pytest.importorskip("tensorboard")
    out, _, meta = run3
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3]
    want = expected_scalars(logged)
    assert {
        "loss",
        "grad_norm",
        "lr/branches",
        "lr/pretrained",
        "tokens_per_s",
        "eta_s",
    } <= want.keys()
    assert event_scalars(out / "tensorboard") == want

    cut = tmp_path / "cut"
    shutil.copytree(out, cut, ignore=shutil.ignore_patterns("step_3", "export*"))
    train_here(
        "--model",
        model_dir,
        "--data",
        meta,
        "--pv",
        "2",
        "--pl",
        "2",
        "--max-steps",
        "3",
        "--save-every",
        "1",
        "--keep-last",
        "2",
        "--tracker",
        "tensorboard",
        "--out",
        cut,
        "--resume",
        *COMMON,
    )
    resumed = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert resumed[:2] == logged[:2] and resumed[2]["loss"] == logged[2]["loss"]
    assert resumed[2]["tokens_per_s"] != logged[2]["tokens_per_s"]  # the resumed step is told apart
    files = sorted((cut / "tensorboard").iterdir())
    # the first run's step 3 is there
    assert len(files) == 2 and event_scalars(files[0])["loss"] == want["loss"]
    assert event_scalars(cut / "tensorboard") == expected_scalars(resumed)


def test_a_missing_tracker_package_is_one_line(model_dir, meta, tmp_path, monkeypatch, capsys):
    """--tracker with its package absent: one line naming the package and how to get it, exit 1, before
    anything is written into --out."""
    for name in ("tensorboard", "torch.utils.tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of it raises ImportError
    for kind in ("tensorboard", "wandb"):
        res = train_here(
            "--model",
            model_dir,
            "--data",
            meta,
            "--max-steps",
            "1",
            "--tracker",
            kind,
            "--out",
            tmp_path / kind,
            *COMMON,
            check=False,
        )
        assert (res.returncode, res.stderr.strip().splitlines()) == (
            1,
            [f"error: --tracker {kind}: the {kind} package is not installed (pip install {kind})"],
        )
        assert not (tmp_path / kind).exists()


def test_a_tracker_whose_import_or_init_raises_is_one_line(model_dir, meta, tmp_path, monkeypatch):
    """A tracker package that is installed but broken (its import raises, as a protobuf mismatch makes it) or whose
    wandb.init raises (no login, no network) was a traceback: one line naming the tracker and the cause, exit 1
    (issue 38, item 15). The import's is found before the model loads, nothing written."""
    broken = tmp_path / "site" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        'raise TypeError("Descriptors cannot be created directly.")\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    # undone after the test, whatever the imports left
    monkeypatch.setitem(sys.modules, "wandb", None)
    del sys.modules["wandb"]
    res = train_here(
        "--model",
        model_dir,
        "--data",
        meta,
        "--max-steps",
        "1",
        "--tracker",
        "wandb",
        "--out",
        tmp_path / "a",
        *COMMON,
        check=False,
    )
    assert (res.returncode, res.stderr.strip().splitlines()) == (
        1,
        [
            "error: --tracker wandb: importing the wandb package failed (TypeError: Descriptors cannot be created "
            "directly.); reinstall it (pip install --force-reinstall wandb) or run without --tracker"
        ],
    )
    assert not (tmp_path / "a").exists()

    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=init))
    res = train_here(
        "--model",
        model_dir,
        "--data",
        meta,
        "--max-steps",
        "1",
        "--tracker",
        "wandb",
        "--out",
        tmp_path / "b",
        *COMMON,
        check=False,
    )
    assert res.returncode == 1 and [
        x for x in res.stderr.splitlines() if x.startswith("error")
    ] == [
        "error: --tracker wandb: wandb.init failed (RuntimeError: api_key not configured (no-tty). call "
        "wandb.login(key=[your_api_key])); see WANDB_MODE=offline, or run without --tracker"
    ], res.stderr
    assert "Traceback" not in res.stderr


def wandb_history(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series an offline W&B run logged, read from its run-ID.wandb file: W&B's record log
    (":W&B", its magic and version in 7 bytes, then LevelDB log records in 32 KiB blocks: crc32, length,
    type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4, data), each a wandb_internal Record; the history records
    hold the logged values as JSON at their step. W&B's own keys (_step, _runtime, ...) are left out."""
    from wandb.proto import wandb_internal_pb2

    [path] = run.glob("run-*.wandb")
    data, pos, frag, history = path.read_bytes(), 7, b"", {}
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        frag, pos = frag + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(frag)
            frag = b""
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    name = item.key or "/".join(item.nested_key)
                    if not name.startswith("_"):
                        history.setdefault(name, []).append(
                            (record.history.step.num, json.loads(item.value_json))
                        )
    return history


def test_wandb_offline_run_holds_the_metrics(model_dir, meta, tmp_path, monkeypatch):
    """--tracker wandb under WANDB_MODE=offline (no network): the offline run is OUT/wandb's, under the id
    kept in OUT/wandb_id, and the history it logged, read back from W&B's own file, equals metrics.jsonl,
    every number at its step; a resume continues the same run id."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = [
        "--model",
        model_dir,
        "--data",
        meta,
        "--tracker",
        "wandb",
        "--out",
        out,
        "--save-every",
        "1",
        *COMMON,
    ]
    train_here(*args, "--max-steps", "2")
    run_id = (out / "wandb_id").read_text()
    [run] = (out / "wandb").glob(f"offline-run-*-{run_id}")
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2]
    want = expected_scalars(logged, dtype=float)  # W&B keeps the float64 JSON numbers
    assert {"loss", "grad_norm", "lr/pretrained", "tokens_per_s"} <= want.keys() and wandb_history(
        run
    ) == want
    train_here(*args, "--max-steps", "3", "--resume")  # one step more, into the same W&B run id
    assert (out / "wandb_id").read_text() == run_id
    assert len(list((out / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
