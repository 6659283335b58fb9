"""`python run.py <overrides>` in a subprocess, as a user types it: the helper the end-to-end tests share."""

import os
import subprocess
import sys

from helpers.configs import REPO_DIR


def start_run_py(*overrides: str, env: dict | None = None, new_session: bool = False) -> subprocess.Popen:
    """Starts it from the repository root with wandb offline, without waiting; stdout and stderr are captured as
    text. `new_session`: in a process group of its own, which a signal to the group reaches alone."""
    environment = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    environment.pop("FLOWFORMER_TRACEBACK", None)
    environment.update(env or {})
    return subprocess.Popen(
        [sys.executable, "run.py", *overrides],
        cwd=REPO_DIR,
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
) -> subprocess.CompletedProcess:
    """Runs it to the end (`start_run_py`); fails with the output's tail unless expect_ok=False."""
    process = start_run_py(*overrides, env=env, new_session=new_session)
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
