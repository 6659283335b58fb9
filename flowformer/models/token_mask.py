"""Which cost-map patch tokens MCVA hides from the cost encoder (FlowFormer++'s `random_masking`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenMask:
    """A per-source-pixel mask over the H3*W3 patch tokens of each cost map.

    ids_keep: [N, n_keep] int64, the kept token indices in ascending-noise order (the gather order of the
        official `random_masking`), N = B*H1*W1 rows in (b, y1, x1) order.
    removed: [N, H3*W3] float, 1 = removed, 0 = kept; token l = h3*W3 + w3 (row-major over the patch grid).
    """

    ids_keep: Tensor
    removed: Tensor

    @classmethod
    def from_noise(cls, noise: Tensor, mask_ratio: float) -> TokenMask:
        """noise [N, L] -> keep the int(L*(1-mask_ratio)) tokens with the smallest noise, in ascending-noise order
        (the official argsort of the noise)."""
        n_rows, n_tokens = noise.shape
        n_keep = int(n_tokens * (1 - mask_ratio))
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_keep = ids_shuffle[:, :n_keep]
        removed = torch.ones(n_rows, n_tokens, device=noise.device, dtype=torch.float32)
        removed.scatter_(1, ids_keep, 0.0)
        return cls(ids_keep=ids_keep, removed=removed)

    @property
    def visible_ratio(self) -> float:
        return self.ids_keep.shape[1] / self.removed.shape[1]
