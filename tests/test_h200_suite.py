"""bench/h200.sh --dry-run: the GPU suite's own plumbing on CPU at tiny sizes (CI has no GPU)."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_suite_dry_run_writes_every_figure(tmp_path):
    res = subprocess.run(
        ["bash", str(REPO / "bench" / "h200.sh"), "--dry-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads((tmp_path / "h200.json").read_text())
    assert {k: result[k]["status"] for k in ("tests", "latency", "training")} == dict.fromkeys(
        ("tests", "latency", "training"), "ok"
    )
    assert result["tests"]["failed"] == [] and "passed" in (tmp_path / "tests.log").read_text()
    kernels = result["tests"]["kernels"]
    # 4 cases at 1:1, 5 at 2:2
    assert len(kernels) == 9 and all(k["fused"] for k in kernels.values()), kernels
    rows = result["latency"]["rows"]
    assert sorted((r["pv"], r["shared_kv"], r["batch"]) for r in rows) == [
        (1, False, 1),
        (1, False, 2),
        (4, False, 1),
        (4, False, 2),
        (4, True, 1),
        (4, True, 2),
    ]
    # int8 and int4 (groups of 32 at tiny widths) at 1:1, batch 1 and 2
    quant = result["latency_quant"]
    assert quant["status"] == "ok" and [
        (r["quant"], r["pv"], r["batch"]) for r in quant["rows"]
    ] == [("int8", 1, 1), ("int8", 1, 2), ("int4-g32", 1, 1), ("int4-g32", 1, 2)], quant
    assert list(result["training"]["runs"]) == ["2:2"]  # the dry run trains one configuration
    # both steps logged, the figures read back from the run
    for name, run in result["training"]["runs"].items():
        lines = [
            json.loads(x)
            for x in (tmp_path / f"train_{name.replace(':', 'x')}" / "metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        assert run["steps"] == len(lines) == 2, run
        assert run["tokens_per_s"] == statistics.median(x["tokens_per_s"] for x in lines), (
            run,
            lines,
        )
        # packed, one row per micro-batch: a row holds its samples and nothing else
        assert run["pad_frac"] == 0.0, run
    md = (tmp_path / "h200.md").read_text()
    # the quantized rows, beside bf16's (fp32 here)
    assert "| int8 | 1 |" in md and "| int4-g32 | 2 |" in md
    # the paper's numbers beside ours
    assert "Table S7" in md and "| 4:4 | yes | latency (s) |" in md and "1.963" in md


def test_failed_ids_read_from_pytest_summary(tmp_path, monkeypatch):
    """The suite keeps the ids of failed tests (its output's tail can hold a single traceback): read from a
    real pytest run with one passing, one failing and one erroring test."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from h200 import failed_ids

    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef broken():\n    raise RuntimeError('no')\n\n"
        "def test_ok():\n    pass\n\n@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_bad(n):\n    assert n == 1, 'a - b'\n\n"
        "def test_err(broken):\n    pass\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "test_x.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed_ids(res.stdout) == ["test_x.py::test_bad[2]", "test_x.py::test_err"], res.stdout
