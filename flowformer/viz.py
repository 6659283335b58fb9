"""Flow pictures: the Middlebury colour wheel (numpy and torch), an end-point-error map, and panels.

Colour coding (Baker et al., "A Database and Evaluation Methodology for Optical Flow", the Middlebury
``flowToColor`` code): the direction of a flow vector picks the hue from a 55-colour wheel, its length
relative to the largest length in the picture (or a fixed ``max_flow``) the saturation; vectors longer than
the normaliser are drawn darker. Pure +x flow (right) is red, +y (down) orange-yellow, -x (left) light
blue, -y (up) violet-blue; zero flow is white.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from flowformer.data.io import write_image

__all__ = [
    "epe_map",
    "error_to_color",
    "flow_panel",
    "flow_to_color",
    "make_colorwheel",
    "stack_panels",
    "write_flow_image",
]

# Segment lengths of the Middlebury wheel: red->yellow, yellow->green, green->cyan, cyan->blue,
# blue->magenta, magenta->red (55 colours in all).
_SEGMENTS = (("RY", 15), ("YG", 6), ("GC", 4), ("CB", 11), ("BM", 13), ("MR", 6))
_EPS = 1e-5

# KITTI devkit error colours: bins of the normalised error min(epe / 3 px, epe / (5% of |gt|)), RGB.
_ERROR_BINS = (
    (0.0, 0.0625, (49, 54, 149)),
    (0.0625, 0.125, (69, 117, 180)),
    (0.125, 0.25, (116, 173, 209)),
    (0.25, 0.5, (171, 217, 233)),
    (0.5, 1.0, (224, 243, 248)),
    (1.0, 2.0, (254, 224, 144)),
    (2.0, 4.0, (253, 174, 97)),
    (4.0, 8.0, (244, 109, 67)),
    (8.0, 16.0, (215, 48, 39)),
    (16.0, float("inf"), (165, 0, 38)),
)


def make_colorwheel() -> np.ndarray:
    """The Middlebury colour wheel -> float64 [55, 3] RGB in 0..255, ordered by angle."""
    segments = []
    for name, n in _SEGMENTS:
        up = np.floor(255 * np.arange(n) / n)  # the colour channel that ramps in this segment
        down, full, zero = 255 - up, np.full(n, 255.0), np.zeros(n)
        rgb = {
            "RY": (full, up, zero),
            "YG": (down, full, zero),
            "GC": (zero, full, up),
            "CB": (zero, down, full),
            "BM": (up, zero, full),
            "MR": (full, zero, down),
        }[name]
        segments.append(np.stack(rgb, axis=1))
    return np.concatenate(segments, axis=0)


_WHEEL = make_colorwheel()


def _check_max_flow(max_flow: float | None) -> None:
    if max_flow is not None and not max_flow > 0:
        raise ValueError(
            f"flow_to_color: max_flow must be positive or None (use the largest length), got {max_flow}"
        )


def _flow_to_color_numpy(flow: np.ndarray, max_flow: float | None) -> np.ndarray:
    """flow [H, W, 2] -> uint8 [H, W, 3]."""
    u, v = (np.nan_to_num(flow[..., i].astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0) for i in (0, 1))
    radius = np.sqrt(u**2 + v**2)
    norm = (max_flow if max_flow is not None else radius.max()) + _EPS
    u, v, radius = u / norm, v / norm, radius / norm
    ncols = len(_WHEEL)
    angle = np.arctan2(-v, -u) / np.pi  # -1..1
    position = (angle + 1) / 2 * (ncols - 1)  # 0..ncols-1
    k0 = np.floor(position).astype(np.int64)
    k1 = (k0 + 1) % ncols
    frac = (position - k0)[..., None]
    colour = ((1 - frac) * _WHEEL[k0] + frac * _WHEEL[k1]) / 255.0  # [H, W, 3] in 0..1
    inside = (radius <= 1)[..., None]
    colour = np.where(inside, 1 - radius[..., None] * (1 - colour), colour * 0.75)
    return np.floor(255 * colour).astype(np.uint8)


def _flow_to_color_torch(flow: torch.Tensor, max_flow: float | None) -> torch.Tensor:
    """flow [B, 2, H, W] -> uint8 [B, 3, H, W]; each picture is normalised by its own largest length."""
    flow = torch.nan_to_num(flow.detach().double(), nan=0.0, posinf=0.0, neginf=0.0)
    u, v = flow[:, 0], flow[:, 1]
    radius = torch.sqrt(u**2 + v**2)
    if max_flow is None:
        norm = radius.flatten(1).amax(dim=1).view(-1, 1, 1) + _EPS
    else:
        norm = torch.full_like(radius[:, :1, :1], max_flow + _EPS)
    u, v, radius = u / norm, v / norm, radius / norm
    wheel = torch.as_tensor(_WHEEL, dtype=torch.float64, device=flow.device)
    ncols = wheel.shape[0]
    angle = torch.atan2(-v, -u) / torch.pi
    position = (angle + 1) / 2 * (ncols - 1)
    k0 = torch.floor(position).long()
    k1 = (k0 + 1) % ncols
    frac = (position - k0).unsqueeze(-1)
    colour = ((1 - frac) * wheel[k0] + frac * wheel[k1]) / 255.0  # [B, H, W, 3]
    inside = (radius <= 1).unsqueeze(-1)
    colour = torch.where(inside, 1 - radius.unsqueeze(-1) * (1 - colour), colour * 0.75)
    return torch.floor(255 * colour).to(torch.uint8).permute(0, 3, 1, 2).contiguous()


def flow_to_color(
    flow: np.ndarray | torch.Tensor, max_flow: float | None = None
) -> np.ndarray | torch.Tensor:
    """Colour-code flow with the Middlebury wheel.

    numpy [H, W, 2] -> uint8 [H, W, 3]; torch [B, 2, H, W] -> uint8 [B, 3, H, W] (or [2, H, W] -> [3, H, W]),
    on the input's device. Lengths are divided by the largest length of each picture, or by ``max_flow``
    when given (use a fixed value to compare pictures). Non-finite vectors are drawn as zero flow (white).
    """
    _check_max_flow(max_flow)
    if isinstance(flow, torch.Tensor):
        if flow.ndim == 3 and flow.shape[0] == 2:
            return _flow_to_color_torch(flow.unsqueeze(0), max_flow)[0]
        if flow.ndim != 4 or flow.shape[1] != 2:
            raise ValueError(
                f"flow_to_color: expected a torch flow [B, 2, H, W] or [2, H, W], got {tuple(flow.shape)}"
            )
        return _flow_to_color_torch(flow, max_flow)
    flow = np.asarray(flow)
    if flow.ndim != 3 or flow.shape[2] != 2:
        raise ValueError(f"flow_to_color: expected a numpy flow [H, W, 2], got {tuple(flow.shape)}")
    return _flow_to_color_numpy(flow, max_flow)


def epe_map(pred: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """Per-pixel end-point error ||pred - gt||_2: numpy flows [H, W, 2] -> float32 [H, W]."""
    pred, gt = np.asarray(pred, dtype=np.float64), np.asarray(gt, dtype=np.float64)
    if pred.shape != gt.shape or pred.ndim != 3 or pred.shape[2] != 2:
        raise ValueError(
            f"epe_map: expected two flows [H, W, 2] of equal shape, got {pred.shape} and {gt.shape}"
        )
    return np.sqrt(((pred - gt) ** 2).sum(axis=2)).astype(np.float32)


def error_to_color(pred: np.ndarray, gt: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """Colour-code the flow error with the KITTI devkit scale -> uint8 [H, W, 3].

    The error is normalised as min(epe / 3 px, epe / (0.05 * |gt|)), so 1.0 is exactly the KITTI outlier
    threshold (epe > 3 px and > 5 %); bins run from dark blue (< 1/16) through white (0.5..1) to dark red
    (> 16). Pixels with ``valid`` < 0.5 are black.
    """
    epe = epe_map(pred, gt).astype(np.float64)
    magnitude = np.sqrt((np.asarray(gt, dtype=np.float64) ** 2).sum(axis=2))
    normalised = np.minimum(epe / 3.0, epe / np.maximum(0.05 * magnitude, _EPS))
    normalised = np.nan_to_num(normalised, nan=np.inf)
    out = np.zeros((*epe.shape, 3), dtype=np.uint8)
    for low, high, colour in _ERROR_BINS:
        out[(normalised >= low) & (normalised < high)] = colour
    if valid is not None:
        valid = np.asarray(valid)
        if valid.shape != epe.shape:
            raise ValueError(
                f"error_to_color: valid mask shape {valid.shape} does not match the flow {epe.shape}"
            )
        out[valid < 0.5] = 0
    return out


def _as_hwc(array: np.ndarray | torch.Tensor, channels: int, name: str) -> np.ndarray:
    """torch [C, H, W] or numpy [H, W, C] -> numpy [H, W, C]."""
    if isinstance(array, torch.Tensor):
        array = array.detach().float().cpu().numpy()
        if array.ndim == 3 and array.shape[0] == channels:
            array = array.transpose(1, 2, 0)
    array = np.asarray(array)
    if array.ndim != 3 or array.shape[2] != channels:
        raise ValueError(
            f"{name} must be torch [{channels}, H, W] or numpy [H, W, {channels}], got {tuple(array.shape)}"
        )
    return array


def flow_panel(
    image: np.ndarray | torch.Tensor,
    flow_pred: np.ndarray | torch.Tensor,
    flow_gt: np.ndarray | torch.Tensor | None = None,
    valid: np.ndarray | torch.Tensor | None = None,
    max_flow: float | None = None,
) -> np.ndarray:
    """One picture, side by side: image | ground truth | prediction | error -> uint8 [H, 4W, 3].

    Without ground truth the panel is image | prediction -> [H, 2W, 3]. Inputs are single samples, torch
    channels-first ([3, H, W] image in 0..255, [2, H, W] flows, [H, W] valid) or numpy channels-last. Both
    flows share one normaliser (``max_flow``, else the largest valid ground-truth length), so their colours
    compare directly.
    """
    image = np.clip(_as_hwc(image, 3, "flow_panel: image"), 0, 255).astype(np.uint8)
    pred = _as_hwc(flow_pred, 2, "flow_panel: flow_pred")
    if pred.shape[:2] != image.shape[:2]:
        raise ValueError(f"flow_panel: flow_pred is {pred.shape[:2]} but the image is {image.shape[:2]}")
    if flow_gt is None:
        return np.concatenate([image, flow_to_color(pred, max_flow)], axis=1)
    gt = _as_hwc(flow_gt, 2, "flow_panel: flow_gt")
    if gt.shape != pred.shape:
        raise ValueError(f"flow_panel: flow_gt is {gt.shape[:2]} but flow_pred is {pred.shape[:2]}")
    if isinstance(valid, torch.Tensor):
        valid = valid.detach().float().cpu().numpy()
    mask = np.ones(gt.shape[:2], dtype=bool) if valid is None else np.asarray(valid) >= 0.5
    if max_flow is None:
        lengths = np.sqrt((np.nan_to_num(gt) ** 2).sum(axis=2))[mask]
        max_flow = float(lengths.max()) if lengths.size and lengths.max() > 0 else 1.0
    gt_rgb = flow_to_color(np.where(mask[..., None], gt, 0.0), max_flow)
    pred_rgb = flow_to_color(pred, max_flow)
    return np.concatenate([image, gt_rgb, pred_rgb, error_to_color(pred, gt, valid)], axis=1)


def stack_panels(panels: list[np.ndarray], gap: int = 4) -> np.ndarray:
    """Panels of one width (uint8 [H_i, W, 3], e.g. flow_panel's) one above the other with `gap` white rows
    between them -> uint8 [sum of H_i + gap * (n - 1), W, 3]."""
    if not panels:
        raise ValueError("stack_panels: no panels to stack")
    widths = sorted({panel.shape[1] for panel in panels})
    if len(widths) > 1:
        raise ValueError(f"stack_panels: the panels must share one width, got widths {widths}")
    spacer = np.full((gap, widths[0], 3), 255, dtype=np.uint8)
    rows = [part for panel in panels for part in (spacer, panel)][1:]
    return np.concatenate(rows, axis=0)


def write_flow_image(
    path: str | os.PathLike, flow: np.ndarray | torch.Tensor, max_flow: float | None = None
) -> None:
    """Save the colour-coded flow (numpy [H, W, 2] or torch [2, H, W]) as an 8-bit RGB picture (e.g. PNG)."""
    write_image(path, flow_to_color(_as_hwc(flow, 2, "write_flow_image: flow"), max_flow))
