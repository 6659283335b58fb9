"""task=eval with an official checkpoint reproduces the official numbers (fixture A: FlowFormer things.py).

A one-pair Sintel-format tree holds fixture A's two images and their true flow (the second image is the first
translated by (+3.37, -1.62) px). task=eval loads the official fp16 `module.`-keyed checkpoint through the
backbone config and must report the EPE of the official network's output on that pair.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from flowformer.data.io import write_flo
from flowformer.tasks.eval import run

from helpers.configs import CONF_DIR, FIXTURES_DIR

FIXTURE_A = FIXTURES_DIR / "flowformer_a"
TRUE_FLOW = (3.37, -1.62)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not FIXTURE_A.is_dir(), reason=f"parity fixture not found at {FIXTURE_A}"),
]


def test_official_checkpoint_through_task_eval(tmp_path: Path) -> None:
    torch.set_num_threads(2)  # the fixture's thread count
    scene = tmp_path / "data" / "Sintel" / "training"
    (scene / "clean" / "fixture_a").mkdir(parents=True)
    for index in (1, 2):
        (scene / "clean" / "fixture_a" / f"frame_{index:04d}.png").symlink_to(FIXTURE_A / f"image{index}.png")
    truth = np.broadcast_to(np.array(TRUE_FLOW, dtype=np.float32), (368, 496, 2)).copy()
    write_flo(scene / "flow" / "fixture_a" / "frame_0001.flo", truth)
    overrides = [
        "task=eval",
        "backbone=flowformer",
        f"eval.checkpoint={FIXTURE_A / 'weights_fp16.pth'}",
        "eval.sets=[sintel_clean]",
        "eval.benchmarks.sintel_clean.iters=2",
        "eval.num_workers=0",
        f"paths.data_dir={tmp_path / 'data'}",
        f"paths.output_dir={tmp_path / 'out'}",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    epe = run(cfg)

    official = torch.load(FIXTURE_A / "expected.pt", weights_only=True)["flow_up_iters2"][0]  # [2,H,W]
    official_epe = torch.linalg.vector_norm(official - torch.tensor(TRUE_FLOW).view(2, 1, 1), dim=0)
    assert epe == pytest.approx(official_epe.mean().item(), abs=1e-4)
    result = json.loads((tmp_path / "out" / "eval_results.json").read_text())["results"]["sintel_clean"]
    assert result["1px"] == pytest.approx((official_epe < 1).float().mean().item(), abs=1e-3)
