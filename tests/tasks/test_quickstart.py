"""experiment=quickstart, shortened (2 steps per stage): pretrain -> finetune (from MCVA and, with
compare_from_scratch, from random weights) -> eval -> metrics.json.
The full run (which must reach <= 50% of the zero-flow EPE) is `make demo`."""

import json

from helpers.run import run_py


def test_quickstart_chains_stages_and_writes_metrics(tmp_path):
    result = run_py(
        "experiment=quickstart",
        "quickstart.pretrain_steps=2",
        "quickstart.finetune_steps=2",
        "quickstart.max_epe_ratio=100",
        "quickstart.compare_from_scratch=true",
        f"hydra.run.dir={tmp_path}",
        expect_ok=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["zero_flow_epe"] > 1.0
    assert metrics["pass"] is True
    for key in ("epe_finetuned_with_mcva", "epe_finetuned_from_scratch"):
        assert metrics[key] > 0
    # the finetune-with-MCVA stage started from the pretraining checkpoint
    assert "initialised the backbone from" in (tmp_path / "run.log").read_text()
    assert metrics["checkpoints"]["pretrain"].startswith(str(tmp_path / "pretrain"))
    assert "zero flow" in result.stdout and "finetuned from scratch" in result.stdout
