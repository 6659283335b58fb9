"""task=bench bench=data as a user runs it: the sintel mix's training loader on dataset trees in the real formats
(Sintel png/flo, KITTI and HD1K 16-bit png, FlyingThings3D png/pfm), its pairs per second, one worker's, and the
workers the step's 42 pairs per second take."""

import json
import math

from helpers.run import fresh_checkout, run_py
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
