"""One evaluation path: validation in the training loop, task=eval and task=infer predict through the same
protocol and score with the same metric bundle, so the same predictions give the same numbers everywhere."""

from pathlib import Path

import cv2
import hydra
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn
from torch.utils.data import Dataset

from flowformer.data.datamodules import FlowDataModule
from flowformer.data.io import read_flo
from flowformer.eval.protocol import EvalSet
from flowformer.lit.flow import FlowModule
from flowformer.models import save_backbone
from flowformer.tasks import infer
from flowformer.tasks.eval import evaluate_set

from helpers.configs import CONF_DIR, flow_settings
from helpers.trainers import cpu_trainer

CPU = torch.device("cpu")


class ImageFlowNet(nn.Module):
    """A stand-in network whose flow depends on the (padded) images and on `iters`; flow_low is its 1/8 pool."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.05))

    def forward(self, image1: torch.Tensor, image2: torch.Tensor, iters: int = 12) -> dict:
        flow = self.scale * iters * (image1[:, :2] - image2[:, 1:]) / 255.0
        return {"flow": flow, "flow_low": F.avg_pool2d(flow, 8)}


class PairsWithInvalidPixels(Dataset):
    """Pairs of the given sizes with a random dense flow; `invalid` marks every 3rd row invalid and gives it a
    ground truth far from any prediction, so counting those pixels or not changes every metric."""

    def __init__(self, sizes: list[tuple[int, int]], seed: int) -> None:
        self.sizes, self.seed = sizes, seed

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(self.seed + index)
        h, w = self.sizes[index]
        flow = 3 * torch.randn(2, h, w, generator=generator)
        valid = torch.ones(h, w)
        valid[::3] = 0.0
        flow[:, ::3] = 50.0
        return {
            "img1": 255 * torch.rand(3, h, w, generator=generator),
            "img2": 255 * torch.rand(3, h, w, generator=generator),
            "flow": flow,
            "valid": valid,
        }


def test_validation_and_task_eval_report_the_same_metrics_for_the_same_predictions() -> None:
    sets = {
        "sintel_clean": EvalSet(PairsWithInvalidPixels([(36, 60)] * 3, seed=0), kind="sintel"),
        "kitti": EvalSet(PairsWithInvalidPixels([(30, 44), (27, 52)], seed=10), kind="kitti"),
    }
    torch.manual_seed(0)
    module = FlowModule(backbone=ImageFlowNet(), **flow_settings(val_iters=3))
    trainer = cpu_trainer(enable_checkpointing=True)
    trainer.validate(module, datamodule=FlowDataModule(val=sets, val_batch_size=1))
    logged = {key: value.item() for key, value in trainer.callback_metrics.items()}

    for name, eval_set in sets.items():
        results = evaluate_set(module.backbone, eval_set, eval_set.protocol(3), name=name, device=CPU)
        assert {key.removeprefix(f"val/{name}/") for key in logged if key.startswith(f"val/{name}/")} == set(
            results
        ), name
        for key, value in results.items():
            assert logged[f"val/{name}/{key}"] == pytest.approx(value, rel=1e-6, nan_ok=True), (name, key)

    # the decisions both paths share: Sintel counts every pixel (the invalid rows too); KITTI only the valid
    # ones, and its `epe` is the mean over images of each image's mean
    def epe_and_valid(name: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        item = sets[name][index]
        with torch.no_grad():
            flow = sets[name].protocol(3).predict(module.backbone, item["img1"][None], item["img2"][None])
        return torch.linalg.vector_norm(flow["flow"][0] - item["flow"], dim=0), item["valid"] > 0

    sintel = torch.cat([epe_and_valid("sintel_clean", i)[0].flatten() for i in range(3)])
    assert logged["val/sintel_clean/epe"] == pytest.approx(sintel.mean().item(), rel=1e-5)
    kitti = [epe[valid].mean() for epe, valid in (epe_and_valid("kitti", i) for i in range(2))]
    assert logged["val/kitti/epe"] == pytest.approx(torch.stack(kitti).mean().item(), rel=1e-5)


def test_task_infer_predicts_as_task_eval(tmp_path: Path) -> None:
    """The flow task=infer writes for a 50x70 pair is task=eval's prediction of that pair (same padding and
    iterations through the same protocol)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "backbone=tiny",
                f"infer.input=[{tmp_path / 'a.png'},{tmp_path / 'b.png'}]",
                f"infer.checkpoint={tmp_path / 'tiny.pt'}",
                f"infer.output_dir={tmp_path / 'out'}",
                "infer.iters=2",
                "infer.device=cpu",
                "infer.pad_mode=sintel",
                "infer.save_png=false",
                "infer.save_video=false",
            ],
        )
    torch.manual_seed(3)
    net = hydra.utils.instantiate(cfg.backbone).eval()
    save_backbone(tmp_path / "tiny.pt", net)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (50, 70, 3), dtype=np.uint8) for _ in range(2)]
    for name, image in zip(("a.png", "b.png"), images, strict=True):
        cv2.imwrite(str(tmp_path / name), cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
    infer.run(cfg)

    pair = [torch.from_numpy(image).permute(2, 0, 1).float() for image in images]
    eval_set = EvalSet([{"img1": pair[0], "img2": pair[1]}], kind="flow", iters=2, pad_mode="sintel")
    with torch.inference_mode():
        expected = eval_set.protocol(eval_set.iters).predict(net, pair[0][None], pair[1][None])["flow"]
    written = torch.from_numpy(read_flo(tmp_path / "out" / "a.flo")).permute(2, 0, 1)  # [2,50,70]
    torch.testing.assert_close(written, expected[0], rtol=0, atol=1e-5)
