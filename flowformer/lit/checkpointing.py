"""Checkpoints a long run can trust: written atomically, read safely, `last.ckpt` always the latest state.

- :class:`SafeCheckpointIO` is the trainer's checkpoint I/O: every checkpoint (last, best, resume) is written to
  a temporary file beside the target and renamed over it, so a failed write (disk full, permission) leaves the
  previous file whole; every read, resume included, goes through ``torch.load(weights_only=True)`` whatever
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says, so a checkpoint cannot run code.
- :class:`LastCheckpoint` writes ``<dir>/last.ckpt`` every ``every_n_train_steps``, when training ends (max
  steps, max time, max epochs), whatever validation says, and when a stop signal ends it early (SIGTERM,
  SIGUSR1, Ctrl-C: flowformer/tasks/preemption.py), also during a validation; a resume runs the validation of the
  step it resumes at (:func:`validation_restart`); ``ModelCheckpoint`` keeps only the best by the monitor.
- :class:`RandomStates` saves the global torch / numpy / Python random states, so a resumed run draws the same
  numbers (pixel noise, anything using the global stream) as the run it continues.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from flowformer.data.io import InputsGoneError
from flowformer.lit.base import FORMER_HYPERPARAMETERS, BackboneModule
from flowformer.lit.flow import FlowModule
from flowformer.lit.mcva import MCVAPretrainModule
from flowformer.lit.unsup import UnsupervisedPretrainModule
from flowformer.models.checkpoint import check_compatible, checkpoint_file, read_checkpoint
from flowformer.models.output_files import atomic_write
from flowformer.overrides import shell_override

log = logging.getLogger(__name__)

LAST_CHECKPOINT = "last.ckpt"


class SafeCheckpointIO(TorchCheckpointIO):
    """Atomic local writes (temporary file + rename) and weights-only reads. `resume`: a (path, checkpoint)
    already read and checked (`check_resume_checkpoint`), handed to Lightning's resume instead of reading the
    file a second time."""

    def __init__(self, resume: tuple[str | Path, dict] | None = None) -> None:
        super().__init__()
        self._resume = resume

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = Path(path)
        advice = (
            f"Free disk space or fix the permissions of {path.parent}, then resume with "
            "ckpt_path=<the last good checkpoint>"
        )
        with atomic_write(path, advice) as file:
            torch.save(checkpoint, file)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict:
        if self._resume is not None and Path(path) == Path(self._resume[0]):
            checkpoint, self._resume = self._resume[1], None
            return checkpoint
        return read_checkpoint(path)


class LastCheckpoint(Checkpoint):
    """``<dirpath>/last.ckpt``: the full training state every ``every_n_train_steps`` optimiser steps, at the
    end of training, and at the step a stop signal came in: Preemption (flowformer/tasks/preemption.py) sets
    ``trainer.received_sigterm`` and Lightning ends training with ``SIGTERMException`` after that step, or after
    the validation batch in progress when the step is followed by a validation; and when input files disappear
    during the run (``InputsGoneError``: the state is whole, the data is not). A ``Checkpoint`` subclass, so
    Lightning runs it after the other callbacks of a step.

    A step followed by a validation is saved as it stood when that validation started, whenever the save
    comes (at the step's end, during the validation or after it, before the next step), so a resume runs the
    whole validation and then goes on as the uninterrupted run did (:func:`validation_restart`). Lightning
    itself resumes a step saved at its end or during its validation without that validation, and one saved
    after the validation ended (a stop in its last batch) logs every later step one too high."""

    def __init__(self, dirpath: str | Path, every_n_train_steps: int = 500) -> None:
        if every_n_train_steps < 1:
            raise ValueError(
                f"LastCheckpoint: every_n_train_steps must be >= 1, got {every_n_train_steps} "
                "(set callbacks.last_checkpoint.every_n_train_steps)"
            )
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps
        # (global step, whether the loops saved are those before that step's validation) of the last write
        self._saved: tuple[int, bool] | None = None
        # (global step, the fit loop's state to resume that step's validation from) while that validation runs
        self._before_validation: tuple[int, dict] | None = None
        self._loops_to_save: dict | None = None

    @property
    def path(self) -> Path:
        return self.dirpath / LAST_CHECKPOINT

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._before_validation = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        # a stop the processes of a DDP run agreed on in this step's Preemption callback (run before this one)
        if trainer.global_step % self.every_n_train_steps == 0 or trainer.received_sigterm:
            self._save(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A validation during training: `last.ckpt` written at this step is written again with the loops as
        they stand now, so a resume from it runs this validation."""
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self._before_validation = (trainer.global_step, validation_restart(trainer.fit_loop.state_dict()))
        if self._saved is not None and self._saved[0] == trainer.global_step:
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._before_validation = None  # training is over: a resume has nothing left to validate
        self._save(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, (SIGTERMException, InputsGoneError)):  # the state is whole: keep it
            self._save(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self._loops_to_save is not None:
            checkpoint["loops"]["fit_loop"] = self._loops_to_save

    def _save(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        before = self._before_validation
        before_validation = before is not None and before[0] == step
        if trainer.sanity_checking or self._saved == (step, before_validation):
            return
        self._loops_to_save = before[1] if before is not None and before_validation else None
        try:
            # the whole state: optimiser, schedulers, loops
            trainer.save_checkpoint(self.path, weights_only=False)
        finally:
            self._loops_to_save = None
        self._saved = (step, before_validation)
        log.debug("wrote %s at step %d", self.path, step)


def validation_restart(fit_loop: dict) -> dict:
    """The fit loop's state (``trainer.fit_loop.state_dict()``) as a validation during training starts, made
    the state Lightning saves inside that validation's first batch: Lightning resumes it by running the whole
    validation (its RESTARTED_MID_EVALUATION stage, with no batch done; its totals over the epoch count one
    batch started and not processed), then the rest of the training step's end, where the logged step
    (``_batches_that_stepped``, saved before that increment) advances. The random states saved beside it are
    those before the validation: its loaders draw from their own generator (FlowDataModule) and its steps draw
    nothing."""
    state = copy.deepcopy(fit_loop)
    progress = state["epoch_loop.val_loop.batch_progress"]
    done = progress["total"]["completed"]
    progress["total"].update(ready=done + 1, started=done + 1, processed=done)
    progress["current"].update(ready=1, started=1, processed=0, completed=0)
    progress["is_last_batch"] = False
    return state


# The kinds of module a training checkpoint comes from (their own hyper-parameters tell them apart).
TRAINING_MODULES: tuple[type[BackboneModule], ...] = (FlowModule, MCVAPretrainModule, UnsupervisedPretrainModule)
# Settings only a run that starts afresh reads (a resumed run takes the weights from its checkpoint).
FRESH_START_SETTINGS = ("init_from", "skip_init_prefixes")

# What Lightning writes into every training checkpoint; a file without them cannot resume a run.
TRAINING_STATE_KEYS = ("state_dict", "global_step", "loops", "optimizer_states")


def check_resume_checkpoint(path: str | Path, module: BackboneModule, max_steps: int | None) -> dict:
    """The checkpoint at ``ckpt_path``, refused before training starts when it is unreadable, not a Lightning
    training checkpoint, saved by another kind of module, made for another network (the error lists missing /
    unexpected / mis-shaped keys), or leaves nothing to train up to ``max_steps`` (trainer.max_steps) within
    the schedule it resumes."""
    checkpoint = read_checkpoint(checkpoint_file(path, "ckpt_path"), module)
    missing = [key for key in TRAINING_STATE_KEYS if key not in checkpoint]
    if missing:
        raise ValueError(
            f"ckpt_path={path} is not a Lightning training checkpoint (it lacks {', '.join(missing)}): resume "
            "from <run dir>/checkpoints/last.ckpt, or start from its weights with model.init_from=<file>"
        )
    check_module_kind(checkpoint, module, path)
    check_compatible(module, checkpoint["state_dict"], f"ckpt_path={path}")
    check_steps_left(checkpoint, max_steps, path)
    return checkpoint


def check_module_kind(checkpoint: dict, module: BackboneModule, path: str | Path) -> None:
    """Refuses a checkpoint whose hyper-parameters are another kind of module's (an MCVAPretrainModule or
    UnsupervisedPretrainModule checkpoint resumed as FlowModule, or the reverse): their optimisers hold different
    parameter groups, or their settings mean different things."""
    saved = set(checkpoint.get("hyper_parameters") or {})
    if not saved:
        return
    kind = saved_module_kind(saved)
    if kind is not None and isinstance(module, kind):
        return
    if kind is None and type(module).own_hyperparameters() & saved:  # a kind outside TRAINING_MODULES
        return
    raise ValueError(
        f"ckpt_path={path} was saved by {kind.__name__ if kind else 'another module'}, but this run trains "
        f"{type(module).__name__}: resume it with the model it was trained with, or start from its weights with "
        f"{shell_override('model.init_from', path)}"
    )


def saved_module_kind(saved: set[str]) -> type[BackboneModule] | None:
    """The kind in TRAINING_MODULES whose own hyper-parameters the saved names hold most of (kinds share a few,
    e.g. FlowModule's and UnsupervisedPretrainModule's gamma and train_iters), or None if none holds any."""
    shared = {kind: len(kind.own_hyperparameters() & saved) for kind in TRAINING_MODULES}
    kind = max(shared, key=shared.get)
    return kind if shared[kind] else None


def check_steps_left(checkpoint: dict, max_steps: int | None, path: str | Path) -> None:
    """Refuses a resume that trains nothing (the checkpoint is at or past trainer.max_steps) or that would
    step the checkpoint's schedule past its end: a resumed schedule keeps the total_steps it was built
    with."""
    if max_steps is None or max_steps < 1:
        return
    step = checkpoint["global_step"]
    if step >= max_steps:
        raise ValueError(
            f"ckpt_path={path} is at step {step} and trainer.max_steps={max_steps}: nothing is left to "
            f"train; raise trainer.max_steps above {step}"
        )
    for schedule in checkpoint.get("lr_schedulers") or []:
        total_steps = schedule.get("total_steps")
        if total_steps is not None and max_steps > total_steps:
            raise ValueError(
                f"ckpt_path={path} resumes a schedule of total_steps={total_steps}, which a resumed run "
                f"keeps, so trainer.max_steps={max_steps} would step past its end; train at most "
                f"{total_steps} steps, or start a new run from its weights with "
                f"{shell_override('model.init_from', path)}"
            )


def changed_settings(checkpoint: dict, module: BackboneModule) -> list[str]:
    """`<config key>=<this run's value> (checkpoint: <its value>)` for each of the module's settings that
    differs from the checkpoint's hyper-parameters (those written before model.optimizer / model.scheduler
    under their former names); the settings only a fresh start reads (init_from, skip_init_prefixes) are
    left out."""
    saved = config_keys(checkpoint.get("hyper_parameters") or {})
    current = config_keys(module.hparams)
    return [
        f"{key}={current[key]!r} (checkpoint: {saved[key]!r})"
        for key in sorted(saved.keys() & current.keys())
        if saved[key] != current[key]
    ]


def config_keys(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """A module's hyper-parameters by their config keys (backbone.<knob>, model.<setting>; a former name by
    the setting it is now, FORMER_HYPERPARAMETERS), nested ones flattened."""
    keys: dict[str, Any] = {}
    for name, value in hparams.items():
        if name not in FRESH_START_SETTINGS:
            setting = ".".join(FORMER_HYPERPARAMETERS.get(name, (name,)))
            key = "backbone" if name == "backbone" else f"model.{setting}"
            keys |= flattened(value, key)
    return keys


def flattened(value: Any, key: str) -> dict[str, Any]:
    """{key: value}, or for a mapping its leaves under key.<name>...."""
    if not isinstance(value, Mapping):
        return {key: value}
    return {
        leaf: item
        for name, inner in value.items()
        for leaf, item in flattened(inner, f"{key}.{name}").items()
    }


def forget_best_of_other_dirs(checkpoint: dict, dirpath: str | Path) -> None:
    """Drops the ModelCheckpoint state a checkpoint saved in another directory: Lightning would restore its
    best_model_path, and another run's (maybe deleted) file would pass for this run's best checkpoint."""
    callbacks = checkpoint.get("callbacks") or {}
    for key, state in list(callbacks.items()):
        saved_in = Path(state.get("dirpath") or "").resolve()
        if "best_model_path" in state and saved_in != Path(dirpath).resolve():
            del callbacks[key]


def last_checkpoint_path(trainer: L.Trainer) -> Path | None:
    """Where the trainer's :class:`LastCheckpoint` wrote ``last.ckpt``, or None without one / before a write."""
    for callback in trainer.callbacks:
        if isinstance(callback, LastCheckpoint) and callback.path.is_file():
            return callback.path
    return None


def best_checkpoint_callback(trainer: L.Trainer) -> ModelCheckpoint | None:
    """The trainer's ``ModelCheckpoint`` (the best by the monitor), or None."""
    return next((c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)), None)


class RandomStates(L.Callback):
    """The global random states (torch CPU and CUDA, numpy, Python) in the checkpoint, restored on resume."""

    def state_dict(self) -> dict[str, Any]:
        _, keys, position, has_gauss, cached_gauss = np.random.get_state()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            # numpy's MT19937 state as plain values (weights-only loading refuses numpy arrays)
            "numpy": [torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached_gauss)],
            "python": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        keys, position, has_gauss, cached_gauss = state_dict["numpy"]
        np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss))
        version, internal, gauss = state_dict["python"]
        random.setstate((version, tuple(internal), gauss))
        cuda = state_dict.get("cuda")
        if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
