"""A multirun runs every job when some fail, records the failed ones in the sweep directory and exits 1."""

import json
import math

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from flowformer.tasks import run_task
from flowformer.tasks.sweeps import failed_jobs

from helpers.compose import compose_run_config
from helpers.run import fresh_checkout, run_py


def test_failed_jobs_are_recorded_and_the_sweep_goes_on(tmp_path):
    # the first and the middle job fail (a negative learning rate), the last one trains
    result = run_py(
        "-m",
        "debug=tiny",
        "trainer.max_steps=1",
        "trainer.val_check_interval=1",
        "model.optimizer.lr=-1,-2,1e-3",
        f"hydra.sweep.dir={tmp_path}",
        expect_ok=False,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [trained] = tmp_path.glob("2_*")
    assert (trained / "checkpoints" / "last.ckpt").is_file()

    records = [json.loads(line) for line in (tmp_path / "failed_jobs.jsonl").read_text().splitlines()]
    assert [record["job"] for record in records] == [0, 1]
    for record, lr in zip(records, ("-1", "-2"), strict=True):
        assert f"model.optimizer.lr={lr}" in record["overrides"]
        assert record["error"] == (
            f"error (ValueError): model.optimizer (torch.optim.AdamW) refuses its settings: Invalid learning rate: {lr}"
        )
        assert record["dir"] is None  # failed before producing anything: no directory left behind
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("error: 2 job(s) of this sweep failed: #0 (") and "failed_jobs.jsonl" in summary


def test_a_failed_job_hands_the_sweeper_nan(tmp_path):
    """Sweepers read each job's return value: a failed job's is NaN, never a best value."""
    cfg = compose_run_config(["task=nonsense", f"hydra.sweep.dir={tmp_path}"])
    cfg.hydra.mode = RunMode.MULTIRUN
    cfg.hydra.job.num = 0
    cfg.hydra.runtime.output_dir = str(tmp_path / "0_task=nonsense")
    HydraConfig.instance().set_config(cfg)
    try:
        assert math.isnan(run_task(cfg))
    finally:
        HydraConfig.instance().cfg = None
    [record] = failed_jobs(tmp_path)
    assert record["job"] == 0 and "task='nonsense' is unknown" in record["error"]


def test_a_sweep_whose_first_job_hydra_refuses_leaves_no_directory(tmp_path):
    """`python run.py -m debug=tiny sweep=mask_ratio`: the sweep's value is for MCVA (model.mask_ratio), which the
    supervised config does not have. Hydra refuses the first job before it starts and ends the sweep, which left
    logs/train/default/multiruns/<time>/ holding only its claim and Hydra's multirun.yaml."""
    checkout = fresh_checkout(tmp_path)
    result = run_py("-m", "debug=tiny", "sweep=mask_ratio", cwd=checkout, expect_ok=False)
    assert result.returncode == 1 and "Could not override 'model.mask_ratio'" in result.stderr
    assert list((checkout / "logs").rglob("*")) == []
