"""The training run's progress: Lightning's Rich bar, described for step-based training, and a log line where no
bar shows it.

Training here ends at ``trainer.max_steps`` with ``trainer.max_epochs: -1`` (no epoch limit), where Lightning's
bar reads "Epoch 3/-2" (its epoch limit less one) beside the count of the epoch's batches. :class:`StepProgressBar`
reads "Step 9846/120000" there instead: the optimizer steps taken, of ``max_steps``, kept current at each training
batch; the count beside it is still the epoch's batches. The bar is drawn only on a terminal: where the console
is a file (a SLURM job's output, a CI log, ``| tee``), :class:`ProgressLog` logs the progress instead.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

log = logging.getLogger(__name__)


class StepProgressBar(RichProgressBar):
    """RichProgressBar whose training description, where max_steps ends training, is the step of max_steps
    (module docstring); with an epoch limit, Lightning's own "Epoch 3/9"."""

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        limit = "" if trainer.max_steps < 0 else f"/{trainer.max_steps}"
        description = f"Step {trainer.global_step}{limit}"
        # as wide as the validation bar's description, so neither moves when the other is drawn
        return f"{description:{len(self.validation_description)}}"

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.progress is not None and self.is_enabled and self.train_progress_bar_id is not None:
            description = self._get_train_description(trainer.current_epoch)
            self.progress.update(self.train_progress_bar_id, description=description)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class ProgressLog(L.Callback):
    """Where no progress bar shows the training (the console is not a terminal, or there is no bar), one log line
    every `every_s` seconds of it, from global rank 0: "step 600/1200 (50%): train/loss 2.2855, 3.06 steps/s,
    0:03:16 left", the rate since the line before (validation included) and the time left at that rate."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self.active = False
        self.last = (0.0, 0)  # (time.monotonic() of the line before, its step)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        bar_shown = trainer.progress_bar_callback is not None and sys.stdout.isatty()  # Rich draws on stdout
        self.active = trainer.is_global_zero and not bar_shown
        self.last = (time.monotonic(), trainer.global_step)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        then, step_then = self.last
        if not self.active or now - then < self.every_s:
            return
        step, limit = trainer.global_step, trainer.max_steps
        rate = (step - step_then) / (now - then)
        parts = [f"step {step}" + (f"/{limit} ({100 * step / limit:.0f}%)" if limit > 0 else "")]
        if (loss := trainer.callback_metrics.get("train/loss")) is not None:
            parts.append(f"train/loss {float(loss):.4g}")
        parts.append(f"{rate:.3g} steps/s")
        if limit > 0 and rate > 0:
            parts.append(f"{timedelta(seconds=round((limit - step) / rate))} left")
        log.info("%s: %s", parts[0], ", ".join(parts[1:]))
        self.last = (now, step)
