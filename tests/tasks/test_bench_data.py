"""task=bench bench=data as a user runs it: the sintel mix's training loader on dataset trees in the real formats
(Sintel png/flo, KITTI and HD1K 16-bit png, FlyingThings3D png/pfm), its pairs per second, one worker's, and the
workers the step's 42 pairs per second take; Ctrl-C ends it at once with one line."""

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest

from helpers.run import fresh_checkout, run_py, start_run_py
from helpers.trees import hd1k_tree, kitti_tree, sintel_tree, things_tree


def test_bench_data_measures_the_sintel_mix_loader(tmp_path):
    data_dir = tmp_path / "datasets"
    sintel_tree(data_dir / "Sintel")
    kitti_tree(data_dir / "KITTI")
    hd1k_tree(data_dir / "HD1k")
    things_tree(data_dir / "FlyingThings3D")
    checkout = fresh_checkout(tmp_path / "checkout")
    result = run_py(
        "task=bench", "bench=data", "data=sintel_mix", f"paths.data_dir={data_dir}", "bench.repeats=3",
        "bench.warmup=0", "data.train.parts.0.dataset.augmentor.crop_size=[16,24]", cwd=checkout, timeout=120,
    )
    (run_dir,) = (checkout / "logs/bench/default/runs").iterdir()
    (row,) = json.loads((run_dir / "bench.json").read_text())["rows"]
    # batches of 6 draw from every part of the mix: their items' meta keys differ (Sintel's pass, HD1K's sequence)
    assert row["dataset"] == "100 x MpiSintel (6) + 200 x KITTI (2) + 5 x HD1K (2) + 1 x FlyingThings3D (8) = 1018 items"
    assert row["batch_size"] == 6 and row["pairs_per_s"] > 0 and row["startup_s"] > 0
    assert row["one_worker_pairs_per_s"] > 0 and row["one_worker_pairs_per_cpu_s"] > 0  # OpenCV may use threads
    assert row["workers_for_target"] == math.ceil(42 / row["one_worker_pairs_per_cpu_s"])
    table = (run_dir / "bench.md").read_text()
    assert f"| {row['pairs_per_s']:.1f} | {row['one_worker_pairs_per_s']:.2f} |" in table
    assert table in result.stdout


def test_ctrl_c_while_bench_data_reads_through_its_loader_ends_it_and_its_workers_with_one_line(tmp_path):
    """`python run.py task=bench bench=data data=synthetic`, Ctrl-C (SIGINT to its process group, as a terminal
    sends it) once its loader's 2 workers read: status 130, one line, no traceback (from the run or its workers),
    nothing written, the workers ended. Before, the run and its workers each printed a KeyboardInterrupt
    traceback (status 1)."""
    run_dir = tmp_path / "run"
    process = start_run_py(
        "task=bench", "bench=data", "data=synthetic", "data.num_workers=2", "bench.repeats=2", "bench.warmup=100000",
        f"hydra.run.dir={run_dir}", new_session=True,
    )
    deadline = time.monotonic() + 120
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    while len(workers := children.read_text().split()) < 2:  # the one-worker rate is measured, the loader reads
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the loader did not start its workers: {process.communicate()[1][-3000:]}")
        time.sleep(0.1)
    time.sleep(1)
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stdout + stderr, stderr[-3000:]
    lines = [line for line in (stdout + stderr).splitlines() if "stopped by" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "task=bench bench=data stopped by SIGINT before its row was measured: nothing was written"
    )
    assert not (run_dir / "bench.json").exists() and not (run_dir / "bench.md").exists()
    deadline = time.monotonic() + 10
    while alive := [pid for pid in workers if Path(f"/proc/{pid}").exists()]:
        assert time.monotonic() < deadline, f"workers {alive} outlived the run"
        time.sleep(0.1)
