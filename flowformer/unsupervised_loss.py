"""Unsupervised (photometric) flow loss: the conventional recipe FlowFormer++ compares MCVA with (UFlow, SMURF,
ARFlow). Image 2 is warped backward by the predicted flow and compared with image 1 where the pixel is visible
(forward-backward consistent and inside the frame), plus an edge-aware smoothness term.

The differentiable image operations are kornia's: SSIM (`kornia.metrics.ssim`), the spatial derivatives
(`kornia.filters.spatial_gradient`), the grey conversion (`kornia.color.rgb_to_grayscale`) and the backward warp
(`kornia.geometry.transform.remap` on kornia's `create_meshgrid` grid, from `kornia.geometry` where kornia has it:
0.8.3 and newer, for Python 3.11 and newer, which deprecate `kornia.utils`; from `kornia.utils` in 0.7 to 0.8.2,
the newest for Python 3.10). The census transform is written
here: kornia has none. kornia is imported by the functions that use it, so that a run without this loss does not
pay its import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

SSIM_WINDOW = 3  # ARFlow's 3x3 SSIM window: local structure at the scale of a pixel's neighbours
CENSUS_WINDOW = 7  # UFlow's and SMURF's 7x7 census neighbourhood
CENSUS_SOFTNESS = 0.81  # UFlow's soft sign: d / sqrt(0.81 + d^2) on grey levels 0..255
HAMMING_SOFTNESS = 0.1  # UFlow's soft Hamming distance: t^2 / (0.1 + t^2) per neighbour
ROBUST_EPSILON, ROBUST_POWER = 0.01, 0.4  # UFlow's robust penalty (d + 0.01)^0.4 of the census distance d >= 0


@dataclass(frozen=True)
class UnsupervisedLossSettings:
    """The knobs of the loss (conf/model/unsup.yaml holds their defaults and why).

    l1_weight, ssim_weight, census_weight: the photometric terms, on images scaled to 0..1.
    smooth_weight, smooth_order: the edge-aware smoothness of flow / min(H, W), first or second derivatives.
    edge_constant: the smoothness at a pixel is weighted by exp(-edge_constant * mean_c |dI/dx|) (and y).
    mask_occlusions: leave pixels whose forward and backward flows disagree out of the photometric terms:
        |f + b(x + f)|^2 > occlusion_relative * (|f|^2 + |b(x + f)|^2) + occlusion_absolute.
    gamma: iteration i of N is weighted by gamma^(N-1-i), as the supervised sequence loss.
    """

    l1_weight: float
    ssim_weight: float
    census_weight: float
    smooth_weight: float
    smooth_order: int
    edge_constant: float
    mask_occlusions: bool
    occlusion_relative: float
    occlusion_absolute: float
    gamma: float

    def __post_init__(self) -> None:
        for name in ("l1_weight", "ssim_weight", "census_weight", "smooth_weight", "edge_constant", "gamma"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name}={getattr(self, name)}: must be >= 0")
        if not any(self.photometric_weights().values()):
            raise ValueError(
                "model.l1_weight, model.ssim_weight and model.census_weight are all 0: the loss needs a "
                "photometric term; set at least one > 0 (defaults: l1 0.15, ssim 0.85)"
            )
        if self.smooth_order not in (1, 2):
            raise ValueError(f"model.smooth_order={self.smooth_order}: expected 1 or 2 (flow derivatives)")

    def photometric_weights(self) -> dict[str, float]:
        return {"l1": self.l1_weight, "ssim": self.ssim_weight, "census": self.census_weight}


def backward_warp(image: Tensor, flow: Tensor) -> tuple[Tensor, Tensor]:
    """image [B, C, H, W] sampled at x + flow(x) (bilinear, zeros outside) -> (warped [B, C, H, W], inside
    [B, 1, H, W] bool: x + flow(x) lies in the frame)."""
    from kornia.geometry.transform import remap

    try:
        from kornia.geometry import create_meshgrid
    except ImportError:  # kornia before 0.8.3
        from kornia.utils import create_meshgrid

    _, _, height, width = image.shape
    grid = create_meshgrid(height, width, False, device=flow.device, dtype=flow.dtype)  # [1, H, W, (x, y)]
    map_x = grid[..., 0] + flow[:, 0]  # [B, H, W]
    map_y = grid[..., 1] + flow[:, 1]
    warped = remap(image, map_x, map_y, align_corners=True, normalized_coordinates=False)
    inside = (map_x >= 0) & (map_x <= width - 1) & (map_y >= 0) & (map_y <= height - 1)
    return warped, inside[:, None]


def occluded_pixels(forward: Tensor, backward_at_target: Tensor, *, relative: float, absolute: float) -> Tensor:
    """Forward-backward consistency: the flow (1 -> 2) [B, 2, H, W] and the flow (2 -> 1) sampled where it
    lands, backward(x + forward(x)) [B, 2, H, W] -> occluded [B, 1, H, W] bool, where the second does not bring
    the pixel back."""
    mismatch = (forward + backward_at_target).square().sum(1, keepdim=True)
    magnitude = forward.square().sum(1, keepdim=True) + backward_at_target.square().sum(1, keepdim=True)
    return mismatch > relative * magnitude + absolute


def census_transform(image: Tensor) -> Tensor:
    """image [B, 3, H, W] in 0..1 -> the soft signs of each 7x7 neighbour's difference to the centre, on grey
    levels 0..255 [B, 49, H, W] (borders replicated)."""
    from kornia.color import rgb_to_grayscale

    grey = rgb_to_grayscale(image) * 255.0  # [B, 1, H, W]
    pad = CENSUS_WINDOW // 2
    neighbours = F.unfold(F.pad(grey, (pad,) * 4, mode="replicate"), CENSUS_WINDOW)  # [B, 49, H*W]
    difference = neighbours.view(grey.shape[0], -1, *grey.shape[-2:]) - grey  # [B, 49, H, W]
    return difference / torch.sqrt(CENSUS_SOFTNESS + difference.square())


def census_distance(image1: Tensor, warped2: Tensor) -> Tensor:
    """Images [B, 3, H, W] in 0..1 -> UFlow's robust soft Hamming distance of their census transforms
    [B, 1, H, W]."""
    difference = (census_transform(image1) - census_transform(warped2)).square()  # [B, 49, H, W]
    hamming = (difference / (HAMMING_SOFTNESS + difference)).sum(1, keepdim=True)
    return (hamming + ROBUST_EPSILON).pow(ROBUST_POWER)


def photometric_maps(image1: Tensor, warped2: Tensor, weights: dict[str, float]) -> dict[str, Tensor]:
    """Per-pixel errors [B, 1, H, W] of the terms with a weight > 0, images [B, 3, H, W] in 0..1."""
    from kornia.metrics import ssim

    errors = {
        "l1": lambda: (image1 - warped2).abs().mean(1, keepdim=True),
        "ssim": lambda: ((1 - ssim(image1, warped2, SSIM_WINDOW)) / 2).clamp(0, 1).mean(1, keepdim=True),
        "census": lambda: census_distance(image1, warped2),
    }
    return {name: error() for name, error in errors.items() if weights[name] > 0}


def edge_aware_smoothness(flow: Tensor, image: Tensor, *, order: int, edge_constant: float) -> Tensor:
    """Mean over the interior pixels of exp(-edge_constant * mean_c |dI/dd|) * |d^order flow / dd^order| for
    d = x, y; flow [B, 2, H, W] in units of min(H, W) (ARFlow's scale), image [B, 3, H, W] in 0..1."""
    from kornia.filters import spatial_gradient

    image_slope = spatial_gradient(image, mode="diff", order=1).abs().mean(1)  # [B, (x, y), H, W]
    edge_weight = torch.exp(-edge_constant * image_slope)
    if order == 1:
        derivatives = spatial_gradient(flow, mode="diff", order=1)  # [B, 2, (x, y), H, W]
    else:  # [1, -2, 1] unnormalised: the second derivative; kornia's order 2 is (xx, xy, yy)
        derivatives = spatial_gradient(flow, mode="diff", order=2, normalized=False)[:, :, 0::2]
    # the 1-pixel border is left out: its derivatives see kornia's replicated padding, not the flow
    penalty = edge_weight[:, None] * derivatives.abs()  # [B, 2, 2, H, W]
    return penalty[..., 1:-1, 1:-1].mean()


def masked_mean(error: Tensor, keep: Tensor) -> Tensor:
    """Mean of error [B, 1, H, W] over the pixels where keep [B, 1, H, W] is true (0 where none is)."""
    return (error * keep).sum() / keep.sum().clamp_min(1)


def unsupervised_loss(
    flow_predictions: Sequence[Tensor], image1: Tensor, image2: Tensor, settings: UnsupervisedLossSettings
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of the flows of each iteration [B, 2, H, W] from image1 to image2 [B, 3, H, W] (0..255).

    The batch must hold each pair in both directions: item k + B/2 is item k reversed (see
    `UnsupervisedPretrainModule`), so the backward flow of item k is item k + B/2 of the same prediction. The
    visible pixels come from the last prediction, without gradient, and serve every iteration (ARFlow).
    Computed in fp32 whatever the autocast. Returns the loss and the detached terms: each term's
    gamma-weighted sum over iterations (unweighted by its knob) and the fractions of pixels left out,
    `occluded_fraction` (forward-backward check) and `outside_fraction` (flow leaving the frame).
    """
    with torch.autocast(image1.device.type, enabled=False):
        image1, image2 = image1.float() / 255.0, image2.float() / 255.0
        flows = [flow.float() for flow in flow_predictions]
        keep, fractions = visible_pixels(flows[-1].detach(), settings)
        terms = iteration_terms(flows, image1, image2, keep, settings)
        weights = {**settings.photometric_weights(), "smoothness": settings.smooth_weight}
        loss = sum(weights[name] * value for name, value in terms.items())
    return loss, {**{name: value.detach() for name, value in terms.items()}, **fractions}


def visible_pixels(flow: Tensor, settings: UnsupervisedLossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """flow [2B, 2, H, W] of the pairs and their reverses -> (pixels the photometric terms see [2B, 1, H, W]
    bool, the fractions left out as occluded and as leaving the frame)."""
    reverse = flow.roll(flow.shape[0] // 2, dims=0)  # item k <-> item k + B/2: the flow back
    reverse_at_target, inside = backward_warp(reverse, flow)
    occluded = torch.zeros_like(inside)
    if settings.mask_occlusions:
        occluded = occluded_pixels(
            flow, reverse_at_target, relative=settings.occlusion_relative, absolute=settings.occlusion_absolute
        )
    fractions = {"occluded_fraction": occluded.float().mean(), "outside_fraction": (~inside).float().mean()}
    return inside & ~occluded, fractions


def iteration_terms(
    flows: Sequence[Tensor], image1: Tensor, image2: Tensor, keep: Tensor, settings: UnsupervisedLossSettings
) -> dict[str, Tensor]:
    """Each term's sum over iterations i of gamma^(N-1-i) * term(flow_i); images in 0..1."""
    terms: dict[str, Tensor] = {}
    scale = min(image1.shape[-2:])
    for i, flow in enumerate(flows):
        weight = settings.gamma ** (len(flows) - 1 - i)
        if weight == 0:
            continue
        warped2, _ = backward_warp(image2, flow)
        # both images zeroed where hidden (ARFlow): no hidden pixel differs inside the SSIM and census windows
        errors = photometric_maps(image1 * keep, warped2 * keep, settings.photometric_weights())
        values = {name: masked_mean(error, keep) for name, error in errors.items()}
        if settings.smooth_weight > 0:
            values["smoothness"] = edge_aware_smoothness(
                flow / scale, image1, order=settings.smooth_order, edge_constant=settings.edge_constant
            )
        for name, value in values.items():
            terms[name] = terms.get(name, 0.0) + weight * value
    return terms
