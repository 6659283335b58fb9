"""Preparing a training run (task=train, task=pretrain) around its data and model, in one call: `prepare_run`
checks the output directories, writes the run record (config_resolved.yaml, run_info.json with the network's
parameter counts), warns when Twins image encoders start from random weights, resolves the monitored metric,
checks `ckpt_path`, and builds the trainer with its loggers (a wandb run resumes with its checkpoint),
callbacks and checkpoint IO."""

from __future__ import annotations

import json
import logging
import platform
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from flowformer.device_settings import memory_settings
from flowformer.eval.protocol import validation_protocol
from flowformer.lit.checkpointing import (
    RandomStates,
    SafeCheckpointIO,
    changed_settings,
    check_resume_checkpoint,
    forget_best_of_other_dirs,
)
from flowformer.lit.data_wait import DataWait
from flowformer.models.output_files import atomic_write_text
from flowformer.overrides import override_key
from flowformer.setting_types import check_setting_types, whole_number
from flowformer.tasks.preemption import Preemption
from flowformer.tasks.run_dirs import claim_dir, ensure_writable_dir, joins_existing_run, run_owner
from flowformer.tasks.runtime import log_parameter_counts, parameter_counts

log = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_run_id.txt"
WANDB_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what wandb makes (8 letters and digits) or takes as logger.*.id
RECORDED_PACKAGES = (
    "torch",
    "lightning",
    "torchmetrics",
    "hydra-core",
    "omegaconf",
    "timm",
    "wandb",
    "numpy",
    "opencv-python-headless",
    "flowformer",
)


@dataclass(frozen=True)
class PreparedRun:
    """A training run ready to fit: its trainer and the metric it monitors."""

    trainer: L.Trainer
    monitor: str


# What the run passes to lightning.Trainer itself, besides cfg.trainer.
TRAINER_PARTS = ("logger", "callbacks", "plugins")


def prepare_run(cfg: DictConfig, datamodule: L.LightningDataModule, model: L.LightningModule) -> PreparedRun:
    """Everything `trainer.fit(model, datamodule)` needs around them, checked before any training: the run and
    checkpoint directories are writable, the run record is written, cfg.monitor is resolved, `ckpt_path` fits
    `model`, and the trainer holds the configured loggers and callbacks (with the random states for an exact
    resume, Preemption for the stop signals, and DataWait, how long each step waited for its data); the loggers
    get the whole config, and a wandb run's id is stored beside the checkpoints."""
    check_setting_types(cfg.trainer, "trainer", given_elsewhere=TRAINER_PARTS)  # before the values are compared
    if cfg.trainer.get("max_steps") is not None:  # 1e5 on the command line: the whole number Lightning counts to
        cfg.trainer.max_steps = whole_number(cfg.trainer.max_steps, "trainer.max_steps")
    check_validation_interval(cfg.trainer.get("val_check_interval"), cfg.trainer.get("check_val_every_n_epoch", 1))
    check_gradient_clipping(cfg.trainer.get("gradient_clip_val"))
    output_dir = check_output_dirs(cfg)
    write_run_record(cfg, output_dir, parameter_counts(model), memory_settings(model))
    warn_random_twins(cfg)
    monitor = set_monitor(cfg, datamodule)
    resume = checked_resume(cfg, datamodule, model) if cfg.get("ckpt_path") else None
    loggers = build_loggers(cfg)
    callbacks = [*build_callbacks(cfg), RandomStates(), Preemption(), DataWait()]
    trainer = instantiate_setting(
        cfg.trainer, "trainer", logger=loggers or False, callbacks=callbacks, plugins=[SafeCheckpointIO(resume)]
    )
    start_wandb_runs(loggers)
    log_config(loggers, cfg)
    record_wandb_id(loggers, output_dir / "checkpoints")
    return PreparedRun(trainer=trainer, monitor=monitor)


def instantiate_setting(node: DictConfig, setting: str, **parts: Any) -> Any:
    """The object config `node` (cfg.<setting>: the trainer, a logger, a callback) describes, with the run's
    `parts`. Where Lightning refuses its settings with other than a ValueError (a wrong type,
    `trainer.limit_val_batches=abc`; a MisconfigurationException, `trainer.devices=0`; an accelerator whose
    package is missing, `trainer.accelerator=tpu`), a ValueError naming `setting`, the reason and the command's
    settings under it. Values of the wrong type are refused before, naming each (`check_setting_types`)."""
    check_setting_types(node, setting, given_elsewhere=parts)
    try:
        return hydra.utils.instantiate(node, **parts)
    except InstantiationException as error:
        cause = error.__cause__
        if not isinstance(cause, TypeError | ImportError | MisconfigurationException):
            raise
        overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
        given = [o for o in overrides if f"{override_key(o)}.".startswith(f"{setting}.")]
        where = f" (the command sets {' '.join(given)})" if given else ""
        raise ValueError(
            f"the {setting}.* settings are refused by {node._target_}{where}: {type(cause).__name__}: {cause}"
        ) from error


def checked_resume(
    cfg: DictConfig, datamodule: L.LightningDataModule, model: L.LightningModule
) -> tuple[str, dict]:
    """(ckpt_path, its checkpoint), checked against this run (`check_resume_checkpoint`); the settings that
    differ from the checkpoint's are listed in one warning line, and the best checkpoint of the directory it
    was saved in is not restored as this run's."""
    checkpoint = check_resume_checkpoint(cfg.ckpt_path, model, cfg.trainer.get("max_steps"))
    changes = changed_settings(checkpoint, model)
    saved_seed = (checkpoint.get(type(datamodule).__qualname__) or {}).get("seed")
    if saved_seed is not None and saved_seed != cfg.seed:
        changes.append(f"seed={cfg.seed!r} (checkpoint: {saved_seed!r})")
    if changes:
        log.warning(
            "resuming %s with settings that differ from the checkpoint's: %s; the optimiser and LR schedule "
            "continue from the checkpoint's state",
            cfg.ckpt_path,
            ", ".join(changes),
        )
    best_dir = checkpoint_dirs(cfg).get("callbacks.model_checkpoint.dirpath")
    if best_dir is not None:
        forget_best_of_other_dirs(checkpoint, best_dir)
    return cfg.ckpt_path, checkpoint


def seed_run(seed: int) -> None:
    """Lightning's seed_everything (DataLoader workers too); a seed that is no whole number (`2.5`, which Lightning
    would truncate to 2) or outside its range names `seed`."""
    seed = whole_number(seed, "seed")
    try:
        L.seed_everything(seed, workers=True)
    except ValueError as error:
        raise ValueError(f"seed={seed}: {error}; choose a seed in that range") from None


def check_validation_interval(interval: float | None, every_n_epochs: int | None = 1) -> None:
    """trainer.val_check_interval: a number of training steps (>= 1), a fraction of an epoch, or null;
    trainer.check_val_every_n_epoch: a whole number of epochs >= 1 (Lightning takes 0 and divides by it as the
    first epoch ends), or null. An interval of time (Lightning 2.6 takes a string or a mapping) is Lightning's to
    check."""
    if isinstance(interval, int | float) and interval <= 0:
        raise ValueError(
            f"trainer.val_check_interval={interval}: expected a number of training steps >= 1, a fraction of "
            "an epoch in (0, 1], or null (once an epoch)"
        )
    if every_n_epochs is not None and whole_number(every_n_epochs, "trainer.check_val_every_n_epoch") < 1:
        raise ValueError(
            f"trainer.check_val_every_n_epoch={every_n_epochs}: expected a whole number of epochs >= 1, or null "
            "(validation every trainer.val_check_interval steps alone)"
        )


def check_training_types(cfg: DictConfig) -> None:
    """The trainer.* and model.* values of a training config against the classes they build, as its run checks
    them when it builds each (`check_setting_types`): for a pipeline's plan, before any stage trains. (data.* are
    checked as the run starts: its global batch sets data.batch_size first, `set_per_process_batch`.)"""
    check_setting_types(cfg.trainer, "trainer", given_elsewhere=TRAINER_PARTS)
    check_setting_types(cfg.model, "model", given_elsewhere=("backbone",))  # the network checks its own knobs


def check_gradient_clipping(norm: float | None) -> None:
    """trainer.gradient_clip_val: a gradient norm > 0, or 0 or null for no clipping. Below 0 Lightning clips
    nothing, and torch's clip_grad_norm_ (which a fused optimiser under bf16-mixed is clipped with,
    `BackboneModule.configure_gradient_clipping`) turns every gradient around: the step ascends the loss."""
    if norm is not None and norm < 0:
        raise ValueError(
            f"trainer.gradient_clip_val={norm}: expected a gradient norm > 0 (official: 1.0), or 0 or null for no "
            "clipping"
        )


def check_output_dirs(cfg: DictConfig) -> Path:
    """Creates the run directory (paths.output_dir) and every configured checkpoint directory, proving each
    writable, and claims each checkpoint directory for this run (it must be empty, or already this run's: the
    run directory itself); returns the run directory."""
    output_dir = ensure_writable_dir(cfg.paths.output_dir, "the run directory (hydra.run.dir / paths.output_dir)")
    owner = run_owner(output_dir)
    for setting, directory in checkpoint_dirs(cfg).items():
        ensure_writable_dir(directory, f"the checkpoint directory ({setting})")
        if not joins_existing_run():
            claim_dir(directory, setting, owner)
            # The claim proved the directory held nothing else; Lightning's warning would only see the claim file
            warnings.filterwarnings(
                "ignore", message=f"Checkpoint directory {re.escape(str(directory))} exists and is not empty"
            )
    return output_dir


def checkpoint_dirs(cfg: DictConfig) -> dict[str, Path]:
    """The `dirpath` of every configured checkpoint callback, by its setting name."""
    return {
        f"callbacks.{name}.dirpath": Path(callback_cfg.dirpath)
        for name, callback_cfg in (cfg.get("callbacks") or {}).items()
        if callback_cfg is not None and callback_cfg.get("dirpath")
    }


def git_revision(repo_dir: Path) -> dict[str, Any]:
    """{'sha': ..., 'dirty': bool} of the checkout holding the code, or nulls outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo_dir,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"sha": None, "dirty": None}
    return {"sha": sha, "dirty": bool(status.strip())}


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@rank_zero_only
def write_run_record(
    cfg: DictConfig, output_dir: Path, parameters: dict[str, Any], memory: dict[str, Any]
) -> None:
    """<run dir>/config_resolved.yaml and <run dir>/run_info.json (git SHA, packages, command line, host, the
    network's `parameters`: {total, trainable, by_part}, `runtime.parameter_counts`, and the `memory` settings
    it was built with, those chosen for the device included, `device_settings.memory_settings`); logs the counts."""
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output_dir / "config_resolved.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    info = {
        "git": git_revision(Path(__file__).resolve().parent),
        "packages": package_versions(),
        "command": sys.argv,
        "host": platform.node(),
        "parameters": parameters,
        "memory_settings": memory,
    }
    atomic_write_text(output_dir / "run_info.json", json.dumps(info, indent=2))
    log_parameter_counts(parameters)


@rank_zero_only
def warn_random_twins(cfg: DictConfig) -> None:
    """One warning line when a run starts Twins image encoders from random weights: backbone.twins_weights is
    null and neither model.init_from nor ckpt_path gives the network its weights. Every fresh start of the
    paper's training (stage 1, MCVA pretraining) has the ImageNet Twins."""
    backbone = cfg.backbone
    if backbone.get("image_encoder") != "twins" or backbone.get("twins_weights"):
        return
    if cfg.model.get("init_from") or cfg.get("ckpt_path"):
        return
    log.warning(
        "backbone.twins_weights is null and nothing initialises the network (model.init_from, ckpt_path): "
        "its Twins image encoders start from random weights, where the paper starts from ImageNet ones "
        "(Sintel clean EPE 1.29 with them, 1.44 from scratch); set backbone.twins_weights=imagenet or a "
        "local copy"
    )


def set_monitor(cfg: DictConfig, datamodule: Any) -> str:
    """Resolves cfg.monitor in place (the checkpoint callbacks read it): as set, or val/<first validation set>/epe,
    or train/loss without validation sets; without a validation loop the best checkpoint is written on a step
    schedule instead (trainer.val_check_interval, else every 1000 steps). A val/ metric no validation set logs
    is refused (`check_validation_monitor`)."""
    val_names = list(getattr(datamodule, "val_names", []) or [])
    monitor = str(cfg.get("monitor") or (f"val/{val_names[0]}/epe" if val_names else "train/loss"))
    with open_dict(cfg):
        cfg.monitor = monitor
        checkpoint_cfg = (cfg.get("callbacks") or {}).get("model_checkpoint")
        if monitor.startswith("train/") and checkpoint_cfg is not None and not checkpoint_cfg.every_n_train_steps:
            interval = cfg.trainer.get("val_check_interval")
            checkpoint_cfg.every_n_train_steps = interval if isinstance(interval, int) else 1000
    val_sets = getattr(datamodule, "val_sets", None) or dict.fromkeys(val_names)
    for setting, value in monitored_settings(cfg).items():
        if value.startswith("val/"):
            check_validation_monitor(value, setting, val_sets)
    log.info("monitored metric: %s (%s)", monitor, cfg.monitor_mode)
    return monitor


def monitored_settings(cfg: DictConfig) -> dict[str, str]:
    """{setting: metric} of `monitor` and of each callback that monitors another metric than it
    (`callbacks.model_checkpoint.monitor=...` given on its own)."""
    monitored = {"monitor": str(cfg.monitor)}
    for name, callback_cfg in (cfg.get("callbacks") or {}).items():
        raw = OmegaConf.to_container(callback_cfg, resolve=False) if callback_cfg is not None else {}
        if raw.get("monitor") not in (None, "${monitor}"):
            monitored[f"callbacks.{name}.monitor"] = str(callback_cfg.monitor)
    return monitored


def check_validation_monitor(monitor: str, setting: str, val_sets: dict[str, Any]) -> None:
    """A ValueError unless `monitor` (the value of `setting`) is a metric the validation sets {name: dataset} log
    (`val/<set>/<key>`, the keys of each set's metric bundle): Lightning's checkpoint callback found out at the
    first validation, after the training before it, with a traceback."""
    logged = {
        name: validation_protocol(dataset, iters=1).metrics().metric_names() for name, dataset in val_sets.items()
    }
    if any(monitor == f"val/{name}/{key}" for name, keys in logged.items() for key in keys):
        return
    if not logged:
        raise ValueError(
            f"{setting}={monitor}: this run has no validation set, so it logs no val/ metric; monitor a train/ "
            "metric (monitor=null: train/loss), or give the run validation sets (data.val)"
        )
    sets = "; ".join(f"val/{name}/{{{','.join(keys)}}}" for name, keys in logged.items())
    first = next(iter(logged))
    raise ValueError(
        f"{setting}={monitor} is not a metric this run logs: its validation sets log {sets}; give one of them "
        f"(monitor=null: val/{first}/epe)"
    )


def override_run_name(cfg: DictConfig) -> str:
    """The command-line overrides as a run name (`model.mask_ratio=0.5,backbone=tiny`), else the experiment."""
    if HydraConfig.initialized():
        dirname = HydraConfig.get().job.override_dirname
        if dirname:
            return str(dirname)
    return str(cfg.name)


def build_loggers(cfg: DictConfig) -> list[Logger]:
    """Instantiate cfg.logger; a wandb logger gets a run name from the overrides and, when resuming from
    ckpt_path, the id of the wandb run stored beside that checkpoint (resume='allow')."""
    loggers: list[Logger] = []
    for key, logger_cfg in (cfg.get("logger") or {}).items():
        if logger_cfg is None or "_target_" not in logger_cfg:
            continue
        kwargs: dict[str, Any] = {}
        if issubclass(hydra.utils.get_class(logger_cfg._target_), WandbLogger):
            if logger_cfg.get("name") is None:
                kwargs["name"] = override_run_name(cfg)
            if logger_cfg.get("id") is None and cfg.get("ckpt_path"):
                id_file = Path(cfg.ckpt_path).parent / WANDB_ID_FILE
                if id_file.is_file():
                    kwargs["id"] = read_wandb_id(id_file)
                    kwargs["resume"] = "allow"
                    log.info("resuming wandb run %s (from %s)", kwargs["id"], id_file)
        log.info("logger %s: %s", key, logger_cfg._target_)
        logger = instantiate_setting(logger_cfg, f"logger.{key}", **kwargs)
        if isinstance(logger, WandbLogger):
            leave_anonymous_unset(logger)
        loggers.append(logger)
    return loggers


def leave_anonymous_unset(logger: WandbLogger) -> None:
    """Lightning 2.6 gives wandb.init `anonymous=None` where no one set it, and wandb 0.31, which no longer has
    the setting, then prints "The anonymous setting has no effect ..." at every run: the setting is left out
    unless it was given (tests/tasks/test_run.py runs wandb without the line)."""
    init = getattr(logger, "_wandb_init", {})
    if "anonymous" in init and init["anonymous"] is None:
        del init["anonymous"]


def read_wandb_id(id_file: Path) -> str:
    """The wandb run id `record_wandb_id` stored in `id_file`; a ValueError naming the file for anything else."""
    run_id = id_file.read_text(errors="replace").strip()
    if not WANDB_RUN_ID.fullmatch(run_id):
        raise ValueError(
            f"{id_file} holds {run_id[:80]!r}, not a wandb run id (1-64 letters, digits, '-' or '_', as the run "
            "wrote it); fix or delete the file (a new wandb run is then started), or set logger.wandb.id"
        )
    return run_id


@rank_zero_only
def record_wandb_id(loggers: list[Logger], checkpoint_dir: Path) -> None:
    """Store the wandb run id beside the checkpoints, so `ckpt_path=<that dir>/last.ckpt` continues it."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            checkpoint_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(checkpoint_dir / WANDB_ID_FILE, logger.experiment.id)


def build_callbacks(cfg: DictConfig) -> list[L.Callback]:
    """The configured callbacks; a progress bar is left out under trainer.enable_progress_bar=false (Lightning
    refuses a progress-bar callback with the bar switched off)."""
    callbacks = [
        instantiate_setting(callback_cfg, f"callbacks.{key}")
        for key, callback_cfg in (cfg.get("callbacks") or {}).items()
        if callback_cfg is not None and "_target_" in callback_cfg
    ]
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks = [callback for callback in callbacks if not isinstance(callback, ProgressBar)]
    return callbacks


@rank_zero_only
def start_wandb_runs(loggers: list[Logger]) -> None:
    """Starts the run of each wandb logger (wandb.init) before any training, so that wandb's refusal (no API key
    on this machine, its server out of reach, a project or entity the key may not write to) is one ValueError
    saying how to log in or to log offline, not a traceback."""
    for logger in loggers:
        if not isinstance(logger, WandbLogger):
            continue
        from wandb.errors import Error as WandbError  # wandb is imported only by runs that log to it

        try:
            logger.experiment  # noqa: B018 - the property starts the run
        except WandbError as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(
                f"logger=wandb: wandb did not start its run ({reason}); log in once with `wandb login` (or set "
                "WANDB_API_KEY), or log without an account or network with WANDB_MODE=offline (`wandb sync "
                "<run dir>/wandb/offline-run-*` uploads it later), or log to CSV only with logger=csv"
            ) from None


@rank_zero_only
def log_config(loggers: list[Logger], cfg: DictConfig) -> None:
    """The whole resolved config as hyperparameters of every logger (wandb's config panel, hparams.yaml)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for logger in loggers:
        logger.log_hyperparams({"config": config})
