"""The training run's progress bar: Lightning's Rich bar, described for step-based training.

Training here ends at ``trainer.max_steps`` with ``trainer.max_epochs: -1`` (no epoch limit), where Lightning's
bar reads "Epoch 3/-2" (its epoch limit less one) beside the count of the epoch's batches. :class:`StepProgressBar`
reads "Step 9846/120000" there instead: the optimizer steps taken, of ``max_steps``, kept current at each training
batch; the count beside it is still the epoch's batches.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


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
