"""Flow metrics and the per-kind bundles against hand-computed cases."""

import math

import pytest
import torch

from flowformer.metrics import (
    SET_METRICS,
    FlowMetrics,
    FlowSetMetrics,
    KittiSetMetrics,
    NothingScoredError,
    PerImageMetrics,
    SintelSetMetrics,
    SpeedBinnedEPE,
)


def _flows(gt_uv: list[tuple[float, float]], err_uv: list[tuple[float, float]]) -> tuple[torch.Tensor, ...]:
    """One row of pixels: gt [1,2,1,N] and pred = gt + err."""
    gt = torch.tensor(gt_uv, dtype=torch.float32).T.reshape(1, 2, 1, -1)
    err = torch.tensor(err_uv, dtype=torch.float32).T.reshape(1, 2, 1, -1)
    return gt + err, gt


# errors 0.5, 2, 4, 10 px; |gt| = 0, 3, 100, 5
# F1: pixel 3 has epe 4 > 3 but 4 < 5 % of 100 -> inlier; pixel 4 (10 px on |gt| 5) is the only outlier.
PRED, GT = _flows([(0, 0), (3, 0), (0, 100), (3, 4)], [(0.3, 0.4), (1.2, 1.6), (0, 4), (6, 8)])


def test_flow_metrics_all_pixels() -> None:
    m = FlowMetrics()
    m.update(PRED, GT)
    r = m.compute()
    assert r["epe"].item() == pytest.approx((0.5 + 2 + 4 + 10) / 4)
    assert r["1px"].item() == pytest.approx(1 / 4)
    assert r["3px"].item() == pytest.approx(2 / 4)
    assert r["5px"].item() == pytest.approx(3 / 4)
    assert r["f1_all"].item() == pytest.approx(25.0)
    # kind `flow` counts the valid pixels; with every pixel valid that is the all-pixel mean above
    masked = FlowSetMetrics()
    masked.update(PRED, GT, torch.ones(1, 1, 4))
    assert all(masked.compute()[k].item() == pytest.approx(v.item()) for k, v in r.items())


def test_flow_metrics_valid_mask_and_max_flow() -> None:
    m = FlowMetrics()
    m.update(PRED, GT, torch.tensor([[[1.0, 1.0, 1.0, 0.4]]]))  # 0.4 < 0.5 counts as invalid
    r = m.compute()
    assert r["epe"].item() == pytest.approx(6.5 / 3)
    assert r["5px"].item() == pytest.approx(1.0)
    assert r["f1_all"].item() == pytest.approx(0.0)
    capped = FlowMetrics(max_flow=50.0)  # drops the |gt| = 100 pixel
    capped.update(PRED, GT)
    assert capped.compute()["epe"].item() == pytest.approx((0.5 + 2 + 10) / 3)


def test_flow_metrics_pixel_pooled_across_updates_and_merge() -> None:
    # image A: one pixel with epe 1; image B: three pixels with epe 3 -> pooled (1 + 9) / 4, not (1 + 3) / 2
    a = _flows([(0, 0)], [(1, 0)])
    b = _flows([(0, 0)] * 3, [(3, 0)] * 3)
    m = FlowMetrics()
    m.update(*a)
    m.update(*b)
    assert m.compute()["epe"].item() == pytest.approx(2.5)
    # states are sums, so merging two ranks' states (what DDP's sum-reduce does) gives the same answer
    rank0, rank1 = FlowMetrics(), FlowMetrics()
    rank0.update(*a)
    rank1.update(*b)
    rank0.merge_state(rank1)
    assert rank0.compute()["epe"].item() == pytest.approx(2.5)


def test_speed_bins() -> None:
    pred, gt = _flows([(5, 0), (0, 20), (50, 0), (39.9, 0)], [(1, 0), (0, 2), (3, 0), (0, 4)])
    m = SpeedBinnedEPE()
    m.update(pred, gt)
    r = m.compute()
    assert r["s0-10"].item() == pytest.approx(1.0)
    assert r["s10-40"].item() == pytest.approx(3.0)
    assert r["s40+"].item() == pytest.approx(3.0, rel=1e-6)
    slow = SpeedBinnedEPE()
    slow.update(*_flows([(1, 0)], [(1, 0)]))
    assert math.isnan(slow.compute()["s40+"].item())


def test_kitti_per_image_vs_pooled() -> None:
    # image A: valid pixel epe 4 on |gt| 10 (outlier), invalid pixel with a huge error (ignored);
    # image B: two valid pixels with epe 1. Image C has no valid pixel and is left out.
    gt = torch.tensor([[[10.0, 0.0]], [[0.0, 0.0]]]).reshape(2, 1, 1, 2).expand(2, 2, 1, 2).clone()
    gt[:, 1] = 0.0
    pred = gt.clone()
    pred[0, 0, 0, 0] += 4.0
    pred[0, 0, 0, 1] += 100.0
    pred[1, 1] += 1.0
    valid = torch.tensor([[[1.0, 0.0]], [[1.0, 1.0]]])
    per_image, kitti = PerImageMetrics(), KittiSetMetrics()
    for m in (per_image, kitti):
        m.update(pred, gt, valid)
        m.update(pred[:1], gt[:1], torch.zeros(1, 1, 2))
    assert per_image.compute()["epe_per_image"].item() == pytest.approx((4 + 1) / 2)
    r = kitti.compute()
    assert r["epe"].item() == pytest.approx((4 + 1) / 2)  # the official kitti-epe: per image
    assert r["epe_pooled"].item() == pytest.approx((4 + 1 + 1) / 3)
    assert r["f1_all_per_image"].item() == pytest.approx((100 + 0) / 2)
    assert r["f1_all"].item() == pytest.approx(100 / 3)  # the official kitti-f1: pooled
    assert r["3px"].item() == pytest.approx(2 / 3)  # pixel-pooled: epe 4, 1, 1
    with pytest.raises(ValueError, match="valid"):
        kitti.update(pred, gt, None)


def test_sintel_bundle_counts_every_pixel() -> None:
    """The official validate_sintel has no valid mask: the items' mask is ignored, F1-all is not reported."""
    masked, unmasked = SintelSetMetrics(), SintelSetMetrics()
    masked.update(PRED, GT, torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]))
    unmasked.update(PRED, GT, None)
    r = masked.compute()
    assert r["epe"].item() == pytest.approx((0.5 + 2 + 4 + 10) / 4)
    assert set(r) == {"epe", "1px", "3px", "5px", "s0-10", "s10-40", "s40+"}
    assert all(r[k].item() == pytest.approx(v.item(), nan_ok=True) for k, v in unmasked.compute().items())


def test_shape_errors_are_clear() -> None:
    with pytest.raises(ValueError, match=r"\[B,2,H,W\]"):
        FlowMetrics().update(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 5))
    with pytest.raises(ValueError, match="valid mask"):
        FlowMetrics().update(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), torch.ones(1, 4, 5))


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_a_metric_over_nothing_is_an_error_not_zero() -> None:
    """No pair, or no valid pixel: compute() refuses instead of reporting EPE 0 (which a sweep would pick)."""
    for metric in (FlowMetrics(), PerImageMetrics(), KittiSetMetrics()):
        with pytest.raises(NothingScoredError):
            metric.compute()
    no_valid_pixel = KittiSetMetrics()
    no_valid_pixel.update(PRED, GT, torch.zeros(1, 1, 4))
    with pytest.raises(NothingScoredError, match="no pixel was scored"):
        no_valid_pixel.compute()


@pytest.mark.parametrize("kind", sorted(SET_METRICS))
def test_a_bundles_keys_are_those_its_compute_returns(kind) -> None:
    """`metric_names()` (what a run may monitor as val/<set>/<key>, checked before training) against a scored bundle."""
    bundle = SET_METRICS[kind]()
    bundle.update(PRED, GT, torch.ones(1, 1, 4))
    assert bundle.metric_names() == list(bundle.compute())
    assert "epe" in bundle.metric_names()
