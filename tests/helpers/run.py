"""`python run.py <overrides>` in a subprocess, as a user types it: the helper the end-to-end tests share, and
the fresh checkout a new user types it in; the same command run in this process, where a subprocess per
command costs too much; and a SLURM job step on this machine (srun's tasks and a stub `scontrol`)."""

import json
import logging
import os
import runpy
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from helpers.configs import REPO_DIR

# What a user's clone holds that the tests leave out of a fresh checkout: the tests and the documentation.
NOT_CHECKED_OUT = ("tests", "docs")


def fresh_checkout(destination: Path) -> Path:
    """`destination` holding the repository's tracked files (as a clone has them, without tests/ and docs/):
    no logs/, no earlier run, nothing the tests set up. `python run.py ...` run there runs the checkout's own
    run.py, conf/ and flowformer/."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_DIR, capture_output=True, check=True, text=True)
    for name in tracked.stdout.split("\0"):
        if name and name.split("/")[0] not in NOT_CHECKED_OUT and (REPO_DIR / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_DIR / name, destination / name)
    return destination


def free_port() -> int:
    """A TCP port free on this machine now, for a job's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def srun_task(rank: int, port: int) -> dict[str, str]:
    """The environment `srun --ntasks=2` (one node, job 4242, step 0) gives task `rank`, as far as Lightning's
    SLURMEnvironment and this code read it; MASTER_ADDR/MASTER_PORT as an sbatch script exports them."""
    return {
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0",
        "SLURM_JOB_NAME": "table", "SLURM_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }


# srun's part in a job step on one node, in a process of its own: it starts each task's command with the task's
# variables added (argv[1]: their list, as JSON; the command follows), waits for them all, and prints their
# exit statuses last. Like slurmstepd, it is not stopped by the signals meant for its tasks.
SRUN = """
import json, os, signal, subprocess, sys
for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(signum, lambda *_: None)
tasks = [subprocess.Popen(sys.argv[2:], env={**os.environ, **task}) for task in json.loads(sys.argv[1])]
print("srun: task exit statuses", json.dumps([task.wait() for task in tasks]), flush=True)
"""


def start_job_step(*overrides: str, tasks: list[dict[str, str]], env: dict, cwd: Path = REPO_DIR) -> subprocess.Popen:
    """`srun python run.py <overrides>` as srun starts it on one machine: one process per task (`tasks`: the
    variables each gets, as :func:`srun_task` gives them), all in one process group of a session of their
    own, which a signal to the group (SLURM's, to every task) reaches alone; stdout and stderr of all the tasks
    in one text stream, their exit statuses on its last line (`srun: task exit statuses [...]`)."""
    return subprocess.Popen(
        [sys.executable, "-c", SRUN, json.dumps(tasks), sys.executable, "run.py", *overrides],
        cwd=cwd,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_job_step(
    *overrides: str, port: int, env: dict, restarts: int = 0, cwd: Path = REPO_DIR, timeout: float = 600
) -> str:
    """:func:`start_job_step` of srun's 2 tasks (:func:`srun_task`) in a job SLURM started `restarts` times
    before (SLURM_RESTART_COUNT), run to its end: the tasks' output. A job step still running after `timeout`
    seconds (hung) is killed, and the test fails with its output's tail."""
    tasks = [{**srun_task(rank, port), "SLURM_RESTART_COUNT": str(restarts)} for rank in (0, 1)]
    job = start_job_step(*overrides, tasks=tasks, env=env, cwd=cwd)
    try:
        return job.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise AssertionError(f"the job step hung: {job.communicate()[0][-3000:]}") from None


def stub_scontrol(folder: Path, runs: Path) -> Path:
    """An `scontrol` that records its arguments and the last.ckpt files under `runs` when it ran, then, as
    SLURM's requeue does, sends SIGTERM to every process of the job (its process group: start the job in a
    session of its own)."""
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {folder / "calls"}\nfind {runs} -name last.ckpt >> {folder / "calls"}\n'
        "trap '' TERM\nkill -TERM 0\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def start_run_py(
    *overrides: str, env: dict | None = None, new_session: bool = False, cwd: Path = REPO_DIR
) -> subprocess.Popen:
    """Starts `python run.py <overrides>` in `cwd` (the repository root by default) with wandb offline, without
    waiting; stdout and stderr are captured as text. `new_session`: in a process group of its own, which a
    signal to the group reaches alone."""
    environment = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    environment.pop("FLOWFORMER_TRACEBACK", None)
    environment.update(env or {})
    return subprocess.Popen(
        [sys.executable, "run.py", *overrides],
        cwd=cwd,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


def run_py(
    *overrides: str,
    env: dict | None = None,
    expect_ok: bool = True,
    timeout: float | None = None,
    new_session: bool = False,
    cwd: Path = REPO_DIR,
) -> subprocess.CompletedProcess:
    """Runs it to the end (`start_run_py`); fails with the output's tail unless expect_ok=False."""
    process = start_run_py(*overrides, env=env, new_session=new_session, cwd=cwd)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if expect_ok and result.returncode != 0:
        raise AssertionError(f"run.py {' '.join(overrides)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def run_py_in_this_process(*overrides: str, cwd: Path) -> int:
    """`python run.py <overrides>` started in `cwd`, run in this process as `python` runs a script (runpy, as
    __main__: the same run.py, Hydra and tasks, without a new interpreter's start-up); returns its exit status.
    The working directory, sys.argv, Hydra's job config and the root logger's handlers are put back after."""
    root = logging.getLogger()
    handlers, level, argv, started_in = root.handlers[:], root.level, sys.argv, Path.cwd()
    sys.argv = [str(REPO_DIR / "run.py"), *overrides]
    os.chdir(cwd)
    try:
        runpy.run_path(str(REPO_DIR / "run.py"), run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = argv
        os.chdir(started_in)
        HydraConfig.instance().cfg = None
        root.handlers[:] = handlers
        root.setLevel(level)
    return 0
