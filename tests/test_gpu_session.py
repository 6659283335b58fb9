"""tools/gpu_session.py, the one command a session lent a GPU runs (docs/performance.md, "GPU figures"): its
--dry-run on this CPU, from a fresh checkout, runs the same steps at tiny sizes and writes the files the GPU run
sends back; a step past its time limit is stopped with its processes, and the steps past the budget are not run."""

import json
import re
import subprocess
import sys

import pytest

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


def test_a_step_past_its_limit_is_stopped_and_the_steps_past_the_budget_do_not_run(tmp_path):
    """A budget of 5 s: the MCVA step (two Python processes, 18 s on 2 cores of an Intel Xeon) starts with what
    the session's own start left of it (at least MIN_STEP_S, 3 s) and is stopped then; the next is not run."""
    checkout = fresh_checkout(tmp_path / "checkout")
    out = tmp_path / "out"
    result = gpu_session(checkout, "--dry-run", "--steps", "mcva_bf16", "other_rows", "--budget-s", "5",
                         "--out", str(out))
    assert result.returncode == 1
    summary = (out / "summary.md").read_text()
    stopped = re.search(r"\| mcva_bf16 \| stopped after (\d+) s \|", summary)
    assert stopped and 3 <= int(stopped.group(1)) <= 5, summary
    assert "| other_rows | not run: session budget spent |" in summary
    assert f"## mcva_bf16: stopped after {stopped.group(1)} s" in (out / "bench.md").read_text()
    assert "===== mcva_bf16: run.py task=bench bench=gpu" in (out / "session.log").read_text()


def test_an_unknown_step_is_refused_in_one_line(tmp_path):
    result = gpu_session(fresh_checkout(tmp_path), "--steps", "train")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        (
            "--steps: train unknown; expected some of attention_kernels, compile_inference, compile_train, data_wait, "
            "inference_tf32_bf16, mcva_bf16, other_rows, probe, pytest_gpu, train_bf16"
        )
    ]
