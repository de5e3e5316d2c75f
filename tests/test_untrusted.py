"""What a command takes on trust, and no longer does (issue 46): an output adopted only when it was made here
with these settings, a Ctrl-C that is never an answer, the answer extractor as a remote service that can fail,
lie or redirect, nothing saved that is not finite, one writer for every output, a study that resumes where it
lives, and flags spelled whole. Each test names the rule it holds; each is small (no model is trained)."""

import pytest
from cluster_fakes import fake_slurm, sbatch, slurm_log
from commands import run_main

import evaluate
import generate
import profiling
import router
import study
import train

# -- rule 9: a flag is spelled whole; the sbatch script's first word is a script ----------------------------


@pytest.mark.parametrize(
    "main, argv, whole",
    [
        (train.main, ["--overwr"], None),
        (generate.main, ["--max-new", "4"], None),
        (evaluate.main, ["run", "--bench", "MMMU_DEV_VAL"], "--benchmark"),
        (router.main, ["train", "--mod", "m"], "--model"),
        (profiling.main, ["latency", "--arc", "1b"], None),
        (study.main, ["--mod", "m"], "--model"),
    ],
)
def test_an_abbreviated_flag_is_refused_in_every_command(capsys, main, argv, whole):
    """argparse took `--overwr` for --overwrite: a requeued job then got `--overwr --resume` and exited 2 on every
    restart. A flag is taken only as spelled whole (OneLineParser, allow_abbrev=False): exit 2, one line naming it."""
    abbreviation = next(a for a in argv if a.startswith("--"))
    code, err = run_main(capsys, main, argv)
    assert (code, len(err)) == (2, 1), err
    # a command with required flags names the whole flag as missing: the abbreviation filled none
    assert (
        f"required: {whole}" in err[0]
        if whole
        else f"unrecognized arguments: {abbreviation}" in err[0]
    ), err


def test_sbatch_refuses_a_first_word_that_is_no_script(tmp_path):
    """`sbatch slurm/parvl.sbatch python train.py ...` ran torchrun on `python` and never resumed a requeued
    train.py: the first word is the command's script, else one line and exit 2, srun never started."""
    env = fake_slurm(tmp_path, FAKE_SRUN_SLEEP=0)
    res = sbatch(["python", "train.py", "--out", "r"], env, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        "parvl.sbatch: 'python': not a command's script (train.py, evaluate.py, router.py, ...; the "
        "interpreter is PYTHON's)"
    ]
    assert not [c for c in slurm_log(env) if c[0] == "srun"]
