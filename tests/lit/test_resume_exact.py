"""A run killed after a checkpoint and resumed with ckpt_path= equals the run that was never interrupted:
the same losses step by step and bitwise the same final weights (CPU, num_workers 0), for supervised training
and MCVA pretraining, resumed mid-epoch and at an epoch's end, and for the unsupervised baseline (model=unsup)
stopped by SIGTERM mid-epoch. (A finished run continued to more steps is not the longer run: its OneCycle
schedule was built for the shorter one.)"""

import csv
import signal
from pathlib import Path

import pytest
import torch

from flowformer.stop_signals import StoppedBySignal
from flowformer.tasks.train import fit

from helpers.compose import compose_tiny_config
from helpers.configs import REPO_DIR
from helpers.run import run_py

pytestmark = pytest.mark.slow

# 8 pairs in batches of 2: 4 batches per epoch, so 10 steps cross two epoch boundaries. Pixel noise draws from
# the global torch stream, which the checkpoint must carry over too.
TRAIN = (
    "debug=tiny",
    "data.train.num_samples=8",
    "model.add_noise=true",
    "trainer.max_steps=10",
    "trainer.val_check_interval=4",
)
PRETRAIN = (
    "experiment=mcva_pretrain",
    "backbone=tiny",
    "data=synthetic_video",
    "data.train.num_samples=8",
    "trainer=cpu",
    "data.batch_size=2",
    "model.query_num=2",
    "trainer.max_steps=10",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "callbacks.progress_bar=null",
)
ENV = {"PYTHONPATH": str(REPO_DIR / "tests")}


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row["train/loss"]}


def last(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.fixture(scope="module", params=["train", "pretrain"])
def uninterrupted(request, tmp_path_factory):
    overrides = TRAIN if request.param == "train" else PRETRAIN
    run_dir = tmp_path_factory.mktemp(f"{request.param}_uninterrupted")
    run_py(*overrides, f"hydra.run.dir={run_dir}", "callbacks.last_checkpoint.every_n_train_steps=3")
    return overrides, run_dir


@pytest.mark.parametrize(
    ("every_n", "kill_at"),
    [
        (3, 7),  # last.ckpt at step 6, mid-epoch; killed during step 7
        (4, 5),  # last.ckpt at step 4, the end of epoch 0 (written at that batch's end)
    ],
)
def test_resumed_run_equals_the_uninterrupted_one(uninterrupted, tmp_path, every_n, kill_at):
    overrides, reference = uninterrupted
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    kill = ["+callbacks.kill._target_=helpers.faults.KillAtStep", f"+callbacks.kill.step={kill_at}"]
    result = run_py(
        *overrides,
        f"hydra.run.dir={first}",
        f"callbacks.last_checkpoint.every_n_train_steps={every_n}",
        *kill,
        env=ENV,
        expect_ok=False,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    start = last(first)["global_step"]
    assert start == kill_at - 1 - (kill_at - 1) % every_n

    run_py(*overrides, f"hydra.run.dir={resumed}", f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}")
    assert_continues(reference, resumed, start)


def test_a_run_stopped_by_sigterm_resumes_as_the_uninterrupted_one(uninterrupted, tmp_path):
    """last.ckpt written when SIGTERM stopped the run (during step 7, mid-epoch; no periodic save before)."""
    overrides, reference = uninterrupted
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    stop = [
        "+callbacks.stop._target_=helpers.faults.SignalAtStep",
        "+callbacks.stop.step=6",
        "+callbacks.stop.signal_name=SIGTERM",
    ]
    result = run_py(
        *overrides,
        f"hydra.run.dir={first}",
        "callbacks.last_checkpoint.every_n_train_steps=100",
        *stop,
        env=ENV,
        expect_ok=False,
    )
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert last(first)["global_step"] == 7

    run_py(*overrides, f"hydra.run.dir={resumed}", f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}")
    assert_continues(reference, resumed, 7)


def assert_continues(reference: Path, resumed: Path, start: int, final_step: int = 10) -> None:
    """The run `resumed` from step `start` logged the losses of the `reference` run from there, bitwise, and
    ended at `final_step` with its weights."""
    expected, got = losses(reference), losses(resumed)
    assert sorted(got) == [step for step in sorted(expected) if step >= start]
    assert all(got[step] == expected[step] for step in got), (got, expected)
    final, reference_final = last(resumed), last(reference)
    assert final["global_step"] == reference_final["global_step"] == final_step
    # the data position written at the end of training agrees with Lightning's loop: stopping at max_steps
    # ends the epoch, so a resume would start the next one
    data_state = next(value for key, value in final.items() if key.endswith("DataModule"))
    assert data_state == {"epoch": final["epoch"], "batches_done": 0, "seed": 1234}  # conf/config.yaml's seed
    assert final["state_dict"].keys() == reference_final["state_dict"].keys()
    for key, value in reference_final["state_dict"].items():
        assert torch.equal(final["state_dict"][key], value), key


# The unsupervised baseline in this process (no run.py start), as small as a step gets: 3 pairs of 32x48 in
# batches of 1, 3 steps an epoch, so 4 steps cross an epoch boundary.
UNSUP = (
    "experiment=unsup_pretrain",
    "data=synthetic_video",
    "data.train.size=[32,48]",
    "data.train.num_samples=3",
    "data.batch_size=1",
    "trainer=cpu",
    "model.train_iters=1",
    "trainer.max_steps=4",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks.progress_bar=null",
)


def unsup_run(run_dir: Path, *overrides: str) -> None:
    """task=pretrain of UNSUP with the tiny backbone in this process, its run directory `run_dir`."""
    cfg = compose_tiny_config(*UNSUP, f"paths.root_dir={run_dir.parent}", f"paths.output_dir={run_dir}", *overrides)
    fit(cfg)


def test_unsupervised_pretraining_stopped_by_sigterm_resumes_as_the_uninterrupted_run(tmp_path):
    """Stopped during step 2 (mid-epoch, no periodic save before), resumed to step 4 across the epoch's end."""
    reference, first, resumed = tmp_path / "reference", tmp_path / "first", tmp_path / "resumed"
    unsup_run(reference)
    stop = [
        "+callbacks.stop._target_=helpers.faults.SignalAtStep",
        "+callbacks.stop.step=1",
        "+callbacks.stop.signal_name=SIGTERM",
    ]
    with pytest.raises(StoppedBySignal):
        unsup_run(first, "callbacks.last_checkpoint.every_n_train_steps=100", *stop)
    assert last(first)["global_step"] == 2

    unsup_run(resumed, f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}")
    assert_continues(reference, resumed, 2, final_step=4)
