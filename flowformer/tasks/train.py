"""task=train (and task=pretrain): fit cfg.model on cfg.data with cfg.trainer; return the monitored metric."""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
import lightning as L
from omegaconf import DictConfig, open_dict

from flowformer.lit.checkpointing import (
    RandomStates,
    SafeCheckpointIO,
    best_checkpoint_callback,
    check_resume_checkpoint,
    last_checkpoint_path,
)
from flowformer.tasks.run_dirs import ensure_writable_dir
from flowformer.tasks.runtime import (
    build_callbacks,
    build_loggers,
    checkpoint_dirs,
    compile_network,
    log_config,
    record_wandb_id,
    resolve_monitor,
    write_run_record,
)

log = logging.getLogger(__name__)


def fit(cfg: DictConfig) -> tuple[float | None, L.Trainer]:
    """Train as configured. Returns (monitored metric: best checkpoint score or last value, the trainer)."""
    L.seed_everything(cfg.seed, workers=True)
    output_dir = Path(cfg.paths.output_dir)
    ensure_writable_dir(output_dir, "the run directory (hydra.run.dir / paths.output_dir)")
    for setting, directory in checkpoint_dirs(cfg).items():
        ensure_writable_dir(directory, f"the checkpoint directory ({setting})")
    write_run_record(cfg, output_dir)

    datamodule = hydra.utils.instantiate(cfg.data)
    monitor = resolve_monitor(cfg, datamodule)
    with open_dict(cfg):
        cfg.monitor = monitor
        checkpoint_cfg = (cfg.get("callbacks") or {}).get("model_checkpoint")
        if monitor.startswith("train/") and checkpoint_cfg is not None and not checkpoint_cfg.every_n_train_steps:
            # Without a validation loop the checkpoint is written on a step schedule instead.
            interval = cfg.trainer.get("val_check_interval")
            checkpoint_cfg.every_n_train_steps = interval if isinstance(interval, int) else 1000
    log.info("monitored metric: %s (%s)", monitor, cfg.monitor_mode)
    if cfg.get("ckpt_path") and cfg.model.get("init_from"):
        log.info(
            "resuming from %s: model.init_from is not loaded (%s); the checkpoint holds the weights",
            cfg.ckpt_path,
            cfg.model.init_from,
        )
        with open_dict(cfg):
            cfg.model.init_from = None

    model = hydra.utils.instantiate(cfg.model)
    compile_network(model.backbone, cfg.runtime)
    resume = None
    if cfg.get("ckpt_path"):
        resume = (cfg.ckpt_path, check_resume_checkpoint(cfg.ckpt_path, model))
    loggers = build_loggers(cfg, output_dir)
    callbacks = [*build_callbacks(cfg), RandomStates()]
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer, logger=loggers or False, callbacks=callbacks, plugins=[SafeCheckpointIO(resume)]
    )
    log_config(loggers, cfg)
    record_wandb_id(loggers, output_dir / "checkpoints")

    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))

    best = best_checkpoint_callback(trainer)
    score = best.best_model_score if best is not None else None
    if score is None:
        score = trainer.callback_metrics.get(monitor)
    value = None if score is None else float(score)
    if best is not None and best.best_model_path:
        log.info("best checkpoint: %s", best.best_model_path)
    if (last := last_checkpoint_path(trainer)) is not None:
        log.info("last checkpoint: %s", last)
    log.info("%s = %s", monitor, value)
    return value, trainer


def run(cfg: DictConfig) -> float | None:
    return fit(cfg)[0]
