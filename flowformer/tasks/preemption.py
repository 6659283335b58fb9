"""Stopping on a scheduler's signal without losing work, and a requeued SLURM job resuming by itself.

SIGTERM (preemption, `scancel`, the end of a time limit, torchrun stopping its workers), SIGUSR1 (SLURM's
warning before the time limit, `#SBATCH --signal=SIGUSR1@90`) and SIGINT (Ctrl-C) stop a run at the end of the
unit of work in progress, with its files complete; the run logs one line (also into run.log) and exits with status
128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1, 130 for SIGINT), so a scheduler sees a failure, not
a success.

- Training (task=train, task=pretrain) builds on Lightning's stop: :class:`Preemption`'s handlers set
  `trainer.received_sigterm` (in a DDP run once the processes agree), Lightning's loops raise `SIGTERMException`
  at the end of the step in progress, and `LastCheckpoint` writes `last.ckpt` at that step
  (flowformer/lit/checkpointing.py). Preemption remembers which signal came. Under SLURM with auto-requeue
  (Lightning's `SLURMEnvironment`, its default), SIGUSR1 then requeues the job (:func:`requeue_if_warned`):
  once the run has stopped and `last.ckpt` is written, every process ignores SIGTERM (the requeue's) and
  global rank 0 runs `scontrol requeue <job>`. (Lightning's own handler wrote `hpc_ckpt_<n>.ckpt` and requeued
  from inside the signal handler: mid-step, before `last.ckpt`, and in a DDP run a collective at whatever point
  each process was interrupted.) Where `scontrol` is not on PATH (a container), the requeue cannot happen:
  the run says why in one line, so the job can be resubmitted.
- A requeued SLURM job runs the same command again, in a new run directory: :func:`resume_requeued_job` sets
  its `ckpt_path` to the `last.ckpt` the job's previous run recorded (:func:`record_for_requeue`), so it
  continues exactly as `ckpt_path=<that file>` would.
- task=infer and a pipeline's evaluation stop with flowformer/stop_signals.py, which imports no Lightning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from flowformer.lit.checkpointing import LAST_CHECKPOINT, last_checkpoint_path
from flowformer.models.output_files import atomic_write_text
from flowformer.overrides import shell_override
from flowformer.stop_signals import STOP_SIGNALS, StoppedBySignal, forked_children, note_stop, stop_noted

log = logging.getLogger(__name__)


class Preemption(L.Callback):
    """Training stops on SIGTERM, SIGINT (Ctrl-C: Lightning would end it at once, unsaved, with
    KeyboardInterrupt) and SIGUSR1 after the step in progress, through Lightning's own stop
    (``trainer.received_sigterm``, which its loops check: `SIGTERMException`), and ``received`` names the first
    stop signal. Installed when training starts, after Lightning's own handlers (which Lightning puts back when
    the trainer tears down).

    The handlers replace Lightning's SIGTERM handler and its SLURM SIGUSR1 handler, which (Lightning 2.6) make
    collectives from inside the signal handler (a broadcast; a checkpoint's save and barrier): at whatever
    point each process was interrupted, which deadlocks a DDP run whose other processes are in another
    collective (a step's gradients). Here a signal only requests the stop. With one
    process the stop is set at once (a validation in progress stops after its batch); with several, at the end
    of the training step where the processes agree that one of them was signalled (one collective a step,
    `on_train_batch_end`), so that all stop after that same step, whichever of them got a signal and when.

    Processes forked while the trainer runs (DataLoader workers) ignore the stop signals: SLURM and a terminal
    signal every process of the job, and a worker killed by one would end the main process with an error
    before it could save; the main process ends its workers when it stops. (Lightning creates the first
    workers before ``on_train_start``, and they would otherwise inherit its handlers.)"""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._trainer: L.Trainer | None = None
        self._stop_requested = False  # by a stop signal's handler

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        forked_children.ignore_stop_signals = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._request_stop)
        if (noted := stop_noted()) is not None:  # while training started, in a pipeline: stop after the first step
            self._request_stop(noted, None)

    def _request_stop(self, signum: int, frame: FrameType | None) -> None:
        note_stop(signum)
        self.received = self.received or signal.Signals(signum)
        self._stop_requested = True
        if self._trainer is not None and self._trainer.world_size == 1:
            self._trainer._signal_connector.received_sigterm = True

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.world_size > 1 and trainer.strategy.reduce_boolean_decision(self._stop_requested, all=False):
            trainer._signal_connector.received_sigterm = True

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        forked_children.ignore_stop_signals = False

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        forked_children.ignore_stop_signals = False


def received_signal(trainer: L.Trainer) -> signal.Signals | None:
    """The first stop signal this process got while `trainer` trained (its Preemption callback noted it)."""
    preemption = next((c for c in trainer.callbacks if isinstance(c, Preemption)), None)
    return preemption.received if preemption else None


def stopped_training(trainer: L.Trainer) -> StoppedBySignal:
    """What a training run stopped by a signal reports: the signal, the step, where `last.ckpt` is."""
    signum = received_signal(trainer) or signal.SIGTERM
    last = last_checkpoint_path(trainer)
    saved = (
        f"{last} holds that step; resume with {shell_override('ckpt_path', last)}"
        if last is not None
        else "nothing was saved (callbacks.last_checkpoint is off)"
    )
    return StoppedBySignal(
        signum, f"training stopped by {signum.name} at step {trainer.global_step}: {saved}"
    )


def requeue_if_warned(trainer: L.Trainer) -> None:
    """After training stopped on a signal (on every process, once last.ckpt is written): when one of the
    processes got SLURM's warning signal (SIGUSR1) in a job Lightning auto-requeues, every process ignores
    SIGTERM from now on (the run is over and saved; the requeue sends it to every process of the job) and
    global rank 0 runs `scontrol requeue <job>`, logging what it did."""
    environment = trainer._accelerator_connector.cluster_environment
    if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
        return
    warned = received_signal(trainer) == signal.SIGUSR1
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # every process stopped after the same step (Preemption), so each makes this collective, after ignoring SIGTERM
    if not trainer.strategy.reduce_boolean_decision(warned, all=False):
        signal.signal(signal.SIGTERM, previous)
        return
    if not trainer.is_global_zero:
        return
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")  # an array's task is requeued by <array job>_<task>
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if shutil.which("scontrol") is None:
        log.warning(
            "SIGUSR1: SLURM job %s cannot be requeued: scontrol is not on PATH (%s); resubmit it",
            job,
            os.environ.get("PATH", ""),
        )
        return
    status = subprocess.run(["scontrol", "requeue", job], check=False, capture_output=True, text=True)
    if status.returncode == 0:
        log.info("SIGUSR1: SLURM job %s is requeued (scontrol requeue %s)", job, job)
    else:
        log.warning(
            "SIGUSR1: SLURM job %s could not be requeued: scontrol requeue %s ended with status %d (%s); resubmit it",
            job,
            job,
            status.returncode,
            (status.stderr or status.stdout).strip(),
        )


def requeue_record(cfg: DictConfig) -> Path | None:
    """Where a SLURM job's run records its `last.ckpt` for the job's requeued run: one file per job (each
    array task has its own job id), srun step and command line, under paths.log_dir; None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    if job is None or not HydraConfig.initialized():
        return None
    step = os.environ.get("SLURM_STEP_ID")
    command = "\n".join(HydraConfig.get().overrides.task)
    digest = hashlib.sha256(command.encode()).hexdigest()[:12]
    return Path(cfg.paths.log_dir) / "requeue" / f"slurm-{job}{f'.{step}' if step else ''}-{digest}.txt"


def pipeline_stage(cfg: DictConfig) -> bool:
    """Whether `cfg` is a stage of a pipeline (task=pipeline gives each `callbacks.stage_result`): its pipeline
    resumes it from pipeline.json when the job runs again; the stages of one job would share one record here."""
    return bool((cfg.get("callbacks") or {}).get("stage_result"))


def resume_requeued_job(cfg: DictConfig) -> None:
    """In a requeued SLURM job (SLURM_RESTART_COUNT >= 1) without ckpt_path: ckpt_path becomes the newest
    checkpoint the job's previous run recorded, when one exists."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    record = requeue_record(cfg)
    if restarts < 1 or cfg.get("ckpt_path") or pipeline_stage(cfg) or record is None or not record.is_file():
        return
    checkpoint = next((line for line in record.read_text().splitlines() if Path(line).is_file()), None)
    job = os.environ["SLURM_JOB_ID"]
    if checkpoint is None:
        log.warning(
            "requeued SLURM job %s (restart %d): its previous run saved no checkpoint (%s)",
            job,
            restarts,
            record,
        )
        return
    log.info("requeued SLURM job %s (restart %d): resuming from ckpt_path=%s", job, restarts, checkpoint)
    cfg.ckpt_path = checkpoint


@rank_zero_only
def record_for_requeue(cfg: DictConfig) -> None:
    """Under SLURM, the file :func:`resume_requeued_job` reads: this run's `last.ckpt` and, should this run be
    stopped before it writes one, the checkpoint it resumed from."""
    record = requeue_record(cfg)
    last_cfg = (cfg.get("callbacks") or {}).get("last_checkpoint")
    if record is None or last_cfg is None or pipeline_stage(cfg):
        return
    candidates = [Path(last_cfg.dirpath).resolve() / LAST_CHECKPOINT]
    if cfg.get("ckpt_path"):
        candidates.append(Path(cfg.ckpt_path).resolve())
    atomic_write_text(record, "".join(f"{path}\n" for path in candidates))
