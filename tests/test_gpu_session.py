"""tools/gpu_session.py, the one command a session lent a GPU runs (docs/performance.md, "GPU figures"): its
--dry-run on this CPU, from a fresh checkout, runs the same steps at tiny sizes and writes the files the GPU run
sends back; a step past its time limit is stopped with the processes it started, and the steps past the budget are
not run."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.configs import REPO_DIR
from helpers.run import fresh_checkout


def gpu_session(checkout, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tools/gpu_session.py", *arguments], cwd=checkout, capture_output=True, text=True,
        timeout=900, check=False,
    )


@pytest.mark.slow
def test_a_dry_run_measures_a_gpu_row_at_tiny_size_and_writes_the_files_a_gpu_session_sends_back(tmp_path):
    checkout = fresh_checkout(tmp_path / "checkout")
    out = tmp_path / "out"
    result = gpu_session(checkout, "--dry-run", "--steps", "train_bf16", "data_wait", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(path.name for path in out.iterdir()) == [
        "bench.json", "bench.md", "data_wait.log", "session.log", "summary.md"
    ]
    summary = (out / "summary.md").read_text()
    assert "| train_bf16 | ok |" in summary and "| data_wait | ok |" in summary
    assert "over 2 steps (time/data_wait_s)" in summary  # the training run's data wait, 3 steps less the first
    (step,) = json.loads((out / "bench.json").read_text())
    (row,) = step["record"]["rows"]
    assert (row["name"], row["status"], row["height"], row["width"]) == ("train_b8_368x496_bf16", "ok", 64, 96)
    assert row["precision"] == "bf16-mixed" and row["device"] == "cpu" and row["mean_s"] > 0
    assert "| train_b8_368x496_bf16 | 64x96 |" in (out / "bench.md").read_text()
    assert result.stdout.endswith(f"{summary}\n{(out / 'bench.md').read_text()}\nwrote {out}\n")  # the reply's tail


def load_gpu_session():
    """tools/gpu_session.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_session", REPO_DIR / "tools" / "gpu_session.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# a step that would run for two minutes, and a process it starts, which writes its pid to argv[1]
SLOW_STEP = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                  "time.sleep(120)", sys.argv[1]])
time.sleep(120)
"""


def test_a_step_past_its_limit_is_stopped_with_every_process_it_started(tmp_path):
    gpu_session_module = load_gpu_session()
    pid_file, log = tmp_path / "grandchild.pid", tmp_path / "session.log"
    step = gpu_session_module.Step("slow", 5, ["-c", SLOW_STEP, str(pid_file)])
    status, seconds = gpu_session_module.run_step(step, step.argv, 5, log, dict(os.environ))
    assert status == "stopped after 5 s" and 5 <= seconds < 60
    assert log.read_text().startswith("\n===== slow: -c")
    status_file = Path(f"/proc/{pid_file.read_text()}/status")
    for _ in range(50):  # the killed process's parent, now init, reaps it
        if not status_file.exists() or "State:\tZ" in status_file.read_text():
            break
        time.sleep(0.1)
    assert not status_file.exists() or "State:\tZ" in status_file.read_text()


def test_the_steps_past_the_budget_are_not_run(tmp_path):
    """A budget under MIN_STEP_S (3 s) starts no step; each is recorded as not run, in bench.md too."""
    out = tmp_path / "out"
    result = gpu_session(fresh_checkout(tmp_path / "checkout"), "--dry-run", "--steps", "mcva_bf16", "other_rows",
                         "--budget-s", "1", "--out", str(out))
    assert result.returncode == 1
    summary = (out / "summary.md").read_text()
    assert "| mcva_bf16 | not run: session budget spent |" in summary
    assert "| other_rows | not run: session budget spent |" in summary
    assert "## mcva_bf16: not run: session budget spent, 0 s\n\nno table" in (out / "bench.md").read_text()


def test_an_unknown_step_is_refused_in_one_line(tmp_path):
    result = gpu_session(fresh_checkout(tmp_path), "--steps", "train")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        (
            "--steps: train unknown; expected some of attention_kernels, compile_inference, compile_inference_decoder, "
            "compile_train, data_wait, inference_tf32_bf16, mcva_bf16, other_rows, probe, pytest_gpu, train_bf16"
        )
    ]
