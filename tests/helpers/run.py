"""`python run.py <overrides>` in a subprocess, as a user types it: the helper the end-to-end tests share."""

import os
import subprocess
import sys

from helpers.configs import REPO_DIR


def run_py(
    *overrides: str, env: dict | None = None, expect_ok: bool = True, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """Runs from the repository root with wandb offline; fails with the output's tail unless expect_ok=False."""
    environment = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    environment.pop("FLOWFORMER_TRACEBACK", None)
    environment.update(env or {})
    result = subprocess.run(
        [sys.executable, "run.py", *overrides],
        cwd=REPO_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if expect_ok and result.returncode != 0:
        raise AssertionError(f"run.py {' '.join(overrides)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result
