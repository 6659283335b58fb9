"""`python run.py <overrides>` in a subprocess, as a user types it: the helper the end-to-end tests share, and
the fresh checkout a new user types it in; the same command run in this process, where a subprocess per
command costs too much."""

import logging
import os
import runpy
import shutil
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
