"""Multiruns as the README gives them: `python run.py -m ...` and `sweep=<file>` run in a fresh checkout with no
hydra.sweep.dir and no paths.* setting, each job in logs/<task>/<name>/multiruns/<time>/<n>_<overrides>/."""

import os
import re
import subprocess
import sys

import pytest

from helpers.run import fresh_checkout, run_py, start_run_py

TIME = re.compile(r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(_\d+)?")


@pytest.fixture
def checkout(tmp_path):
    return fresh_checkout(tmp_path / "checkout")


def sweep_dirs(checkout, task="train", name="default"):
    return sorted((checkout / "logs" / task / name / "multiruns").iterdir())


def test_a_multirun_without_a_sweep_dir_runs_every_job_in_the_documented_folders(checkout):
    run_py("-m", "debug=tiny", "seed=1,2", cwd=checkout)
    [sweep] = sweep_dirs(checkout)
    assert TIME.fullmatch(sweep.name)
    jobs = sorted(path.name for path in sweep.iterdir() if path.is_dir())
    assert jobs == ["0_debug=tiny,seed=1", "1_debug=tiny,seed=2"]
    for job in jobs:
        assert (sweep / job / "checkpoints" / "last.ckpt").is_file()


def test_a_sweep_file_runs_as_a_multirun_without_minus_m(checkout):
    """conf/sweep/*.yaml set hydra.mode: MULTIRUN: `python run.py ... sweep=agt_depth` sweeps its grid."""
    run_py("debug=tiny", "sweep=agt_depth", "backbone.agt_depth=1,2", cwd=checkout)
    [sweep] = sweep_dirs(checkout)
    jobs = sorted(path.name for path in sweep.iterdir() if path.is_dir())
    assert jobs == ["0_backbone.agt_depth=1,debug=tiny", "1_backbone.agt_depth=2,debug=tiny"]
    assert all((sweep / job / "checkpoints" / "last.ckpt").is_file() for job in jobs)


def test_two_multiruns_started_together_get_their_own_sweep_dirs(checkout):
    commands = [("-m", "debug=tiny", "trainer.max_steps=1", f"seed={a},{b}") for a, b in ((1, 2), (3, 4))]
    processes = [start_run_py(*command, cwd=checkout) for command in commands]
    for process in processes:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
    sweeps = sweep_dirs(checkout)
    assert len(sweeps) == 2
    jobs = {job.name for sweep in sweeps for job in sweep.iterdir() if job.is_dir()}
    assert jobs == {f"{n}_debug=tiny,seed={seed},trainer.max_steps=1" for n, seed in ((0, 1), (1, 2), (0, 3), (1, 4))}


def test_run_py_started_from_another_directory_writes_its_logs_there(tmp_path, checkout):
    """paths.root_dir is the directory run.py was started from, in a single run and in a multirun."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, str(checkout / "run.py"), "-m", "debug=tiny", "trainer.max_steps=1", "seed=1"],
        cwd=elsewhere,
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [sweep] = sweep_dirs(elsewhere)
    assert (sweep / "0_debug=tiny,seed=1,trainer.max_steps=1" / "checkpoints" / "last.ckpt").is_file()
    assert not (checkout / "logs").exists()
