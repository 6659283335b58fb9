"""Flow pictures: the Middlebury wheel, known directions, numpy/torch agreement, error map, panel."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flowformer.data.io import read_image
from flowformer.viz import (
    epe_map,
    error_to_color,
    flow_panel,
    flow_to_color,
    make_colorwheel,
    write_flow_image,
)


def _uniform_flow(u: float, v: float, size: tuple[int, int] = (4, 5)) -> np.ndarray:
    flow = np.zeros((*size, 2), np.float32)
    flow[..., 0], flow[..., 1] = u, v
    return flow


def test_colorwheel_has_the_middlebury_segments() -> None:
    wheel = make_colorwheel()
    assert wheel.shape == (55, 3)
    # Segment starts: RY 0, YG 15, GC 21, CB 25, BM 36, MR 49 -> red, yellow, green, cyan, blue, magenta.
    starts = {
        0: (255, 0, 0),
        15: (255, 255, 0),
        21: (0, 255, 0),
        25: (0, 255, 255),
        36: (0, 0, 255),
        49: (255, 0, 255),
    }
    for index, rgb in starts.items():
        assert tuple(wheel[index]) == rgb
    assert tuple(wheel[54]) == (255, 0, 255 - np.floor(255 * 5 / 6))


def test_known_directions() -> None:
    right = flow_to_color(_uniform_flow(3.0, 0.0))[0, 0]
    assert right.tolist() == [255, 0, 0]  # full length, pure +x -> red
    down = flow_to_color(_uniform_flow(0.0, 3.0))[0, 0]
    assert down[0] == 255 and 150 < down[1] < 255 and down[2] == 0  # orange-yellow
    left = flow_to_color(_uniform_flow(-3.0, 0.0))[0, 0]
    assert left[0] == 0 and left[2] == 255  # light blue
    up = flow_to_color(_uniform_flow(0.0, -3.0))[0, 0]
    assert up[2] == 255 and up[1] == 0 and up[0] < 200  # violet-blue


def test_saturation_follows_length_and_max_flow() -> None:
    flow = np.zeros((1, 3, 2), np.float32)
    flow[0, :, 0] = [0.0, 1.0, 2.0]
    rgb = flow_to_color(flow)
    assert rgb[0, 0].tolist() == [255, 255, 255]  # zero flow is white
    assert rgb[0, 2].tolist() == [255, 0, 0]  # the longest vector is fully saturated
    assert rgb[0, 1, 1] == pytest.approx(127, abs=1)  # half length, half saturation
    fixed = flow_to_color(flow, max_flow=4.0)
    assert fixed[0, 2, 1] == pytest.approx(127, abs=1)
    darker = flow_to_color(flow, max_flow=1.0)[0, 2]  # longer than max_flow -> darkened by 0.75
    assert darker.tolist() == [191, 0, 0]
    with pytest.raises(ValueError, match="max_flow"):
        flow_to_color(flow, max_flow=0.0)


def test_numpy_and_torch_paths_agree() -> None:
    rng = np.random.default_rng(0)
    flows = (rng.standard_normal((2, 9, 13, 2)) * 5).astype(np.float32)
    flows[1, 0, 0] = np.nan  # non-finite vectors are drawn as zero flow in both paths
    batch = torch.from_numpy(flows).permute(0, 3, 1, 2)
    rgb_torch = flow_to_color(batch)
    assert rgb_torch.dtype == torch.uint8 and rgb_torch.shape == (2, 3, 9, 13)
    for i in range(2):
        expected = flow_to_color(flows[i])
        np.testing.assert_array_equal(rgb_torch[i].permute(1, 2, 0).numpy(), expected)
        np.testing.assert_array_equal(
            flow_to_color(batch[i], max_flow=3.0).permute(1, 2, 0).numpy(),
            flow_to_color(flows[i], max_flow=3.0),
        )
    assert rgb_torch[1, :, 0, 0].tolist() == [255, 255, 255]
    with pytest.raises(ValueError, match=r"\[B, 2, H, W\]"):
        flow_to_color(torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match=r"\[H, W, 2\]"):
        flow_to_color(np.zeros((2, 4, 4)))


def test_epe_and_error_map() -> None:
    gt = _uniform_flow(10.0, 0.0, (2, 3))
    pred = gt.copy()
    pred[0, 0] = (13.0, 4.0)  # epe 5 > 3 px and > 5% of 10 -> outlier
    pred[0, 1] = (10.3, 0.4)  # epe 0.5 -> small
    np.testing.assert_allclose(epe_map(pred, gt)[0, :2], [5.0, 0.5], rtol=1e-6)
    valid = np.ones((2, 3), np.float32)
    valid[1, 2] = 0
    rgb = error_to_color(pred, gt, valid)
    assert rgb.shape == (2, 3, 3) and rgb.dtype == np.uint8
    assert tuple(rgb[0, 0]) == (254, 224, 144)  # normalised error min(5/3, 5/0.5) = 1.67 -> the 1..2 bin
    assert tuple(rgb[0, 1]) == (116, 173, 209)  # min(0.5/3, 0.5/0.5) = 0.167 -> the 1/8..1/4 bin
    assert tuple(rgb[0, 2]) == (49, 54, 149)  # exact -> darkest blue
    assert tuple(rgb[1, 2]) == (0, 0, 0)  # invalid -> black


def test_panel_from_torch_sample() -> None:
    image = torch.full((3, 6, 8), 100.0)
    gt = torch.zeros(2, 6, 8)
    gt[0] = 4.0
    pred = gt.clone()
    pred[0, :, :4] = 0.0
    panel = flow_panel(image, pred, gt, valid=torch.ones(6, 8))
    assert panel.shape == (6, 32, 3) and panel.dtype == np.uint8
    assert (panel[:, :8] == 100).all()
    assert panel[0, 8].tolist() == [255, 0, 0]  # ground truth: +x, full length
    assert panel[0, 16].tolist() == [255, 255, 255]  # prediction: zero here (shares the GT normaliser)
    assert panel[0, 20].tolist() == [255, 0, 0]
    assert panel[0, 24].tolist() != panel[0, 31].tolist()  # error map: wrong half vs exact half
    no_gt = flow_panel(image.permute(1, 2, 0).numpy(), pred.permute(1, 2, 0).numpy())
    assert no_gt.shape == (6, 16, 3)
    with pytest.raises(ValueError, match="flow_pred"):
        flow_panel(image, torch.zeros(2, 5, 8), gt)


def test_write_flow_image(tmp_path: Path) -> None:
    flow = _uniform_flow(1.0, 0.0)
    path = tmp_path / "vis" / "flow.png"
    write_flow_image(path, flow)
    np.testing.assert_array_equal(read_image(path), flow_to_color(flow))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_colours_on_gpu_match_cpu() -> None:
    flow = torch.randn(2, 2, 16, 24) * 4
    on_gpu = flow_to_color(flow.cuda())
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), flow_to_color(flow))
