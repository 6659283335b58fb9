"""task=report: the jobs of a multirun (or one run) as one table, beside the paper's numbers.

    python run.py -m task=pipeline protocol=paper_ablation sweep=paper_pe     # train the table's rows
    python run.py task=report report.runs=logs/pipeline/paper_pe/multiruns/<time>
    python run.py task=report report.runs=<run dir> report.table=paper_pe     # conf/paper/paper_pe.yaml

`report.runs` is a multirun's directory (each folder with a `.hydra/` under it, however deep, is a job;
`failed_jobs.jsonl` names the failed ones, also those that left no folder; `multirun.yaml` how many jobs the
sweep launched) or one run's directory, or a list of them (`[<FlowFormer run>,<FlowFormer+MCVA run>]`). Of
each job it reads:

- the overrides it was started with (`.hydra/overrides.yaml`), the sweep it belongs to (`.hydra/hydra.yaml`);
- a pipeline (task=pipeline) from `pipeline.json`: its status, its row's overrides, its stages' wall time and
  directories, and its evaluations' `eval_results.json` (an evaluation's metrics are
  `<label>:<set>/<metric>`); any other run from its own `eval_results.json`, or else the last validation
  values of its `csv/metrics.csv` (`val/<set>/<metric>` -> `<set>/<metric>`);
- the network's parameter count from `run_info.json` (the last stage's in a pipeline);
- `train/loss` and every `val/<set>/epe` of the `csv/metrics.csv` files against the step, for `report.png`.

A job is `done`, `failed` (in failed_jobs.jsonl, or its pipeline failed; its error line is kept), `stopped`
(a pipeline stopped by a signal), `running` (no results yet: running, or killed without a record) or
`unreadable` (one of its files is damaged or holds what it should not: the file and why are its error; the
report is written for the other jobs, then the task exits with status 1).

The paper's table is `report.table`, or the one named as the sweep of each job (`sweep=paper_pe` ->
`conf/paper/paper_pe.yaml`, `sweep=mcva_masking` -> `conf/paper/mcva_masking.yaml`). A job is a row of it
when every override that defines the row (not one of SETUP_KEYS, which only set a run up on its machine) is
one of the job's (its command line and, in a pipeline, its row), with the same value (`0.5` = `0.50`). Rows
defined by the same overrides are one job's, told apart by the evaluation each names (the tile table: one
model, a row with and one without tiles): the job fills each of them, one report row apiece. The job's
overrides beyond its row are listed beside it, and the rows no job ran are listed as `missing`. The paper's
columns come first: each the measured value (of the pipeline evaluation the row names as `evaluation`, none
when the job did not run it; else of the one the table names, e.g. `tiled` for numbers the paper tiled, else
its first), the row's published number and their difference (measured - published); then every other
measured value; the parameter count beside the paper's.

Writes, into `report.output_dir` (default: the first of `report.runs`), `report.md` (the table's title and
caption, then one row per job and row it fills, labelled with the row's label in the paper, else by the
overrides that tell the jobs apart, under the paper's column headers), `report.csv` (the same, one column per
value) and `report.png` (the paper's "AEPE vs. training-step curves": training loss and validation AEPE
against the step, one panel per stage and set, one line per job, the jobs that did not finish named in the
legend). These three are the
report's own and are rewritten at every report. With `logger=wandb` the table is also logged as a wandb Table,
and the figure as an image, in a run of job type `report` grouped with the jobs (the table, else `name`).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import track

from flowformer.models.output_files import atomic_write, atomic_write_text
from flowformer.overrides import override_key
from flowformer.tasks.run_dirs import ensure_writable_dir
from flowformer.tasks.sweeps import FAILED_JOBS, JOB_KEYS

log = logging.getLogger(__name__)

PIPELINE_RECORD = "pipeline.json"  # flowformer/tasks/pipeline.py writes it
# The paper's tables (report.tables_dir null): conf/paper/ of this repository, wherever run.py is started from.
PAPER_TABLES_DIR = Path(__file__).resolve().parents[2] / "conf" / "paper"
# The paper's names of the metrics its tables report (KITTI-15 F1-epe is the per-image EPE, F1-all in %).
PAPER_COLUMNS = {
    "sintel_clean/epe": "Sintel clean",
    "sintel_final/epe": "Sintel final",
    "kitti/epe": "KITTI-15 F1-epe",
    "kitti/f1_all": "KITTI-15 F1-all",
    "sintel_test_clean/epe": "Sintel test clean",  # the benchmarks' numbers: published, not measured here
    "sintel_test_final/epe": "Sintel test final",
    "kitti_test/f1_all": "KITTI-15 test F1-all",
}
PARAMS_KEY = "params_m"  # a published row's parameter count, in millions
# the fields of a report row that are no measured value
ROW_FIELDS = ("row", "job", "status", "other_overrides", "params_m", "params_m paper", "train_s", "error")
# The settings that say how a run was made on its machine (where the Twins weights come from, devices, batch,
# precision, memory, paths, logging), never which row of a paper's table it is: a job is matched to its row
# without them, and they are listed beside its numbers when they differ from the row's.
SETUP_KEYS = (
    "backbone.twins_weights",
    "backbone.memory_budget_gb",
    "backbone.activation_checkpoint",
    "backbone.tokenize_chunk",
    "trainer",
    "data.batch_size",
    "data.val_batch_size",
    "data.num_workers",
    "runtime",
    "paths",
    "logger",
)


@dataclass
class Job:
    """What the report knows of one job of the multirun."""

    name: str  # its directory's name, or #<job number> when it left none
    directory: Path | None
    overrides: list[str]  # its command line (.hydra/overrides.yaml, or the failed-job record)
    row: list[str]  # the overrides that make it: a pipeline's row, else its command line
    status: str = "running"
    error: str | None = None
    results: dict[str, float] = field(default_factory=dict)  # "[<evaluation>:]<set>/<metric>" -> value
    parameters: int | None = None
    train_s: float | None = None
    evaluations: list[str] = field(default_factory=list)  # a pipeline's evaluation labels, in order
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # panel -> [(step, epe)]
    sweep: str | None = None  # the sweep config it ran under (names the paper's table)
    number: int | None = None  # its job number in the multirun (hydra.job.num)


class UnreadableFile(ValueError):
    """A job's file that the report cannot read (damaged, or holding what it does not expect): its path and why."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")


# What reading a damaged file's content raises: a missing field, a value of another type or form.
CONTENT_ERRORS = (AttributeError, IndexError, KeyError, TypeError, ValueError)


def damage(error: Exception) -> str:
    """What is wrong with a file's content, from what reading it raised."""
    if isinstance(error, KeyError):
        return f"no {error} field"
    return f"unexpected content ({type(error).__name__}: {error})"


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Turns what a damaged `path` raises while its content is read into an UnreadableFile naming it."""
    try:
        yield
    except UnreadableFile:
        raise
    except CONTENT_ERRORS as error:
        raise UnreadableFile(path, damage(error)) from None


def read_json(path: Path) -> Any:
    """A JSON file's content, or None when it is missing (a job still running); UnreadableFile when damaged."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise UnreadableFile(path, f"not readable as JSON ({error})") from None


def read_yaml(path: Path) -> Any:
    """A YAML file's content (plain data only: a `!!python/...` tag is refused, never run), or UnreadableFile."""
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError) as error:
        reason = getattr(error, "problem", None) or getattr(error, "strerror", None) or str(error)
        raise UnreadableFile(path, f"not readable as YAML ({reason.splitlines()[0]})") from None


def job_directories(runs: Path) -> list[Path]:
    """The run directory itself, or the job folders (each with its .hydra/) under a multirun directory however
    deep (an override holding a `/` nested the folders of sweeps run before job folder names were made one
    plain name); a job's own folders are not searched, nor are links followed."""
    if (runs / ".hydra").is_dir():
        return [runs]
    folders = sorted(path for path in runs.iterdir() if path.is_dir() and not path.is_symlink())
    return [job for folder in folders for job in job_directories(folder)]


def launched_jobs(runs: Path) -> int | None:
    """How many jobs the sweep of `runs` launched, as its multirun.yaml records the sweep: the combinations
    of its swept values (Hydra's basic sweeper), a sweeper's n_trials (Optuna), else None (not a multirun, or
    a damaged record: a warning)."""
    record = runs / "multirun.yaml"
    if not record.is_file():
        return None
    try:
        with reading(record):
            hydra_cfg = read_yaml(record)["hydra"]
            sweeper = hydra_cfg.get("sweeper") or {}
            if not str(sweeper.get("_target_")).endswith("BasicSweeper"):
                return sweeper.get("n_trials")
            swept = [f"{key}={value}" for key, value in (sweeper.get("params") or {}).items()]
            overrides = OverridesParser.create().parse_overrides([*swept, *hydra_cfg["overrides"]["task"]])
            return len(BasicSweeper.split_arguments(overrides, None)[0])
    except (UnreadableFile, HydraException) as error:
        log.warning("how many jobs the sweep launched is not known: %s", error)
        return None


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics.csv (SafeCSVLogger: one column per logged name, empty where not logged) as numbers,
    the empty cells left out; UnreadableFile naming the line that holds something else."""
    if not path.is_file():
        return []
    rows = []
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        for row in reader:
            try:
                rows.append(
                    {column: float(value) for column, value in row.items() if value not in ("", None)}
                )
            except (TypeError, ValueError) as error:
                raise UnreadableFile(path, f"line {reader.line_num} is not numbers ({error})") from None
    return rows


def training_curves(rows: list[dict[str, float]], panel_prefix: str) -> dict[str, list[tuple[int, float]]]:
    """The training loss and every validation EPE against the step, the paper's training-curve panels:
    {"<prefix>training loss": [(step, value), ...], "<prefix>validation AEPE, <set>": [...]}."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for column, value in row.items():
            if column == "train/loss":
                curves.setdefault(f"{panel_prefix}training loss", []).append((int(row["step"]), value))
            elif column.startswith("val/") and column.endswith("/epe"):
                panel = f"{panel_prefix}validation AEPE, {column.split('/')[1]}"
                curves.setdefault(panel, []).append((int(row["step"]), value))
    return curves


def last_validation(rows: list[dict[str, float]]) -> dict[str, float]:
    """The last logged value of every `val/<set>/<metric>`, as `<set>/<metric>`."""
    values: dict[str, float] = {}
    for row in rows:
        values.update(
            {column.removeprefix("val/"): v for column, v in row.items() if column.startswith("val/")}
        )
    return values


def parameter_count(run_dir: Path) -> int | None:
    """The network's parameter count its run_info.json records (written at the start of a training run)."""
    path = run_dir / "run_info.json"
    with reading(path):
        return ((read_json(path) or {}).get("parameters") or {}).get("total")


def moved(path: str | None, recorded_dir: str | None, job_dir: Path) -> Path | None:
    """A path pipeline.json records (relative to the run directory, or absolute), in this job's folder wherever
    the folder is now (a copied multirun)."""
    if not path:
        return None
    recorded = Path(path)
    if not recorded.is_absolute():
        return job_dir / recorded
    if recorded.exists() or recorded_dir is None or not recorded.is_relative_to(recorded_dir):
        return recorded
    return job_dir / recorded.relative_to(recorded_dir)


def evaluation_results(path: Path) -> dict[str, float]:
    """An eval_results.json's metrics as `<set>/<metric>` -> value."""
    with reading(path):
        sets = (read_json(path) or {"results": {}})["results"].items()
        return {f"{name}/{metric}": float(value) for name, values in sets for metric, value in values.items()}


def read_stage_runs(job: Job, record: dict[str, Any]) -> None:
    """The parameter count (the last stage's network) and validation curves of a pipeline's stages."""
    for stage in record.get("stages", []):
        stage_dir, panel_prefix = (
            moved(stage.get("dir"), record.get("run_dir"), job.directory),
            f"{stage['name']}: ",
        )
        if stage_dir is None:
            continue
        job.parameters = parameter_count(stage_dir) or job.parameters
        metrics = stage_dir / "csv" / "metrics.csv"
        with reading(metrics):
            job.curves.update(training_curves(read_metrics(metrics), panel_prefix))


def read_pipeline(job: Job, record: dict[str, Any]) -> None:
    """Status, row, errors, wall time, evaluation results, parameter count and curves of a pipeline job."""
    job.status = record.get("status", "running")
    job.row = [str(override) for override in record.get("row", job.overrides)]
    stages, evaluations = record.get("stages", []), record.get("evaluations", [])
    job.error = next((entry["error"] for entry in [*stages, *evaluations] if entry.get("error")), None)
    walls = [stage["wall_s"] for stage in stages if stage.get("wall_s") is not None]
    job.train_s = sum(walls) if walls else None
    job.evaluations = [evaluation["label"] for evaluation in evaluations]
    for evaluation in evaluations:
        results_json = moved(evaluation.get("results_json"), record.get("run_dir"), job.directory)
        if evaluation.get("status") == "done" and results_json:
            results = evaluation_results(results_json)
            job.results.update({f"{evaluation['label']}:{key}": value for key, value in results.items()})


def training_finished(run_dir: Path, rows: list[dict[str, float]]) -> bool:
    """A training run reached trainer.max_steps: last.ckpt is written and its metrics reach the last step."""
    config = run_dir / "config_resolved.yaml"
    if not (run_dir / "checkpoints" / "last.ckpt").is_file() or not config.is_file() or not rows:
        return False
    with reading(config):
        max_steps = (read_yaml(config).get("trainer") or {}).get("max_steps")
    last_step = max((int(row["step"]) for row in rows if "step" in row), default=-1)
    return max_steps is not None and last_step + 1 >= max_steps


def read_run(job: Job, run_dir: Path) -> None:
    """Status, results, parameter count, training time and curves of any other run (task=train, pretrain,
    eval): its eval_results.json, else the last validation values of its metrics.csv."""
    metrics, results = run_dir / "csv" / "metrics.csv", run_dir / "eval_results.json"
    with reading(metrics):
        rows = read_metrics(metrics)
        job.curves = training_curves(rows, "")
    if results.is_file():
        job.results, job.status = evaluation_results(results), "done"
    else:
        job.results = last_validation(rows)
        job.status = "done" if training_finished(run_dir, rows) else "running"
    job.parameters = parameter_count(run_dir)
    checkpoint, info = run_dir / "checkpoints" / "last.ckpt", run_dir / "run_info.json"
    if checkpoint.is_file() and info.is_file():  # run_info.json is written as training starts
        job.train_s = checkpoint.stat().st_mtime - info.stat().st_mtime


def read_job(job_dir: Path) -> Job:
    """A job folder: its overrides, sweep and number (.hydra/), then its pipeline record or run files;
    UnreadableFile when one of them is damaged."""
    overrides_yaml, hydra_yaml = job_dir / ".hydra" / "overrides.yaml", job_dir / ".hydra" / "hydra.yaml"
    overrides = read_yaml(overrides_yaml)
    if not isinstance(overrides, list):
        found = "nothing" if overrides is None else f"{overrides!r:.60}"
        raise UnreadableFile(overrides_yaml, f"expected the list of the job's overrides, found {found}")
    with reading(hydra_yaml):
        hydra_cfg = read_yaml(hydra_yaml)["hydra"] if hydra_yaml.is_file() else {}
        number = (hydra_cfg.get("job") or {}).get("num")  # a single run's is Hydra's mark of no value, '???'
        job = Job(
            name=job_dir.name,
            directory=job_dir,
            overrides=[str(item) for item in overrides],
            row=[str(item) for item in overrides],
            sweep=((hydra_cfg.get("runtime") or {}).get("choices") or {}).get("sweep"),
            number=number if isinstance(number, int) else None,
        )
    record_path = job_dir / PIPELINE_RECORD
    record = read_json(record_path)
    if record is None:
        read_run(job, job_dir)
        return job
    with reading(record_path):
        read_pipeline(job, record)
        read_stage_runs(job, record)
    return job


def unreadable_job(name: str, directory: Path | None, error: UnreadableFile) -> Job:
    """The report's row of a job whose files could not be read: its folder and the damaged file with why."""
    head = name.partition("_")[0]
    number = int(head) if head.isdigit() else None
    return Job(name, directory, [], [], status="unreadable", error=str(error), number=number)


def failed_records(runs: Path) -> tuple[list[dict[str, Any]], list[Job]]:
    """The failed jobs' records of failed_jobs.jsonl, and a job row for each line that is not one (a truncated
    last line)."""
    path = runs / FAILED_JOBS
    records, damaged = [], []
    for number, line in enumerate(path.read_text().splitlines() if path.is_file() else [], start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            overrides = [str(item) for item in record["overrides"]]
            records.append({"job": int(record["job"]), "overrides": overrides, "error": str(record["error"])})
        except CONTENT_ERRORS as error:
            problem = UnreadableFile(path, f"line {number}: {damage(error)}")
            damaged.append(unreadable_job(f"{FAILED_JOBS} line {number}", None, problem))
    return records, damaged


# The tasks whose runs give no result a report could hold (a folder of assorted runs, `report.runs=logs`, holds
# the report's own runs too).
TASKS_WITHOUT_RESULTS = ("report", "infer", "bench", "convert")


def read_jobs(runs: Path) -> list[Job]:
    """Every job of `runs`, with a progress bar over the folders read; failed jobs (failed_jobs.jsonl) are
    marked so, those that left no folder are listed from their record, and each job (or failed_jobs.jsonl
    line) with a damaged file is listed as unreadable with that file and why. Runs of TASKS_WITHOUT_RESULTS are
    left out, in one line."""
    jobs, left_out = [], []
    console = Console(stderr=True)
    for folder in track(job_directories(runs), "reading jobs", console=console, transient=True):
        try:
            job = read_job(folder)
        except UnreadableFile as error:
            jobs.append(unreadable_job(folder.name, folder, error))
            continue
        task = override_values(job.overrides).get("task")
        if task in TASKS_WITHOUT_RESULTS:
            left_out.append(f"task={task}")
        else:
            jobs.append(job)
    if left_out:
        kinds = ", ".join(f"{left_out.count(task)} {task}" for task in sorted(set(left_out)))
        log.info("%s: %d runs of tasks that give no result left out (%s)", runs, len(left_out), kinds)
    by_number = {job.number: job for job in jobs}
    records, damaged = failed_records(runs)
    for record in records:
        job = by_number.get(record["job"])
        if job is None:
            job = Job(
                f"#{record['job']}", None, record["overrides"], record["overrides"], number=record["job"]
            )
            jobs.append(job)
        if job.status != "unreadable":
            job.status, job.error = "failed", record["error"]
    return sorted(jobs, key=lambda job: (job.number is None, job.number or 0, job.name)) + damaged


def load_table(tables_dir: Path, name: str, explicit: bool) -> dict[str, Any] | None:
    """conf/paper/<name>.yaml; a sweep without a paper table gives None, a report.table that names none an
    error listing the tables."""
    path = tables_dir / f"{name}.yaml"
    if not path.is_file():
        if not explicit:
            return None
        known = sorted(table.stem for table in tables_dir.glob("*.yaml"))
        raise FileNotFoundError(f"report.table={name}: no {path}; the paper's tables are {known}")
    table = yaml.safe_load(path.read_text())
    if not isinstance(table, dict) or not isinstance(table.get("rows"), dict):
        raise TypeError(f"{path}: expected a mapping with 'rows' (name -> overrides, published); fix it")
    return {"name": name, **table}


def override_values(overrides: Iterable[str]) -> dict[str, Any]:
    """{key or group: value} of overrides, `+`/`++` dropped, values typed as Hydra parses them (0.5 = 0.5)."""
    parsed = OverridesParser.create().parse_overrides([str(override) for override in overrides])
    return {override.key_or_group: override.value() for override in parsed}


def is_setup(key: str) -> bool:
    """Whether an override's key is one of SETUP_KEYS (or inside one)."""
    return any(key == setup or key.startswith(f"{setup}.") for setup in SETUP_KEYS)


def defining_overrides(paper_row: dict[str, Any]) -> dict[str, Any]:
    """{key: value} of the overrides that define a paper row: its overrides but the SETUP_KEYS ones."""
    values = override_values(list(paper_row["overrides"]))
    return {key: value for key, value in values.items() if not is_setup(key)}


def match_row(table: dict[str, Any], job: Job) -> dict[str, Any] | None:
    """The first row of `table` whose every override that defines it is one of the job's (its command line, a
    pipeline's row)."""
    values = override_values([*job.overrides, *job.row])
    for row in table["rows"].values():
        if all(key in values and values[key] == value for key, value in defining_overrides(row).items()):
            return row
    return None


def filled_rows(table: dict[str, Any] | None, job: Job) -> list[dict[str, Any]]:
    """The rows of `table` the job fills: the row it matches and every other row defined by the same overrides,
    which tell such rows apart by the evaluation they compare (the tile table's two rows are one model,
    evaluated with and without tiles); [] without a table or a matching row."""
    first = match_row(table, job) if table else None
    if first is None:
        return []
    return [row for row in table["rows"].values() if defining_overrides(row) == defining_overrides(first)]


def other_overrides(job: Job, paper_row: dict[str, Any]) -> list[str]:
    """The job's overrides (the last of each key) that its paper row does not have, leaving out those that set
    up a pipeline job itself (task, protocol, sweep, pipeline.*, ...): what it ran with beyond the row."""
    latest = {override_key(override): override for override in [*job.overrides, *job.row]}
    values = override_values(latest.values())
    defining = override_values(paper_row.get("overrides") or [])
    return [
        override
        for key, override in latest.items()
        if key.split(".")[0].split("/")[0] not in JOB_KEYS
        and (key not in defining or defining[key] != values[key])
    ]


def differing_overrides(jobs: list[Job]) -> dict[str, list[str]]:
    """Each job's overrides of its command line that not every job (whose overrides are known) shares."""
    known = [job for job in jobs if job.overrides]
    return {
        job.name: [override for override in job.overrides if not all(override in o.overrides for o in known)]
        for job in jobs
    }


def job_name(job: Job, differing: list[str]) -> str:
    """A job's name: its differing overrides (`differing_overrides`), else its folder."""
    return ",".join(differing) or job.name


def job_names(jobs: list[Job]) -> dict[str, str]:
    """Each job's name (`job_name`)."""
    differing = differing_overrides(jobs)
    return {job.name: job_name(job, differing[job.name]) for job in jobs}


def paper_columns(table: dict[str, Any] | None) -> list[str]:
    """The metrics the table publishes (`<set>/<metric>`), in its order."""
    rows = (table or {}).get("rows", {}).values()
    columns = (column for row in rows for column in row.get("published", {}) if column != PARAMS_KEY)
    return list(dict.fromkeys(columns))


def measured_columns(jobs: list[Job], metrics: Iterable[str]) -> list[str]:
    """Every measured `[<evaluation>:]<set>/<metric>` whose metric is one of `metrics`."""
    wanted = set(metrics)
    return sorted({column for job in jobs for column in job.results if column.rsplit("/", 1)[-1] in wanted})


def compared_value(
    job: Job, paper_row: dict[str, Any], table: dict[str, Any] | None, column: str
) -> float | None:
    """The job's value for a paper's column: of the pipeline evaluation the paper's row names (none when the
    job did not run it: rows that name theirs differ by it), else of the one the table names when the job ran
    it, else of its first evaluation; a run without evaluations' own value."""
    label = paper_row.get("evaluation")
    if label is None:
        label = (table or {}).get("evaluation")
        if label not in job.evaluations:
            label = job.evaluations[0] if job.evaluations else None
    return job.results.get(column if label is None else f"{label}:{column}")


def difference(value: float | None, published: float | None) -> float | None:
    return None if value is None or published is None or math.isnan(value) else value - published


def job_row(
    job: Job, differing: list[str], paper: dict[str, Any], table: dict[str, Any] | None, measured: list[str]
) -> dict[str, Any]:
    """The report's row of a job in one paper row (`paper`, {} for none): the paper's label (else the job's
    name: `differing`, its overrides that other jobs do not share), name, status, each paper column's value /
    published / difference, every other measured value, the overrides beyond its row (beyond its name without a
    paper row), parameter counts (millions), training seconds, error."""
    name = job_name(job, differing)
    published = paper.get("published") or {}
    row: dict[str, Any] = {"row": paper.get("label") or name, "job": name, "status": job.status}
    compared = paper_columns(table)
    for column in compared:
        value = compared_value(job, paper, table, column)
        row[column] = value
        row[f"{column} paper"] = published.get(column)
        row[f"{column} diff"] = difference(value, published.get(column))
    row.update({column: job.results.get(column) for column in measured if column not in compared})
    beyond = other_overrides(job, paper)
    row["other_overrides"] = " ".join(beyond if paper else [o for o in beyond if o not in differing])
    row["params_m"] = None if job.parameters is None else job.parameters / 1e6
    row["params_m paper"] = published.get(PARAMS_KEY)
    row["train_s"] = job.train_s
    row["error"] = job.error
    return row


def report_rows(jobs: list[Job], table: dict[str, Any] | None, metrics: Iterable[str]) -> list[dict]:
    """One dict per job and paper row it fills (job_row; a job of no row once), then one per row of the table
    no job ran, `missing`."""
    differing, compared, measured = differing_overrides(jobs), paper_columns(table), measured_columns(jobs, metrics)
    rows, matched = [], set()
    for job in jobs:
        papers = filled_rows(table, job)
        matched.update(paper["label"] for paper in papers)
        rows += [job_row(job, differing[job.name], paper, table, measured) for paper in papers or [{}]]
    for paper in (table or {}).get("rows", {}).values():
        if paper["label"] not in matched:
            published = paper.get("published") or {}
            row = dict.fromkeys(rows[0] if rows else ROW_FIELDS)
            row.update(row=paper["label"], job="", status="missing", other_overrides="")
            row.update({f"{column} paper": published.get(column) for column in compared})
            rows.append({**row, "params_m paper": published.get(PARAMS_KEY)})
    return rows


def status_counts(statuses: list[str]) -> str:
    """'2 done, 1 failed': how many of `statuses` are each, in the order the statuses first come."""
    return ", ".join(f"{statuses.count(status)} {status}" for status in dict.fromkeys(statuses))


def cell(value: float | None, published: float | None, diff: float | None) -> str:
    """`measured / published (difference)`, as much of it as is known (`-`: not measured)."""
    text = "-" if value is None else f"{value:.2f}"
    if published is not None:
        text += f" / {published:.2f}" + ("" if diff is None else f" ({diff:+.2f})")
    return text


def launched_count(runs: list[Path], jobs: list[Job]) -> int | None:
    """How many jobs were launched into `runs`: what each sweep's multirun.yaml records, one per run
    directory of another kind; None when no sweep is among them."""
    counts = [launched_jobs(path) for path in runs]
    if all(count is None for count in counts):
        return None
    found = [
        sum(job.directory is not None and job.directory.is_relative_to(path) for job in jobs) for path in runs
    ]
    return sum(found[index] if count is None else count for index, count in enumerate(counts))


def found_line(jobs: list[Job], rows: list[dict[str, Any]], launched: int | None) -> str:
    """'2 jobs of the 3 launched: 1 done, 1 failed, 1 missing' (the jobs' statuses, then the table's rows no
    job ran; without the launched count where no sweep is reported)."""
    of = "" if launched is None else f" of the {launched} launched"
    statuses = [job.status for job in jobs] + [row["status"] for row in rows if row["status"] == "missing"]
    return f"{len(jobs)} jobs{of}: {status_counts(statuses)}"


def compared_line(table: dict[str, Any]) -> str:
    """Which pipeline evaluation the paper's columns are compared with: each row's own, the table's, else the
    first."""
    default = table.get("evaluation", "first")
    own = [f"{row['label']}: {row['evaluation']}" for row in table["rows"].values() if row.get("evaluation")]
    if not own:
        return f"Compared: a pipeline's {default} evaluation."
    others = "" if len(own) == len(table["rows"]) else f"; the other rows: {default}"
    return f"Compared, of a pipeline's evaluations: {'; '.join(own)}{others}."


def markdown(title: str, table: dict[str, Any] | None, rows: list[dict[str, Any]], found: str) -> str:
    """report.md: what was compared, then one line per job, then the failed jobs' errors."""
    lines = [f"# {title}", "", found, ""]
    if table is not None:
        caption = table["caption"].strip()
        lines += [f"Paper: {table['title']} (conf/paper/{table['name']}.yaml). {caption}", ""]
        lines += [f"The paper's training: {table['training']}. {compared_line(table)}", ""]
        lines += ["Each value: measured / the paper's (measured - paper's).", ""]
    columns = [key for key in rows[0] if key not in ROW_FIELDS and not key.endswith((" paper", " diff"))]
    headers = ["row", "job", "status", *(PAPER_COLUMNS.get(c, c) for c in columns)]
    headers += ["Params (M)", "other overrides", "train h:mm:ss"]
    lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [row["row"], row["job"], row["status"]]
        cells += [cell(row[c], row.get(f"{c} paper"), row.get(f"{c} diff")) for c in columns]
        params, paper_params = row["params_m"], row["params_m paper"]
        params = cell(params, paper_params, difference(params, paper_params))
        train = "" if row["train_s"] is None else str(timedelta(seconds=round(row["train_s"])))
        lines.append("| " + " | ".join([*cells, params, row["other_overrides"], train]) + " |")
    errors = [f"- {row['row']}: {row['error'].splitlines()[0]}" for row in rows if row["error"]]
    if errors:
        lines += ["", "Errors:", "", *errors]
    return "\n".join(lines) + "\n"


def csv_text(rows: list[dict[str, Any]]) -> str:
    """report.csv: one line per job, one column per value (empty where unknown)."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["job"])
    writer.writeheader()
    writer.writerows({key: "" if value is None else value for key, value in row.items()} for row in rows)
    return text.getvalue()


def draw_curves(jobs: list[Job], labels: list[str]) -> Any:
    """The paper's training-curve figure (report.png): one panel per stage (of a pipeline) for the training
    loss and for each validation AEPE against the step, one line per job labelled `labels` (its paper row), a
    job that did not finish named in every legend with its status; None when no job logged a curve."""
    panels = sorted({panel for job in jobs for panel in job.curves})
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for axis, panel in zip(axes[0], panels, strict=True):
        for job, label in zip(jobs, labels, strict=True):
            points = sorted(job.curves.get(panel, []))
            steps, values = [step for step, _ in points], [value for _, value in points]
            if job.status not in ("done", "running"):
                axis.plot(steps, values, "x--", label=f"{label} ({job.status})")
            elif steps:
                axis.plot(steps, values, marker=".", label=label)
        axis.set(title=panel, xlabel="training step", ylabel=panel.rpartition(": ")[2].partition(",")[0])
        axis.ticklabel_format(axis="y", useOffset=False)  # values near 6.15 read as such, not 1e-6 + 6.1517
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.legend(fontsize="small")
    figure.tight_layout()
    return figure


def curve_labels(jobs: list[Job], table: dict[str, Any] | None) -> list[str]:
    """Each job's line label in the figure: the labels of the rows it fills (one model: 'w/ tile / w/o tile'),
    else its name; with the job's name when jobs share the label."""
    names = job_names(jobs)
    labels = [" / ".join(row["label"] for row in filled_rows(table, job)) or names[job.name] for job in jobs]
    return [
        label if labels.count(label) == 1 else f"{label} [{names[job.name]}]"
        for label, job in zip(labels, jobs, strict=True)
    ]


def write_figure(path: Path, figure: Any) -> None:
    """`figure` as a PNG at `path`, then closed."""
    from matplotlib import pyplot as plt

    with atomic_write(path) as file:
        figure.savefig(file, format="png", dpi=100)
    plt.close(figure)


def log_to_wandb(cfg: DictConfig, group: str, rows: list[dict[str, Any]], figure: Path | None) -> Any:
    """With logger=wandb (or many): the report as a wandb Table (and the figure) in a run of job type report,
    in `group`; returns the finished wandb run (None without a wandb logger)."""
    loggers = (cfg.get("logger") or {}).values()
    settings = next((entry for entry in loggers if entry and "Wandb" in str(entry.get("_target_"))), None)
    if settings is None or not rows:
        return None
    import wandb

    run = wandb.init(
        project=settings.project,
        entity=settings.entity,
        group=group,
        job_type="report",
        tags=list(settings.tags or []),
        dir=str(settings.save_dir),
        mode="offline" if settings.offline else None,
    )
    table = wandb.Table(columns=list(rows[0]), data=[list(row.values()) for row in rows])
    payload: dict[str, Any] = {"report": table}
    if figure is not None:
        payload["validation_epe"] = wandb.Image(str(figure))
    run.log(payload)
    run.finish()
    return run


def run(cfg: DictConfig) -> None:
    settings = cfg.report
    if not settings.get("runs"):
        raise ValueError(
            "report.runs is not set: give a multirun's directory (logs/<task>/<name>/multiruns/<time>) or a "
            "run's"
        )
    runs = [Path(path) for path in (settings.runs if OmegaConf.is_list(settings.runs) else [settings.runs])]
    for path in runs:
        if not path.is_dir():
            raise FileNotFoundError(f"report.runs: {path} is not a directory: give a multirun's or a run's")
    output_dir = ensure_writable_dir(settings.output_dir or runs[0], "report.output_dir")
    jobs = [job for path in runs for job in read_jobs(path)]
    if not jobs:
        raise ValueError(
            f"report.runs={settings.runs} holds no job: expected a multirun's <n>_<overrides>/ folders or a run's "
            "directory, each with its .hydra/ folder"
        )
    name = settings.get("table") or next((job.sweep for job in jobs if job.sweep), None)
    explicit = bool(settings.get("table"))
    table = load_table(Path(settings.tables_dir or PAPER_TABLES_DIR), name, explicit) if name else None
    rows = report_rows(jobs, table, settings.metrics)
    found = found_line(jobs, rows, launched_count(runs, jobs))
    title = f"Report of {', '.join(map(str, runs))}"
    atomic_write_text(output_dir / "report.md", markdown(title, table, rows, found))
    atomic_write_text(output_dir / "report.csv", csv_text(rows))
    figure, curves = output_dir / "report.png", draw_curves(jobs, curve_labels(jobs, table))
    if curves is None:
        log.warning("no job logged a training curve: no report.png")
        figure = None
    else:
        write_figure(figure, curves)
    print(f"report: {found} -> {output_dir}/report.md, .csv and .png")
    log_to_wandb(cfg, table["name"] if table else str(cfg.name), rows, figure)
    unreadable = [job.error for job in jobs if job.status == "unreadable"]
    if unreadable:
        raise ValueError(
            f"{len(unreadable)} of the jobs could not be read ({unreadable[0]}{', ...' if len(unreadable) > 1 else ''}"
            f"): each is listed with its file and why in {output_dir}/report.md; the report holds the others"
        )
