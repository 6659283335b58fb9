"""Baseline methods beside the network in task=eval (eval.baselines): zero flow and OpenCV's DIS."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import hydra
import numpy as np
import pytest
import torch

from flowformer.eval.baselines import baseline_methods
from flowformer.metrics import FlowMetrics
from flowformer.tasks.eval import run

from helpers.compose import compose_tiny_config


def test_dis_finds_a_translation_and_zero_is_zero() -> None:
    rng = np.random.default_rng(0)
    texture = cv2.GaussianBlur(rng.uniform(0, 255, (96, 128, 3)).astype(np.float32), (0, 0), 2.0)
    image1 = torch.from_numpy((texture - texture.mean()) * 4 + 128).clamp(0, 255).permute(2, 0, 1)[None]
    image2 = torch.roll(image1, shifts=(-2, 3), dims=(2, 3))  # image2(p + (3, -2)) = image1(p): flow (3, -2)
    methods = baseline_methods(["zero", "dis"])
    dis = methods["dis"](image1, image2, iters=12, flow_init=None)
    assert dis["flow"].shape == (1, 2, 96, 128) and dis["flow_low"].shape == (1, 2, 12, 16)
    interior = dis["flow"][0, :, 16:-16, 16:-16].flatten(1)
    assert torch.allclose(interior.median(dim=1).values, torch.tensor([3.0, -2.0]), atol=0.1)
    low = dis["flow_low"][0, :, 2:-2, 2:-2].mean((1, 2))  # in 1/8-resolution pixels
    assert torch.allclose(low, torch.tensor([3.0, -2.0]) / 8, atol=0.05)
    zero = methods["zero"](image1, image2, iters=12)
    assert zero["flow"].shape == (1, 2, 96, 128) and not zero["flow"].any() and not zero["flow_low"].any()
    with pytest.raises(ValueError, match=r"eval.baselines names \['raft'\]; known baselines: \['zero'"):
        baseline_methods(["dis", "raft"])


def test_task_eval_scores_the_baselines_beside_the_network(tmp_path: Path, capsys) -> None:
    cfg = compose_tiny_config(
        "task=eval",
        "eval=synthetic",
        "eval.baselines=[zero,dis]",
        "eval.max_samples=2",
        "eval.benchmarks.synthetic.iters=1",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path}",
    )
    epe = run(cfg)
    record = json.loads((tmp_path / "eval_results.json").read_text())
    assert list(record["results"]) == ["synthetic"] and epe == record["results"]["synthetic"]["epe"]
    scores = record["baselines"]
    assert list(scores) == ["zero", "dis"] and list(scores["zero"]) == ["synthetic"]
    table = capsys.readouterr().out
    assert "synthetic (zero)" in table and "synthetic (dis)" in table

    # by hand on the same two pairs (80x128: the padding to a multiple of 8 changes nothing)
    dataset = hydra.utils.instantiate(cfg.eval.benchmarks.synthetic.dataset)
    dis = baseline_methods(["dis"])["dis"]

    def predict(method: str, item: dict) -> torch.Tensor:
        if method == "zero":
            return torch.zeros_like(item["flow"])[None]
        return dis(item["img1"][None], item["img2"][None])["flow"]

    for method in ("zero", "dis"):
        expected = FlowMetrics()
        for item in (dataset[0], dataset[1]):
            expected.update(predict(method, item), item["flow"][None], item["valid"][None])
        assert scores[method]["synthetic"]["epe"] == pytest.approx(float(expected.compute()["epe"]), rel=1e-6)
    assert scores["dis"]["synthetic"]["epe"] != scores["zero"]["synthetic"]["epe"]
