"""Baseline methods that task=eval scores beside the network (``eval.baselines``), on the same pairs with the
same metrics, each in a row of its own:

- ``zero``: zero flow everywhere, the reference every method has to beat;
- ``dis``: OpenCV's DIS optical flow (Kroeger et al., ECCV 2016) with its medium preset, a fast classical
  method run on the grey (ITU-R 601 luma) 8-bit images.

A baseline is a ``FlowNet`` (``flowformer/eval/protocol.py``): ``method(image1, image2, iters=...)`` on
images [B, 3, H, W] in 0..255 returns ``{"flow": [B, 2, H, W], "flow_low": [B, 2, H/8, W/8]}``, so
``Protocol.predict`` pads, tiles and crops for it as for the network. ``iters`` and a warm start's
``flow_init`` mean nothing to these methods and are ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from flowformer.eval.protocol import FlowNet

__all__ = ["BASELINES", "DISFlow", "baseline_methods", "zero_flow"]


def _output(flow: Tensor) -> dict[str, Tensor]:
    """Full-resolution flow [B, 2, H, W] -> the network's outputs: the flow and its 1/8-resolution average in
    1/8-resolution pixels (what the network's ``flow_low`` is; H and W are multiples of 8 after padding)."""
    return {"flow": flow, "flow_low": F.avg_pool2d(flow, 8, ceil_mode=True) / 8}


def zero_flow(image1: Tensor, image2: Tensor, **ignored: Any) -> dict[str, Tensor]:
    """Zero flow for image1 [B, 3, H, W]."""
    batch, _, height, width = image1.shape
    return _output(image1.new_zeros(batch, 2, height, width, dtype=torch.float32))


def _grey(image: Tensor) -> np.ndarray:
    """[3, H, W] RGB in 0..255 -> uint8 [H, W] luma."""
    rgb = image.detach().round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)


class DISFlow:
    """OpenCV's DIS optical flow, ``cv2.DISOPTICAL_FLOW_PRESET_MEDIUM``, one pair at a time on the CPU."""

    def __init__(self) -> None:
        self._dis: cv2.DISOpticalFlow | None = None  # made on first use: OpenCV objects do not pickle

    def __call__(self, image1: Tensor, image2: Tensor, **ignored: Any) -> dict[str, Tensor]:
        if self._dis is None:
            self._dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)
        flows = [
            torch.from_numpy(self._dis.calc(_grey(first), _grey(second), None)).permute(2, 0, 1)  # [2, H, W]
            for first, second in zip(image1, image2, strict=True)
        ]
        return _output(torch.stack(flows).to(image1.device))


# name -> a factory of the method (DIS keeps an OpenCV object per method)
BASELINES: Mapping[str, Callable[[], FlowNet]] = {"zero": lambda: zero_flow, "dis": DISFlow}


def baseline_methods(names: Sequence[str]) -> dict[str, FlowNet]:
    """The methods ``eval.baselines`` names, by name; an unknown name is a ValueError listing the others."""
    unknown = [name for name in names if name not in BASELINES]
    if unknown:
        raise ValueError(f"eval.baselines names {unknown}; known baselines: {list(BASELINES)}")
    return {name: BASELINES[name]() for name in names}
