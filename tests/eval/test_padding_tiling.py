"""Official padding modes (`core/utils/utils.py` and `evaluate_FlowFormer_tile.py`) and Gaussian tiling."""

import pytest
import torch
import torch.nn.functional as F

from flowformer.eval.padding import InputPadder
from flowformer.eval.tiling import compute_grid_indices, compute_weight, tiled_flow


@pytest.mark.parametrize(
    ("shape", "mode", "expected"),
    [
        ((436, 1024), "sintel", (0, 0, 2, 2)),
        ((375, 1242), "sintel", (3, 3, 0, 1)),
        ((373, 1242), "sintel", (3, 3, 1, 2)),
        ((373, 1242), "default", (3, 3, 0, 3)),
        ((375, 1242), "kitti400", (0, 0, 0, 25)),
        ((375, 1242), "kitti432", (0, 0, 0, 57)),
        ((375, 1242), "kitti376", (0, 0, 0, 1)),
        ((375, 1242), "downzero", (0, 6, 0, 1)),
    ],
)
def test_padding_geometry(shape: tuple[int, int], mode: str, expected: tuple[int, int, int, int]) -> None:
    padder = InputPadder((1, 3, *shape), mode=mode)
    assert padder.padding == expected
    x = torch.rand(1, 3, *shape)
    (padded,) = padder.pad(x)
    assert padded.shape[-2:] == (shape[0] + expected[2] + expected[3], shape[1] + expected[0] + expected[1])
    assert torch.equal(padder.unpad(padded), x)


def test_padding_fill_values() -> None:
    x = torch.arange(1.0, 1.0 + 5 * 6).reshape(1, 1, 5, 6)
    (rep,) = InputPadder(x.shape, mode="sintel").pad(x)  # official non-tiled padder: replicate
    assert torch.equal(rep[0, 0, 0, 1:7], x[0, 0, 0])  # top row replicated: 5 -> 8 rows, top pad 1
    assert torch.equal(rep[0, 0, -1, 1:7], x[0, 0, -1])
    (zero,) = InputPadder(x.shape, mode="sintel", fill="zeros").pad(x)  # the tile-eval padder
    assert zero[0, 0, 0].abs().sum() == 0 and zero[0, 0, :, 0].abs().sum() == 0
    (down,) = InputPadder(x.shape, mode="downzero").pad(x)
    assert torch.equal(down[0, 0, :5, :6], x[0, 0]) and down[0, 0, 5:].abs().sum() == 0


def test_padding_errors() -> None:
    with pytest.raises(ValueError, match="unknown"):
        InputPadder((10, 10), mode="kitti")
    with pytest.raises(ValueError, match="376"):
        InputPadder((380, 1242), mode="kitti376")
    with pytest.raises(ValueError, match="one padder per image size"):
        InputPadder((16, 16)).pad(torch.zeros(1, 3, 8, 8))


@pytest.mark.parametrize(
    ("image", "tile", "expected"),
    [
        ((436, 1024), (432, 960), [(0, 0), (0, 64), (4, 0), (4, 64)]),  # Sintel: the paper's 4 corners
        ((376, 1242), (376, 720), [(0, 0), (0, 522), (0, 0), (0, 522)]),  # FF KITTI val: 4 passes, 2 tiles
        ((375, 1242), (288, 960), [(0, 0), (0, 282), (87, 0), (87, 282)]),  # FF++ KITTI val
        ((432, 1242), (432, 960), [(0, 0), (0, 282), (0, 0), (0, 282)]),  # KITTI submission
    ],
)
def test_grid_indices_match_spec(
    image: tuple[int, int], tile: tuple[int, int], expected: list[tuple[int, int]]
) -> None:
    assert compute_grid_indices(image, tile) == expected


def test_grid_indices_errors() -> None:
    with pytest.raises(ValueError, match="at least as large as the tile"):
        compute_grid_indices((375, 1242), (432, 960))
    # a middle tile that would cross the border (the official code crashes there) is clamped inside
    assert compute_grid_indices((40, 90), (40, 64)) == [(h, w) for h in (0, 0) for w in (0, 26, 26)]
    with pytest.raises(ValueError, match="min_overlap"):
        compute_grid_indices((64, 64), (16, 16), min_overlap=16)


def test_weight_values_match_spec() -> None:
    w = compute_weight((432, 960), sigma=0.05)
    assert w.dtype == torch.float32 and w.shape == (432, 960)
    peak = 1.0 / (0.05 * (2 * torch.pi) ** 0.5)
    assert w.max().item() == pytest.approx(peak, rel=1e-6)
    assert w[216, 480].item() == pytest.approx(peak, rel=1e-6)  # centre at index th/2 (normalised by th)
    assert w[0, 480].item() == pytest.approx(1.54e-21, rel=0.01)  # middle of an edge: exp(-50) * peak
    corner = w[0, 0].item()
    assert 0.0 < corner < torch.finfo(torch.float32).tiny  # a float32 subnormal, not flushed
    assert corner == pytest.approx(2.97e-43, rel=0.02)
    assert w[0, 0].to(torch.bfloat16).item() == 0.0  # why the blend must stay fp32


def _pointwise_flow(img1: torch.Tensor, img2: torch.Tensor) -> torch.Tensor:
    """A translation-equivariant dummy 'network' without border effects: flow depends on the pixel only."""
    return torch.stack([img1[:, 0] - img2[:, 1], 0.5 * img1[:, 2] + img2[:, 0]], dim=1)


def _official_blend(flow_fn, image1, image2, tile, min_overlap, sigma=0.05):
    """The official accumulation with F.pad, written out for the parity check."""
    height, width = image1.shape[-2:]
    weight = compute_weight(tile, sigma)[None, None]
    flows, count = 0, 0
    for h, w in compute_grid_indices((height, width), tile, min_overlap):
        flow = flow_fn(
            image1[:, :, h : h + tile[0], w : w + tile[1]], image2[:, :, h : h + tile[0], w : w + tile[1]]
        )
        padding = (w, width - w - tile[1], h, height - h - tile[0], 0, 0)
        flows = flows + F.pad(flow * weight, padding)
        count = count + F.pad(weight, padding)
    return flows / count


def test_tiled_equals_untiled_for_equivariant_model_and_official_blend() -> None:
    gen = torch.Generator().manual_seed(0)
    image1 = torch.rand(2, 3, 60, 100, generator=gen) * 255
    image2 = torch.rand(2, 3, 60, 100, generator=gen) * 255
    full = _pointwise_flow(image1, image2)
    assert compute_grid_indices((60, 100), (32, 48), min_overlap=8) == [
        (h, w) for h in (0, 24, 28) for w in (0, 40, 52)
    ]
    tiled = tiled_flow(_pointwise_flow, image1, image2, tile_size=(32, 48), min_overlap=8)
    assert torch.isfinite(tiled).all()
    # image corners are covered by one tile corner only (weight ~1e-40, a subnormal with few mantissa bits)
    torch.testing.assert_close(tiled, full, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(tiled[..., 8:-8, 8:-8], full[..., 8:-8, 8:-8], rtol=1e-5, atol=1e-4)
    assert torch.equal(tiled, _official_blend(_pointwise_flow, image1, image2, (32, 48), 8))


def test_tiled_blend_is_fp32_under_low_precision_and_corners_stay_finite() -> None:
    image1 = torch.full((1, 3, 436, 1024), 10.0)
    image2 = torch.full((1, 3, 436, 1024), 4.0)
    calls: list[torch.dtype] = []

    def bf16_net(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
        out = _pointwise_flow(t1, t2).to(torch.bfloat16)  # what a bf16-mixed network hands back
        calls.append(out.dtype)
        return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        flow = tiled_flow(bf16_net, image1, image2, tile_size=(432, 960))
    assert calls == [torch.bfloat16] * 4
    assert flow.dtype == torch.float32 and torch.isfinite(flow).all()
    torch.testing.assert_close(flow[0, :, 0, 0], torch.tensor([6.0, 9.0]), rtol=1e-2, atol=0)  # corner pixel


def test_deduplicate_halves_passes_with_the_same_result() -> None:
    image1 = torch.rand(1, 3, 40, 80) * 255
    image2 = torch.rand(1, 3, 40, 80) * 255
    counts = {"calls": 0}

    def counting(t1: torch.Tensor, t2: torch.Tensor) -> torch.Tensor:
        counts["calls"] += 1
        return _pointwise_flow(t1, t2)

    official = tiled_flow(counting, image1, image2, tile_size=(40, 64))  # hs [0, 0] x ws [0, 16]
    assert counts["calls"] == 4
    fast = tiled_flow(counting, image1, image2, tile_size=(40, 64), deduplicate=True)
    assert counts["calls"] == 6
    torch.testing.assert_close(fast, official, rtol=1e-5, atol=1e-5)
