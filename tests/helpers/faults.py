"""Callbacks that break a run on purpose, for the reliability tests (`+callbacks.<name>._target_=...`)."""

import os
import signal

import lightning as L


class KillAtStep(L.Callback):
    """SIGKILL the process when the batch after `step` optimiser steps starts: no handler, no cleanup."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
