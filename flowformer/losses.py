"""Supervised flow loss: the official exponentially weighted sequence loss (``core/loss.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def sequence_loss(
    flow_predictions: Sequence[Tensor],
    flow_gt: Tensor,
    valid: Tensor,
    *,
    gamma: float = 0.8,
    max_flow: float = 400.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sum over iterations i of gamma^(N-1-i) * mean(valid * |pred_i - gt|_1).

    flow_predictions: N tensors [B,2,H,W]; flow_gt [B,2,H,W]; valid [B,H,W] (>= 0.5 means valid).
    The mean runs over all B*2*H*W elements, invalid pixels included (they add zero but count in the
    denominator), exactly as the official `sequence_loss` in `core/loss.py`. Pixels with |gt| >= max_flow are invalid.

    Returns the loss (a scalar) and detached metrics of the last prediction over valid pixels:
    `epe` (mean end-point error) and `1px`/`3px`/`5px` (fraction of valid pixels with EPE below 1/3/5);
    a batch without valid pixels reports EPE 0.
    """
    if len(flow_predictions) == 0:
        raise ValueError("sequence_loss: flow_predictions is empty; the network returned no iterations")
    if flow_predictions[0].shape != flow_gt.shape:
        raise ValueError(
            f"sequence_loss: prediction shape {tuple(flow_predictions[0].shape)} != ground-truth shape "
            f"{tuple(flow_gt.shape)}; both must be [B,2,H,W]"
        )
    n_predictions = len(flow_predictions)
    magnitude = flow_gt.pow(2).sum(dim=1).sqrt()  # [B,H,W]
    valid_mask = (valid >= 0.5) & (magnitude < max_flow)  # [B,H,W] bool
    weights = valid_mask[:, None].to(flow_gt.dtype)  # [B,1,H,W]

    loss = flow_gt.new_zeros(())
    for i, prediction in enumerate(flow_predictions):
        # torch.where keeps non-finite ground truth at invalid pixels from poisoning the mean.
        l1 = torch.where(weights > 0, (prediction.float() - flow_gt).abs(), 0.0)  # [B,2,H,W]
        loss = loss + gamma ** (n_predictions - 1 - i) * l1.mean()

    with torch.no_grad():
        epe = (flow_predictions[-1].float() - flow_gt).pow(2).sum(dim=1).sqrt()[valid_mask]  # [n_valid]
        if epe.numel() == 0:
            epe = flow_gt.new_zeros(1)
        metrics = {
            "epe": epe.mean(),
            "1px": (epe < 1).float().mean(),
            "3px": (epe < 3).float().mean(),
            "5px": (epe < 5).float().mean(),
        }
    return loss, metrics
