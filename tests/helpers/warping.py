"""The exact-flow check the rendered datasets share: frame 2 warped back by the flow against frame 1."""

import torch
import torch.nn.functional as F


def backward_warp(image: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Sample image [3, H, W] at p + flow(p) (bilinear) -> [3, H, W]."""
    _, height, width = image.shape
    ys, xs = torch.meshgrid(torch.arange(height).float(), torch.arange(width).float(), indexing="ij")
    grid = torch.stack(
        [(xs + flow[0]) / (width - 1) * 2 - 1, (ys + flow[1]) / (height - 1) * 2 - 1], dim=-1
    ).unsqueeze(0)
    return F.grid_sample(image[None], grid, mode="bilinear", align_corners=True)[0]


def visible(item: dict) -> torch.Tensor:
    return (item["valid"] > 0) & (item["occlusion"] == 0)


def warp_error(item: dict, flow: torch.Tensor) -> float:
    """Mean abs error of frame 1 against frame 2 warped back, over visible pixels away from occlusions
    (3x3 erosion: bilinear warping mixes two layers where a neighbour is occluded)."""
    error = (backward_warp(item["img2"], flow) - item["img1"]).abs().mean(dim=0)
    interior = -F.max_pool2d(-visible(item)[None].float(), 3, stride=1, padding=1)[0] > 0
    return error[interior].mean().item()
