"""The training batch of each process.

A training stage states the paper's batch over all processes (``global_batch: {stage, size}`` in
``conf/experiment/*.yaml``: MCVA 24, chairs 8, things 6, S+K+H 6, KITTI 6) and leaves ``data.batch_size`` null;
each process then takes ``size / (trainer.devices x trainer.num_nodes x trainer.accumulate_grad_batches)``.
A size that does not divide is refused before any work, in one line naming the stage and the nearest settings
that divide it. ``data.batch_size``, when set, is the batch of each process itself (a single run's override).
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, ListConfig

from flowformer.setting_types import count_at_least, whole_number

log = logging.getLogger(__name__)


def devices_per_node(devices: object) -> int | None:
    """trainer.devices as a number of processes on each node (a count, a list or a comma-separated string of
    device ids), or None where only the trainer knows it (auto, -1)."""
    if isinstance(devices, (list, ListConfig)):
        return len(devices)
    if isinstance(devices, str) and "," in devices:
        return len([device for device in devices.split(",") if device.strip()])
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    return devices if isinstance(devices, int) and devices > 0 else None


def nearest_settings(size: int, devices: int, nodes: int, accumulate: int) -> list[str]:
    """Settings that divide a global batch of `size`, each changing one of the given: fewer devices on each
    node, another number of accumulated batches, or a per-process data.batch_size (another global batch)."""
    found = []
    fewer = [d for d in range(devices - 1, 0, -1) if size % (d * nodes * accumulate) == 0]
    if fewer:
        found.append(f"trainer.devices={fewer[0]} ({size // (fewer[0] * nodes * accumulate)} a process)")
    if size % (devices * nodes) == 0:
        divisors = [a for a in range(1, size // (devices * nodes) + 1) if size % (devices * nodes * a) == 0]
        nearest = min(divisors, key=lambda a: (abs(a - accumulate), -a))
        found.append(f"trainer.accumulate_grad_batches={nearest}")
    share = devices * nodes * accumulate
    per_process = max(1, round(size / share))
    found.append(f"data.batch_size={per_process} (a global batch of {per_process * share} instead)")
    return found


def process_counts(trainer: DictConfig) -> tuple[int, int]:
    """(trainer.num_nodes, trainer.accumulate_grad_batches), each a whole number >= 1, else a ValueError naming it:
    Lightning takes 0 accumulated batches and divides by it at the first step."""
    return (
        count_at_least(trainer.get("num_nodes", 1), "trainer.num_nodes", 1),
        count_at_least(trainer.get("accumulate_grad_batches", 1), "trainer.accumulate_grad_batches", 1),
    )


def per_process_batch(cfg: DictConfig) -> int:
    """data.batch_size where it is set, else the stage's global batch shared out over the processes and the
    accumulated batches; a ValueError (one line) where that does not divide."""
    trainer = cfg.trainer
    nodes, accumulate = process_counts(trainer)
    if cfg.data.get("batch_size") is not None:
        return whole_number(cfg.data.batch_size, "data.batch_size")
    stage = cfg.get("global_batch")
    if stage is None:
        raise ValueError("data.batch_size is null and no stage states its global batch: set data.batch_size")
    devices = devices_per_node(trainer.get("devices", 1))
    if devices is None:
        raise ValueError(
            f"trainer.devices={trainer.devices}: the {stage.stage} stage shares its global batch of {stage.size} "
            "out over the processes; give trainer.devices as a count, or the per-process data.batch_size"
        )
    share = devices * nodes * accumulate
    if stage.size % share:
        raise ValueError(
            f"the {stage.stage} stage's global batch of {stage.size} (global_batch.size) does not divide over "
            f"trainer.devices={devices} x trainer.num_nodes={nodes} x trainer.accumulate_grad_batches="
            f"{accumulate}; set " + ", or ".join(nearest_settings(stage.size, devices, nodes, accumulate))
        )
    log.info(
        "batch %d a process: the %s stage's global batch of %d over %d process(es) x %d accumulated",
        stage.size // share,
        stage.stage,
        stage.size,
        devices * nodes,
        accumulate,
    )
    return stage.size // share


def set_per_process_batch(cfg: DictConfig) -> None:
    """cfg.data.batch_size := the batch of each process (`per_process_batch`), for the DataModule and the run's
    records; the first thing a training run does, so that a global batch that does not divide is refused before
    any work."""
    cfg.data.batch_size = per_process_batch(cfg)
