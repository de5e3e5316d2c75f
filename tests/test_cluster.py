"""The study at cluster scale: a kept step's export (`train.py export`), experiment trackers
(`--tracker`), the Slurm launch (slurm/) and the study recipe as one script (study.py)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import generate
import runs
import train
from test_train import COMMON, train_here

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("qwen3", "original")


@pytest.fixture(scope="module")
def meta(tmp_path_factory):
    from test_train import write_dataset
    return write_dataset(tmp_path_factory.mktemp("data"), rows=16)


def answer(capsys, model: Path, png: Path) -> str:
    """generate.py's greedy answer (its default) from a model folder, as a user runs it."""
    capsys.readouterr()
    assert generate.main([str(png), "Hi?", "--model", str(model), "--max-new-tokens", "6", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["answer"]


def test_export_of_a_kept_step(model_dir, meta, tmp_path, monkeypatch, capsys):
    """`train.py export RUN --step N` of a 2:2 run of 3 steps keeping the last 2 checkpoints: step 2 gives
    the weights the run's model held in memory after step 2 (exported by the run itself, through a
    patched save), step 3 the run's own end-of-run export; generate.py answers alike from each pair. Step 1
    (no longer kept) and a step whose shard lost its tail are refused in one line."""
    out, at_two = tmp_path / "run", tmp_path / "in_memory_step_2"
    save = train.save_checkpoint

    def save_and_export(model, optim, sched, step, *args):
        save(model, optim, sched, step, *args)
        if step == 2:  # the model as the run holds it at step 2, written by the end-of-run export's function
            runs.export(model, at_two, Path(model_dir))

    monkeypatch.setattr(train, "save_checkpoint", save_and_export)
    train_here("--model", model_dir, "--data", meta, "--pv", "2", "--pl", "2", "--max-steps", "3", "--save-every", "1",
               "--keep-last", "2", "--out", out, *COMMON)
    monkeypatch.undo()
    assert train.main(["export", str(out), "--step", "2"]) == 0
    assert train.main(["export", str(out), "--step", "3", "--out", str(tmp_path / "three")]) == 0
    for got, want in ((out / "export_step_2", at_two), (tmp_path / "three", out / "export")):
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in want.iterdir())
        a, b = load_file(str(got / "model.safetensors")), load_file(str(want / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert json.loads((got / "config.json").read_text()) == json.loads((want / "config.json").read_text())
    first = load_file(str(model_dir / "model.safetensors"))
    two = load_file(str(out / "export_step_2" / "model.safetensors"))
    three = load_file(str(out / "export" / "model.safetensors"))
    trained = [k for k in first if k in two and not torch.equal(first[k], two[k])]
    assert trained and all(not torch.equal(two[k], three[k]) for k in trained)  # step 2 is its own model
    png = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 90, 3), dtype=np.uint8)).save(png)
    assert answer(capsys, out / "export_step_2", png) == answer(capsys, at_two, png)
    assert answer(capsys, tmp_path / "three", png) == answer(capsys, out / "export", png)

    ckpts = out / "checkpoints"
    assert train.main(["export", str(out), "--step", "1"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {ckpts / 'step_1'}: no such checkpoint (kept: step_2, step_3); a run keeps its newest --keep-last "
        f"saves, see docs/training.md to keep a step"]
    shard = next(p for p in (ckpts / "step_2").iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-8])
    size = shard.stat().st_size
    assert train.main(["export", str(out), "--step", "2", "--out", str(tmp_path / "bad")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {ckpts / 'step_2'}: does not verify ({shard.name} is {size} bytes, the save wrote {size + 8})"]
    assert not (tmp_path / "bad").exists()
