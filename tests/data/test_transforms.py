"""Augmentation keeps flow consistent with its images (dense and sparse), and the photometric parts behave."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowformer.data.transforms import (
    ColorJitter,
    FlowAugmentor,
    ImagePairAugmentor,
    SparseFlowAugmentor,
    resample_sparse_flow,
)


def _scene(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A smooth colour pattern (periods of 20-40 px) -> uint8-range float [..., 3]."""
    channels = [
        128 + 100 * np.sin(x / 7.0) * np.cos(y / 9.0),
        128 + 100 * np.sin((x + y) / 11.0),
        128 + 100 * np.cos(x / 13.0 - y / 6.0),
    ]
    return np.stack(channels, axis=-1)


def _smooth_pair(height: int = 120, width: int = 160) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """img1(p) = img2(p + flow(p)) exactly, for an affine flow field."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    u = 4.0 + 0.03 * x - 0.02 * y
    v = -3.0 + 0.01 * x + 0.02 * y
    img2 = _scene(x, y)
    img1 = _scene(x + u, y + v)
    flow = np.stack([u, v], axis=-1).astype(np.float32)
    return np.round(img1).astype(np.uint8), np.round(img2).astype(np.uint8), flow


def _warp_error(
    img1: np.ndarray, img2: np.ndarray, flow: np.ndarray, mask: np.ndarray | None = None
) -> float:
    """Mean |img2(p + flow(p)) - img1(p)| over pixels whose target lies inside img2 (and inside ``mask``)."""
    height, width = flow.shape[:2]
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    tx, ty = x + flow[..., 0], y + flow[..., 1]
    grid = torch.from_numpy(np.stack([2 * tx / (width - 1) - 1, 2 * ty / (height - 1) - 1], axis=-1))[None]
    source = torch.from_numpy(img2.astype(np.float32)).permute(2, 0, 1)[None]
    warped = F.grid_sample(source, grid.float(), align_corners=True)[0].permute(1, 2, 0).numpy()
    inside = (tx >= 1) & (tx <= width - 2) & (ty >= 1) & (ty <= height - 2)
    if mask is not None:
        inside &= mask > 0.5
    assert inside.sum() > 50
    return float(np.abs(warped - img1.astype(np.float32))[inside].mean())


def _assert_consistent(
    img1: np.ndarray, img2: np.ndarray, flow: np.ndarray, tolerance: float, mask: np.ndarray | None = None
) -> None:
    """The flow warps img2 onto img1 within `tolerance` grey levels, and zero flow does not (so the test bites)."""
    assert _warp_error(img1, img2, flow, mask) < tolerance
    assert _warp_error(img1, img2, np.zeros_like(flow), mask) > 10.0


def _without_geometry(**settings) -> FlowAugmentor:
    """A FlowAugmentor for 64x80 images that neither scales, stretches, crops nor flips."""
    return FlowAugmentor(
        crop_size=(64, 80),
        spatial_prob=0.0,
        do_flip=False,
        min_scale=0.0,
        max_scale=0.0,
        stretch_prob=0.0,
        **settings,
    )


def test_smooth_pair_is_consistent_before_augmentation() -> None:
    _assert_consistent(*_smooth_pair(), tolerance=1.0)


@pytest.mark.parametrize("seed", range(8))
def test_dense_spatial_augmentation_keeps_flow_consistent(seed: int) -> None:
    img1, img2, flow = _smooth_pair()
    augmentor = FlowAugmentor(
        crop_size=(64, 96),
        min_scale=-0.2,
        max_scale=0.6,
        photometric=False,
        eraser_prob=0.0,
        h_flip_prob=0.5,
        v_flip_prob=0.5,
    )
    a1, a2, aflow = augmentor(img1, img2, flow, np.random.default_rng(seed))
    assert a1.shape == a2.shape == (64, 96, 3) and a1.dtype == np.uint8
    assert aflow.shape == (64, 96, 2) and aflow.dtype == np.float32
    _assert_consistent(a1, a2, aflow, tolerance=1.5)


def test_flips_negate_the_matching_flow_component() -> None:
    img1, img2, flow = _smooth_pair()
    augmentor = FlowAugmentor(
        crop_size=(112, 152),
        min_scale=0.0,
        max_scale=0.0,
        photometric=False,
        eraser_prob=0.0,
        spatial_prob=0.0,
        h_flip_prob=1.0,
        v_flip_prob=1.0,
    )
    a1, a2, aflow = augmentor(img1, img2, flow, np.random.default_rng(0))
    assert np.all(aflow[..., 0] < 0)  # u > 0 everywhere before the horizontal flip
    _assert_consistent(a1, a2, aflow, tolerance=1.0)


@pytest.mark.parametrize("seed", range(6))
def test_sparse_augmentation_keeps_valid_points_consistent(seed: int) -> None:
    img1, img2, flow = _smooth_pair()
    valid = (np.random.default_rng(100 + seed).random(flow.shape[:2]) < 0.3).astype(np.float32)
    valid[-10:] = 0.0  # targets stay clear of the zero padding added below the image
    flow = flow * valid[..., None]
    # crop taller than the image: exercises the bottom zero-padding
    augmentor = SparseFlowAugmentor(
        crop_size=(128, 96),
        min_scale=-0.2,
        max_scale=0.5,
        do_flip=True,
        photometric=False,
        eraser_prob=0.0,
    )
    a1, a2, aflow, avalid = augmentor(img1, img2, flow, valid, np.random.default_rng(seed))
    assert a1.shape == (128, 96, 3) and aflow.shape == (128, 96, 2) and avalid.shape == (128, 96)
    assert set(np.unique(avalid)) <= {0.0, 1.0} and avalid.sum() > 100
    assert np.all(aflow[avalid == 0] == 0)
    _assert_consistent(a1, a2, aflow, tolerance=2.0, mask=avalid)


def test_resample_sparse_flow_scatters_and_scales() -> None:
    flow = np.zeros((10, 12, 2), dtype=np.float32)
    valid = np.zeros((10, 12), dtype=np.float32)
    flow[0, 0] = (1.0, 2.0)
    valid[0, 0] = 1.0  # row/column 0: the official strict `> 0` test would drop it
    flow[5, 6] = (3.0, -1.0)
    valid[5, 6] = 1.0
    same_flow, same_valid = resample_sparse_flow(flow, valid, 1.0, 1.0)
    np.testing.assert_array_equal(same_flow, flow)
    np.testing.assert_array_equal(same_valid, valid)
    up_flow, up_valid = resample_sparse_flow(flow, valid, 2.0, 2.0)
    assert up_flow.shape == (20, 24, 2) and up_valid.sum() == 2
    # pixel (6, 5) -> (6.5 * 2 - 0.5, 5.5 * 2 - 0.5) = (12.5, 10.5) -> rounded half up to (13, 11); flow doubled
    np.testing.assert_allclose(up_flow[11, 13], (6.0, -2.0))
    assert up_valid[11, 13] == 1.0 and up_valid[1, 1] == 1.0


def _noise_image() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(64, 80, 3), dtype=np.uint8)


def test_eraser_touches_only_img2() -> None:
    img = _noise_image()
    flow = np.zeros((64, 80, 2), dtype=np.float32)
    eraser_only = _without_geometry(photometric=False, eraser_prob=1.0)
    out1, out2, _ = eraser_only(img, img.copy(), flow, np.random.default_rng(1))
    np.testing.assert_array_equal(out1, img)
    changed = (out2 != img).any(axis=-1)
    assert changed.sum() > 0
    np.testing.assert_allclose(
        out2[changed], np.broadcast_to(img.reshape(-1, 3).mean(0), (changed.sum(), 3)), atol=1
    )


def test_color_jitter_changes_the_image() -> None:
    img = _noise_image()
    jitter = ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4, hue=0.5 / 3.14)
    assert not np.array_equal(jitter(img, np.random.default_rng(3)), img)


@pytest.mark.parametrize("asymmetric_prob", [0.0, 1.0])
def test_photometric_jitter_is_shared_unless_asymmetric(asymmetric_prob: float) -> None:
    img = _noise_image()
    augmentor = _without_geometry(asymmetric_prob=asymmetric_prob, eraser_prob=0.0)
    out1, out2, _ = augmentor(img, img.copy(), np.zeros((64, 80, 2), np.float32), np.random.default_rng(4))
    assert np.array_equal(out1, out2) == (asymmetric_prob == 0.0)


def test_image_pair_augmentor_crops_and_keeps_alignment() -> None:
    img1, _, _ = _smooth_pair()
    augmentor = ImagePairAugmentor(crop_size=(64, 96))
    same1, same2 = augmentor(img1, img1.copy(), np.random.default_rng(0))
    assert same1.shape == (64, 96, 3)
    # no eraser and a shared geometry: identical inputs stay identical up to (asymmetric) colour changes
    assert np.corrcoef(same1[..., 0].ravel().astype(float), same2[..., 0].ravel().astype(float))[0, 1] > 0.9


def test_bad_crop_settings_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="crop_size"):
        FlowAugmentor(crop_size=(64,))
    img = np.zeros((32, 32, 3), dtype=np.uint8)
    too_small = FlowAugmentor(crop_size=(64, 64), spatial_prob=0.0, photometric=False)
    with pytest.raises(ValueError, match="smaller than the crop"):
        too_small(img, img, np.zeros((32, 32, 2), np.float32), np.random.default_rng(0))


def test_color_jitter_ops_match_torchvision_on_pil() -> None:
    """Each op equals torchvision's PIL path (what the official code runs) to 1 grey level; hue on average."""
    tvf = pytest.importorskip("torchvision.transforms.functional")
    from PIL import Image

    from flowformer.data.transforms import _blend, _shift_hue

    img = np.random.default_rng(0).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    pil = Image.fromarray(img)
    grey = np.repeat(np.asarray(pil.convert("L"))[..., None], 3, axis=2)
    mean_grey = int(np.asarray(pil.convert("L")).mean() + 0.5)
    cases = [
        (tvf.adjust_brightness(pil, 1.3), _blend(img, 0, 1.3)),
        (tvf.adjust_contrast(pil, 0.7), _blend(img, mean_grey, 0.7)),
        (tvf.adjust_saturation(pil, 1.4), _blend(img, grey, 1.4)),
    ]
    for expected, ours in cases:
        assert np.abs(np.asarray(expected).astype(int) - ours).max() <= 1
    hue_diff = np.abs(np.asarray(tvf.adjust_hue(pil, -0.13)).astype(int) - _shift_hue(img, -0.13))
    assert hue_diff.mean() < 2.0


def test_worker_rng_is_reproducible_per_seed_and_distinct_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from flowformer.data import transforms

    def draws(seed: int, rank: int) -> np.ndarray:
        monkeypatch.setattr(transforms, "_global_rank", lambda: rank)
        torch.manual_seed(seed)
        return transforms.WorkerRNG().get().random(4)

    np.testing.assert_array_equal(draws(7, 0), draws(7, 0))
    assert not np.array_equal(draws(7, 0), draws(7, 1))
    assert not np.array_equal(draws(7, 0), draws(8, 0))
