"""How long each training step waited for its data, so a run shows whether its device idles for the loader.

:class:`DataWait` (a callback every training run has) logs per step:

- ``time/data_wait_s``: seconds from the end of the previous training step to the start of this one: the wait
  for the loader's next batch, its copy to the device and the loop's bookkeeping between steps;
- ``time/data_wait_fraction``: that wait over the step's whole period (the wait plus the step itself).

At the end of training one line gives the mean of both over the steps counted. Not counted: the first step of
an epoch (the loader's workers start then) and the step after a validation or a checkpoint (their time is
theirs, not the loader's). On a GPU the step's kernels are queued asynchronously; the step ends, as this
measures it, once its loss has been checked on the host, so the wait is time the GPU has only the step's last
kernels (the optimiser's) to run, if any.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

log = logging.getLogger(__name__)

# A wait above this share of the step time is reported as the loader not keeping up.
SLOW_LOADER_FRACTION = 0.1


class DataWait(L.Callback):
    """Logs ``time/data_wait_s`` and ``time/data_wait_fraction`` every training step (module docstring)."""

    def __init__(self) -> None:
        self._previous_end: float | None = None  # None: the next step's wait is not the loader's alone
        self._wait: float | None = None
        self._step_start = 0.0
        self._waits: list[float] = []
        self._fractions: list[float] = []

    def _not_counted(self) -> None:
        self._previous_end = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._not_counted()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._not_counted()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._not_counted()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()
        self._wait = None if self._previous_end is None else self._step_start - self._previous_end

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._wait is not None:
            period = self._wait + time.perf_counter() - self._step_start
            fraction = self._wait / period if period > 0 else 0.0
            pl_module.log("time/data_wait_s", self._wait, on_step=True, on_epoch=False)
            pl_module.log("time/data_wait_fraction", fraction, on_step=True, on_epoch=False)
            self._waits.append(self._wait)
            self._fractions.append(fraction)
        self._previous_end = time.perf_counter()

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._waits:
            return
        wait = sum(self._waits) / len(self._waits)
        fraction = sum(self._fractions) / len(self._fractions)
        verdict = _verdict(fraction, getattr(trainer.train_dataloader, "num_workers", None))
        log.info(
            "data wait: %.3f s per step, %.1f%% of the step time, over %d steps (time/data_wait_s): %s",
            wait,
            100 * fraction,
            len(self._waits),
            verdict,
        )


def _verdict(fraction: float, workers: int | None) -> str:
    """What a mean wait of `fraction` of the step says about a loader of `workers` worker processes."""
    if fraction <= SLOW_LOADER_FRACTION:
        return "the loader keeps up"
    if workers == 0:  # the wait is the loading itself: nothing loads beside the step
        return (
            "the batches are loaded in the training process between the steps (data.num_workers=0); with cores "
            "to spare beside the step's (a GPU run), data.num_workers>0 loads them while it runs"
        )
    return "the loader does not keep up: raise data.num_workers or lower the data's cost"
