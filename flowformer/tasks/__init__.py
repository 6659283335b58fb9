"""Task dispatch for run.py: `task=<name>` runs `flowformer.tasks.<name>.run(cfg)`.

User-facing errors (a missing dataset root, an unreadable file, a NaN loss, a checkpoint that does not fit
the backbone, an output location that cannot be written) are printed once, as one clear line on stderr (and
into run.log), and exit with status 1 instead of a traceback; FLOWFORMER_TRACEBACK=1 prints the whole
traceback before that line. A run that fails before producing anything leaves no run directory behind. Loggers
are always closed, also on error. In a multirun a failed job (also one failing from a bug, whose traceback is
printed) is recorded and the sweep goes on (flowformer/tasks/sweeps.py). A run stopped by SIGTERM or SIGUSR1
logs one line and exits with status 128 + the signal's number, a sweep too (flowformer/tasks/preemption.py).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import sys
import traceback
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, InstantiationException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError, MissingMandatoryValue, OmegaConfBaseException

from flowformer.models.output_files import OutputWriteError
from flowformer.overrides import override_key
from flowformer.setting_types import check_against_shipped, in_plain_node
from flowformer.stop_signals import StoppedBySignal
from flowformer.tasks.run_dirs import joins_existing_run, remove_if_unused
from flowformer.tasks.runtime import configure_runtime
from flowformer.tasks.sweeps import in_multirun, record_failed_job

log = logging.getLogger(__name__)

TASKS = ("train", "pretrain", "eval", "infer", "bench", "convert", "pipeline", "report", "quickstart")

# Errors caused by inputs or settings rather than by bugs: reported without a traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    ValueError,
    FloatingPointError,
    OutputWriteError,  # disk full or no permission while writing a file; the earlier file is intact
)


# Warnings of Lightning and torch that every training run, or every DDP run, would print and that ask nothing of
# the user (Lightning 2.6, torch 2.14; a test runs DDP training with none of them, nor Lightning's advertisement:
# tests/tasks/test_ddp.py):
# - Lightning builds torch's LeafSpec itself, which torch deprecated (a FutureWarning);
# - Lightning recommends sync_dist=True for the validation values, which torchmetrics' compute() has already
#   gathered from every process (flowformer/metrics.py): each process logs the same numbers;
# - DDP compares the gradient strides of a 1x1 convolution's weight [O, I, 1, 1] with its bucket's strictly, and a
#   channels-last one (strides [I, 1, I, I]) lies in memory as the contiguous one does (strides [I, 1, 1, 1]).
MISLEADING_WARNINGS = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    (UserWarning, r"It is recommended to use `self\.log\('val/"),
    (UserWarning, r"(?s)Grad strides do not match bucket view strides\..*grad\.sizes\(\) = \[\d+, \d+, 1, 1\]"),
)


def silence_misleading_warnings() -> None:
    for category, message in MISLEADING_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(not_an_advertisement)


def not_an_advertisement(record: logging.LogRecord) -> bool:
    """False for Lightning 2.6's line that every Trainer logs to advertise a cloud logger ("💡 Tip: ...")."""
    return not str(record.msg).startswith("💡 Tip:")


def close_loggers() -> None:
    """Finish the wandb run, if one was started (also between the jobs of a multirun)."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def run_task(cfg: DictConfig) -> float | None:
    """Run `cfg.task`; return its metric (for sweepers) or None. A failed job of a multirun is recorded in the
    sweep directory and returns NaN, so the sweep goes on with its next job (flowformer/tasks/sweeps.py)."""
    try:
        module = task_module(cfg.get("task"))  # a task that trains imports Lightning here, not before
        if logging.getLogger().handlers:
            # Hydra already logs to the console and run.log; Lightning's own console handler would repeat each line
            logging.getLogger("lightning").handlers.clear()
        silence_misleading_warnings()
        check_command_settings(cfg)
        configure_runtime(cfg.runtime)
        return module.run(cfg)
    except StoppedBySignal as stop:  # the work so far is saved; the status says it did not finish (a sweep ends)
        log.warning(stop.message)
        raise
    except Exception as error:
        user_error = find_user_error(error)
        if user_error is None and not in_multirun():
            raise
        if user_error is None or os.environ.get("FLOWFORMER_TRACEBACK"):
            traceback.print_exception(error)
        error_line = report_error(user_error or error, user_error_message(user_error, error) if user_error else None)
        if user_error is not None and HydraConfig.initialized() and not joins_existing_run():
            remove_if_unused(Path(HydraConfig.get().runtime.output_dir), Path(cfg.paths.log_dir))
        if in_multirun():
            record_failed_job(error_line)
            return math.nan
        raise SystemExit(1) from None
    finally:
        close_loggers()


def check_command_settings(cfg: DictConfig) -> None:
    """The command's settings of plain config nodes (eval.*, infer.*, bench.*, runtime.*, seed, ...) whose
    shipped value is true/false, a number or a list, checked against it (`check_against_shipped`; one value where
    a list is shipped becomes that list of one in `cfg`): the shipped config is
    composed again from the command's config choices (`experiment=`, `eval=synthetic`, `debug=tiny`) alone (0.4
    to 0.6 s on 2 cores: docs/performance.md), only where the command sets a value in such a node (`~key`
    deletes one: nothing to check)."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    check_debug_preset(hydra_cfg.runtime.choices)
    overrides = list(hydra_cfg.overrides.task)
    check_empty_dict_overrides(cfg, overrides)
    groups = set(hydra_cfg.runtime.choices)
    choices = [o for o in overrides if not is_setting(o, groups)]
    keys = [override_key(o) for o in overrides if o not in choices and not o.startswith("~")]
    settings = [key for key in keys if in_plain_node(cfg, key)]
    if not settings:
        return
    try:
        shipped = compose(config_name=hydra_cfg.job.config_name, overrides=choices)
    except (HydraException, OmegaConfBaseException) as error:  # a config that needs the command's settings
        log.debug("the shipped settings are not checked: the config choices alone do not compose (%s)", error)
        return
    for key, value in check_against_shipped(settings, cfg, shipped).items():
        OmegaConf.update(cfg, key, value)


def check_empty_dict_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Refuses `key={}` where `key` holds entries: Hydra merges the empty dict into them, so the command changes
    nothing (`pipeline.evaluate={}` kept the protocol's evaluations), though it reads as emptying it."""
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if value.replace(" ", "") != "{}" or override.startswith("~"):
            continue
        entries = OmegaConf.select(cfg, key)
        if isinstance(entries, DictConfig) and len(entries):
            raise ValueError(
                f"{key}={{}} changes nothing: Hydra merges it into {key}, which keeps its entries "
                f"({', '.join(map(str, entries))}); to remove them give {key}=null where {key} may be null, or "
                f"~{key}.<entry> for each"
            )


# The debug presets that set their data config's own keys (conf/debug/tiny.yaml: data=synthetic's sizes, its
# validation set and val_batch_size), which another data config's module does not take.
DEBUG_PRESET_DATA = {"tiny": "synthetic"}


def check_debug_preset(choices: Mapping[str, str | None]) -> None:
    """A debug preset with another data config than its own (`experiment=mcva_pretrain debug=tiny`, `debug=tiny
    data=image_folder`) is one ValueError naming both and debug=fdr, which takes any data: the preset's data keys
    would reach a module that does not take them (a TypeError naming a key the command never gave, or a
    validation set with no dataset class, failing in the loader with a traceback)."""
    debug, data = choices.get("debug"), choices.get("data")
    wanted = DEBUG_PRESET_DATA.get(debug)
    if wanted is not None and data != wanted:
        raise ValueError(
            f"debug={debug} is a smoke run on data={wanted} (conf/debug/{debug}.yaml sets its sizes), and this run's "
            f"data is data={data} (chosen by the command or its experiment): for a smoke run on data={data} use "
            f"debug=fdr (one training and one validation batch), or leave out debug={debug} and shorten the run "
            "(trainer.max_steps=2 backbone=tiny)"
        )


def is_setting(override: str, groups: set[str]) -> bool:
    """Whether an override sets a value (`eval.tile=true`, `seed=7`) rather than choosing a config of one of
    the `groups` (`eval=synthetic`, `model/optimizer=sgd`, `backbone@x.y=tiny`)."""
    key = override_key(override)
    return key not in groups and "/" not in key and "@" not in key and not key.startswith("hydra.")


def task_module(task: object) -> ModuleType:
    """flowformer.tasks.<task>, or a ValueError listing the tasks."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; choose one of {', '.join(TASKS)}")
    return importlib.import_module(f"flowformer.tasks.{task}")


def report_error(error: BaseException, text: str | None = None) -> str:
    """The error (`text`, else its own message) once on stderr, and into the log files (run.log) without
    repeating it on the console; returns the line."""
    message = f"error ({type(error).__name__}): {error if text is None else text}"
    print(message, file=sys.stderr)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    return message


def find_user_error(error: BaseException) -> BaseException | None:
    """The user-facing error in an exception chain (Hydra's instantiate wraps the original as __cause__); a
    setting the config leaves to the command line (`???`, e.g. infer.input) read unset, or one the command deletes
    (`deleted_setting_error`, first: omegaconf's error for a deleted `${paths.data_dir}` is a ValueError too), is a
    ValueError naming it."""
    if (deleted := deleted_setting_error(error)) is not None:
        return deleted
    while error is not None:
        if isinstance(error, USER_ERRORS):
            return error
        if isinstance(error, MissingMandatoryValue):
            key = error.full_key
            return ValueError(f"{key} is not set, and has no default: add {key}=<value> to the command")
        error = error.__cause__
    return None


# A constructor's TypeError for a keyword argument its config node lacks: `missing 1 required keyword-only
# argument: 'gamma'`.
MISSING_ARGUMENT = re.compile(r"missing \d+ required (?:keyword-only |positional )?arguments?: '(\w+)'")


# omegaconf's line for a `${key}` whose key is not in the config.
MISSING_REFERENCE = re.compile(r"Interpolation key '([^']+)' not found")


def deleted_setting_error(error: BaseException) -> ValueError | None:
    """For an exception chain that failed reading a setting the command deletes (`~eval.sets`, `~model.gamma`,
    `~runtime`): a ValueError naming it (it was a traceback from wherever the run read it: omegaconf's key not in
    the config, or a constructor's missing argument under the node Hydra was building); None otherwise."""
    if not HydraConfig.initialized():
        return None
    deleted = [override_key(o) for o in HydraConfig.get().overrides.task if o.startswith("~")]
    node = None
    while error is not None and deleted:
        wanted = getattr(error, "full_key", None) if isinstance(error, OmegaConfBaseException) else None
        if isinstance(error, InterpolationKeyError) and (reference := MISSING_REFERENCE.search(str(error))):
            wanted = reference.group(1)  # `${paths.data_dir}` read by data.train.root: the deleted one
        node = instantiated_node(error) or node
        if isinstance(error, TypeError) and node and (argument := MISSING_ARGUMENT.search(str(error))):
            wanted = f"{node}.{argument.group(1)}"
        for key in deleted:
            if wanted and (wanted == key or wanted.startswith(f"{key}.")):
                return ValueError(
                    f"{wanted} is needed by this run, but the command deletes it (~{key}); give it a value instead"
                )
        error = error.__cause__
    return None


# How Hydra's instantiate ends the message of the InstantiationException it wraps a constructor's error in (every
# Hydra 1.3 release): the config node it was building, e.g. `full_key: data.val.image_folder.dataset`.
FULL_KEY = re.compile(r"\nfull_key: (\S+)$")


def instantiated_node(error: BaseException) -> str | None:
    """The config node Hydra was building, where `error` is the InstantiationException it raised; else None."""
    found = FULL_KEY.search(str(error)) if isinstance(error, InstantiationException) else None
    return found.group(1) if found else None


def user_error_message(user_error: BaseException, chain: BaseException) -> str:
    """`user_error`'s message (`find_user_error` of `chain`), with the config node Hydra was building when it was
    raised where the message does not name it: a dataset's constructor knows its class, not the setting that
    made it (`ImageFolderFlowDataset: ... lower the dataset's size` -> `(config: data.val.image_folder.dataset)`)."""
    message = str(user_error)
    node = None
    while chain is not None and chain is not user_error:
        node = instantiated_node(chain) or node  # the innermost node: the object whose constructor failed
        chain = chain.__cause__
    return message if node is None or node in message else f"{message} (config: {node})"
