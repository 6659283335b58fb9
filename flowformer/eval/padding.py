"""Input padding for evaluation, with the official modes (the two official ``InputPadder`` classes).

The network needs H and W divisible by 8. Two official padders exist:

- ``core/utils/utils.py`` (non-tiled evaluation): **replicate** padding, modes ``sintel`` (split evenly
  top/bottom and left/right), ``kitti400`` (pad the bottom up to 400 rows) and ``default`` (the official
  "any other mode": width split evenly, height at the bottom); FF++ adds ``downzero`` (zeros, right/bottom).
- ``evaluate_FlowFormer_tile.py`` (tiled evaluation): the same geometry with **zero** padding, and the
  modes ``kitti432`` / ``kitti376`` (pad the bottom up to 432 / 376 rows, no width padding).

``fill`` picks the padding values; left as None it is the fill the official code uses with that mode
(replicate for ``sintel``, ``kitti400``, ``default``; zeros for the others). Tiled evaluation passes
``fill="zeros"`` explicitly, as its official padder does for every mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch.nn.functional as F
from torch import Tensor

PadMode = Literal["sintel", "kitti400", "kitti432", "kitti376", "default", "downzero"]
PadFill = Literal["replicate", "zeros"]

PAD_TO_HEIGHT = {"kitti400": 400, "kitti432": 432, "kitti376": 376}
DEFAULT_FILL: dict[str, PadFill] = {
    "sintel": "replicate",
    "kitti400": "replicate",
    "default": "replicate",
    "downzero": "zeros",
    "kitti432": "zeros",
    "kitti376": "zeros",
}


class InputPadder:
    """Pads [..., H, W] tensors as the official ``InputPadder`` does; ``unpad`` crops the result back.

    ``InputPadder(image.shape, mode="sintel").pad(img1, img2) -> [img1 [...,H',W'], img2 [...,H',W']]``.
    """

    def __init__(self, dims: Sequence[int], *, mode: PadMode = "sintel", fill: PadFill | None = None) -> None:
        if mode not in DEFAULT_FILL:
            raise ValueError(f"padding mode {mode!r} is unknown; expected one of {sorted(DEFAULT_FILL)}")
        self.mode = mode
        self.fill: PadFill = fill or DEFAULT_FILL[mode]
        if self.fill not in ("replicate", "zeros"):
            raise ValueError(f"padding fill {self.fill!r} is unknown; expected 'replicate' or 'zeros'")
        self.ht, self.wd = int(dims[-2]), int(dims[-1])
        pad_ht = (-self.ht) % 8
        pad_wd = (-self.wd) % 8
        # F.pad order: (left, right, top, bottom)
        if mode == "sintel":
            self._pad = (pad_wd // 2, pad_wd - pad_wd // 2, pad_ht // 2, pad_ht - pad_ht // 2)
        elif mode in PAD_TO_HEIGHT:
            target = PAD_TO_HEIGHT[mode]
            if self.ht > target:
                raise ValueError(
                    f"padding mode {mode!r} pads the height up to {target}, but the image is {self.ht} rows; "
                    f"use mode 'sintel' or 'default' for images taller than {target}"
                )
            self._pad = (0, 0, 0, target - self.ht)
        elif mode == "downzero":
            self._pad = (0, pad_wd, 0, pad_ht)
        else:
            self._pad = (pad_wd // 2, pad_wd - pad_wd // 2, 0, pad_ht)

    @property
    def padding(self) -> tuple[int, int, int, int]:
        """(left, right, top, bottom) in pixels."""
        return self._pad

    def pad(self, *inputs: Tensor) -> list[Tensor]:
        """Each input [B,C,H,W] -> [B,C,H+top+bottom,W+left+right]."""
        for x in inputs:
            if tuple(x.shape[-2:]) != (self.ht, self.wd):
                raise ValueError(
                    f"InputPadder was built for {self.ht}x{self.wd} inputs but got {tuple(x.shape)}; "
                    "build one padder per image size"
                )
        if self.fill == "zeros":
            return [F.pad(x, self._pad, mode="constant", value=0.0) for x in inputs]
        return [F.pad(x, self._pad, mode="replicate") for x in inputs]

    def unpad(self, x: Tensor) -> Tensor:
        """[..., H', W'] -> [..., H, W]: crops away what ``pad`` added."""
        left, right, top, bottom = self._pad
        ht, wd = x.shape[-2:]
        return x[..., top : ht - bottom, left : wd - right]
