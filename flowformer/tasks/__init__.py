"""Task dispatch for run.py: `task=<name>` runs `flowformer.tasks.<name>.run(cfg)`.

User-facing errors (a missing dataset root, an unreadable file, a NaN loss, a checkpoint that does not fit
the backbone, an output location that cannot be written) are printed once, as one clear line on stderr (and
into run.log), and exit with status 1 instead of a traceback; FLOWFORMER_TRACEBACK=1 prints the whole
traceback before that line. A run that fails before producing anything leaves no run directory behind. Loggers
are always closed, also on error.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from flowformer.lit.checkpointing import CheckpointWriteError
from flowformer.tasks.run_dirs import joins_existing_run, remove_if_unused
from flowformer.tasks.runtime import configure_runtime

log = logging.getLogger(__name__)

TASKS = ("train", "pretrain", "eval", "infer", "bench", "convert", "quickstart")

# Errors caused by inputs or settings rather than by bugs: reported without a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    ValueError,
    FloatingPointError,
    CheckpointWriteError,  # disk full or no permission while saving; the previous checkpoint is intact
)


def close_loggers() -> None:
    """Finish the wandb run, if one was started (also between the jobs of a multirun)."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def run_task(cfg: DictConfig) -> float | None:
    """Run `cfg.task`; return its metric (for sweepers) or None."""
    task = cfg.get("task")
    if task not in TASKS:
        raise SystemExit(f"error: task={task!r} is unknown; choose one of {', '.join(TASKS)}")
    module = importlib.import_module(f"flowformer.tasks.{task}")
    if logging.getLogger().handlers:
        # Hydra already logs to the console and run.log; Lightning's own console handler would repeat each line.
        logging.getLogger("lightning").handlers.clear()
    try:
        configure_runtime(cfg.runtime)
        return module.run(cfg)
    except Exception as error:
        user_error = find_user_error(error)
        if user_error is None:
            raise
        if os.environ.get("FLOWFORMER_TRACEBACK"):
            traceback.print_exception(error)
        report(user_error)
        if HydraConfig.initialized() and not joins_existing_run():
            remove_if_unused(Path(HydraConfig.get().runtime.output_dir))
        raise SystemExit(1) from None
    finally:
        close_loggers()


def report(error: BaseException) -> None:
    """The error once on stderr, and into the log files (run.log) without repeating it on the console."""
    message = f"error ({type(error).__name__}): {error}"
    print(message, file=sys.stderr)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def find_user_error(error: BaseException) -> BaseException | None:
    """The user-facing error in an exception chain (Hydra's instantiate wraps the original as __cause__)."""
    while error is not None:
        if isinstance(error, USER_ERRORS):
            return error
        error = error.__cause__
    return None
