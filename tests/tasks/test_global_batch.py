"""A training stage's batch is the paper's over all processes (issue 34 item 4): each process takes
global / (trainer.devices x trainer.num_nodes x trainer.accumulate_grad_batches); a global batch that does not
divide is one line before any work; data.batch_size is the per-process batch itself."""

import pytest
import yaml

from flowformer.tasks.batches import per_process_batch

from helpers.compose import compose_run_config
from helpers.run import fresh_checkout, run_py

REFUSAL = (
    "error (ValueError): the things stage's global batch of 6 (global_batch.size) does not divide over "
    "trainer.devices=8 x trainer.num_nodes=1 x trainer.accumulate_grad_batches=1; set trainer.devices=6 "
    "(1 a process), or data.batch_size=1 (a global batch of 8 instead)"
)


@pytest.mark.parametrize(
    ("overrides", "per_process"),
    [
        (["experiment=mcva_pretrain"], 24),
        (["experiment=mcva_pretrain", "trainer=ddp"], 3),
        (["experiment=mcva_pretrain", "trainer.accumulate_grad_batches=2"], 12),
        (["experiment=chairs"], 8),
        (["experiment=chairs", "trainer=ddp"], 1),
        (["experiment=chairs", "trainer=ddp", "trainer.devices=2", "trainer.num_nodes=2"], 2),
        (["experiment=things", "trainer=ddp", "trainer.devices=[0,1,2]"], 2),
        (["experiment=sintel", "trainer=ddp", "trainer.devices=6"], 1),
        (["experiment=kitti", "trainer=ddp", "trainer.devices=3", "trainer.accumulate_grad_batches=2"], 1),
        (["experiment=things", "trainer=ddp", "data.batch_size=1"], 1),  # the per-process batch as given
    ],
)
def test_a_stage_shares_its_global_batch_out_over_the_processes(overrides, per_process):
    assert per_process_batch(compose_run_config(overrides)) == per_process


@pytest.mark.parametrize(
    ("overrides", "nearest"),
    [
        (["experiment=things", "trainer=ddp"], "set trainer.devices=6 (1 a process), or data.batch_size=1"),
        (
            ["experiment=mcva_pretrain", "trainer=ddp", "trainer.num_nodes=2"],
            "set trainer.devices=6 (2 a process), or data.batch_size=2 (a global batch of 32 instead)",
        ),
        (
            ["experiment=chairs", "trainer.accumulate_grad_batches=3"],
            "set trainer.accumulate_grad_batches=4, or data.batch_size=3",
        ),
    ],
)
def test_a_global_batch_that_does_not_divide_names_the_nearest_settings(overrides, nearest):
    with pytest.raises(ValueError, match="global batch of") as refused:
        per_process_batch(compose_run_config(overrides))
    assert nearest in str(refused.value)


def test_the_readme_ddp_command_is_refused_in_one_line_before_any_work(tmp_path):
    """`python run.py experiment=things trainer=ddp` (8 processes, the paper's batch 6): one line, status 1,
    before the network, the data or the devices are looked at; no run directory is left."""
    checkout = fresh_checkout(tmp_path)
    result = run_py("experiment=things", "trainer=ddp", cwd=checkout, expect_ok=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [REFUSAL]
    assert not list(checkout.glob("logs/train/things/runs/*"))


def test_the_per_process_batch_is_the_one_the_run_trains_and_records(tmp_path):
    """A stage of global batch 4 accumulating 2 batches trains with 2 a process, and records it."""
    checkout = fresh_checkout(tmp_path)
    result = run_py(
        "debug=tiny",
        "global_batch={stage:tiny,size:4}",
        "data.batch_size=null",
        "trainer.accumulate_grad_batches=2",
        cwd=checkout,
    )
    assert "batch 2 a process: the tiny stage's global batch of 4 over 1 process(es) x 2 accumulated" in (
        result.stdout + result.stderr
    )
    [run_dir] = (checkout / "logs" / "train" / "default" / "runs").iterdir()
    assert yaml.safe_load((run_dir / "config_resolved.yaml").read_text())["data"]["batch_size"] == 2
