"""task=train (and task=pretrain): fit cfg.model on cfg.data with cfg.trainer; return the monitored metric."""

from __future__ import annotations

import logging

import hydra
import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from flowformer.device_settings import (
    TrainingStep,
    check_training_precision,
    device_memory_settings,
    training_device,
)
from flowformer.lit.checkpointing import best_checkpoint_callback, last_checkpoint_path
from flowformer.setting_types import check_setting_types
from flowformer.tasks.batches import per_process_batch, set_per_process_batch
from flowformer.tasks.pipeline_plan import training_crop
from flowformer.tasks.preemption import (
    record_for_requeue,
    requeue_if_warned,
    resume_requeued_job,
    stopped_training,
)
from flowformer.tasks.run_setup import PreparedRun, instantiate_setting, prepare_run, seed_run
from flowformer.tasks.runtime import compile_network

log = logging.getLogger(__name__)


def fit(cfg: DictConfig) -> tuple[float | None, L.Trainer]:
    """Train as configured. Returns (monitored metric: best checkpoint score or last value, the trainer). A
    requeued SLURM job resumes from its previous run's checkpoint; a stop signal (SIGTERM, SIGUSR1, Ctrl-C) ends
    training after the step in progress, with last.ckpt at that step (StoppedBySignal)."""
    set_per_process_batch(cfg)
    seed_run(cfg.seed)
    resume_requeued_job(cfg)
    datamodule = instantiate_setting(cfg.data, "data")
    model = build_model(cfg)
    run = prepare_run(cfg, datamodule, model)
    record_for_requeue(cfg)
    try:
        run.trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    except SIGTERMException:
        requeue_if_warned(run.trainer)
        raise stopped_training(run.trainer) from None
    return monitored_value(run), run.trainer


def build_model(cfg: DictConfig) -> L.LightningModule:
    """The LightningModule of cfg.model, its backbone's memory settings chosen for the training device and
    compiled as `runtime` says. A resumed run (ckpt_path) loads neither model.init_from nor the ImageNet Twins
    weights: the checkpoint holds the weights."""
    check_setting_types(cfg.model, "model", given_elsewhere=("backbone",))  # the network checks its own knobs
    overrides = {}
    if cfg.get("ckpt_path") and cfg.model.get("init_from"):
        log.info(
            "resuming from %s: model.init_from is not loaded (%s); the checkpoint holds the weights",
            cfg.ckpt_path,
            cfg.model.init_from,
        )
        overrides["init_from"] = None
    backbone = cfg.model.backbone
    if cfg.get("ckpt_path") and backbone.get("twins_weights"):
        backbone = OmegaConf.merge(backbone, {"twins_weights": None})
    step = training_step(cfg)
    check_training_precision(cfg.trainer)
    overrides["backbone"] = device_memory_settings(backbone, training_device(cfg.trainer), training=True, step=step)
    model = hydra.utils.instantiate(cfg.model, **overrides)
    compile_network(model.backbone, cfg.runtime)
    return model


def training_step(cfg: DictConfig) -> TrainingStep | None:
    """The training step of one process (cfg.model's objective, its batch, the training crop,
    trainer.precision) that backbone.activation_checkpoint=auto is sized for; None where the data config names
    no crop."""
    crop = training_crop(OmegaConf.to_container(cfg.data.get("train") or {}, resolve=True))
    if crop is None:
        return None
    model = OmegaConf.to_yaml(cfg.model, resolve=True)
    return TrainingStep(model, per_process_batch(cfg), crop[0], crop[1], str(cfg.trainer.get("precision")))


def monitored_value(run: PreparedRun) -> float | None:
    """The best checkpoint's score of the monitored metric, else its last logged value; logs the checkpoints."""
    best = best_checkpoint_callback(run.trainer)
    score = best.best_model_score if best is not None else None
    if score is None:
        score = run.trainer.callback_metrics.get(run.monitor)
    value = None if score is None else float(score)
    if best is not None and best.best_model_path:
        log.info("best checkpoint: %s", best.best_model_path)
    if (last := last_checkpoint_path(run.trainer)) is not None:
        log.info("last checkpoint: %s", last)
    if value is not None:
        log.info("%s = %s", run.monitor, value)
    else:
        log.info("%s: not measured: %s", run.monitor, why_unmeasured(run.trainer))
    return value


def why_unmeasured(trainer: L.Trainer) -> str:
    """Why a fit has no value of its monitored metric: the validations it ran logged others, or it ran none."""
    logged = sorted(key for key in trainer.callback_metrics if key.startswith("val/"))
    if logged:
        return f"the validation logged {', '.join(logged)}"
    return (
        f"no validation ran in its {trainer.global_step} training steps "
        f"(trainer.val_check_interval={trainer.val_check_interval})"
    )


def run(cfg: DictConfig) -> float | None:
    return fit(cfg)[0]
