"""What a pipeline will cost, said before any work (task=pipeline, and each job of a table's multirun).

For every stage: its task, steps, global batch (the batch of each process x processes x accumulated batches,
`flowformer.tasks.batches`), training crop and an estimate of its GPU-hours; then the evaluations, the job's
total and, in a multirun, the table's (the job's total x the jobs the sweep launched). A stage whose global batch
does not divide over its processes is refused here, before the first stage trains.

The estimate scales a step time measured on one H200 (`pipeline.step_time`, conf/pipeline/default.yaml; the
measurements are in docs/performance.md, "What a table costs") by the stage's global batch x crop pixels: it
assumes time grows with the pixels a step trains on and that the processes share the step without loss.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from flowformer.tasks.batches import devices_per_node, per_process_batch, process_counts
from flowformer.tasks.sweeps import in_multirun

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagePlan:
    """One stage as it will run: what the plan's line shows."""

    name: str
    task: str
    steps: int
    batch: int  # of each process
    processes: int
    accumulate: int
    crop: tuple[int, int] | None
    gpu_hours: float | None

    @property
    def global_batch(self) -> int:
        return self.batch * self.processes * self.accumulate


def training_crop(data: Any) -> tuple[int, int] | None:
    """The first `crop_size` (else `size`) found in a data config's training part: the pixels a step trains
    on (a crop, or a rendered synthetic pair's size)."""
    if isinstance(data, Mapping):
        for key in ("crop_size", "size"):
            value = data.get(key)
            if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
                return value[0], value[1]
        values = data.values()
    elif isinstance(data, list):
        values = data
    else:
        return None
    return next((crop for crop in map(training_crop, values) if crop is not None), None)


def stage_plan(name: str, stage_cfg: DictConfig, step_time: DictConfig) -> StagePlan:
    """`stage_cfg` (a composed stage) as a StagePlan; a ValueError (one line) where its global batch does not
    divide over its processes."""
    trainer = stage_cfg.trainer
    batch = per_process_batch(stage_cfg)
    nodes, accumulate = process_counts(trainer)
    processes = (devices_per_node(trainer.get("devices", 1)) or 1) * nodes
    data = OmegaConf.to_container(stage_cfg.data.get("train") or {}, resolve=True)
    crop = training_crop(data)
    steps = int(trainer.max_steps)  # a whole number: the plan checked the stage's trainer.* types before
    reference = step_time.get(str(stage_cfg.task))
    gpu_hours = None
    if reference is not None and crop is not None and steps > 0:
        pixels = batch * processes * accumulate * crop[0] * crop[1]
        reference_pixels = reference.batch * reference.crop[0] * reference.crop[1]
        gpu_hours = steps * reference.seconds * pixels / reference_pixels / 3600
    return StagePlan(name, str(stage_cfg.task), steps, batch, processes, accumulate, crop, gpu_hours)


def launched_jobs() -> int | None:
    """In a multirun job, how many jobs its sweep launched (the sweep's multirun.yaml); else None."""
    if not in_multirun():
        return None
    from flowformer.tasks.report import launched_jobs as sweep_jobs  # here: report.py imports pipeline.py

    return sweep_jobs(Path(HydraConfig.get().sweep.dir))


def hours(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def log_plan(run_dir: Path, plans: list[StagePlan], evaluations: list[str]) -> None:
    """The plan's lines in the log, before any stage starts."""
    lines = [f"pipeline: the plan of {run_dir}, before any work (GPU-hours estimated for H200s):"]
    for plan in plans:
        crop = "?" if plan.crop is None else f"{plan.crop[0]}x{plan.crop[1]}"
        lines.append(
            f"  {plan.name}: task={plan.task}, {plan.steps} steps, global batch {plan.global_batch} "
            f"({plan.batch} a process x {plan.processes} process(es) x {plan.accumulate} accumulated), crop {crop}, "
            f"{hours(plan.gpu_hours)} GPU-hours"
        )
    lines.append(f"  evaluations: {', '.join(evaluations) or 'none'}")
    known = [plan.gpu_hours for plan in plans if plan.gpu_hours is not None]
    total = sum(known) if len(known) == len(plans) else None
    lines.append(f"  this job: {hours(total)} GPU-hours of training")
    jobs = launched_jobs()
    if jobs is not None:
        table = None if total is None else total * jobs
        lines.append(f"  the table: {jobs} jobs, about {hours(table)} GPU-hours if each job costs as much as this one")
    log.info("\n".join(lines))
