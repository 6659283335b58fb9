"""Gaussian-weighted tiled inference, exactly as the official ``evaluate_FlowFormer_tile.py``.

The image is covered by training-size tiles; every tile's flow is weighted by the same Gaussian map and the
full-size flow is ``f = sum_i w_i f_i / sum_i w_i``. The weights are very peaked (about 1.5e-21 at the middle of
a tile edge and 3e-43, a float32 subnormal, at tile corners), so the blend runs in fp32 whatever the autocast
state; in fp16/bf16 image corners covered by one tile would become 0/0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

FlowFn = Callable[[Tensor, Tensor], Tensor]


def compute_grid_indices(
    image_shape: Sequence[int], tile_size: Sequence[int], min_overlap: int = 20
) -> list[tuple[int, int]]:
    """Top-left corners (h, w) of the tiles, h-major, as the official code places them.

    hs = range(0, H, th - min_overlap) with the last entry replaced by H - th (likewise ws), so the last tile
    is flush with the border. The official placement can repeat a tile (e.g. a 376-row tile on a 376-row
    canvas gives hs = [0, 0]); repeats are kept, since they are part of the official protocol. Entries are
    clamped to H - th (W - tw): this only matters where a middle tile would cross the border, a case in
    which the official code crashes.
    Example (the official Sintel tiles): 436x1024 with 432x960 tiles -> [(0, 0), (0, 64), (4, 0), (4, 64)].
    """
    height, width = int(image_shape[0]), int(image_shape[1])
    th, tw = int(tile_size[0]), int(tile_size[1])
    if min_overlap >= th or min_overlap >= tw:
        raise ValueError(f"tiling min_overlap={min_overlap} must be smaller than the tile size {th}x{tw}")
    if height < th or width < tw:
        raise ValueError(
            f"tiling needs an image at least as large as the tile: image {height}x{width}, tile {th}x{tw}; "
            "pad the image first (eval padding mode 'kitti432' / 'kitti376') or use a smaller tile"
        )
    hs = list(range(0, height, th - min_overlap))
    ws = list(range(0, width, tw - min_overlap))
    hs = [min(h, height - th) for h in hs[:-1]] + [height - th]
    ws = [min(w, width - tw) for w in ws[:-1]] + [width - tw]
    return [(h, w) for h in hs for w in ws]


def compute_weight(tile_size: Sequence[int], sigma: float = 0.05) -> Tensor:
    """The Gaussian weight map of one tile, float32 [th, tw].

    For tile pixel (u, v): d = sqrt((u/th - 0.5)^2 + (v/tw - 0.5)^2) (normalised by th, not th-1, so the
    centre is pixel th/2) and w = exp(-0.5 (d/sigma)^2) / (sigma sqrt(2 pi)).
    """
    th, tw = int(tile_size[0]), int(tile_size[1])
    u = torch.arange(th, dtype=torch.float32)[:, None] / float(th) - 0.5
    v = torch.arange(tw, dtype=torch.float32)[None, :] / float(tw) - 0.5
    d = (u**2 + v**2) ** 0.5 / sigma
    return (1.0 / (sigma * math.sqrt(2.0 * math.pi))) * torch.exp(-0.5 * d**2)


@torch.no_grad()
def tiled_flow(
    flow_fn: FlowFn,
    image1: Tensor,
    image2: Tensor,
    *,
    tile_size: Sequence[int],
    sigma: float = 0.05,
    min_overlap: int = 20,
    deduplicate: bool = False,
) -> Tensor:
    """Runs ``flow_fn`` on every tile and blends the tile flows with the Gaussian weights, in fp32.

    image1, image2 [B,3,H,W] -> flow [B,2,H,W] (float32). ``flow_fn(tile1, tile2)`` maps [B,3,th,tw] tiles to
    flow [B,2,th,tw]. ``deduplicate=True`` runs repeated tiles once: the result changes only by float rounding
    (the same weighted flow is summed once instead of twice), and FF's KITTI protocol runs half the passes.
    """
    if image1.shape != image2.shape or image1.dim() != 4:
        raise ValueError(
            f"tiled_flow expects two images of the same shape [B,3,H,W]; got {tuple(image1.shape)} and "
            f"{tuple(image2.shape)}"
        )
    batch, _, height, width = image1.shape
    th, tw = int(tile_size[0]), int(tile_size[1])
    corners = compute_grid_indices((height, width), (th, tw), min_overlap)
    if deduplicate:
        corners = list(dict.fromkeys(corners))
    weight = compute_weight((th, tw), sigma).to(image1.device)
    numerator = torch.zeros(batch, 2, height, width, dtype=torch.float32, device=image1.device)
    denominator = torch.zeros(1, 1, height, width, dtype=torch.float32, device=image1.device)
    for h, w in corners:
        flow = flow_fn(image1[:, :, h : h + th, w : w + tw], image2[:, :, h : h + th, w : w + tw])
        if flow.shape != (batch, 2, th, tw):
            raise ValueError(
                f"the flow of a {th}x{tw} tile must be [{batch},2,{th},{tw}]; got {tuple(flow.shape)}"
            )
        with torch.autocast(device_type=image1.device.type, enabled=False):
            numerator[:, :, h : h + th, w : w + tw] += flow.float() * weight
            denominator[:, :, h : h + th, w : w + tw] += weight
    if not bool((denominator > 0).all()):
        raise FloatingPointError(
            "tile weights underflowed to 0 (subnormal float32 weights were flushed); "
            "call torch.set_flush_denormal(False) before tiled evaluation"
        )
    return numerator / denominator
