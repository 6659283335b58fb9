"""One directory per run, never shared by accident.

``${fresh_dir:<parent>}`` (used by ``conf/hydra/default.yaml``) names a run or sweep directory after the start
time and claims it with an atomic ``mkdir``: two runs started in the same second (parallel sweeps, several users,
SLURM arrays) get ``<time>`` and ``<time>_2``. Under a multi-process launcher every process of one job must
share the directory, so it is named after the job instead: ``slurm-<job>.<step>`` under ``srun`` with several
tasks, ``torchrun-<rdzv id>`` under torchrun with an ``--rdzv-id``. ``${job_folder:<n>,<overrides>}`` names a
multirun job's folder: one plain folder name of at most JOB_FOLDER_MAX bytes, whatever its overrides hold.

:class:`RunDirGuard` (a Hydra callback) checks the directory before Hydra writes into it: it must be creatable
and writable, and a fresh run (not a process joining its job's directory) must find it empty and claims it
(:func:`claim_dir`: a ``.run_claim`` file created exclusively, so of two runs given the same directory at the
same time exactly one gets it); training claims its checkpoint directories the same way.
:func:`ensure_writable_dir` is the writability check for every output location (the run and checkpoint
directories, task=eval's, task=infer's and task=convert's outputs); :func:`refuse_existing` keeps their
earlier files unless the task's ``overwrite`` setting is true. :func:`remove_if_unused` deletes the directory
of a run that failed before producing anything, and when the process ends, :func:`release_unused_claims`
gives back the directories it claimed but wrote nothing into.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import hashlib
import logging
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from flowformer.models.output_files import check_room, file_in_the_way
from flowformer.overrides import override_key

RESOLVER = "fresh_dir"
LAUNCH_DIR_RESOLVER = "launch_dir"
JOB_FOLDER_RESOLVER = "job_folder"
_claimed: dict[str, str] = {}


def launcher_job_name() -> str | None:
    """The name every process of a multi-process launcher job shares, or None outside one."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ['SLURM_STEP_ID']}"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return f"torchrun-{run_id}"
    return None


def joins_existing_run() -> bool:
    """True in a process that writes into a directory its job already made: a launcher job, or a DDP worker
    Lightning started (it passes the parent's hydra.run.dir and sets LOCAL_RANK)."""
    return launcher_job_name() is not None or os.environ.get("LOCAL_RANK", "0") != "0"


def fresh_dir(parent: str) -> str:
    """``<parent>/<start time>[_n]``, created empty by this process (or the launcher job's shared name)."""
    if parent in _claimed:
        return _claimed[parent]
    job = launcher_job_name()
    if job is not None:
        _claimed[parent] = str(Path(parent) / job)
        return _claimed[parent]
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    for attempt in range(1, 1000):
        candidate = Path(parent) / (stamp if attempt == 1 else f"{stamp}_{attempt}")
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            candidate.mkdir()
        except FileExistsError:
            continue
        except OSError:
            break  # not creatable: RunDirGuard reports it with the reason
        _claimed[parent] = str(candidate)
        return _claimed[parent]
    return str(Path(parent) / stamp)


# The file that marks a directory as one run's (claim_dir); it names that run's host, process and directory.
CLAIM_FILE = ".run_claim"
# What a run writes before it does any work: Hydra's records, logs, the run record, logger metadata.
BOOKKEEPING = (".hydra", "config_resolved.yaml", "run_info.json", "hparams.yaml", CLAIM_FILE)
_claim_files: list[Path] = []
# paths.log_dir of each multirun directory this process claimed: the folders above an unused one that
# `release_unused_claims` leaves empty there go too.
_sweep_log_dirs: dict[Path, Path] = {}


def remove_if_unused(run_dir: Path, log_dir: Path | None = None) -> bool:
    """Delete a run directory that holds only bookkeeping (a run that failed before it started, or in its
    first step: a metrics.csv of learning rates only), and the folders above it inside `log_dir`
    (paths.log_dir) it leaves empty; True if deleted. Anything else in it (a checkpoint, metrics, flow files)
    keeps the whole directory."""
    if not run_dir.is_dir():
        return False
    for path in run_dir.rglob("*"):
        relative = path.relative_to(run_dir)
        bookkeeping = relative.parts[0] in BOOKKEEPING or path.name in BOOKKEEPING or path.suffix == ".log"
        if path.is_file() and not bookkeeping and not learning_rates_only(path):
            return False
    shutil.rmtree(run_dir, ignore_errors=True)
    if log_dir is not None:
        remove_empty_parents(run_dir, log_dir)
    return True


def learning_rates_only(path: Path) -> bool:
    """Whether `path` is a metrics.csv whose only values are learning rates (`lr-*` columns), which Lightning's
    LearningRateMonitor logs as a step starts, before anything is computed."""
    if path.name != "metrics.csv":
        return False
    with path.open(newline="") as file:
        header = next(csv.reader(file), [])
    return all(column.startswith("lr-") or column in ("step", "epoch") for column in header)


def remove_empty_parents(path: Path, root: Path) -> None:
    """rmdir the folders above `path` up to (not including) `root` while they are empty."""
    root = root.resolve()
    for parent in path.resolve().parents:
        if not parent.is_relative_to(root) or parent == root:
            return
        try:
            parent.rmdir()
        except OSError:  # not empty (another run's), or not ours to remove
            return


# The settings that each name one folder of the run directory, <paths.log_dir>/<task>/<name>/ (conf/hydra/).
FOLDER_SETTINGS = ("task", "name")


def check_folder_names(config: DictConfig) -> None:
    """Exit with one line unless `task` and `name` are plain folder names: a `/` or `..` would put the run
    outside paths.log_dir, and a name over NAME_MAX bytes cannot be created."""
    for setting in FOLDER_SETTINGS:
        value = str(config.get(setting))
        if value in ("", ".", "..") or "/" in value or os.sep in value or len(value.encode()) > NAME_MAX:
            print(
                f"error: {setting}={value[:60]!r}{'...' if len(value) > 60 else ''} names a folder of the run "
                f"directory under paths.log_dir: give one plain folder name (no '/', not '..', at most {NAME_MAX} "
                f"bytes; this one has {len(value.encode())})",
                file=sys.stderr,
            )
            raise SystemExit(1)


def launch_dir() -> str:
    """The directory run.py was started from (paths.root_dir): Hydra's runtime.cwd inside a job, and the
    current directory before any job exists, where a multirun resolves hydra.sweep.dir (Hydra sets its
    HydraConfig per job, so ``${hydra:runtime.cwd}`` cannot resolve there; hydra.job.chdir is false)."""
    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.cwd)
    return os.getcwd()


# The longest file name most file systems take (ext4, XFS, Btrfs: NAME_MAX, in bytes), and the longest multirun
# job folder name this code makes (well inside it, also inside eCryptfs's 143).
NAME_MAX = 255
JOB_FOLDER_MAX = 128
SHORT_VALUE = 12  # in a shortened job folder name, the characters kept of each longer override value


def job_folder(number: int, override_dirname: str) -> str:
    """A multirun job's folder name, ``<n>_<overrides>``: one plain folder whatever the overrides hold (each
    ``/`` written ``%2F``), and at most JOB_FOLDER_MAX bytes. Longer, each value is cut to SHORT_VALUE
    characters + ``~`` (the keys stay), the whole to the limit, and a hash of the overrides appended so that
    jobs stay apart; the job's overrides in full are its .hydra/overrides.yaml."""
    name = f"{number}_{override_dirname.replace('/', '%2F')}"
    if len(name.encode()) <= JOB_FOLDER_MAX:
        return name
    digest = hashlib.sha1(override_dirname.encode()).hexdigest()[:10]
    pieces = [piece.partition("=") for piece in name.split(",")]
    short = ",".join(
        key + sep + (value[:SHORT_VALUE] + "~" if len(value) > SHORT_VALUE else value) for key, sep, value in pieces
    )
    head = short.encode()[: JOB_FOLDER_MAX - len(digest) - 1].decode(errors="ignore")
    return f"{head}-{digest}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, fresh_dir, use_cache=True)
    if not OmegaConf.has_resolver(LAUNCH_DIR_RESOLVER):
        OmegaConf.register_new_resolver(LAUNCH_DIR_RESOLVER, launch_dir)
    if not OmegaConf.has_resolver(JOB_FOLDER_RESOLVER):
        OmegaConf.register_new_resolver(JOB_FOLDER_RESOLVER, job_folder)


class OutputPathError(ValueError):
    """An output location (run directory, checkpoint directory, inference output) cannot be written."""


# What the write probe writes: room for Hydra's records, run.log's first lines and the run record, which a run
# writes before its own files (a full disk is refused here rather than in the middle of Hydra's writes).
PROBE_BYTES = 1 << 20


def ensure_writable_dir(path: str | Path, what: str) -> Path:
    """Create `path` and prove it writable (a probe file of PROBE_BYTES), before any work is done; else one
    clear error."""
    path = Path(path)
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise OutputPathError(f"cannot create {what} {path}: {blocker} is a file; choose another location")
    try:
        path.mkdir(parents=True, exist_ok=True)
        check_room(path, PROBE_BYTES)
    except OSError as err:
        raise OutputPathError(
            f"cannot write {what} {path}: {err.strerror or err}; choose another location"
        ) from None
    return path


def run_owner(run_dir: str | Path) -> str:
    """What a claim file says: this host and process, and the run directory it writes."""
    return f"host {socket.gethostname()} pid {os.getpid()} run {os.path.abspath(run_dir)}"


def claim_dir(path: str | Path, setting: str, owner: str) -> None:
    """Make the existing directory `path` the run `owner`'s: it must hold nothing (or be `owner`'s already);
    the claim file is created with O_EXCL, so of two runs that both found it empty exactly one gets it. Else
    an OutputPathError naming `setting`."""
    claim = Path(path) / CLAIM_FILE
    if claim.is_file() and claim.read_text() == owner:
        return
    if entries := sorted(p.name for p in Path(path).iterdir()):
        raise OutputPathError(
            f"{setting} {path} is not empty ({', '.join(entries[:5])}{', ...' if len(entries) > 5 else ''}): a "
            "new run never writes into another run's directory. Choose another one, or leave it unset for a "
            "fresh one; to continue that run, pass ckpt_path=<that run's last.ckpt>"
        )
    try:
        with open(claim, "x") as file:
            file.write(owner)
    except FileExistsError:
        raise OutputPathError(
            f"{setting} {path} was just claimed by another run started at the same time; choose another one"
        ) from None
    if not _claim_files:
        atexit.register(release_unused_claims)
    _claim_files.append(claim)


def release_unused_claims() -> None:
    """Remove this process's claim files from directories that hold nothing else (its run wrote nothing
    there), so the directory can be given again; and a multirun's directory that holds nothing but Hydra's
    record of the sweep (`multirun.yaml`): its first job was refused before it started (Hydra could not apply
    its overrides, `sweep=mask_ratio` on a config without model.mask_ratio), so the sweep ran nothing."""
    while _claim_files:
        claim = _claim_files.pop()
        if not claim.is_file():
            continue
        held = sorted(p.name for p in claim.parent.iterdir())
        if held == [CLAIM_FILE]:
            claim.unlink()
        elif held == sorted([CLAIM_FILE, "multirun.yaml"]):
            shutil.rmtree(claim.parent, ignore_errors=True)
            if claim.parent in _sweep_log_dirs:
                remove_empty_parents(claim.parent, _sweep_log_dirs[claim.parent])


def refuse_existing(outputs: Iterable[Path], setting: str, overwrite_setting: str, overwrite: bool) -> None:
    """An OutputPathError naming the `outputs` that exist already (an earlier run's results), unless
    `overwrite`."""
    existing = [path for path in outputs if path.exists()]
    if existing and not overwrite:
        what = f"{existing[0]} exists already"
        if len(existing) > 1:
            what = f"{len(existing)} of its files exist already ({existing[0]}, ...)"
        raise OutputPathError(
            f"{setting}: {what}; choose another {setting}, or pass {overwrite_setting}=true to replace "
            f"{'them' if len(existing) > 1 else 'it'}"
        )


# `${paths.log_dir}` inside a config string: a reference to another setting (a resolver's `${now:...}` has a colon).
SETTING_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")


def check_dir_references(config: DictConfig, setting: str) -> None:
    """Exit with one line when the run or sweep directory `setting` is built from a setting that is null (its
    folder would be named "None") or absent (a command's `~paths.log_dir`: a traceback from inside Hydra), following
    the references of the settings it names (paths.log_dir is built from paths.root_dir)."""
    raw = OmegaConf.to_container(config, resolve=False)
    deleted = {override_key(o) for o in config.hydra.overrides.task if o.startswith("~")}
    pending, seen = [setting], set()
    while pending:
        key = pending.pop()
        value: Any = raw
        for part in key.split("."):
            value = value.get(part, KeyError) if isinstance(value, dict) else KeyError
        problem = None
        if value is KeyError:
            problem = f"which the command deletes (~{key})" if key in deleted else "which is not a setting"
        elif value is None:
            problem = "which is null"
        if problem is not None:
            print(f"error: {setting} is built from {key}, {problem}; give {key} a value", file=sys.stderr)
            raise SystemExit(1)
        for reference in SETTING_REFERENCE.findall(str(value)):
            if reference not in seen:
                seen.add(reference)
                pending.append(reference)


def check_output_dir(path: str | Path, setting: str, *, claim: bool) -> None:
    """Exit with one line unless `path` can be created and written (and, when `claim`, be claimed by this
    run)."""
    try:
        ensure_writable_dir(path, setting)
        if claim:
            claim_dir(path, setting, run_owner(path))
    except OutputPathError as err:
        print(f"error: {err}", file=sys.stderr)
        if str(path) in _claimed.values():  # made empty by fresh_dir for this run: leave nothing behind
            with contextlib.suppress(OSError):  # not empty: kept
                Path(path).rmdir()
        raise SystemExit(1) from None


class RunDirGuard(Callback):
    """Checks and claims the run / sweep directory before Hydra writes its files there."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_folder_names(config)
        check_dir_references(config, "hydra.run.dir")
        check_output_dir(config.hydra.run.dir, "hydra.run.dir", claim=not joins_existing_run())

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_folder_names(config)
        check_dir_references(config, "hydra.sweep.dir")
        check_output_dir(config.hydra.sweep.dir, "hydra.sweep.dir", claim=not joins_existing_run())
        _sweep_log_dirs[Path(config.hydra.sweep.dir)] = Path(config.paths.log_dir)


class RunLogHandler(logging.FileHandler):
    """run.log's handler (conf/hydra/default.yaml): when a line cannot be written (disk full), one warning on
    stderr instead of logging's traceback for every line; the console still gets every line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.write_failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
        elif not self.write_failed:
            self.write_failed = True
            print(
                f"warning: cannot write {self.baseFilename} ({error.strerror or error}); from here on the log "
                "lines go to the console only",
                file=sys.stderr,
            )
