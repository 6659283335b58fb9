"""Task dispatch for run.py: `task=<name>` runs `flowformer.tasks.<name>.run(cfg)`.

User-facing errors (a missing dataset root, an unreadable file, a NaN loss, a checkpoint that does not fit
the backbone) are printed as one clear message and exit with status 1 instead of a traceback; set
FLOWFORMER_TRACEBACK=1 to see the traceback as well. Loggers are always closed, also on error.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from omegaconf import DictConfig

log = logging.getLogger(__name__)

TASKS = ("train", "pretrain", "eval", "infer", "bench", "quickstart")

# Errors caused by inputs or settings rather than by bugs: reported without a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    ValueError,
    FloatingPointError,
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
        return module.run(cfg)
    except Exception as error:
        user_error = find_user_error(error)
        if user_error is None or os.environ.get("FLOWFORMER_TRACEBACK"):
            raise
        log.error("%s: %s", type(user_error).__name__, user_error)
        print(f"error ({type(user_error).__name__}): {user_error}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        close_loggers()


def find_user_error(error: BaseException) -> BaseException | None:
    """The user-facing error in an exception chain (Hydra's instantiate wraps the original as __cause__)."""
    while error is not None:
        if isinstance(error, USER_ERRORS):
            return error
        error = error.__cause__
    return None
