"""`make bench-gpu` (python run.py task=bench bench=gpu): the rows of the GPU figures in docs/performance.md,
each a named set of overrides in conf/bench/gpu.yaml measured in its own process. The GPU run itself needs a
GPU; here the preset composes into exactly those rows, and the same machinery runs a preset of tiny rows on the
CPU from a fresh checkout, writing bench.json and bench.md with each row's operator counts."""

import json
from pathlib import Path

from hydra import compose, initialize_config_dir

from flowformer.tasks import bench

from helpers.configs import CONF_DIR, REPO_DIR
from helpers.run import fresh_checkout, run_py

# name: (mode, backbone variant, batch, size, decoder iterations, precision, matmul precision, memory budgets,
# recomputed stages) of each row of the GPU table (issue 35); "auto": the backbone's memory_budget_gb, chosen for
# the GPU when the rows run (dense in training, half of the free memory in a forward row)
GPU_ROWS = {
    "inference_440x1024_tf32": ("forward", "flowformer", 1, [440, 1024], 32, "32-true", "high", ["auto"], ["auto"]),
    "inference_440x1024_bf16": ("forward", "flowformer", 1, [440, 1024], 32, "bf16-mixed", "high", ["auto"], ["auto"]),
    "inference_440x1024_fp32": ("forward", "flowformer", 1, [440, 1024], 32, "32-true", "highest", ["auto"], ["auto"]),
    "train_b8_368x496_bf16": ("train", "flowformer", 8, [368, 496], 12, "bf16-mixed", "high", ["auto"], ["auto"]),
    "train_b8_368x496_tf32": ("train", "flowformer", 8, [368, 496], 12, "32-true", "high", ["auto"], ["auto"]),
    "mcva_b24_368x496_bf16": (
        "pretrain", "flowformer_pp", 24, [368, 496], 12, "bf16-mixed", "high", ["auto"], [["tokenize"]]
    ),
    "inference_1080x1920_tf32": ("forward", "flowformer", 1, [1080, 1920], 12, "32-true", "high", [None, 2], ["auto"]),
}


def test_the_gpu_preset_composes_into_the_rows_of_the_gpu_table():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        command_line = ["task=bench", "bench=gpu"]  # make bench-gpu's
        configs = bench.named_configs(compose("config", overrides=command_line), command_line)
    rows = {}
    for name, row in configs:
        (size,), (precision,) = row.bench.sizes, row.bench.precisions
        rows[name] = (
            row.bench.mode, row.backbone.variant, row.bench.batch_size, list(size), row.bench.iters, precision,
            row.runtime.matmul_precision, list(row.bench.memory_budgets_gb),
            [stages if stages == "auto" else list(stages) for stages in row.bench.activation_checkpoints],
        )
        assert row.bench.device == "cuda" and row.backbone.tokenize_chunk == "auto"
        assert row.model._target_.endswith("MCVAPretrainModule" if row.bench.mode == "pretrain" else "FlowModule")
    assert rows == GPU_ROWS
    assert "bench-gpu:" in (REPO_DIR / "Makefile").read_text()


TINY_ROWS = """defaults:
  - default
  - _self_
device: cpu
iters: 2
warmup: 0
repeats: 1
rows:
  tiny_forward: [bench.mode=forward, "bench.sizes=[[64,96]]", "bench.memory_budgets_gb=[null]"]
  tiny_train_budget: [bench.mode=train, "bench.sizes=[[64,96]]", "bench.memory_budgets_gb=[null,0.0001]"]
"""


def test_a_preset_of_tiny_rows_writes_the_table_with_operator_counts(tmp_path):
    checkout = fresh_checkout(tmp_path)
    Path(checkout / "conf" / "bench" / "tiny_rows.yaml").write_text(TINY_ROWS)
    run_py("task=bench", "bench=tiny_rows", "backbone=tiny", "hydra.run.dir=out", cwd=checkout, timeout=600)
    rows = json.loads((checkout / "out" / "bench.json").read_text())["rows"]
    assert [(r["name"], r["mode"], r["path"], r["status"]) for r in rows] == [
        ("tiny_forward", "forward", "dense", "ok"),
        ("tiny_train_budget", "train", "dense", "ok"),
        ("tiny_train_budget", "train", "budget 0.0001 GB", "ok"),
    ]
    assert all(0 < r["operators_per_decoder_iteration"] < r["operators_per_step"] for r in rows)
    # the counting steps come after the built model's memory is read: a training step's own memory shows
    assert all(r["peak_rss_mib"] > r["built_rss_mib"] for r in rows[1:])
    # a bounded plan works in blocks: more operators for the same numbers
    assert rows[2]["operators_per_step"] > rows[1]["operators_per_step"]
    table = (checkout / "out" / "bench.md").read_text().splitlines()
    assert table[0].startswith("| row | size |") and "| operators per step | operators per decoder iteration |" in table[0]
    cells = table[2].split(" | ")
    assert cells[0] == "| tiny_forward" and cells[7:9] == [
        str(rows[0]["operators_per_step"]), str(rows[0]["operators_per_decoder_iteration"])
    ]
