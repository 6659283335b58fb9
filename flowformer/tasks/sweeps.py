"""A multirun (`python run.py -m ...`) runs every job, also after one fails.

A job that fails is reported as a single run's error is (one line on stderr and in its run.log), recorded as
one JSON line in ``<sweep dir>/failed_jobs.jsonl`` (job number, overrides, the error line, its directory) and
hands the sweeper NaN, never a best value; the sweep goes on with the next job. :class:`FailedJobsReport` (a
Hydra callback, ``conf/hydra/default.yaml``) names the failed jobs when the sweep ends and exits with status 1.

Every run imports this module (the Hydra callback); it loads Lightning only to learn a process's rank when a
job failed or a sweep ends, so the tasks that never train (report, convert, eval, infer) start without it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from flowformer.overrides import shell_override

FAILED_JOBS = "failed_jobs.jsonl"
# A pipeline's record in its run directory (flowformer/tasks/pipeline.py); in a table, one in each row's folder.
RECORD = "pipeline.json"
# The first part of the keys of a job's overrides that set up a pipeline job itself, not a table row (its
# stages get seed, name and logger from Pipeline.pass_through; quickstart.* is the demo's own).
JOB_KEYS = ("task", "name", "seed", "logger", "experiment", "protocol", "sweep", "pipeline", "hydra", "quickstart")


def in_multirun() -> bool:
    """True inside a job of `python run.py -m ...`."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def global_rank_zero() -> bool:
    """Whether this process is global rank 0, as Lightning counts ranks (under a launcher, or alone)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return rank_zero_only.rank == 0


def record_failed_job(error_line: str) -> None:
    """On global rank 0, appends this job (its number, overrides, error line and directory, null when it was
    removed as unused) to the sweep's failed_jobs.jsonl."""
    if not global_rank_zero():
        return
    hydra_cfg = HydraConfig.get()
    record = {
        "job": hydra_cfg.job.num,
        "overrides": list(hydra_cfg.overrides.task),
        "error": error_line,
        "dir": hydra_cfg.runtime.output_dir if Path(hydra_cfg.runtime.output_dir).is_dir() else None,
    }
    with open(Path(hydra_cfg.sweep.dir) / FAILED_JOBS, "a") as file:
        file.write(json.dumps(record) + "\n")


def failed_jobs(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a sweep's failed jobs, in the order they failed."""
    path = Path(sweep_dir) / FAILED_JOBS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FailedJobsReport(Callback):
    """When a sweep ends: one line naming its failed jobs and where they are recorded, and exit status 1. Under
    a launcher (torchrun, srun) every process runs the sweep and global rank 0 alone reports: another process
    ending with status 1 first would make the launcher stop rank 0, still evaluating its last row."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = failed_jobs(config.hydra.sweep.dir)
        if failed and global_rank_zero():
            jobs = ", ".join(f"#{record['job']} ({' '.join(record['overrides'])})" for record in failed)
            path = Path(config.hydra.sweep.dir) / FAILED_JOBS
            print(
                f"error: {len(failed)} job(s) of this sweep failed: {jobs}; overrides and errors in {path}",
                file=sys.stderr,
            )
            raise SystemExit(1)


class SlurmLauncherCheck(Callback):
    """Before a multirun's jobs: Hydra's submitit SLURM launcher (`hydra/launcher=submitit_slurm`, a table's rows
    as cluster jobs) submits each job to SLURM, whose commands must be on this machine (submitit looks for
    `srun`). Where they are not (a workstation), one line saying where to run the command and what runs the jobs
    here instead, status 1, before any job or folder; submitit's own refusal was a traceback, with the sweep
    directory left behind."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = str(config.hydra.launcher.get("_target_", ""))
        if not launcher.endswith(".SlurmLauncher") or shutil.which("srun") is not None:
            return
        print(
            "error: hydra/launcher=submitit_slurm submits each job to SLURM, but SLURM's commands are not on this "
            "machine (no srun on PATH): run the command on the cluster's login node, or run the jobs here with "
            "hydra/launcher=submitit_local (or without a launcher setting, one after another)",
            file=sys.stderr,
        )
        raise SystemExit(1)


class TableResumeCheck(Callback):
    """Before a table's jobs (`python run.py -m task=pipeline ...`): pipeline.resume must name the table's sweep
    directory, where each row finds its own folder. One row's run directory (it holds a record) would resume
    that row in every job: refused in one line, exit status 1, before any job is started."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        resume = config.get("pipeline", {}).get("resume") if config.get("task") == "pipeline" else None
        if not resume or not (Path(resume) / RECORD).is_file():
            return
        sweep = Path(resume).resolve().parent
        advice = (
            f"its table's sweep directory, {shell_override('pipeline.resume', sweep)}"
            if (sweep / "multirun.yaml").is_file()
            else "the sweep directory of the table's earlier run"
        )
        if global_rank_zero():
            print(
                f"error: pipeline.resume={resume} is one row's run directory (it holds {RECORD}), which every row of "
                f"this table (-m) would resume; give {advice}, where each row finds its own",
                file=sys.stderr,
            )
        raise SystemExit(1)
