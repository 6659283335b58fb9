"""Nothing lost, nothing unclear: last.ckpt is the latest state, checkpoint writes are atomic and reads safe,
every run gets its own directory, output locations are checked before work starts, bad ckpt_path values end in
one line before training."""

import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import cv2
import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from omegaconf import OmegaConf

from flowformer.lit.checkpointing import (
    LastCheckpoint,
    SafeCheckpointIO,
    last_checkpoint_path,
)
from flowformer.models.checkpoint import CheckpointReadError
from flowformer.models.output_files import OutputWriteError
from flowformer.tasks import run_dirs
from flowformer.tasks.run_setup import build_callbacks

from helpers.compose import compose_run_config
from helpers.configs import REPO_DIR
from helpers.run import run_py
from helpers.trainers import LinearModule, cpu_trainer, linear_loader


class GetsWorse(LinearModule):
    """A linear model whose validation metric rises at every validation (so the best is the first)."""

    def validation_step(self, batch, batch_idx):
        self.log("val/metric", float(self.global_step))


def test_last_checkpoint_is_the_final_state_when_validation_got_worse(tmp_path):
    cfg = compose_run_config(["debug=tiny", f"paths.output_dir={tmp_path}", "monitor=val/metric"])
    trainer = cpu_trainer(
        enable_checkpointing=True,
        max_steps=5,  # the run ends between validations (every 2 steps), after a worse one at step 4
        val_check_interval=2,
        check_val_every_n_epoch=None,
        callbacks=[c for c in build_callbacks(cfg) if isinstance(c, Checkpoint)],  # as configured
        plugins=[SafeCheckpointIO()],
    )
    module = GetsWorse()
    trainer.fit(module, train_dataloaders=linear_loader(), val_dataloaders=linear_loader())

    last = torch.load(last_checkpoint_path(trainer), weights_only=True)
    assert last["global_step"] == 5
    for key, value in module.state_dict().items():
        assert torch.equal(last["state_dict"][key], value), key
    best = [p.name for p in (tmp_path / "checkpoints").glob("best-*.ckpt")]
    assert best == ["best-step0000002.ckpt"]


def test_last_checkpoint_is_written_every_n_steps(tmp_path, caplog):
    steps = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if (tmp_path / "last.ckpt").is_file():
                steps.append(torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"])

    trainer = cpu_trainer(
        enable_checkpointing=True,
        max_steps=7,
        limit_val_batches=0,
        callbacks=[Record(), LastCheckpoint(tmp_path, every_n_train_steps=3)],
    )
    with caplog.at_level(logging.INFO):
        trainer.fit(GetsWorse(), train_dataloaders=linear_loader())
    # Record runs before the checkpoint callback within a step: it sees the file of the step before
    assert steps == [3, 3, 3, 6]  # seen at the ends of steps 4, 5, 6 and 7
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert last["global_step"] == 7 and last["optimizer_states"] and "loops" in last  # the whole state, to resume
    # Lightning logs "`weights_only` was not set, defaulting to `False`" for a save that does not say what it
    # saves, which reads as an unsafe load; LastCheckpoint says it saves everything
    assert "weights_only" not in caplog.text


def test_last_checkpoint_is_written_when_max_time_stops_the_run(tmp_path):
    class Slow(GetsWorse):
        def training_step(self, batch, batch_idx):
            time.sleep(0.2)
            return super().training_step(batch, batch_idx)

    trainer = cpu_trainer(
        enable_checkpointing=True,
        max_time={"seconds": 1},
        max_epochs=-1,
        limit_val_batches=0,
        callbacks=[LastCheckpoint(tmp_path, every_n_train_steps=1000)],
    )
    trainer.fit(Slow(), train_dataloaders=linear_loader())
    assert 0 < trainer.global_step < 1000
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == trainer.global_step


def test_a_failed_checkpoint_write_keeps_the_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    io = SafeCheckpointIO()
    io.save_checkpoint({"global_step": 1}, target)

    def disk_full(obj, file):
        file.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OutputWriteError, match="No space left on device.*previous last.ckpt is intact"):
        io.save_checkpoint({"global_step": 2}, target)
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"global_step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


class CreatesFile:
    """Unpickling it would create a file: the payload of a malicious checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_read_for_the_resume_check_is_not_read_again(tmp_path):
    path = tmp_path / "resume.ckpt"
    torch.save({"global_step": 3}, path)
    io = SafeCheckpointIO(resume=(str(path), {"global_step": 3, "read": "once"}))
    assert io.load_checkpoint(path) == {"global_step": 3, "read": "once"}  # handed over, not read from disk
    assert io.load_checkpoint(path) == {"global_step": 3}  # only once: later loads read the file


def malicious_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    payload = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    with open(path, "wb") as handle:
        pickle.dump({"state_dict": {}, "global_step": CreatesFile(str(payload))}, handle)
    return path, payload


def test_resume_loads_plain_values_whatever_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    path, payload = malicious_checkpoint(tmp_path)
    trainer = cpu_trainer(enable_checkpointing=True, max_steps=1, plugins=[SafeCheckpointIO()])
    with pytest.raises(CheckpointReadError):
        trainer.fit(GetsWorse(), train_dataloaders=linear_loader(), ckpt_path=path)
    assert not payload.exists()


def test_malicious_ckpt_path_through_run_py_runs_nothing(tmp_path):
    path, payload = malicious_checkpoint(tmp_path)
    result = run_py(
        "debug=tiny",
        f"ckpt_path={path}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
        expect_ok=False,
    )
    assert result.returncode == 1 and not payload.exists()
    assert "Traceback" not in result.stderr and "weights_only=False" not in result.stderr


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    run_py("debug=tiny", "trainer.max_steps=1", f"hydra.run.dir={run_dir}")
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("kind", ["random bytes", "truncated", "another backbone", "backbone file"])
def test_bad_ckpt_path_is_one_line_before_training(tmp_path, tiny_checkpoint, kind):
    overrides = ["debug=tiny", f"hydra.run.dir={tmp_path / 'run'}"]
    path = tmp_path / "bad.ckpt"
    if kind == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif kind == "truncated":
        data = tiny_checkpoint.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "another backbone":
        path = tiny_checkpoint
        overrides.append("backbone.agt_depth=2")
    else:
        torch.save({"layer.weight": torch.zeros(1)}, path)
    result = run_py(*overrides, f"ckpt_path={path}", expect_ok=False)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and str(path) in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "weights_only=False" not in result.stderr
    if kind == "another backbone":
        assert "does not match the network" in result.stderr and "missing keys" in result.stderr
    if kind == "backbone file":
        assert "not a Lightning training checkpoint" in errors[0] and "model.init_from" in errors[0]
    assert not (tmp_path / "run").exists()  # nothing was trained, nothing is left behind


def test_fresh_dir_claims_a_new_directory_when_the_second_is_taken(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda pattern: "2026-01-01_00-00-00")
    monkeypatch.setattr(run_dirs, "_claimed", {})
    first = run_dirs.fresh_dir(str(tmp_path))
    assert run_dirs.fresh_dir(str(tmp_path)) == first  # one process, one run: the same directory
    monkeypatch.setattr(run_dirs, "_claimed", {})  # another process
    second = run_dirs.fresh_dir(str(tmp_path))
    assert Path(first).name == "2026-01-01_00-00-00" and Path(second).name == "2026-01-01_00-00-00_2"
    assert Path(first).is_dir() and Path(second).is_dir()


def test_runs_and_sweeps_claim_fresh_directories():
    hydra_cfg = compose_run_config([]).hydra
    run, sweep = OmegaConf.to_container(hydra_cfg.run), OmegaConf.to_container(hydra_cfg.sweep)
    assert run["dir"].startswith("${fresh_dir:") and sweep["dir"].startswith("${fresh_dir:")
    # each job of a sweep: its own numbered folder, one plain name (flowformer/tasks/run_dirs.py, job_folder)
    assert sweep["subdir"] == "${job_folder:${hydra.job.num},${hydra.job.override_dirname}}"


def test_two_runs_started_together_get_two_intact_directories(tmp_path):
    command = [sys.executable, "run.py", "debug=tiny", "trainer.max_steps=1", "trainer.val_check_interval=1"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    runs = [
        subprocess.Popen(
            [*command, f"paths.log_dir={tmp_path}", f"seed={seed}"],
            cwd=REPO_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    for run in runs:
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-2000:]
    run_dirs_made = sorted((tmp_path / "train" / "default" / "runs").iterdir())
    assert len(run_dirs_made) == 2
    seeds = set()
    for run_dir in run_dirs_made:
        config = (run_dir / "config_resolved.yaml").read_text()
        seeds.add(next(line for line in config.splitlines() if line.startswith("seed:")))
        assert (run_dir / "checkpoints" / "last.ckpt").is_file()
        assert len(list((run_dir / "checkpoints").glob("best-*.ckpt"))) == 1
        assert (run_dir / "run.log").read_text().count("monitored metric") == 1
    assert seeds == {"seed: 1", "seed: 2"}


def test_a_non_empty_run_directory_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "results.txt").write_text("an earlier run's work")
    result = run_py("debug=tiny", f"hydra.run.dir={tmp_path}", expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "is not empty (results.txt)" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]


@pytest.mark.parametrize("where", ["checkpoints", "run dir parent", "run dir in /proc", "infer output"])
def test_unwritable_output_locations_fail_before_any_work(tmp_path, where):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    run_dir = tmp_path / "run"
    expected = f"{blocker} is a file"
    if where == "checkpoints":
        overrides = [
            "debug=tiny",
            f"hydra.run.dir={run_dir}",
            f"callbacks.model_checkpoint.dirpath={blocker}",
            f"callbacks.last_checkpoint.dirpath={blocker}",
        ]
    elif where == "run dir parent":
        overrides = ["debug=tiny", f"hydra.run.dir={blocker / 'run'}"]
    elif where == "run dir in /proc":
        overrides = ["debug=tiny", "hydra.run.dir=/proc/flowformer-test/run"]
        expected = "cannot write hydra.run.dir /proc/flowformer-test/run"
    else:
        frames = [tmp_path / "a.png", tmp_path / "b.png"]
        for frame in frames:
            cv2.imwrite(str(frame), np.zeros((32, 32, 3), np.uint8))
        overrides = [
            "task=infer",
            "backbone=tiny",
            "infer.checkpoint=unused.ckpt",
            f"infer.input=[{frames[0]},{frames[1]}]",
            f"infer.output_dir={blocker}",
            f"hydra.run.dir={run_dir}",
        ]
    result = run_py(*overrides, expect_ok=False)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (run_dir / "csv" / "metrics.csv").exists()


def test_callbacks_config_keeps_best_and_last_apart():
    callbacks = build_callbacks(compose_run_config(["debug=tiny"]))
    best = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    last = [c for c in callbacks if isinstance(c, LastCheckpoint)]
    assert len(best) == 1 and not best[0].save_last and best[0].save_top_k == 1
    assert len(last) == 1 and last[0].path.name == "last.ckpt"
