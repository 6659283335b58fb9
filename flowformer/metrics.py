"""Optical-flow metrics as torchmetrics objects, so DDP sums their states across processes.

Every metric keeps *sums* (never running means) in float64 states with ``dist_reduce_fx="sum"``; the
division happens once in ``compute``. Two averagings exist and every metric says which one it uses:

- **pixel-pooled**: one mean over all counted pixels of all images (big images weigh more). Used by the
  official Sintel / Chairs EPE and px fractions and by the official KITTI F1-all (``evaluate_FlowFormer.py``).
- **per-image**: the mean over images of each image's own mean. Used by the official KITTI EPE.

Definitions (the official ``core/loss.py`` and ``evaluate_FlowFormer.py``):
- ``epe = ||f_pred - f_gt||_2`` per pixel.
- ``1px`` / ``3px`` / ``5px``: the *fraction* (0..1) of counted pixels with epe < 1, 3, 5.
- ``f1_all``: the *percentage* (0..100) of counted pixels with ``epe > 3 AND epe / |f_gt| > 0.05`` (the code
  and the KITTI benchmark use AND; the paper's text says "or").
- Sintel speed bins: EPE over pixels with ``|f_gt|`` in [0, 10), [10, 40) and [40, inf).

The bundles at the end (``SET_METRICS``, one per metric kind) are what validation and task=eval report. A
metric is never computed over nothing: ``compute`` without a single scored pixel (or image) raises
:class:`NothingScoredError` instead of reporting 0.
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


class NothingScoredError(ValueError):
    """A metric was asked for its value without a single scored pixel or image."""


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
    """KITTI outliers: epe > 3 px AND epe > 5 % of |gt|, as the official ``validate_kitti``. Written without a
    division, so |gt| = 0 gives the same answer as the official ``epe / mag > 0.05`` (inf > 0.05) without a 0/0."""
    return (epe > 3.0) & (epe > 0.05 * mag)


def _valid_mask(epe: Tensor, valid: Tensor | None, mag: Tensor, max_flow: float | None) -> Tensor:
    """valid [B,H,W] (1 = valid, thresholded at 0.5 as in the official code) or None (all pixels) -> bool.
    A pixel whose ground truth is NaN or inf (|gt| = `mag` not finite) is never valid: missing ground truth,
    as the KITTI reader's valid channel says, so no metric is NaN."""
    if valid is None:
        mask = torch.ones_like(epe, dtype=torch.bool)
    else:
        if valid.shape != epe.shape:
            raise ValueError(
                f"valid mask must be [B,H,W] = {tuple(epe.shape)} to match the flow; got {tuple(valid.shape)}"
            )
        mask = valid >= 0.5
    mask = mask & torch.isfinite(mag)
    if max_flow is not None:
        mask = mask & (mag < max_flow)
    return mask


def _sum_state() -> Tensor:
    return torch.zeros((), dtype=torch.float64)


class FlowMetrics(Metric):
    """EPE, 1/3/5 px fractions and F1-all (%), all **pixel-pooled** over the valid pixels.

    ``update(pred, gt, valid=None)`` with pred/gt [B,2,H,W] and valid [B,H,W] (None: every pixel counts, as
    in the official Sintel and Chairs validation). ``max_flow`` additionally drops pixels with
    ``|gt| >= max_flow`` (the official training loss mask of ``core/loss.py`` uses 400); None keeps them.
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
        if self.count == 0:
            raise NothingScoredError("no pixel was scored (no pair, or no valid pixel within max_flow)")
        return {
            "epe": self.epe_sum / self.count,
            "1px": self.lt1 / self.count,
            "3px": self.lt3 / self.count,
            "5px": self.lt5 / self.count,
            "f1_all": 100.0 * self.outliers / self.count,
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


class PerImageMetrics(Metric):
    """EPE and F1-all (%) averaged **per image** over the valid pixels: each image's own mean, then the mean over
    images (``epe_per_image``, ``f1_all_per_image``). Images without a single valid pixel are left out (the
    official KITTI code would give NaN for them).
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self) -> None:
        super().__init__()
        for name in ("epe_sum", "f1_sum", "images"):
            self.add_state(name, default=_sum_state(), dist_reduce_fx="sum")

    def update(self, pred: Tensor, gt: Tensor, valid: Tensor) -> None:
        epe, mag = endpoint_error(pred, gt)
        mask = _valid_mask(epe, valid, mag, None)
        pixels = mask.flatten(1).sum(1).double()  # [B] valid pixels per image
        epe_sums = torch.where(mask, epe, 0.0).flatten(1).double().sum(1)
        outliers = (f1_outliers(epe, mag) & mask).flatten(1).sum(1).double()
        has_px = pixels > 0
        self.epe_sum += (epe_sums[has_px] / pixels[has_px]).sum()
        self.f1_sum += (outliers[has_px] / pixels[has_px]).sum()
        self.images += has_px.sum()

    def compute(self) -> dict[str, Tensor]:
        if self.images == 0:
            raise NothingScoredError("no image was scored (no pair, or no image with a valid pixel)")
        return {"epe_per_image": self.epe_sum / self.images, "f1_all_per_image": 100.0 * self.f1_sum / self.images}


class SetMetrics(nn.Module):
    """The metrics of one kind of evaluation set, the same in validation (logged as ``val/<set>/<key>``) and in
    task=eval (``eval_results.json``). ``update(pred, gt, valid)`` with pred/gt [B,2,H,W] and valid [B,H,W];
    ``compute()`` -> {key: 0-dim tensor}; ``reset()``. A new metric goes into the bundle of each kind it
    belongs to, a new kind into ``SET_METRICS``.
    """

    kind: str
    uses_valid_mask = True

    def __init__(self, **parts: Metric) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(parts)

    @property
    def update_called(self) -> bool:
        return any(part.update_called for part in self.parts.values())

    def update(self, pred: Tensor, gt: Tensor, valid: Tensor | None) -> None:
        if not self.uses_valid_mask:
            valid = None
        elif valid is None:
            raise ValueError(f"'{self.kind}' metrics count the valid pixels: every item needs `valid` [H,W]")
        for part in self.parts.values():
            part.update(pred, gt, valid)

    def compute(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def metric_names(self) -> list[str]:
        """The keys `compute()` returns: those of a fresh bundle of this kind, scored on one pixel."""
        fresh = type(self)()
        flow = torch.zeros(1, 2, 1, 1)  # [B,2,H,W]
        fresh.update(flow, flow, torch.ones(1, 1, 1))
        return list(fresh.compute())

    def reset(self) -> None:
        for part in self.parts.values():
            part.reset()


class FlowSetMetrics(SetMetrics):
    """Kind ``flow`` (FlyingChairs, the synthetic pairs): ``epe``, ``1px``, ``3px``, ``5px`` and ``f1_all``,
    pixel-pooled over the valid pixels."""

    kind = "flow"

    def __init__(self) -> None:
        super().__init__(pooled=FlowMetrics())

    def compute(self) -> dict[str, Tensor]:
        return self.parts["pooled"].compute()


class SintelSetMetrics(SetMetrics):
    """Kind ``sintel``: ``epe``, ``1px``, ``3px``, ``5px`` and the speed bins ``s0-10``, ``s10-40``, ``s40+``,
    pixel-pooled over **every pixel** with finite ground truth: the official ``validate_sintel``
    (``evaluate_FlowFormer.py``) applies no valid mask, so the mask of the items is ignored. F1-all is not a
    Sintel metric and is not reported."""

    kind = "sintel"
    uses_valid_mask = False

    def __init__(self) -> None:
        super().__init__(pooled=FlowMetrics(), speed=SpeedBinnedEPE())

    def compute(self) -> dict[str, Tensor]:
        values = self.parts["pooled"].compute()
        del values["f1_all"]
        return values | self.parts["speed"].compute()


class KittiSetMetrics(SetMetrics):
    """Kind ``kitti``, over the valid (sparse) pixels, as the official ``validate_kitti``:

    - ``epe``: the official kitti-epe, **per image** (each image's mean EPE, then the mean over images);
      ``epe_pooled`` beside it;
    - ``f1_all``: the official kitti-f1, **pixel-pooled**; ``f1_all_per_image`` beside it;
    - ``1px``, ``3px``, ``5px``: pixel-pooled.
    """

    kind = "kitti"

    def __init__(self) -> None:
        super().__init__(pooled=FlowMetrics(), per_image=PerImageMetrics())

    def compute(self) -> dict[str, Tensor]:
        pooled, per_image = self.parts["pooled"].compute(), self.parts["per_image"].compute()
        return pooled | {
            "epe": per_image["epe_per_image"],
            "epe_pooled": pooled["epe"],
            "f1_all_per_image": per_image["f1_all_per_image"],
        }


# metric kind -> its bundle; conf/eval/sets/*.yaml name the kind of each set
SET_METRICS: dict[str, type[SetMetrics]] = {
    "flow": FlowSetMetrics,
    "sintel": SintelSetMetrics,
    "kitti": KittiSetMetrics,
}
