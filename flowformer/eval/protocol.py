"""The one evaluation path: how flow is predicted on a set (padding or Gaussian tiling, decoder iterations)
and which metric bundle scores it. Validation in the training loop (``flowformer/lit/flow.py``), task=eval and
task=infer all predict through ``Protocol.predict``.

- :class:`EvalSet`: a dataset of pairs with its metric kind and padding/tiling geometry, built by Hydra from
  ``conf/eval/sets/<name>.yaml``; ``data.val.<name>`` and ``eval.benchmarks.<name>`` are made from the same
  files, so a set is scored the same way in validation and in task=eval.
- :class:`Protocol`: one run's settings for one set (the set's geometry, the iterations, tiling on or off).
- :class:`WarmStart`: the warm start of task=infer and task=eval (`infer.warm_start`, `eval.warm_start`): each
  pair of a sequence starts from the previous pair's flow, projected forward (:func:`forward_project`).

Metric kinds (``kinds()``): ``flow``, ``sintel``, ``kitti`` (the bundles of ``flowformer.metrics.SET_METRICS``),
and ``sintel_submission`` / ``kitti_submission`` (test splits: task=eval writes the benchmark's files).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from flowformer.eval.padding import DEFAULT_FILL, InputPadder, PadMode
from flowformer.eval.tiling import tiled_flow
from flowformer.setting_types import whole_number

if TYPE_CHECKING:
    from flowformer.metrics import SetMetrics

SUBMISSION_KINDS = ("sintel_submission", "kitti_submission")

# net(image1 [B,3,H,W], image2, iters=..., **kwargs) -> {"flow": [B,2,H,W], "flow_low": [B,2,H/8,W/8], ...}
FlowNet = Callable[..., Mapping[str, Tensor]]


def require_finite_flow(flow: Tensor, pair: str) -> None:
    """A FloatingPointError naming `pair` when a predicted flow holds NaN or inf: such a flow is never scored or
    written (task=eval and task=infer check every pair)."""
    non_finite = int((~torch.isfinite(flow)).sum())
    if non_finite:
        raise FloatingPointError(
            f"{pair}: the network predicted a non-finite flow ({non_finite} of {flow.numel()} values NaN or inf); "
            "check the checkpoint's weights"
        )


def scored_kinds() -> dict[str, type[SetMetrics]]:
    """``flowformer.metrics.SET_METRICS``, the metric bundle of each kind with ground truth, imported when a kind
    is checked or scored rather than with this module: importing torchmetrics costs a process 3 s of CPU, which
    task=infer, scoring nothing, does not pay."""
    from flowformer.metrics import SET_METRICS

    return SET_METRICS


def kinds() -> tuple[str, ...]:
    """Every metric kind: the scored ones, then the test splits' (submission files)."""
    return (*scored_kinds(), *SUBMISSION_KINDS)


def _check_kind(kind: str | None, allow_none: bool = False) -> None:
    if kind is None and allow_none:
        return
    if kind not in kinds():
        raise ValueError(f"evaluation kind {kind!r} is unknown; expected one of {', '.join(kinds())}")


def check_pad_mode(mode: str | None, what: str, optional: bool = False) -> None:
    """A padding mode of flowformer/eval/padding.py (or, where `optional`, None), else a ValueError naming the
    setting `what`."""
    if not (optional and mode is None) and mode not in DEFAULT_FILL:
        raise ValueError(f"{what}={mode!r} is unknown; expected one of {sorted(DEFAULT_FILL)}")


@dataclass(frozen=True)
class Protocol:
    """How flow is predicted and scored on one set.

    kind: the metric bundle (``kinds()``); None predicts without scoring (task=infer).
    iters: decoder iterations.
    pad_mode: padding to a multiple of 8 when not tiling (``flowformer/eval/padding.py``; the official
        ``evaluate_FlowFormer.py`` uses ``sintel`` for every set).
    tile: Gaussian tiling (``evaluate_FlowFormer_tile.py``) with ``tile_size`` tiles, after zero padding the
        image with ``tile_pad_mode`` (None: the image as it is); ``sigma``, ``min_overlap`` and
        ``deduplicate_tiles`` as in ``flowformer.eval.tiling.tiled_flow``.
    """

    iters: int
    kind: str | None = None
    pad_mode: PadMode = "sintel"
    tile: bool = False
    tile_size: tuple[int, int] | None = None
    tile_pad_mode: PadMode | None = None
    sigma: float = 0.05
    min_overlap: int = 20
    deduplicate_tiles: bool = False

    def __post_init__(self) -> None:
        _check_kind(self.kind, allow_none=True)
        check_pad_mode(self.pad_mode, "pad_mode")
        check_pad_mode(self.tile_pad_mode, "tile_pad_mode", optional=True)
        if self.tile and self.tile_size is None:
            raise ValueError("tiled evaluation needs the set's tile_size, e.g. [432, 960] for Sintel")

    @property
    def writes_submission(self) -> bool:
        return self.kind in SUBMISSION_KINDS

    def metrics(self) -> SetMetrics:
        """A fresh metric bundle of this protocol's kind."""
        scored = scored_kinds()
        if self.kind not in scored:
            raise ValueError(f"kind {self.kind!r} has no ground truth to score; scored: {list(scored)}")
        return scored[self.kind]()

    def predict(self, net: FlowNet, image1: Tensor, image2: Tensor, **net_kwargs: Any) -> dict[str, Tensor]:
        """Full-resolution flow of image1, image2 [B,3,H,W] -> {"flow": [B,2,H,W] float32}.

        Without tiling, the images are padded to [B,3,H',W'], ``net(..., iters=self.iters, **net_kwargs)``
        runs once, its flow is cropped back, and its ``flow_low`` [B,2,H'/8,W'/8] (of the padded images, what
        the next pair's ``flow_init`` takes) is returned too. With tiling, net runs on each tile and the tile
        flows are blended; ``net_kwargs`` (e.g. ``flow_init``) have no meaning per tile and are refused.
        """
        if not self.tile:
            padder = InputPadder(image1.shape, mode=self.pad_mode)
            output = net(*padder.pad(image1, image2), iters=self.iters, **net_kwargs)
            return {"flow": padder.unpad(output["flow"]).float(), "flow_low": output["flow_low"]}
        if net_kwargs:
            raise ValueError(f"tiled evaluation starts every tile afresh and takes no {sorted(net_kwargs)}")
        padder = (
            InputPadder(image1.shape, mode=self.tile_pad_mode, fill="zeros") if self.tile_pad_mode else None
        )
        padded = padder.pad(image1, image2) if padder else (image1, image2)
        flow = tiled_flow(
            lambda tile1, tile2: net(tile1, tile2, iters=self.iters)["flow"],
            *padded,
            tile_size=self.tile_size,
            sigma=self.sigma,
            min_overlap=self.min_overlap,
            deduplicate=self.deduplicate_tiles,
        )
        return {"flow": padder.unpad(flow) if padder else flow}


def forward_project(flow: Tensor) -> Tensor:
    """flow [B, 2, H, W] (x, y) of frame t -> an estimate for frame t+1: each pixel's flow is moved to where it
    points (rounded to the nearest pixel, averaged where several land), and pixels nothing lands on take the
    mean of their filled 3x3 neighbours, repeated until all are filled (zero flow if nothing lands inside).
    The official sequence evaluation does this with scipy's nearest-neighbour griddata."""
    batch, _, height, width = flow.shape
    ys, xs = torch.meshgrid(
        torch.arange(height, device=flow.device), torch.arange(width, device=flow.device), indexing="ij"
    )
    out = torch.zeros_like(flow)
    for b in range(batch):
        x1 = (xs + flow[b, 0]).round().long().flatten()
        y1 = (ys + flow[b, 1]).round().long().flatten()
        inside = (x1 >= 0) & (x1 < width) & (y1 >= 0) & (y1 < height)
        if not inside.any():
            continue
        # sums of the flows landing on each pixel, and their count: [3, H*W] -> [1, 3, H, W]
        sums = torch.zeros(3, height * width, device=flow.device, dtype=flow.dtype)
        landing = torch.cat([flow[b].flatten(1)[:, inside], torch.ones_like(x1[inside][None], dtype=flow.dtype)])
        sums.index_add_(1, (y1 * width + x1)[inside], landing)
        count = sums[2:].view(1, 1, height, width)
        mean, filled = sums[:2].view(1, 2, height, width) / count.clamp(min=1), count > 0
        while not filled.all():
            # each empty pixel next to a filled one takes the mean of its filled 3x3 neighbours
            weight = filled.to(mean.dtype)
            pooled = F.avg_pool2d(torch.cat([mean * weight, weight], dim=1), 3, stride=1, padding=1)
            grow = ~filled & (pooled[:, 2:] > 0)
            mean = torch.where(grow, pooled[:, :2] / pooled[:, 2:].clamp(min=1e-12), mean)
            filled = filled | grow
        out[b] = mean[0]
    return out


# the meta keys naming a pair's sequence (Sintel: dataset, pass, scene; HD1K: sequence); `frame`: its place
SEQUENCE_KEYS = ("dataset", "pass", "scene", "sequence")


class WarmStart:
    """Starts each pair's decoder from the previous pair's 1/8-resolution flow projected forward
    (`forward_project`) while the pairs continue one sequence, as RAFT's Sintel submission does (the warm
    start of the results marked * in the paper's Sintel test table). A pair continues the previous one when
    its `meta` names the same sequence (SEQUENCE_KEYS) and the next `frame`; any other pair (a new scene, or
    no `frame` in its meta) starts from zero flow. Pairs come in frame order. Tiled prediction has no
    1/8-resolution flow of the whole image, so it is not warm-started."""

    def __init__(self) -> None:
        self._previous: Mapping[str, Any] | None = None
        self._flow_low: Tensor | None = None  # [B, 2, H'/8, W'/8] of the previous pair's padded images
        self.continued = 0  # pairs that started from a previous pair's flow

    def continues(self, meta: Mapping[str, Any]) -> bool:
        previous = self._previous
        if previous is None or "frame" not in meta or "frame" not in previous:
            return False
        same_sequence = all(meta.get(key) == previous.get(key) for key in SEQUENCE_KEYS)
        return same_sequence and int(meta["frame"]) == int(previous["frame"]) + 1

    def predict(
        self, protocol: Protocol, net: FlowNet, image1: Tensor, image2: Tensor, meta: Mapping[str, Any]
    ) -> dict[str, Tensor]:
        """`protocol.predict` of the pair image1, image2 [B,3,H,W] (its dataset `meta`), started from the
        previous pair's projected flow when it continues that pair's sequence."""
        flow_init = None
        if self.continues(meta):
            flow_init = forward_project(self._flow_low)
            self.continued += 1
        output = protocol.predict(net, image1, image2, flow_init=flow_init)
        self._previous, self._flow_low = meta, output["flow_low"].float()
        return output


class EvalSet(Dataset):
    """A validation or benchmark set: the items of ``dataset`` and how they are evaluated.

    kind: the metric kind (``kinds()``).
    iters: decoder iterations in task=eval (``eval.benchmarks.<name>.iters``); validation sets leave it None
        and run ``model.val_iters``.
    pad_mode, tile_size, tile_pad_mode: see :class:`Protocol`.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        kind: str,
        iters: int | None = None,
        pad_mode: PadMode = "sintel",
        tile_size: Sequence[int] | None = None,
        tile_pad_mode: PadMode | None = None,
    ) -> None:
        _check_kind(kind)
        check_pad_mode(pad_mode, "pad_mode")
        check_pad_mode(tile_pad_mode, "tile_pad_mode", optional=True)
        self.dataset = dataset
        self.kind = kind
        self.iters = None if iters is None else whole_number(iters, "iters")
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"iters={self.iters}: the decoder iterations must be >= 1")
        self.pad_mode = pad_mode
        self.tile_size = None if tile_size is None else (int(tile_size[0]), int(tile_size[1]))
        self.tile_pad_mode = tile_pad_mode

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.dataset[index]

    def describe(self) -> str:
        describe = getattr(self.dataset, "describe", None)
        inner = describe() if callable(describe) else f"{type(self.dataset).__name__} ({len(self)} items)"
        return f"{inner}, kind {self.kind}"

    def protocol(self, iters: int, **run_settings: Any) -> Protocol:
        """The set's protocol with ``iters`` iterations and the run's tiling settings (``tile``, ``sigma``,
        ``min_overlap``, ``deduplicate_tiles``)."""
        return Protocol(
            iters=iters,
            kind=self.kind,
            pad_mode=self.pad_mode,
            tile_size=self.tile_size,
            tile_pad_mode=self.tile_pad_mode,
            **run_settings,
        )


def validation_protocol(dataset: Dataset | None, iters: int) -> Protocol:
    """Validation in the training loop: the set's kind and padding, never tiled (as the official in-training
    validation), ``iters`` (``model.val_iters``) iterations. A plain dataset (or None) is scored as kind
    ``flow``."""
    if not isinstance(dataset, EvalSet):
        return Protocol(iters=iters, kind="flow")
    if dataset.iters is not None:
        raise ValueError(
            f"a validation set sets iters={dataset.iters}, but validation runs model.val_iters={iters} on "
            "every set; remove its iters (they are task=eval's: eval.benchmarks.<name>.iters)"
        )
    if dataset.kind not in scored_kinds():
        raise ValueError(f"a validation set of kind {dataset.kind!r} has no ground truth to score")
    return dataset.protocol(iters)
