"""task=bench on CPU: a row per size x memory path x precision, each in its own process, written as a table, a
JSON report and a plot; the training steps it times really train."""

import json
import os
import signal
import time

import pytest
import torch

from flowformer.models.build import ACTIVATION_CHECKPOINT_STAGES
from flowformer.tasks import bench

from helpers.compose import compose_tiny_config
from helpers.run import fresh_checkout, run_py, start_run_py


def config(*overrides: str):
    return compose_tiny_config("bench.device=cpu", *overrides)


def test_bench_writes_a_row_per_size_path_and_precision(tmp_path):
    cfg = config(
        "bench.sizes=[[64,96],[64,128]]", "bench.memory_budgets_gb=[null,0.0001]", "bench.iters=2",
        "bench.repeats=1", "bench.warmup=0", f"paths.output_dir={tmp_path}",
    )
    seconds = bench.run(cfg)
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["rows"]
    assert [(r["height"], r["width"], r["path"]) for r in rows] == [
        (64, 96, "dense"), (64, 96, "budget 0.0001 GB"), (64, 128, "dense"), (64, 128, "budget 0.0001 GB")
    ]
    assert all(r["status"] == "ok" and r["mean_s"] > 0 and r["peak_rss_mib"] >= r["built_rss_mib"] > 0 for r in rows)
    assert all(r["pairs_per_s"] == pytest.approx(cfg.bench.batch_size / r["mean_s"]) for r in rows)
    assert seconds == rows[0]["mean_s"] and report["machine"]["cpu_cores"] >= 1
    table = (tmp_path / "bench.md").read_text().splitlines()
    assert len(table) == 2 + len(rows) and "| 64x128 | 0.01 | budget 0.0001 GB | 32-true |" in table[-1]
    assert table[-1].split(" | ")[5] == f"{rows[-1]['pairs_per_s']:.2f}"
    peak, above_built = table[-1].split(" | ")[-3:-1]  # the process's peak RSS, the step's part of it
    assert peak == f"{rows[-1]['peak_rss_mib'] / 1024:.2f} GiB"
    assert above_built == f"{(rows[-1]['peak_rss_mib'] - rows[-1]['built_rss_mib']) / 1024:.2f} GiB"
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")


def test_training_rows_for_each_set_of_recomputed_stages(tmp_path):
    cfg = config(
        "bench.mode=train", "bench.sizes=[[64,96]]", "bench.iters=1", "bench.repeats=1", "bench.warmup=0",
        "bench.activation_checkpoints=[[],[decoder,cost_layers]]", f"paths.output_dir={tmp_path}",
    )
    bench.run(cfg)
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(r["path"], r["activation_checkpoint"], r["status"]) for r in rows] == [
        ("dense", [], "ok"), ("dense, recomputing decoder+cost_layers", ["decoder", "cost_layers"], "ok")
    ]
    assert "| 64x96 | 0.01 | dense, recomputing decoder+cost_layers | 32-true |" in (tmp_path / "bench.md").read_text()
    assert bench.path_label(0.5, list(ACTIVATION_CHECKPOINT_STAGES)) == "budget 0.5 GB, recomputing all stages"
    # each row's process builds the backbone with the row's stages
    row = bench.row_config(cfg, [64, 96], None, "32-true", ["decoder"])
    assert row.backbone.activation_checkpoint == ["decoder"] and row.model.backbone.activation_checkpoint == ["decoder"]
    assert bench.row_config(cfg, [64, 96], None, "32-true").backbone.activation_checkpoint == "auto"  # the backbone's


def test_profiled_steps_say_where_a_training_step_spends_its_time(tmp_path):
    """bench.profile_steps: after the timed steps, that many under torch.profiler; each row records seconds per
    profiled step, the GPU's busy seconds (none on a CPU) and the operators by time, and bench.md shows them."""
    cfg = config(
        "bench.mode=train", "bench.sizes=[[64,96]]", "bench.iters=1", "bench.repeats=1", "bench.warmup=0",
        "bench.profile_steps=2", f"paths.output_dir={tmp_path}",
    )
    bench.run(cfg)
    row = json.loads((tmp_path / "bench.json").read_text())["rows"][0]
    assert row["status"] == "ok" and row["profile_wall_s"] > 0 and row["profile_busy_s"] == 0
    by_device, by_cpu = row["profile"].split("by CPU time:")
    assert by_device.startswith("2 steps, by device time:") and "aten::convolution_backward" in by_device
    assert "aten::" in by_cpu
    assert f"### profile of dense: {row['profile_wall_s'] * 1e3:.1f} ms a step, GPU busy 0.0 ms" in (
        tmp_path / "bench.md"
    ).read_text()


def test_a_row_that_does_not_finish_is_recorded_and_the_benchmark_goes_on(tmp_path):
    cfg = config("bench.sizes=[[64,96]]", "bench.timeout_s=0.01", f"paths.output_dir={tmp_path}")
    assert torch.isnan(torch.tensor(bench.run(cfg)))
    (row,) = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert row["status"] == "stopped after bench.timeout_s=0.01" and "mean_s" not in row
    assert "| - | - | - | stopped after" in (tmp_path / "bench.md").read_text()


def test_a_row_that_fails_reports_its_error_and_the_next_row_runs(tmp_path):
    cfg = config("bench.sizes=[[8,16],[64,96]]", "bench.iters=1", "bench.repeats=1", "bench.warmup=0",
                 f"paths.output_dir={tmp_path}")
    bench.run(cfg)
    failed, done = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert failed["status"] == "failed" and "at least 16x16 pixels" in failed["error"] and done["status"] == "ok"
    assert "| failed: ValueError: " in (tmp_path / "bench.md").read_text()


def test_ctrl_c_during_a_bench_keeps_the_rows_measured_and_records_the_others_stopped(tmp_path):
    """`python run.py task=bench ...` of three rows, Ctrl-C (SIGINT to its process group, as a terminal sends it)
    once the first row is measured: the row in progress is ended (its process never sees the signal), the files
    hold the first row and the two others recorded stopped, status 130, one line, no traceback. Before, every
    process printed a KeyboardInterrupt traceback and nothing was written."""
    run_dir = tmp_path / "run"
    process = start_run_py(
        "task=bench", "backbone=tiny", "bench.device=cpu", "bench.sizes=[[64,96],[64,96],[64,96]]", "bench.iters=1",
        "bench.repeats=1", "bench.warmup=0", f"hydra.run.dir={run_dir}", new_session=True,
    )
    deadline, log = time.monotonic() + 300, run_dir / "run.log"
    while not log.is_file() or '"status": "ok"' not in log.read_text():  # the first row's result
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the first row was not measured: {process.communicate()[1][-3000:]}")
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    rows = json.loads((run_dir / "bench.json").read_text())["rows"]
    assert [row["status"] for row in rows] == ["ok", "stopped by SIGINT", "stopped by SIGINT"]
    assert (run_dir / "bench.md").read_text().count("| stopped by SIGINT |") == 2
    lines = [line for line in log.read_text().splitlines() if "task=bench stopped" in line]
    assert len(lines) == 1 and lines[0].endswith(
        f"task=bench stopped by SIGINT: 1 of its 3 rows measured, in {run_dir / 'bench.json'}; the rows it did not "
        "finish are recorded stopped"
    )


def test_row_config_sets_the_memory_path_of_the_backbone_and_of_the_model():
    row = bench.row_config(config("model=mcva"), [64, 96], 2.0, "bf16-mixed")
    assert (row.bench.height, row.bench.width, row.bench.precision) == (64, 96, "bf16-mixed")
    assert row.backbone.memory_budget_gb == 2.0 and row.model.backbone.memory_budget_gb == 2.0


@pytest.mark.parametrize(
    ("mode", "extra"), [("train", []), ("pretrain", ["model=mcva", "model.query_num=2"])]
)
def test_bench_training_modes_step_the_weights(mode, extra):
    cfg = bench.row_config(config(*extra, f"bench.mode={mode}", "bench.iters=2"), [64, 96], None, "32-true")
    images = [torch.rand(2, 3, 64, 96) * 255 for _ in range(2)]
    net, step = bench.build_step(cfg, torch.device("cpu"), *images)
    trainable = {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}
    step()
    changed = {n for n, p in net.named_parameters() if n in trainable and not torch.equal(p, trainable[n])}
    assert changed and all(net.get_parameter(n).grad is not None for n in changed)
    # MCVA keeps its image/context encoders frozen; a supervised step trains them
    assert any(n.startswith("context_encoder.") for n in changed) == (mode == "train")


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        # no row: an IndexError traceback once the (empty) table was written
        ("bench.sizes=[]", "bench.sizes is empty: the rows are its values times the others'; give at least one"),
        # each row measured, then recorded failed, the run ending well
        ("bench.sizes=[[-64,96]]", "bench.sizes: each size is [height, width], both positive multiples of 8"),
        ("bench.precisions=[fp8]", "bench.precisions='fp8': expected one of 32-true, bf16-mixed, 16-mixed"),
        ("bench.mode=pretrain", "bench.mode=pretrain times an MCVA step: add model=mcva"),
    ],
)
def test_settings_that_make_no_row_are_one_line_before_any_work(tmp_path, setting, expected):
    checkout = fresh_checkout(tmp_path)
    result = run_py("task=bench", "backbone=tiny", setting, cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("[")]
    assert line.startswith(f"error (ValueError): {expected}"), line
    assert list((checkout / "logs").rglob("*")) == []


def test_bench_rejects_pretrain_without_mcva_and_bad_sizes(tmp_path):
    cfg = bench.row_config(config("bench.mode=pretrain"), [64, 96], None, "32-true")
    with pytest.raises(ValueError, match="model=mcva"):
        bench.build_step(cfg, torch.device("cpu"), torch.zeros(1, 3, 64, 96), torch.zeros(1, 3, 64, 96))
    example = r"\(bench.sizes=\[\[368,496\]\]\)"
    with pytest.raises(ValueError, match=rf"bench.sizes: .* multiples of 8 {example}; got \[64, 90\]"):
        bench.run(config("bench.sizes=[[64,90]]", f"paths.output_dir={tmp_path}"))
    for flat in ("[64,96]", "[64]"):  # one size not written as a list of sizes: a TypeError before
        with pytest.raises(ValueError, match=r"bench.sizes: .*; got 64$"):
            bench.run(config(f"bench.sizes={flat}", f"paths.output_dir={tmp_path}"))
