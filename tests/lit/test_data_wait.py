"""DataWait: every training step logs how long it waited for its batch and that wait's share of the step, and
a loader slower than the step shows as a large wait."""

import csv
import logging
import time

import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

from flowformer.lit.data_wait import DataWait

from helpers.run import fresh_checkout, run_py
from helpers.trainers import LinearModule, cpu_trainer

BATCH = 4
STEPS = 8


class Pairs(Dataset):
    """2-vectors, each taking `delay_s` to load (a slow disk or augmentation)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        time.sleep(self.delay_s)
        return (torch.full((2,), float(index)),)


def logged_waits(tmp_path, delay_s: float, workers: int = 0) -> list[dict[str, float]]:
    """The time/* values of a LinearModule trained STEPS steps on Pairs(delay_s) loaded by `workers` worker
    processes, one dict per logged step."""
    trainer = cpu_trainer(
        max_steps=STEPS, callbacks=[DataWait()], logger=CSVLogger(tmp_path, name=f"{delay_s}_{workers}"), log_every_n_steps=1
    )
    trainer.fit(LinearModule(), DataLoader(Pairs(delay_s), batch_size=BATCH, num_workers=workers))
    with open(trainer.logger.experiment.metrics_file_path) as file:
        rows = [row for row in csv.DictReader(file) if row.get("time/data_wait_s")]
    return [{key: float(row[key]) for key in ("time/data_wait_s", "time/data_wait_fraction")} for row in rows]


def test_a_slow_loader_shows_as_a_large_wait_and_a_fast_one_as_none(tmp_path, caplog):
    delay_s = 0.03
    with caplog.at_level(logging.INFO, logger="flowformer.lit.data_wait"):
        slow = logged_waits(tmp_path, delay_s)
    assert len(slow) == STEPS - 1  # the first step (the loader starting) is not counted
    assert all(row["time/data_wait_s"] >= BATCH * delay_s for row in slow)
    assert all(0.8 < row["time/data_wait_fraction"] < 1 for row in slow)  # the step itself takes milliseconds
    (summary,) = [record.getMessage() for record in caplog.records if record.name == "flowformer.lit.data_wait"]
    assert f"% of the step time, over {STEPS - 1} steps" in summary
    assert "loaded in the training process between the steps (data.num_workers=0)" in summary

    fast = logged_waits(tmp_path, 0.0)
    assert max(row["time/data_wait_s"] for row in fast) < BATCH * delay_s / 4


def test_workers_slower_than_the_step_are_told_to_grow(tmp_path, caplog):
    """One worker process taking 0.1 s a batch behind a step of milliseconds: more workers are the remedy."""
    with caplog.at_level(logging.INFO, logger="flowformer.lit.data_wait"):
        logged_waits(tmp_path, 0.025, workers=1)
    (summary,) = [record.getMessage() for record in caplog.records if record.name == "flowformer.lit.data_wait"]
    assert "the loader does not keep up: raise data.num_workers" in summary


def test_a_training_run_logs_its_data_wait(tmp_path):
    """`python run.py debug=tiny logger=csv` from a fresh checkout (no checkpoints or validation, small images:
    the callback is every training run's): the wait is in metrics.csv and run.log."""
    checkout = fresh_checkout(tmp_path / "checkout")
    overrides = ("trainer.max_steps=3", "callbacks=none", "trainer.limit_val_batches=0", "data.train.size=[32,32]")
    run_py("debug=tiny", "logger=csv", *overrides, cwd=checkout, timeout=120)
    (run_dir,) = (checkout / "logs/train/default/runs").iterdir()
    with open(run_dir / "csv/metrics.csv") as file:
        waits = [float(row["time/data_wait_s"]) for row in csv.DictReader(file) if row.get("time/data_wait_s")]
    assert len(waits) == 2 and all(0 <= wait < 5 for wait in waits)  # steps 2 and 3; the tiny data is rendered fast
    assert "data wait: " in (run_dir / "run.log").read_text()
