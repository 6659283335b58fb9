"""task=pipeline says what it will cost before any work (issue 34 item 7): every stage's steps, global batch, crop
and estimated GPU-hours, the job's and, in a table's multirun, the table's; a stage whose global batch does not
divide is refused before the first stage trains."""

import re

import pytest
import torch
from omegaconf import OmegaConf

from helpers.run import fresh_checkout, run_py


@pytest.fixture
def checkout(tmp_path):
    return fresh_checkout(tmp_path / "checkout")


def estimate(step_time, task, steps, batch, crop):
    """GPU-hours as conf/pipeline/default.yaml's step_time scales: the reference step x batch x crop pixels."""
    reference = step_time[task]
    pixels = batch * crop[0] * crop[1] / (reference.batch * reference.crop[0] * reference.crop[1])
    return steps * reference.seconds * pixels / 3600


def test_a_table_prints_its_plan_and_cost_before_any_work(checkout):
    """The README's table command, narrowed to two rows, on a machine without the datasets: each job plans its
    stages (the paper's 100k chairs and 60k things steps at batches 8 and 6), then is refused, before any work
    where there is no GPU (the stages train with trainer=gpu), else as its first stage starts (no dataset)."""
    result = run_py(
        "-m", "task=pipeline", "protocol=paper_ablation", "sweep=paper_agt_mlp_conv",
        "pipeline.paper_row=trans_trans,mlp_trans", cwd=checkout, expect_ok=False,
    )
    assert result.returncode == 1
    step_time = OmegaConf.load(checkout / "conf" / "pipeline" / "default.yaml").step_time
    chairs = estimate(step_time, "train", 100000, 8, (368, 496))
    things = estimate(step_time, "train", 60000, 6, (432, 960))
    log = result.stdout + result.stderr
    plans = re.findall(r"the plan of .*?/(\d_pipeline\.paper_row=\w+), before any work", log)
    assert plans == ["0_pipeline.paper_row=trans_trans", "1_pipeline.paper_row=mlp_trans"]
    assert f"chairs: task=train, 100000 steps, global batch 8 (8 a process x 1 process(es) x 1 accumulated), crop " \
        f"368x496, {chairs:.3g} GPU-hours" in log
    assert f"things: task=train, 60000 steps, global batch 6 (6 a process x 1 process(es) x 1 accumulated), crop " \
        f"432x960, {things:.3g} GPU-hours" in log
    assert log.count(f"this job: {chairs + things:.3g} GPU-hours") == 2
    assert log.count(f"the table: 2 jobs, about {2 * (chairs + things):.3g} GPU-hours") == 2
    refused = "pipeline: stage 1/2 chairs" if torch.cuda.is_available() else "asks for a GPU, but torch sees no GPU"
    assert log.index("the plan of") < log.index(refused)


def test_a_later_stage_whose_batch_does_not_divide_is_refused_before_the_first_trains(checkout):
    result = run_py(
        "task=pipeline", "pipeline.stages=[chairs,things]", "trainer=ddp", "trainer.devices=4",
        cwd=checkout, expect_ok=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "the things stage's global batch of 6" in result.stderr and "trainer.devices=3" in result.stderr
    assert "stage 1/2" not in result.stdout + result.stderr  # chairs never started
    assert not list((checkout / "logs").rglob("*"))  # refused before any work: no run directory left
