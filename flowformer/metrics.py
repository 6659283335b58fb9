"""Optical-flow metrics as torchmetrics objects, so DDP sums their states across processes.

Every metric keeps *sums* (never running means) in float64 states with ``dist_reduce_fx="sum"``; the
division happens once in ``compute``. Two averagings exist and every metric says which one it uses:

- **pixel-pooled**: one mean over all counted pixels of all images (big images weigh more). Used by the
  official Sintel / Chairs EPE and px fractions and by the official KITTI F1-all (SPEC §7.1).
- **per-image**: the mean over images of each image's own mean. Used by the official KITTI EPE (SPEC §7.1).

Definitions (SPEC §6.1, §7.1):
- ``epe = ||f_pred - f_gt||_2`` per pixel.
- ``1px`` / ``3px`` / ``5px``: the *fraction* (0..1) of counted pixels with epe < 1, 3, 5.
- ``f1_all``: the *percentage* (0..100) of counted pixels with ``epe > 3 AND epe / |f_gt| > 0.05`` (the code
  and the KITTI benchmark use AND; the paper's text says "or").
- Sintel speed bins: EPE over pixels with ``|f_gt|`` in [0, 10), [10, 40) and [40, inf).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchmetrics import Metric

SPEED_BINS: tuple[tuple[str, float, float], ...] = (
    ("s0-10", 0.0, 10.0),
    ("s10-40", 10.0, 40.0),
    ("s40+", 40.0, float("inf")),
)


def endpoint_error(pred: Tensor, gt: Tensor) -> tuple[Tensor, Tensor]:
    """Per-pixel end-point error and ground-truth magnitude.

    pred, gt [B,2,H,W] -> (epe [B,H,W], mag [B,H,W]), both float32.
    """
    if pred.dim() != 4 or pred.shape[1] != 2 or pred.shape != gt.shape:
        raise ValueError(
            f"flow metrics expect pred and gt of the same shape [B,2,H,W]; got pred {tuple(pred.shape)} and "
            f"gt {tuple(gt.shape)}. Unpad the prediction to the ground-truth size before updating."
        )
    pred, gt = pred.float(), gt.float()
    epe = torch.linalg.vector_norm(pred - gt, dim=1)
    mag = torch.linalg.vector_norm(gt, dim=1)
    return epe, mag


def f1_outliers(epe: Tensor, mag: Tensor) -> Tensor:
    """KITTI outliers: epe > 3 px AND epe > 5 % of |gt| (SPEC §7.1). Written without a division, so |gt| = 0
    gives the same answer as the official ``epe / mag > 0.05`` (inf > 0.05) without a 0/0."""
    return (epe > 3.0) & (epe > 0.05 * mag)


def _valid_mask(epe: Tensor, valid: Tensor | None, mag: Tensor, max_flow: float | None) -> Tensor:
    """valid [B,H,W] (1 = valid, thresholded at 0.5 as in the official code) or None (all pixels) -> bool."""
    if valid is None:
        mask = torch.ones_like(epe, dtype=torch.bool)
    else:
        if valid.shape != epe.shape:
            raise ValueError(
                f"valid mask must be [B,H,W] = {tuple(epe.shape)} to match the flow; got {tuple(valid.shape)}"
            )
        mask = valid >= 0.5
    if max_flow is not None:
        mask = mask & (mag < max_flow)
    return mask


def _sum_state() -> Tensor:
    return torch.zeros((), dtype=torch.float64)


class FlowMetrics(Metric):
    """EPE, 1/3/5 px fractions and F1-all (%), all **pixel-pooled** over the valid pixels.

    ``update(pred, gt, valid=None)`` with pred/gt [B,2,H,W] and valid [B,H,W] (None: every pixel counts, as
    in the official Sintel and Chairs validation). ``max_flow`` additionally drops pixels with
    ``|gt| >= max_flow`` (the training loss mask of SPEC §6.1 uses 400); None keeps them.
    ``compute()`` -> ``{"epe", "1px", "3px", "5px", "f1_all"}``.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, *, max_flow: float | None = None) -> None:
        super().__init__()
        self.max_flow = max_flow
        for name in ("epe_sum", "lt1", "lt3", "lt5", "outliers", "count"):
            self.add_state(name, default=_sum_state(), dist_reduce_fx="sum")

    def update(self, pred: Tensor, gt: Tensor, valid: Tensor | None = None) -> None:
        epe, mag = endpoint_error(pred, gt)
        mask = _valid_mask(epe, valid, mag, self.max_flow)
        e = epe[mask].double()
        self.epe_sum += e.sum()
        self.lt1 += (e < 1.0).sum()
        self.lt3 += (e < 3.0).sum()
        self.lt5 += (e < 5.0).sum()
        self.outliers += f1_outliers(epe, mag)[mask].sum()
        self.count += e.numel()

    def compute(self) -> dict[str, Tensor]:
        n = self.count.clamp_min(1.0)
        return {
            "epe": self.epe_sum / n,
            "1px": self.lt1 / n,
            "3px": self.lt3 / n,
            "5px": self.lt5 / n,
            "f1_all": 100.0 * self.outliers / n,
        }


class SpeedBinnedEPE(Metric):
    """Sintel's EPE split by ground-truth speed: ``s0-10``, ``s10-40``, ``s40+`` (see ``SPEED_BINS``),
    each **pixel-pooled** over the pixels of that bin (and valid, if a mask is given).

    A bin that never received a pixel reports NaN, so an empty bin cannot pass as a perfect score.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state(
            "epe_sum", default=torch.zeros(len(SPEED_BINS), dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "count", default=torch.zeros(len(SPEED_BINS), dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, pred: Tensor, gt: Tensor, valid: Tensor | None = None) -> None:
        epe, mag = endpoint_error(pred, gt)
        mask = _valid_mask(epe, valid, mag, None)
        for i, (_, lo, hi) in enumerate(SPEED_BINS):
            in_bin = mask & (mag >= lo) & (mag < hi)
            self.epe_sum[i] += epe[in_bin].double().sum()
            self.count[i] += in_bin.sum()

    def compute(self) -> dict[str, Tensor]:
        means = self.epe_sum / self.count  # 0/0 -> NaN for an empty bin, on purpose
        return {name: means[i] for i, (name, _, _) in enumerate(SPEED_BINS)}


class KittiMetrics(Metric):
    """KITTI-2015 EPE and F1-all (%), each in both averagings, over the valid (sparse) ground truth:

    - ``epe_per_image`` (the official kitti-epe) and ``epe_pooled``;
    - ``f1_all_pooled`` (the official kitti-f1) and ``f1_all_per_image``.

    Images without a single valid pixel are left out of the per-image means (the official code would give NaN).
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self) -> None:
        super().__init__()
        for name in ("img_epe_sum", "img_f1_sum", "images", "px_epe_sum", "px_outliers", "pixels"):
            self.add_state(name, default=_sum_state(), dist_reduce_fx="sum")

    def update(self, pred: Tensor, gt: Tensor, valid: Tensor) -> None:
        epe, mag = endpoint_error(pred, gt)
        mask = _valid_mask(epe, valid, mag, None)
        out = f1_outliers(epe, mag) & mask
        n_img = mask.flatten(1).sum(1).double()  # [B] valid pixels per image
        epe_img = torch.where(mask, epe, 0.0).flatten(1).double().sum(1)
        out_img = out.flatten(1).sum(1).double()
        has_px = n_img > 0
        self.img_epe_sum += (epe_img[has_px] / n_img[has_px]).sum()
        self.img_f1_sum += (out_img[has_px] / n_img[has_px]).sum()
        self.images += has_px.sum()
        self.px_epe_sum += epe_img.sum()
        self.px_outliers += out_img.sum()
        self.pixels += n_img.sum()

    def compute(self) -> dict[str, Tensor]:
        images, pixels = self.images.clamp_min(1.0), self.pixels.clamp_min(1.0)
        return {
            "epe_per_image": self.img_epe_sum / images,
            "epe_pooled": self.px_epe_sum / pixels,
            "f1_all_per_image": 100.0 * self.img_f1_sum / images,
            "f1_all_pooled": 100.0 * self.px_outliers / pixels,
        }


class ValidationMetrics(nn.Module):
    """One validation set's metrics: `FlowMetrics` (pixel-pooled EPE, 1/3/5 px, F1-all) for every set. For a set
    named `kitti`, `KittiMetrics` adds the per-image averaging: `epe` becomes the official per-image kitti-epe
    (the pooled one stays as `epe_pooled`), `f1_all` stays pooled (the official kitti-f1) and
    `f1_all_per_image` joins it (SPEC §7.1)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.flow = FlowMetrics()
        self.kitti = KittiMetrics() if name == "kitti" else None

    @property
    def update_called(self) -> bool:
        return self.flow.update_called

    def update(self, pred: Tensor, gt: Tensor, valid: Tensor | None) -> None:
        self.flow.update(pred, gt, valid)
        if self.kitti is not None:
            self.kitti.update(pred, gt, valid)

    def compute(self) -> dict[str, Tensor]:
        values = self.flow.compute()
        if self.kitti is not None:
            kitti = self.kitti.compute()
            values |= {
                "epe": kitti["epe_per_image"],
                "epe_pooled": values["epe"],
                "f1_all_per_image": kitti["f1_all_per_image"],
            }
        return values

    def reset(self) -> None:
        self.flow.reset()
        if self.kitti is not None:
            self.kitti.reset()
