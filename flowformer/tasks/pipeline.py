"""task=pipeline: one model trained through a protocol's stages, each from the previous stage's last.ckpt, then
evaluated; one pipeline per job of a multirun (a table's rows).

    python run.py task=pipeline protocol=smoke                                          # CPU, minutes
    python run.py -m task=pipeline protocol=paper_ablation sweep=paper_agt_mlp_conv      # one pipeline per row
    python run.py task=pipeline protocol=smoke pipeline.resume=<run dir>                 # continue it

Settings (`pipeline.*`, conf/pipeline/default.yaml; a protocol of conf/protocol/ fills them):

- `stages`: in order; each an experiment name (`chairs` = the stage `chairs` with the overrides
  `[experiment=chairs]`) or `{name: <folder>, overrides: [...]}`. Stage i is the training run (task=train or
  task=pretrain) `python run.py <shared> <stage overrides> <row> model.init_from=<stage i-1>/checkpoints/last.ckpt`
  written to `<run dir>/<stage>/`, with this job's seed, name and logger; the first stage starts from what its
  overrides say.
- `evaluate`: `{label: [overrides]}`; each label is a task=eval run of the last stage's last.ckpt, with the last
  stage's backbone, in `<run dir>/eval_<label>/` (e.g. `plain` and `tiled`).
- `shared`: overrides every stage and evaluation starts with, routed as a row's (below): a protocol's knobs of
  one module (`model.query_num` of MCVA) reach the stages of that module.
- `row`: a table row's overrides (the per-table sweeps, sweep=paper_*, set it), followed by the job's own
  command-line overrides (a sweep's `params`) except those that set up the pipeline job itself (task, name,
  seed, logger, experiment, protocol, sweep, pipeline.*, hydra.*). A row's override goes to every stage and
  evaluation (the network is the same through the protocol), except that a dotted key goes only where the
  run's config has it (`model.mask_ratio` to the MCVA stage, `model.optimizer.lr` and `backbone.*` everywhere)
  and `model=<name>` and the keys in `pretraining_only` (backbone.decoder_query) only to the pretraining stages
  (a row chooses the pretraining objective, or how only pretraining queries; the supervised stages stay
  `model=flow`, with the method's query). The shared and row overrides a run did not take are listed in its record
  (`dropped`). Command-line overrides compose in the job's own config first: a protocol that pretrains
  selects its pretraining model (`model: mcva`), so that MCVA knobs (sweep=mcva_*) compose.
- `resume`: the run directory of an earlier run of the same pipeline (in a multirun: its sweep directory,
  each job finds its own; one row's run directory is refused before any job, sweeps.TableResumeCheck).
  Finished stages are skipped, an interrupted stage resumes exactly from its last.ckpt (`ckpt_path`; its
  earlier directory is kept as `<stage>.interrupted[-n]`), unfinished evaluations run. A finished stage whose
  checkpoint is missing or changed, or whose overrides differ from this run's, is refused in one line: no
  stage starts from a stale or missing checkpoint. A stage whose last.ckpt reached
  trainer.max_steps although the record does not say it finished (a write after it failed) is recorded as
  finished. The record's paths name the run directory it was written in; a resume in a copy or a moved one
  takes every path inside it to the same place there (check_record, moved_record). A damaged record is one
  line naming it; a damaged evaluation result is evaluated again. A stop signal (SIGTERM, SIGUSR1, Ctrl-C)
  during an evaluation stops it at once, recorded "stopped" (exit status 128 + the signal's number).

Launchers (docs/cluster.md). A stage whose trainer starts processes of its own (`trainer=ddp
trainer.devices=N`: Lightning's launcher starts each new rank by running the command line of the process it
runs in again) runs as `python run.py <its overrides> hydra.run.dir=<run dir>/<stage>` in a process of its own
(`run_child`), whose ranks then run that stage, not the pipeline again; the pipeline reads what it left in its
folder (`stage_result.json`, StageResult) and passes its stop signals on to it. Under a launcher that starts
every process itself (torchrun, srun), global rank 0 runs the pipeline and the others join one process group
for the whole job and train each stage with the config rank 0 sends them (`follow`); only rank 0 moves folders,
writes the record and evaluates (each evaluation in a process of its own, outside the process group). A process
of its own per stage keeps Lightning's launchers as they are (a stage is a plain training run); under torchrun
and srun the processes exist already, and a new process group per stage on torchrun's store hangs. In a table
under such a launcher every process runs the multirun; rank 0 tells the others when a row's stages are over,
also when the row failed or was refused, so that all of them take the next row together; a stage that fails
on some processes only ends on all of them at once (`rejoin_process_group`), recorded with the first error of
its processes (StageResult writes it; so also under Lightning's launcher).

Before any work, every stage is composed and the plan logged (stages, steps, global batch, estimated GPU-hours:
flowformer/tasks/pipeline_plan.py); a global batch that does not divide is refused there. Each stage start is one
line, `pipeline: stage i/N <name> ...`. A stage that fails stops the pipeline with one
line naming it (PipelineStageError); the finished stages and their record are kept.

The record, `<run dir>/pipeline.json` (rewritten atomically at every change; task=report reads it)::

    {
      "version": 1,
      "run_dir": "<absolute run dir>",
      "name": "<cfg.name>",
      "status": "running" | "done" | "failed" | "stopped",
      "row": ["backbone.intra_layer=mlp", ...],          # this job's row overrides
      "metric": <float or null>,                        # what run.py returns: the first evaluation's epe
      "stages": [
        {
          "name": "chairs", "dir": "<run dir>/chairs",
          "task": "train" | "pretrain",
          "overrides": [...],                           # exactly what the stage was composed from, minus seed,
                                                        # name, logger and paths (its command line)
          "dropped": [...],                             # shared and row overrides this stage did not take
          "init_from": "<previous last.ckpt>" | null,
          "init_from_sha256": "<hex>" | null,           # that checkpoint as this stage started from it
          "status": "pending" | "running" | "done" | "failed" | "stopped",
          "checkpoint": "<dir>/checkpoints/last.ckpt" | null,
          "checkpoint_sha256": "<hex>" | null,
          "resumed_from": ["<dir>.interrupted/checkpoints/last.ckpt", ...],
          "wall_s": <seconds, all attempts> | null,
          "metrics": {"train/loss": ..., "val/synthetic/epe": ...},   # the trainer's last logged values
          "error": "<one line>" | null
        }, ...
      ],
      "evaluations": [
        {
          "label": "plain", "dir": "<run dir>/eval_plain", "overrides": [...], "dropped": [...],
          "status": "pending" | "running" | "done" | "failed" | "stopped",
          "checkpoint": "<last stage's last.ckpt>", "checkpoint_sha256": "<hex>",
          "results_json": "<dir>/eval_results.json",    # task=eval's results (flowformer/tasks/eval.py)
          "wall_s": <seconds> | null, "error": "<one line>" | null
        }, ...
      ]
    }

A stage or evaluation that has not started ("pending") has only its name or label, dir, status, resumed_from
and wall_s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Collection, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from flowformer.device_settings import check_training_precision, training_device
from flowformer.lit.checkpointing import LAST_CHECKPOINT, last_checkpoint_path
from flowformer.models.checkpoint import read_checkpoint
from flowformer.models.output_files import atomic_write_text
from flowformer.overrides import command_again, override_key, override_value, path_value, shell_override
from flowformer.stop_signals import (
    STOP_SIGNALS,
    StoppedBySignal,
    StopSignals,
    note_stop,
    stop_noted,
    stopping_at_once,
)
from flowformer.tasks import close_loggers, find_user_error, user_error_message
from flowformer.tasks import eval as eval_task
from flowformer.tasks.pipeline_plan import log_plan, stage_plan
from flowformer.tasks.run_dirs import ensure_writable_dir
from flowformer.tasks.run_setup import check_training_types
from flowformer.tasks.sweeps import JOB_KEYS, RECORD, in_multirun
from flowformer.tasks.train import fit

log = logging.getLogger(__name__)

RECORD_VERSION = 1
_ABSENT = object()
# The routing probes composed under each Hydra instance (one per `python run.py`, shared by a multirun's jobs), by
# their overrides with the job's run directory written as RUN_DIR_MARK (`Pipeline.probe`).
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
RUN_DIR_MARK = "<run dir>"
# The entry point a stage that runs in a process of its own runs (`python run.py <its overrides>`).
RUN_PY = Path(__file__).resolve().parents[2] / "run.py"
# What a stage's run writes into its folder for the pipeline when its training ends (StageResult).
STAGE_RESULT = "stage_result.json"
# What the first of a stage's processes to raise an error writes beside it: its rank and error line.
FIRST_ERROR = "first_error.txt"


class PipelineStageError(ValueError):
    """A stage or an evaluation failed: one line naming it and where the finished work is (a user-facing
    error: printed without a traceback; FLOWFORMER_TRACEBACK=1 prints the cause's, and a cause that is a bug
    is logged with its traceback)."""


class StaleResumeError(ValueError):
    """pipeline.resume found a finished stage this run cannot build on (other overrides, a changed checkpoint)."""


@dataclass(frozen=True)
class Stage:
    """One training run of a pipeline: its folder name and its overrides."""

    name: str
    overrides: list[str]


def read_stages(settings: DictConfig) -> list[Stage]:
    """pipeline.stages as Stages: an experiment name, or {name, overrides}; names are distinct folder names."""
    stages = []
    for index, entry in enumerate(settings.stages):
        if isinstance(entry, str):
            stages.append(Stage(entry, [f"experiment={entry}"]))
        elif isinstance(entry, DictConfig) and "name" in entry and "overrides" in entry:
            stages.append(Stage(str(entry.name), override_list(entry.overrides, f"pipeline.stages[{index}].overrides")))
        else:
            raise ValueError(
                f"pipeline.stages[{index}] = {entry!r}: expected an experiment name (e.g. chairs) or "
                "{name: <folder>, overrides: [...]}"
            )
    if not stages:
        raise ValueError(
            "pipeline.stages is empty: choose a protocol (protocol=smoke, conf/protocol/) or name the stages, "
            "e.g. pipeline.stages=[mcva_pretrain,chairs,things]"
        )
    names = [stage.name for stage in stages]
    bad = [n for n in names if n in ("", ".", "..") or "/" in n or n.startswith("eval_") or names.count(n) > 1]
    if bad:
        raise ValueError(
            f"pipeline.stages: the stage names {sorted(set(bad))} do not fit: each names the stage's folder, so "
            "they must be distinct plain folder names (no '/', not starting with eval_)"
        )
    return stages


def override_list(value: Any, setting: str) -> list[str]:
    """A config's list of overrides as strings; anything else (one string, which would be read letter by letter
    as overrides 'd', 'e', ...) is one line naming `setting`."""
    if not isinstance(value, (ListConfig, list)):
        raise ValueError(  # noqa: TRY004 - a setting's error, which run.py reports in one line
            f"{setting}={value!r}: expected a list of overrides, e.g. [backbone=flowformer_pp,trainer.max_steps=100] "
            "(in a command, quoted: '[\"backbone=flowformer_pp\"]')"
        )
    return [str(override) for override in value]


def missing_config(error: MissingConfigException) -> str:
    """Hydra's "Could not find 'experiment/chiars'" with the group's options, on one line (its search path left
    out)."""
    lines = [line.strip() for line in str(error).split("Config search path")[0].splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]}; {lines[1]} {', '.join(lines[2:])}"


def row_overrides(cfg: DictConfig) -> list[str]:
    """pipeline.row, then the job's command-line overrides that are not about the pipeline job itself."""
    if cfg.get("ckpt_path"):
        raise ValueError(
            f"ckpt_path={cfg.ckpt_path} resumes one training run; a pipeline resumes with pipeline.resume=<its run "
            "directory>, which resumes its interrupted stage from that stage's last.ckpt"
        )
    job: list[str] = []
    if HydraConfig.initialized():
        for override in HydraConfig.get().overrides.task:
            if override_key(override).split(".")[0].split("/")[0] not in JOB_KEYS:
                job.append(override)
    return [*override_list(cfg.pipeline.row, "pipeline.row"), *job]


def takes(override: str, probe: DictConfig, pretraining_only: Collection[str] = ()) -> bool:
    """Whether a run composed as `probe` takes a row's override: model=<name> and the keys in
    `pretraining_only` only a pretraining run; a dotted key (model.mask_ratio, data.val_batch_size) only a run
    whose config has it; anything else (a group choice such as backbone=small, a +key addition) every run."""
    key = override_key(override)
    if key == "model" or key in pretraining_only:
        return probe.task == "pretrain"
    if "." not in key or override.startswith("+"):
        return True
    return OmegaConf.select(probe, key, default=_ABSENT, throw_on_resolution_failure=False) is not _ABSENT


def config_overrides(key: str, node: DictConfig) -> list[str]:
    """`++<key>.<name>=<value>` for every setting of `node`, resolved: the node as a command line sets it."""
    return [f"++{key}.{name}={override_value(value)}" for name, value in OmegaConf.to_container(node, resolve=True).items()]


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file (a checkpoint: what a later stage started from), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def first_epe(results_json: str | Path) -> float | None:
    """The first scored set's epe in a task=eval results file (what task=eval returns); a ValueError naming the
    file when it is not one (truncated, damaged)."""
    try:
        record = json.loads(Path(results_json).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{results_json} is not a task=eval results file ({error})") from None
    results = record.get("results") if isinstance(record, dict) else None
    if not isinstance(results, dict) or not all(isinstance(values, dict) for values in results.values()):
        raise ValueError(f"{results_json} is not a task=eval results file (no results mapping)")
    return next((values["epe"] for values in results.values() if "epe" in values), None)


# The overrides that hand a run the previous stage's checkpoint: a path, which moves with the run directory; a
# resume compares what the checkpoint holds instead (its SHA-256).
HANDOFF_KEYS = ("model.init_from", "eval.checkpoint")


def without_handoff(overrides: list[str] | None) -> list[str] | None:
    """A run's overrides as a resume compares them: without those that hand it a checkpoint (HANDOFF_KEYS)."""
    return None if overrides is None else [o for o in overrides if override_key(o) not in HANDOFF_KEYS]


def set_aside(folder: Path) -> Path | None:
    """Move an interrupted run's folder to <folder>.interrupted[-n] (kept); its last.ckpt there, if it has one."""
    if not folder.exists():
        return None
    target = folder.with_name(f"{folder.name}.interrupted")
    attempt = 1
    while target.exists():
        attempt += 1
        target = folder.with_name(f"{folder.name}.interrupted-{attempt}")
    folder.rename(target)
    checkpoint = target / "checkpoints" / "last.ckpt"
    return checkpoint if checkpoint.is_file() else None


def latest_checkpoint(entry: dict[str, Any], stage_dir: Path) -> Path | None:
    """The newest last.ckpt of a stage that did not finish: its folder's, else the newest one it resumed from
    that is still there (a resume that failed set the folder aside)."""
    candidates = [stage_dir / "checkpoints" / LAST_CHECKPOINT, *map(Path, reversed(entry["resumed_from"]))]
    return next((path for path in candidates if path.is_file()), None)


def trained_to_the_end(checkpoint: Path, stage_cfg: DictConfig) -> bool:
    """Whether `checkpoint` is a whole training checkpoint at the stage's trainer.max_steps: the stage's
    training finished there, whatever failed after it."""
    max_steps = stage_cfg.trainer.get("max_steps")
    if max_steps is None or max_steps < 1:
        return False
    try:
        step = read_checkpoint(checkpoint).get("global_step")
    except (ValueError, OSError):  # not whole: resuming from it says why
        return False
    return isinstance(step, int) and step >= max_steps


class StageResult(L.Callback):
    """What a pipeline stage's training run leaves for the pipeline (`callbacks.stage_result`): when training
    ends, `path` holds its last.ckpt and the trainer's last logged values, whether the stage ran in the
    pipeline's process or in one of its own."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        checkpoint = last_checkpoint_path(trainer)
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items() if value.numel() == 1}
        result = {"checkpoint": None if checkpoint is None else str(checkpoint), "metrics": metrics}
        atomic_write_text(self.path, json.dumps(result, indent=2))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """On every process: the first to raise (the file created exclusively) writes `rank <r>: <its error
        line>` to FIRST_ERROR beside `path`, the stage's real error where the other processes then fail only
        because it left their collective. Nothing where the folder is not on this node."""
        line = " ".join(str(exception).split())
        with suppress(OSError), open(self.path.with_name(FIRST_ERROR), "x") as file:
            file.write(f"rank {trainer.global_rank}: {type(exception).__name__}: {line}")


def first_error(stage_cfg: DictConfig) -> str | None:
    """What the first of a stage's processes to raise an error left in its folder (StageResult), if any."""
    path = Path(stage_cfg.callbacks.stage_result.path).with_name(FIRST_ERROR)
    return path.read_text() if path.is_file() else None


def starts_processes(trainer: DictConfig) -> bool:
    """Whether Lightning's launcher starts processes of its own for this trainer: more than one device or node
    (DDP). Its new processes run the command line of the process they were started from again."""
    devices = trainer.get("devices", 1)
    one_device = devices in (1, "1") or (isinstance(devices, ListConfig) and len(devices) == 1)
    return not (one_device and trainer.get("num_nodes", 1) == 1)


# Lightning's cluster environments of the launchers that start every process of a job themselves, in the order
# its trainer looks for them (lightning.pytorch.trainer.connectors.accelerator_connector).
LAUNCHERS = (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment)


def launcher_environment() -> ClusterEnvironment | None:
    """The environment of a launcher (torchrun, srun, ...) that started several processes running this command,
    found as Lightning's trainer finds it; None in a process of its own."""
    environment = next((kind() for kind in LAUNCHERS if kind.detect()), None)
    return environment if environment is not None and environment.world_size() > 1 else None


def join_process_group(environment: ClusterEnvironment) -> None:
    """The default process group of the launcher's processes, set up as Lightning's DDP sets it up (which then
    finds it there and keeps it for every stage): the main address and port, this process's global rank."""
    if torch.distributed.is_initialized():
        return
    os.environ["MASTER_ADDR"] = environment.main_address
    os.environ["MASTER_PORT"] = str(environment.main_port)
    torch.distributed.init_process_group(
        process_group_backend(), rank=environment.global_rank(), world_size=environment.world_size()
    )


def process_group_backend() -> str:
    """The backends of a launcher's process group: gloo for CPU tensors, NCCL for CUDA ones where there is CUDA."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


# How many times this job's processes have made their process group anew (rejoin_process_group).
_rejoined = 0


def rejoin_process_group() -> None:
    """After a stage failed in a table under a launcher: this process leaves the process group, which ends the
    collective any other process waits in (gloo: 'Connection closed by peer'), then makes a new one with the
    others on the launcher's store, under a prefix of its own (the first group's keys are still there), for the
    table's next row. Each process comes here once per failed stage, with its own error or the one its
    collective raised when another left, so the nth new group of every process is the same."""
    global _rejoined
    store = torch.distributed.distributed_c10d._get_default_store()
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.distributed.destroy_process_group()
    _rejoined += 1
    prefixed = torch.distributed.PrefixStore(f"pipeline-group-{_rejoined}", store)
    torch.distributed.init_process_group(process_group_backend(), store=prefixed, rank=rank, world_size=world_size)


def send_to_followers(stage_cfg: DictConfig | None) -> None:
    """From global rank 0 to the launcher's other processes: the config of the stage they train with it next,
    or None when the stages are over."""
    config = None if stage_cfg is None else OmegaConf.to_container(stage_cfg, resolve=True)
    torch.distributed.broadcast_object_list([config], src=0)


def follow() -> None:
    """A launcher's process other than global rank 0: trains every stage with the config rank 0 sends
    (`send_to_followers`), in the process group, until the stages are over. It reads and writes none of the
    pipeline's folders and records: rank 0 owns them, and evaluates alone. In a table (a multirun), after a
    stage failed here this process makes the process group anew with the others (`rejoin_process_group`:
    leaving it ends the collective a process that did not fail waits in) and waits for rank 0 to say the
    row's stages are over before it raises the failure, so that every process goes on to the next row
    together. Alone (one pipeline) it raises at once and the launcher ends the job, also where the stage
    failed here only (one GPU out of memory), which rank 0, in its DDP step, waits on. A stop signal stops the
    stage on every process after the same step (flowformer/tasks/preemption.py); this process then waits for
    rank 0 to say the stages are over, and stops with one line that points to rank 0's. A stop signal between
    the stages, or after a stage's last step, is kept until then too: rank 0, signalled as well, stops before
    its next stage or evaluation."""
    failure: Exception | None = None
    rank = torch.distributed.get_rank()
    with StopSignals() as stop:
        while True:
            message: list[Any] = [None]
            torch.distributed.broadcast_object_list(message, src=0)
            if message[0] is None:
                break
            if failure is None:
                log.info("pipeline: rank %d trains %s", rank, message[0]["paths"]["output_dir"])
                try:
                    fit(OmegaConf.create(message[0]))
                except StoppedBySignal:  # rank 0 stopped after the same step, and ends the stages; `stop` has it
                    pass
                except Exception as error:  # in a table, raised once rank 0 says the row's stages are over
                    if not in_multirun():
                        raise
                    rejoin_process_group()
                    failure = error
                finally:
                    close_loggers()
    if failure is not None:
        raise failure
    if stop.received is not None:
        raise StoppedBySignal(
            stop.received,
            f"pipeline: rank {rank} stopped by {stop.received.name} with the stage's other processes; global rank "
            "0's line says how to continue",
        )


def train_stage(
    stage_cfg: DictConfig, command: list[str], where: str, resume: str, launched: bool
) -> tuple[Path, dict[str, float]]:
    """Fit one stage: in this process; or, when its trainer starts processes of its own (`starts_processes`),
    as `command` (`python run.py <the stage's overrides>`) in a process of its own, whose new processes then
    run that stage again rather than this pipeline; or, when a launcher started this job's processes
    (`launched`), here and in the others (`follow`). Returns (its last.ckpt, the trainer's last logged values),
    as its StageResult wrote them."""
    if launched:
        send_to_followers(stage_cfg)
    try:
        if starts_processes(stage_cfg.trainer) and not launched:
            run_child(command, where, resume)
        else:
            try:
                fit(stage_cfg)
            except StoppedBySignal as stop:  # its line says how to resume the run, not the pipeline
                raise stage_stopped(stop.signum, where, resume) from None
            close_loggers()
    except Exception as error:
        if launched and in_multirun():
            rejoin_process_group()  # the other processes, waiting for this one or failed too, go on to the next row
        first = first_error(stage_cfg)
        if first is None or first.startswith("rank 0: "):  # this process's own error (its stage's rank 0) first
            raise
        if isinstance(error, StageRunError):  # how the stage's own process ended, then another's error
            raise StageRunError(f"{error}; the first error of its processes: {first}") from error
        raise StageRunError(first) from error
    result_file = Path(stage_cfg.callbacks.stage_result.path)
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if result.get("checkpoint") is None:
        raise ValueError("it wrote no last.ckpt (callbacks.last_checkpoint is off); the next stage starts from it")
    return Path(result["checkpoint"]), result["metrics"]


class StageRunError(ValueError):
    """A stage run in a process of its own failed; the message is its error line."""


# The line run.py prints for a user error (flowformer/tasks/__init__.py, report_error): `error (<type>): ...`.
ERROR_LINE = re.compile(r"error(?: \((\w+)\))?: (.*)")


def stage_stopped(signum: signal.Signals, where: str, resume: str) -> StoppedBySignal:
    """A stage's training stopped by `signum` (its last.ckpt at the step in progress): the pipeline stops, its
    line saying how to continue the pipeline (`resume`)."""
    return StoppedBySignal(
        signum, f"{where} was stopped by {signum.name} (its last.ckpt is kept); continue with {resume}"
    )


def run_child(command: list[str], where: str, resume: str) -> None:
    """Runs `command` (the pipeline's `where`) to its end, its stderr passed on, the stop signals this process gets passed to it. A stop
    signal (its own, or one passed on) stops the pipeline (StoppedBySignal; a training run saves its last.ckpt
    and exits with status 128 + the signal's number); any other failure is a StageRunError with its error
    line."""
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    received: list[signal.Signals] = []

    def pass_on(signum: int, _: object) -> None:
        note_stop(signum)
        received.append(signal.Signals(signum))
        process.send_signal(signum)

    previous = {signum: signal.signal(signum, pass_on) for signum in STOP_SIGNALS}
    error_line = None
    try:
        for line in process.stderr:
            sys.stderr.write(line)
            if match := ERROR_LINE.fullmatch(line.strip()):
                error_line = f"{match[1] or 'error'}: {match[2]}"
        status = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    stop = signal.Signals(status - 128) if status - 128 in [int(s) for s in STOP_SIGNALS] else None
    if (stop := stop or (received[0] if received and status != 0 else None)) is not None:
        raise stage_stopped(stop, where, resume)
    if status != 0:
        ending = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
        raise StageRunError(error_line or f"its training run {ending}")


class Pipeline:
    """The stages of one job, run in order into `run_dir`, then the evaluations; `earlier` is the record of a
    run being resumed; `resume_dir` is what pipeline.resume names to continue it (its run directory, or that
    of the job it is a part of: experiment=quickstart's from_scratch/). `configs` holds every composed stage
    and evaluation config by name / label."""

    def __init__(
        self,
        cfg: DictConfig,
        run_dir: Path,
        stages: list[Stage],
        earlier: dict | None = None,
        launched: bool = False,
        resume_dir: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.launched = launched
        self.run_dir = run_dir
        self.resume_dir = resume_dir or run_dir
        self.stages = stages
        self.shared = override_list(cfg.pipeline.shared, "pipeline.shared")
        self.evaluate = {
            str(label): override_list(overrides, f"pipeline.evaluate.{label}")
            for label, overrides in cfg.pipeline.evaluate.items()
        }
        written = row_overrides(cfg)  # the record's row: what task=report matches the paper's rows on
        substitutes = {str(override): str(run) for override, run in cfg.pipeline.substitutes.items()}
        self.row = [substitutes.get(override, override) for override in written]  # what the runs take
        self.pretraining_only = {str(key) for key in cfg.pipeline.pretraining_only}
        self.configs: dict[str, DictConfig] = {}
        self.composed: dict[tuple, tuple[DictConfig, list, list]] = {}
        self.signals = StopSignals()  # the first stop signal since `run` started
        earlier_stages = {entry["name"]: entry for entry in (earlier or {}).get("stages", [])}
        earlier_evaluations = {entry["label"]: entry for entry in (earlier or {}).get("evaluations", [])}
        self.record: dict[str, Any] = {
            "version": RECORD_VERSION,
            "run_dir": str(run_dir.resolve()),
            "name": str(cfg.name),
            "status": "running",
            "row": written,
            "metric": None,
            "stages": [earlier_stages.get(stage.name) or self.new_entry(stage.name) for stage in stages],
            "evaluations": [
                earlier_evaluations.get(label) or self.new_entry(label, "label") for label in self.evaluate
            ],
        }

    def new_entry(self, name: str, key: str = "name") -> dict[str, Any]:
        """The record of a stage (or evaluation: key "label") that has not started."""
        folder = self.run_dir / (name if key == "name" else f"eval_{name}")
        return {key: name, "dir": str(folder), "status": "pending", "resumed_from": [], "wall_s": None}

    def save(self) -> None:
        atomic_write_text(self.run_dir / RECORD, json.dumps(self.record, indent=2))

    def continuation(self) -> str:
        """What continues this pipeline: this run's command with pipeline.resume=<its run dir> (under a launcher,
        the launcher's command with it); in a table (a multirun, whatever its launcher), the table's command with
        pipeline.resume=<its sweep dir>, where each row finds its own."""
        if in_multirun():
            return f"the table's command and {shell_override('pipeline.resume', self.resume_dir.parent)}"
        resume = shell_override("pipeline.resume", self.resume_dir)
        return resume if self.launched else command_again(resume)

    def pass_through(self, output_dir: Path) -> list[str]:
        """This job's seed, name, paths and logger choice (none: `~logger`), for every run of the pipeline; with
        wandb, the run's job type is its folder's name (the stage, or eval_<label>)."""
        cfg = self.cfg
        through = [
            f"seed={cfg.seed}",
            f"name={path_value(cfg.name)}",
            f"paths.root_dir={path_value(cfg.paths.root_dir)}",
            f"paths.output_dir={path_value(output_dir)}",
        ]
        if HydraConfig.initialized():
            choice = HydraConfig.get().runtime.choices.get("logger")
            through.append(f"logger={choice}" if choice else "~logger")
        if "wandb" in (cfg.get("logger") or {}):  # wandb groups the runs by name (the table); job type: the stage
            through.append(f"logger.wandb.job_type={path_value(output_dir.name)}")
        return through

    def compose(
        self, own: list[str], handoff: list[str], output_dir: Path, through: list[str] = ()
    ) -> tuple[DictConfig, list, list]:
        """The config of `python run.py <shared it takes> <own> <row it takes> <handoff> <through>` writing to
        output_dir, the shared and row overrides routed by `takes`: (config, its overrides without the
        pass-through ones and `through`, the shared and row overrides it did not take)."""
        key = (tuple(own), tuple(handoff), str(output_dir), tuple(through))
        if key not in self.composed:  # the plan composed each stage first (`plan`)
            self.composed[key] = self.compose_anew(own, handoff, output_dir, through)
        return self.composed[key]

    def compose_anew(
        self, own: list[str], handoff: list[str], output_dir: Path, through: list[str]
    ) -> tuple[DictConfig, list, list]:
        tail = [*handoff, *self.pass_through(output_dir), *through]
        groups = [override for override in self.shared if "." not in override_key(override)]
        probe = self.probe([*groups, *own, *tail])
        choices = [override for override in [*self.shared, *self.row] if override_key(override) == "model"]
        if choices and takes(choices[-1], probe):
            probe = self.probe([*groups, *own, choices[-1], *tail])
        shared = [override for override in self.shared if takes(override, probe, self.pretraining_only)]
        row = [override for override in self.row if takes(override, probe, self.pretraining_only)]
        dropped = [override for override in [*self.shared, *self.row] if override not in (*shared, *row)]
        overrides = [*shared, *own, *row, *handoff]
        return hydra.compose("config", overrides=[*overrides, *tail]), overrides, dropped

    def probe(self, overrides: list[str]) -> DictConfig:
        """The config of `overrides` that `takes` routes the shared and row overrides by (its task, its keys),
        composed once for all the jobs of a multirun: those of the same stage or evaluation differ only in the
        paths inside their run directories, values no key or task depends on."""
        probes = _PROBES.setdefault(GlobalHydra.instance().hydra, {})
        key = tuple(override.replace(str(self.run_dir), RUN_DIR_MARK) for override in overrides)
        if key not in probes:
            probes[key] = hydra.compose("config", overrides=overrides)
        return probes[key]

    def run(self) -> dict[str, Any]:
        """Every stage, then every evaluation; returns the record (also in <run dir>/pipeline.json). Under a
        launcher the other processes are told the stages are over however they end (refused by the plan too).
        A stop signal between them, or after a stage's last step (which finishes it), stops the pipeline before
        the next one (`stop_if_signalled`); one while a stage starts stops it after its first step; one after
        the last of them stops the process once the record says done (a table's next row does not start), or,
        where the pipeline is a part of other work (experiment=quickstart), leaves that work to stop."""
        checkpoint: Path | None = None
        with self.signals:
            try:
                ensure_writable_dir(self.run_dir, "the pipeline's run directory")
                self.plan()
                for index, stage in enumerate(self.stages, 1):
                    checkpoint = self.run_stage(index, stage, checkpoint)
            finally:
                if self.launched:
                    send_to_followers(None)
            backbone = self.configs[self.stages[-1].name].backbone
            first_epes = [self.run_evaluation(label, checkpoint, backbone) for label in self.evaluate]
        self.record.update(status="done", metric=first_epes[0] if first_epes else None)
        self.save()
        if (signum := self.signals.received) is not None and not StopSignals.entered:
            table = f"; continue the table with {self.continuation()}" if in_multirun() else ""
            raise StoppedBySignal(
                signum, f"pipeline stopped by {signum.name} as it finished: its record is {self.run_dir / RECORD}{table}"
            )
        return self.record

    def stop_if_signalled(self, where: str) -> None:
        """Stops the pipeline before `where` (its record: stopped) when a stop signal came since it started, or
        since the work it is a part of started (experiment=quickstart's from_scratch/ after the first pipeline)."""
        signum = stop_noted()
        if signum is None:
            return
        self.record["status"] = "stopped"
        self.save()
        raise StoppedBySignal(
            signum,
            f"pipeline stopped by {signum.name} before {where}: the finished stages are kept in {self.run_dir} "
            f"({RECORD}); continue with {self.continuation()}",
        )

    def stage_inputs(self, stage: Stage, init_from: Path | None) -> tuple[list[str], list[str]]:
        """A stage's overrides beside its own: the hand-off from the previous stage (model.init_from) and the
        callback that writes its result."""
        handoff = [] if init_from is None else [f"model.init_from={path_value(init_from)}"]
        result = [
            f"+callbacks.stage_result._target_={StageResult.__module__}.{StageResult.__qualname__}",
            f"+callbacks.stage_result.path={path_value(self.run_dir / stage.name / STAGE_RESULT)}",
        ]
        return handoff, result

    def plan(self) -> None:
        """Composes every stage as it will run, each from the last.ckpt its previous stage writes, and every
        evaluation of the last one, so that an override they cannot run is one line before any work (not after
        the training, for an evaluation's); refuses a stage that does not train or has a global batch that does
        not divide, logs the plan (stages, steps, batches, estimated GPU-hours: flowformer/tasks/pipeline_plan.py),
        then refuses a stage that asks for a GPU torch does not see."""
        plans, trainers, init_from = [], [], None
        for stage in self.stages:
            stage_dir = self.run_dir / stage.name
            handoff, result = self.stage_inputs(stage, init_from)
            where = f"pipeline stage {stage.name} ({' '.join(stage.overrides)})"
            stage_cfg = self.compose_planned(where, stage.overrides, handoff, stage_dir, result)
            if stage_cfg.task not in ("train", "pretrain"):
                raise ValueError(f"{where}: task={stage_cfg.task}, where a stage trains (task=train or task=pretrain)")
            try:
                check_training_types(stage_cfg)  # a word for a number in a later stage, before the first trains
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            plans.append(stage_plan(stage.name, stage_cfg, self.cfg.pipeline.step_time))
            trainers.append(stage_cfg.trainer)
            init_from = stage_dir / "checkpoints" / "last.ckpt"
        for label, overrides in self.evaluate.items():
            where = f"pipeline evaluation {label} ({' '.join(overrides)})"
            checkpoint = [f"eval.checkpoint={path_value(init_from)}"]
            self.compose_planned(where, ["task=eval", *overrides], checkpoint, self.run_dir / f"eval_{label}")
        log_plan(self.run_dir, plans, list(self.evaluate))
        for trainer in trainers:  # after the plan, whose cost a machine without the GPUs can still tell
            check_training_precision(trainer)
            training_device(trainer)

    def compose_planned(self, where: str, own: list[str], *inputs: Any) -> DictConfig:
        """`compose` for the plan: Hydra's error where `own` names a config that does not exist
        (`pipeline.stages=[chairs,chiars]`), an override it cannot parse or a key the config does not have,
        as one line naming `where`."""
        try:
            return self.compose(own, *inputs)[0]
        except MissingConfigException as error:
            raise ValueError(f"{where} names a config that does not exist: {missing_config(error)}") from None
        except (HydraException, OmegaConfBaseException) as error:
            raise ValueError(f"{where}: {' '.join(str(error).split())}") from None

    def run_stage(self, index: int, stage: Stage, init_from: Path | None) -> Path:
        """Stage `index` (from 1), started from `init_from`: skipped when it finished from that very checkpoint,
        resumed from its last.ckpt when it was interrupted, else run; returns its last.ckpt."""
        entry = self.record["stages"][index - 1]
        stage_dir = self.run_dir / stage.name
        handoff, result = self.stage_inputs(stage, init_from)
        stage_cfg, overrides, dropped = self.compose(stage.overrides, handoff, stage_dir, result)
        self.configs[stage.name] = stage_cfg
        init_sha = None if init_from is None else file_sha256(init_from)
        where = f"stage {index}/{len(self.stages)} {stage.name}"
        if entry["status"] != "pending":
            self.check_earlier(entry, where, overrides, init_sha)
        if entry["status"] == "done":
            log.info("pipeline: %s finished already (%s)", where, entry["checkpoint"])
            return Path(entry["checkpoint"])
        latest = latest_checkpoint(entry, stage_dir)
        if latest is not None and entry["status"] != "pending" and trained_to_the_end(latest, stage_cfg):
            return self.finished_unrecorded(entry, where, latest)
        self.stop_if_signalled(where)
        resume_from = set_aside(stage_dir) or latest
        command = [sys.executable, str(RUN_PY), *overrides, *self.pass_through(stage_dir), *result]
        command.append(f"hydra.run.dir={path_value(stage_dir)}")
        if resume_from is not None:
            stage_cfg.ckpt_path = str(resume_from)  # as `ckpt_path=` on its command line: an exact resume
            command.append(f"ckpt_path={path_value(resume_from)}")
            entry["resumed_from"].append(str(resume_from))
        entry.update(
            status="running",
            task=str(stage_cfg.task),
            overrides=overrides,
            dropped=dropped,
            init_from=None if init_from is None else str(init_from),
            init_from_sha256=init_sha,
            checkpoint=None,
            checkpoint_sha256=None,
            metrics={},
            error=None,
        )
        self.save()
        resuming = f", resuming from {resume_from}" if resume_from is not None else ""
        log.info("pipeline: %s (task=%s) in %s%s", where, stage_cfg.task, stage_dir, resuming)
        with self.attempt(entry, where):
            checkpoint, metrics = train_stage(stage_cfg, command, f"pipeline {where}", self.continuation(), self.launched)
        entry.update(checkpoint=str(checkpoint), checkpoint_sha256=file_sha256(checkpoint), metrics=metrics)
        self.save()
        return checkpoint

    def finished_unrecorded(self, entry: dict[str, Any], where: str, checkpoint: Path) -> Path:
        """A stage whose last.ckpt reached trainer.max_steps although its record does not say it finished (a
        write after it failed, e.g. on a full disk): recorded as finished with that checkpoint."""
        log.info("pipeline: %s had trained to its last step (%s): recorded as finished", where, checkpoint)
        entry.update(status="done", checkpoint=str(checkpoint), checkpoint_sha256=file_sha256(checkpoint), error=None)
        self.save()
        return checkpoint

    def check_earlier(self, entry: dict[str, Any], where: str, overrides: list[str], init_sha: str | None) -> None:
        """A stage of the run being resumed must be this run's: the same overrides, started from the checkpoint
        its previous stage holds now, and, when it finished, its own checkpoint unchanged."""
        advice = (
            f"pipeline.resume={self.run_dir} continues the same pipeline (protocol and row); for anything else "
            "start a fresh run (without pipeline.resume)"
        )
        if without_handoff(entry.get("overrides")) != without_handoff(overrides):
            raise StaleResumeError(
                f"pipeline.resume: {where} ran with the overrides {entry.get('overrides')}, this run gives "
                f"{overrides}; {advice}"
            )
        if entry.get("init_from_sha256") != init_sha:
            raise StaleResumeError(
                f"pipeline.resume: {where} started from {entry.get('init_from')} as it was then, which has "
                f"changed since; its result is stale; {advice}"
            )
        if entry["status"] != "done":
            return
        checkpoint = Path(entry["checkpoint"])
        if not checkpoint.is_file() or file_sha256(checkpoint) != entry["checkpoint_sha256"]:
            state = "changed since" if checkpoint.is_file() else "missing"
            raise StaleResumeError(
                f"pipeline.resume: {where} finished, but its checkpoint {checkpoint} is {state}: the stages after "
                f"it would start from a stale or missing checkpoint; {advice}"
            )

    def run_evaluation(self, label: str, checkpoint: Path, backbone: DictConfig) -> float | None:
        """Evaluation `label` of the last stage's checkpoint with that stage's `backbone` (skipped when it
        finished on that very checkpoint); returns its first set's epe."""
        entry = self.record["evaluations"][list(self.evaluate).index(label)]
        eval_dir = self.run_dir / f"eval_{label}"
        own = ["task=eval", *self.evaluate[label]]
        eval_cfg, overrides, dropped = self.compose(own, [f"eval.checkpoint={path_value(checkpoint)}"], eval_dir)
        with open_dict(eval_cfg):
            eval_cfg.backbone = OmegaConf.create(OmegaConf.to_container(backbone, resolve=True))
        self.configs[f"eval_{label}"] = eval_cfg
        sha = self.record["stages"][-1]["checkpoint_sha256"]
        where = f"evaluation {label}"
        if self.evaluated_already(entry, overrides, sha, where):
            log.info("pipeline: %s finished already (%s)", where, entry["results_json"])
            return first_epe(entry["results_json"])
        self.stop_if_signalled(where)
        set_aside(eval_dir)
        entry.update(
            status="running",
            overrides=overrides,
            dropped=dropped,
            checkpoint=str(checkpoint),
            checkpoint_sha256=sha,
            results_json=str(eval_cfg.eval.results_json),
            error=None,
        )
        self.save()
        log.info("pipeline: %s of %s in %s", where, checkpoint, eval_dir)

        def stopped(signum: signal.Signals) -> str:
            return (
                f"pipeline {where} stopped by {signum.name}: the finished stages are kept in {self.run_dir} "
                f"({RECORD}); continue with {self.continuation()}, which runs {where} again"
            )

        with self.attempt(entry, where), stopping_at_once(stopped):
            if self.launched:  # alone, outside the process group the launcher's other processes have left
                command = [sys.executable, str(RUN_PY), *overrides, *self.pass_through(eval_dir)]
                command += [*config_overrides("backbone", eval_cfg.backbone), f"hydra.run.dir={path_value(eval_dir)}"]
                run_child(command, f"pipeline {where}", self.continuation())
            else:
                eval_task.evaluate(eval_cfg)
        return first_epe(entry["results_json"])

    def evaluated_already(self, entry: dict[str, Any], overrides: list[str], sha: str | None, where: str) -> bool:
        """Whether an evaluation finished with these overrides on the checkpoint holding `sha`, its results file
        whole (a damaged one is one warning line, and the evaluation runs again)."""
        if entry["status"] != "done" or entry["checkpoint_sha256"] != sha:
            return False
        if without_handoff(entry["overrides"]) != without_handoff(overrides) or not Path(entry["results_json"]).is_file():
            return False
        try:
            first_epe(entry["results_json"])
        except ValueError as error:
            log.warning("pipeline: %s finished, but %s: evaluating it again", where, error)
            return False
        return True

    @contextmanager
    def attempt(self, entry: dict[str, Any], where: str) -> Iterator[None]:
        """Times one attempt at a stage or evaluation into its record: done; or failed, which stops the
        pipeline with one PipelineStageError line (a bug's traceback goes to the log first); or stopped (a stop
        signal, Ctrl-C), which goes on up."""
        start = time.monotonic()
        status, error_line = "stopped", None
        try:
            yield
            status = "done"
        except Exception as error:
            cause = find_user_error(error)
            if cause is None:
                log.error("pipeline: %s failed", where, exc_info=error)
            message = str(error) if cause is None else user_error_message(cause, error)
            cause = cause or error
            status = "failed"
            error_line = " ".join(line.strip() for line in message.splitlines())
            if not isinstance(cause, StageRunError):  # its message is the error line of the stage's own process
                error_line = f"{type(cause).__name__}: {error_line}"
            raise PipelineStageError(
                f"pipeline {where} failed: {error_line}; the finished stages are kept in {self.run_dir} "
                f"({RECORD}); continue with {self.continuation()}"
            ) from error
        finally:
            entry.update(status=status, error=error_line, wall_s=(entry["wall_s"] or 0.0) + time.monotonic() - start)
            if status != "done":
                self.record["status"] = status
            self.save()


def pipeline_dir(cfg: DictConfig) -> tuple[Path, dict[str, Any] | None]:
    """Where this job's pipeline runs: its own run directory, or the one pipeline.resume names (in a
    multirun, the job's namesake inside the sweep directory it names) with the record found there; a row of a
    table that stopped before it (its namesake missing where other rows of the table started) starts there. A
    command run again in its own run directory, which holds its record (a requeued SLURM job in
    `slurm-<job>.<step>`, torchrun with the same --rdzv-id), continues it as pipeline.resume would."""
    resume = cfg.pipeline.get("resume")
    own = Path(cfg.paths.output_dir).resolve()
    if not resume and (own / RECORD).is_file():
        log.info("pipeline: %s holds this pipeline's record: continuing it (a job run again)", own)
        resume = str(own)
    if not resume:
        return own, None
    folder = Path(resume).resolve()
    if in_multirun() and not (folder / RECORD).is_file():
        sweep, folder = folder, folder / Path(HydraConfig.get().runtime.output_dir).name
        if not folder.exists() and table_started_in(sweep, str(cfg.name)):
            log.info("pipeline: this row had not started (the table stopped before it): it starts in %s", folder)
            return folder, None
    if not (folder / RECORD).is_file():
        raise FileNotFoundError(
            f"pipeline.resume={resume}: {folder / RECORD} does not exist; give the run directory of an earlier "
            "run of this pipeline (task=pipeline or experiment=quickstart; in a multirun, its sweep directory, run "
            "with the same sweep)"
        )
    log.info("pipeline: resuming %s (this run's own log: %s)", folder, cfg.paths.output_dir)
    return folder, read_record(folder)


def read_record(folder: Path) -> dict[str, Any]:
    """The pipeline record in `folder` as a resume reads it: checked, its paths taken to `folder`."""
    path = folder / RECORD
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"pipeline.resume: {path} is not a pipeline record ({error}); {RECORD_ADVICE}") from None
    check_record(record, path)
    return moved_record(record, folder)


def table_started_in(sweep: Path, name: str) -> bool:
    """Whether a row of table `name` (its jobs' `name`) started in the sweep directory `sweep`: one holds a
    record of it."""
    for path in sweep.glob(f"*/{RECORD}"):
        with suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if isinstance(record, dict) and record.get("name") == name:
                return True
    return False


RECORD_ADVICE = "put back a good copy of it, or start a fresh run (without pipeline.resume)"
# What a resume reads of each stage (name) and evaluation (label) entry, and, once it finished, also.
ENTRY_FIELDS = ("status", "resumed_from", "wall_s")
FINISHED_FIELDS = {"name": ("overrides", "init_from_sha256", "checkpoint", "checkpoint_sha256"),
                   "label": ("overrides", "checkpoint_sha256", "results_json")}
STATUSES = ("pending", "running", "done", "failed", "stopped")


def check_record(record: Any, path: Path) -> None:
    """A ValueError naming `path` unless `record` is a pipeline record a resume can read: this version, its
    stages and evaluations each named and holding what a resume reads of it."""
    problem = None
    if not isinstance(record, dict):
        problem = f"it holds a JSON {type(record).__name__}, not a record"
    elif record.get("version") != RECORD_VERSION:
        problem = f"it has record version {record.get('version')}, expected {RECORD_VERSION}"
    for part, key in (("stages", "name"), ("evaluations", "label")):
        entries = record.get(part) if problem is None else []
        if not isinstance(entries, list):
            problem = f"its {part} are not a list"
        for index, entry in enumerate(entries or []):
            if problem is not None:
                break
            if not isinstance(entry, dict):
                problem = f"{part}[{index}] is not a mapping"
                break
            fields = (key, *ENTRY_FIELDS, *(FINISHED_FIELDS[key] if entry.get("status") == "done" else ()))
            missing = [field for field in fields if field not in entry]
            if missing or entry["status"] not in STATUSES or not isinstance(entry["resumed_from"], list):
                problem = f"{part}[{index}] lacks {', '.join(missing)}" if missing else f"{part}[{index}] is damaged"
    if problem is not None:
        raise ValueError(f"pipeline.resume: {path} is damaged ({problem}); {RECORD_ADVICE}")


# The fields of a stage or evaluation entry that hold a path.
PATH_FIELDS = ("dir", "init_from", "checkpoint", "results_json")


def moved_record(record: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The record of a pipeline found in `run_dir`, which may have been copied or moved there since it was
    written: each path it holds inside the run directory it names is taken to the same place in `run_dir`
    (in a copy, the copy's files are used, not the original's)."""
    written = Path(record.get("run_dir") or run_dir)

    def here(path: str | None) -> str | None:
        return str(run_dir / Path(path).relative_to(written)) if path and Path(path).is_relative_to(written) else path

    for entry in [*record["stages"], *record["evaluations"]]:
        entry.update({field: here(entry[field]) for field in PATH_FIELDS if field in entry})
        entry["resumed_from"] = [here(path) for path in entry["resumed_from"]]
    return {**record, "run_dir": str(run_dir)}


def run(cfg: DictConfig) -> float | None:
    """The pipeline; under a launcher (torchrun, srun) global rank 0 runs it and the other processes `follow`."""
    environment = launcher_environment()
    if environment is not None:
        join_process_group(environment)
        if environment.global_rank() != 0:
            follow()
            return None
    try:
        run_dir, earlier = pipeline_dir(cfg)
        pipeline = Pipeline(cfg, run_dir, read_stages(cfg.pipeline), earlier, environment is not None)
    except Exception:
        if environment is not None:  # this job ends before its stages: the others' too, in step for the next job
            send_to_followers(None)
        raise
    return pipeline.run()["metric"]
