"""experiment=quickstart, shortened (2 steps per stage): a pipeline (pretrain -> finetune from MCVA and, with
compare_from_scratch, from random weights -> eval) -> metrics.json and the held-out pairs' picture.
The full run (which must reach <= 50% of the zero-flow EPE) is `make demo`."""

import json

import cv2

from helpers.run import run_py


def test_quickstart_chains_stages_and_writes_metrics(tmp_path):
    result = run_py(
        "experiment=quickstart",
        "quickstart.pretrain_steps=2",
        "quickstart.finetune_steps=2",
        "quickstart.max_epe_ratio=100",
        "quickstart.compare_from_scratch=true",
        "quickstart.panel_pairs=2",
        f"hydra.run.dir={tmp_path}",
        expect_ok=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["zero_flow_epe"] > 1.0
    assert metrics["pass"] is True
    for key in ("epe_finetuned_with_mcva", "epe_finetuned_from_scratch"):
        assert metrics[key] > 0
    # the finetuning stage started from the pretraining checkpoint, through task=pipeline's handoff
    record = json.loads((tmp_path / "pipeline.json").read_text())
    assert [stage["name"] for stage in record["stages"]] == ["pretrain", "finetune"]
    assert record["stages"][1]["init_from"] == metrics["checkpoints"]["pretrain"]
    assert "initialised the backbone from" in (tmp_path / "run.log").read_text()
    assert metrics["checkpoints"]["pretrain"].startswith(str(tmp_path / "pretrain"))
    scratch = json.loads((tmp_path / "from_scratch" / "pipeline.json").read_text())
    assert [stage["init_from"] for stage in scratch["stages"]] == [None]
    assert "zero flow" in result.stdout and "finetuned from scratch" in result.stdout
    # the picture: 2 held-out 80x128 pairs, each image | ground truth | prediction | error, 4 px apart
    assert f"held-out pairs (image | ground truth | prediction | error): {tmp_path / 'heldout_pairs.png'}" in (
        result.stdout
    )
    picture = cv2.imread(str(tmp_path / "heldout_pairs.png"))
    assert picture.shape == (2 * 80 + 4, 4 * 128, 3)
