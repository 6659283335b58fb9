"""Earlier results are never destroyed: a run refuses another run's run or checkpoint directory (and of two
runs given one directory at the same time exactly one gets it); task=convert, task=infer and task=eval refuse
to replace existing outputs unless their `overwrite` setting is true, and never write over (or read back)
their own inputs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowformer.tasks import run_dirs

from helpers.configs import REPO_DIR
from helpers.run import run_py


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """The run directory of a 6-step debug=tiny run (its checkpoints/last.ckpt at step 6)."""
    run_dir = tmp_path_factory.mktemp("first") / "run"
    run_py("debug=tiny", "trainer.max_steps=6", f"hydra.run.dir={run_dir}")
    return run_dir


def test_a_run_given_another_runs_checkpoint_dirpath_is_refused(finished_run, tmp_path):
    checkpoints = finished_run / "checkpoints"
    last = checkpoints / "last.ckpt"
    before = last.read_bytes()
    result = run_py(
        "debug=tiny",
        f"hydra.run.dir={tmp_path / 'second'}",
        f"callbacks.last_checkpoint.dirpath={checkpoints}",
        f"callbacks.model_checkpoint.dirpath={checkpoints}",
        expect_ok=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (error,) = error_lines(result.stderr)
    assert f"callbacks.last_checkpoint.dirpath {checkpoints} is not empty" in error
    assert last.read_bytes() == before
    assert torch.load(last, weights_only=True)["global_step"] == 6
    assert not (tmp_path / "second").exists()  # refused before any work: nothing left behind


def test_the_run_dir_of_a_finished_run_is_refused(finished_run):
    before = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    result = run_py("debug=tiny", f"hydra.run.dir={finished_run}", expect_ok=False)
    assert result.returncode == 1
    (error,) = error_lines(result.stderr)
    assert f"hydra.run.dir {finished_run} is not empty" in error
    assert {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()} == before


# python run.py, with Hydra's first write into the run directory (run.log) 5 s after its checks, as on a slow
# filesystem: two runs started together both check the directory before either writes into it.
SLOW_FIRST_WRITE = (
    "import runpy, time, hydra.core.utils as hydra_utils; configure_log = hydra_utils.configure_log; "
    "hydra_utils.configure_log = lambda *args: (time.sleep(5), configure_log(*args)); "
    "runpy.run_path('run.py', run_name='__main__')"
)


def test_two_runs_started_together_in_one_explicit_run_dir_one_wins(tmp_path):
    run_dir = tmp_path / "shared"
    command = [sys.executable, "-c", SLOW_FIRST_WRITE, "debug=tiny", "trainer.max_steps=1"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    runs = [
        subprocess.Popen(
            [*command, f"hydra.run.dir={run_dir}"],
            cwd=REPO_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    stderrs = [run.communicate(timeout=600)[1] for run in runs]
    codes = [run.returncode for run in runs]
    assert sorted(codes) == [0, 1], [stderr[-2000:] for stderr in stderrs]
    refused = stderrs[codes.index(1)]
    (error,) = error_lines(refused)
    assert f"hydra.run.dir {run_dir}" in error
    assert (run_dir / "run.log").read_text().count("monitored metric") == 1  # one run's log, not two
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 1


def test_of_two_claims_that_both_found_the_directory_empty_the_second_is_refused(tmp_path, monkeypatch):
    run_dirs.claim_dir(tmp_path, "hydra.run.dir", "the first run")
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(()))  # it listed the directory before that claim
    with pytest.raises(run_dirs.OutputPathError, match="was just claimed by another run"):
        run_dirs.claim_dir(tmp_path, "hydra.run.dir", "the second run")
    monkeypatch.undo()
    assert (tmp_path / run_dirs.CLAIM_FILE).read_text() == "the first run"
    run_dirs.claim_dir(tmp_path, "hydra.run.dir", "the first run")  # its own directory: still its own


def test_a_claim_is_given_back_only_where_its_run_wrote_nothing(tmp_path):
    unused, used = tmp_path / "unused", tmp_path / "used"
    for directory in (unused, used):
        directory.mkdir()
        run_dirs.claim_dir(directory, "callbacks.last_checkpoint.dirpath", "this run")
    (used / "last.ckpt").write_bytes(b"a checkpoint")
    run_dirs.release_unused_claims()
    assert not list(unused.iterdir())
    assert sorted(p.name for p in used.iterdir()) == [run_dirs.CLAIM_FILE, "last.ckpt"]
