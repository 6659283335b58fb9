"""Training augmentation for flow pairs and for pretraining image pairs: the official
``core/utils/augmentor.py`` (``FlowAugmentor``, ``SparseFlowAugmentor``; FlowFormer++'s ``ImageAugmentor``).

All augmentors work on numpy arrays, exactly where the official code does: images uint8 [H, W, 3], flow
float32 [H, W, 2], valid float32 [H, W]. Every random draw comes from the ``rng`` argument (a numpy
``Generator``), so the caller decides the stream: a training draw's own seed
(:mod:`flowformer.data.sampling`), else :class:`WorkerRNG`, a stream per DataLoader worker that is fresh every
epoch (the official loaders re-seed each worker with ``np.random.seed(worker_id)`` and so replay the same
streams every epoch; see docs/departures.md).

- :class:`FlowAugmentor`: dense ground truth (Chairs, Things, Sintel). Colour -> eraser -> spatial.
- :class:`SparseFlowAugmentor`: sparse ground truth (KITTI, HD1K). Symmetric colour -> eraser -> pad,
  scale with scattering of the valid points, horizontal flip, border-biased crop.
- :class:`ImagePairAugmentor`: MCVA pretraining pairs (no flow, no eraser).

Resizing uses ``cv2.resize(INTER_LINEAR)`` like the official code; colour jitter reproduces torchvision's
``ColorJitter`` on PIL images (random order of brightness, contrast, saturation, hue) with numpy and OpenCV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import cv2
import numpy as np
import torch

__all__ = [
    "ColorJitter",
    "FlowAugmentor",
    "ImagePairAugmentor",
    "SparseFlowAugmentor",
    "WorkerRNG",
    "resample_sparse_flow",
]


class WorkerRNG:
    """A numpy ``Generator`` per process, seeded from ``torch.initial_seed()`` and the DDP rank.

    In a DataLoader worker ``torch.initial_seed()`` is ``base_seed + worker_id``, where ``base_seed`` is drawn
    anew from the main process's torch RNG for every epoch's iterator: every worker gets its own stream and
    no epoch replays the previous one. The global rank is mixed in because ``seed_everything`` gives every
    DDP rank the same torch seed. In the main process (``num_workers=0``) the seed is the global torch seed,
    and the stream simply continues across epochs.
    """

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._generator: np.random.Generator | None = None

    def get(self) -> np.random.Generator:
        key = (torch.initial_seed(), _global_rank())
        if self._generator is None or key != self._key:
            self._generator = np.random.default_rng(np.random.SeedSequence(key))
            self._key = key
        return self._generator


def _global_rank() -> int:
    """The DDP rank (forked DataLoader workers inherit the process group), 0 without distributed training."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class ColorJitter:
    """torchvision ``ColorJitter`` on PIL images (what the official code uses), driven by a numpy Generator.

    Factors: brightness, contrast and saturation ~ U(max(0, 1-x), 1+x), hue ~ U(-h, h) (fraction of the
    hue circle, h <= 0.5); the four ops are applied in a random order. Each op follows PIL's definition on
    uint8 RGB: brightness blends with black, contrast with the mean grey level, saturation with the grey
    image (ITU-R 601 luma), and hue shifts the 8-bit H channel of HSV with wrap-around. Done with OpenCV
    (about 20 ms for a stacked 1080x960 pair; torchvision's tensor hue alone takes about 280 ms), within a
    grey level or two of PIL (docs/departures.md).
    """

    def __init__(self, *, brightness: float, contrast: float, saturation: float, hue: float) -> None:
        if not 0.0 <= hue <= 0.5:
            raise ValueError(f"ColorJitter: hue must lie in [0, 0.5], got {hue}")
        self.brightness = brightness
        self.contrast = contrast
        self.saturation = saturation
        self.hue = hue

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """uint8 [H, W, 3] RGB -> uint8 [H, W, 3] RGB."""
        image = np.ascontiguousarray(image)
        for op in rng.permutation(4):
            if op == 0 and self.brightness > 0:
                image = _blend(image, 0, self._factor(self.brightness, rng))
            elif op == 1 and self.contrast > 0:
                image = _blend(
                    image,
                    int(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY).mean() + 0.5),
                    self._factor(self.contrast, rng),
                )
            elif op == 2 and self.saturation > 0:
                grey = cv2.cvtColor(cv2.cvtColor(image, cv2.COLOR_RGB2GRAY), cv2.COLOR_GRAY2RGB)
                image = _blend(image, grey, self._factor(self.saturation, rng))
            elif op == 3 and self.hue > 0:
                image = _shift_hue(image, float(rng.uniform(-self.hue, self.hue)))
        return image

    @staticmethod
    def _factor(amount: float, rng: np.random.Generator) -> float:
        return float(rng.uniform(max(0.0, 1.0 - amount), 1.0 + amount))


def _blend(image: np.ndarray, degenerate: int | np.ndarray, factor: float) -> np.ndarray:
    """PIL ``ImageEnhance``: degenerate + factor * (image - degenerate), saturated to uint8 (rounded)."""
    if isinstance(degenerate, np.ndarray):  # an image: factor * image + (1 - factor) * degenerate
        return cv2.addWeighted(image, factor, degenerate, 1.0 - factor, 0.0)
    return cv2.addWeighted(image, factor, image, 0.0, (1.0 - factor) * degenerate)


def _shift_hue(image: np.ndarray, hue_factor: float) -> np.ndarray:
    """Rotate the hue by ``hue_factor`` turns: the uint8 H channel (0..255 = one turn) shifts with wrap-around."""
    hsv = cv2.cvtColor(image, cv2.COLOR_RGB2HSV_FULL)
    hsv[..., 0] += np.uint8(int(hue_factor * 255) % 256)  # uint8 arithmetic wraps around, like PIL's
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB_FULL)


def _as_pair(value: Sequence[int], what: str) -> tuple[int, int]:
    pair = tuple(int(v) for v in value)
    if len(pair) != 2 or min(pair) <= 0:
        raise ValueError(f"{what} must be two positive integers [height, width], got {list(value)}")
    return pair  # type: ignore[return-value]


def _photometric(
    img1: np.ndarray, img2: np.ndarray, jitter: ColorJitter, asymmetric_prob: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """With probability ``asymmetric_prob`` jitter each image on its own, else both stacked as one image."""
    if rng.random() < asymmetric_prob:
        return jitter(img1, rng), jitter(img2, rng)
    stacked = jitter(np.concatenate([img1, img2], axis=0), rng)  # [2H, W, 3]
    return stacked[: img1.shape[0]], stacked[img1.shape[0] :]


def _erase(img2: np.ndarray, prob: float, rng: np.random.Generator) -> np.ndarray:
    """Occlusion augmentation (official ``eraser_transform``): 1-2 boxes of side 50-99 px filled with img2's
    mean colour."""
    if rng.random() >= prob:
        return img2
    img2 = img2.copy()
    height, width = img2.shape[:2]
    mean_color = img2.reshape(-1, 3).mean(axis=0)
    for _ in range(rng.integers(1, 3)):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        dx, dy = rng.integers(50, 100), rng.integers(50, 100)
        img2[y0 : y0 + dy, x0 : x0 + dx] = mean_color
    return img2


def _crop_offset(size: int, crop: int, rng: np.random.Generator, what: str) -> int:
    """``randint(0, size - crop)`` with an exclusive upper bound, 0 when the size equals the crop."""
    if size < crop:
        raise ValueError(
            f"{what}: the image ({size} px) is smaller than the crop ({crop} px) after augmentation; "
            "lower the augmentor's crop_size or raise min_scale"
        )
    return 0 if size == crop else int(rng.integers(0, size - crop))


def _resize(array: np.ndarray, scale_x: float, scale_y: float) -> np.ndarray:
    return cv2.resize(array, None, fx=scale_x, fy=scale_y, interpolation=cv2.INTER_LINEAR)


@dataclass(kw_only=True, eq=False)
class _Augmentor:
    """What every augmentor has: a crop, a scale range ``2^U(min_scale, max_scale)``, flips, colour jitter.

    Augmentors are keyword dataclasses, so each setting and its default is written once. Hydra builds one as
    the ``augmentor`` argument of a dataset; inside a plain config list or dict OmegaConf would turn the
    instance back into a config, so pass it to the dataset that uses it.
    """

    crop_size: Sequence[int]  # [height, width]
    min_scale: float = -0.2
    max_scale: float = 0.5
    do_flip: bool = True
    photometric: bool = True
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.5 / 3.14  # the official literal: 0.5 / 3.14, not 0.5 / pi
    spatial_prob: float = 0.8  # probability of resizing at all
    h_flip_prob: float = 0.5
    jitter: ColorJitter = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.crop_size = _as_pair(self.crop_size, "crop_size")
        if self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})")
        self.jitter = ColorJitter(
            brightness=self.brightness, contrast=self.contrast, saturation=self.saturation, hue=self.hue
        )


@dataclass(kw_only=True, eq=False)
class _DenseSpatial(_Augmentor):
    """Scale + stretch, flips and crop shared by the dense flow and the pretraining augmentors."""

    asymmetric_prob: float = 0.2  # probability of jittering the two images independently
    stretch_prob: float = 0.8
    max_stretch: float = 0.2  # stretch 2^U(-max_stretch, max_stretch) per axis
    v_flip_prob: float = 0.1

    def spatial(
        self, img1: np.ndarray, img2: np.ndarray, flow: np.ndarray | None, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        crop_h, crop_w = self.crop_size
        height, width = img1.shape[:2]
        # Keep 8 px of slack so the crop always fits after resizing (the official (crop + 8) / size floor).
        floor = max((crop_h + 8) / height, (crop_w + 8) / width)
        scale_x = scale_y = 2.0 ** rng.uniform(self.min_scale, self.max_scale)
        if rng.random() < self.stretch_prob:
            scale_x *= 2.0 ** rng.uniform(-self.max_stretch, self.max_stretch)
            scale_y *= 2.0 ** rng.uniform(-self.max_stretch, self.max_stretch)
        scale_x, scale_y = max(scale_x, floor), max(scale_y, floor)

        # The flow's vectors are scaled and their signs flipped in the crop only: the same float32 products as
        # on the whole resized field (a sign flip is exact), for a fraction of its pixels.
        flow_factor = np.ones(2, dtype=np.float32)  # (u, v)
        if rng.random() < self.spatial_prob:
            img1, img2 = _resize(img1, scale_x, scale_y), _resize(img2, scale_x, scale_y)
            if flow is not None:
                flow, flow_factor = _resize(flow, scale_x, scale_y), np.array([scale_x, scale_y], dtype=np.float32)

        if self.do_flip:
            if rng.random() < self.h_flip_prob:  # views: the crop below copies
                img1, img2 = img1[:, ::-1], img2[:, ::-1]
                flow = None if flow is None else flow[:, ::-1]
                flow_factor[0] *= -1
            if rng.random() < self.v_flip_prob:
                img1, img2 = img1[::-1], img2[::-1]
                flow = None if flow is None else flow[::-1]
                flow_factor[1] *= -1

        y0 = _crop_offset(img1.shape[0], crop_h, rng, f"{type(self).__name__} height")
        x0 = _crop_offset(img1.shape[1], crop_w, rng, f"{type(self).__name__} width")
        window = (slice(y0, y0 + crop_h), slice(x0, x0 + crop_w))
        img1, img2 = np.ascontiguousarray(img1[window]), np.ascontiguousarray(img2[window])
        if flow is not None:
            flow = np.multiply(flow[window], flow_factor, dtype=np.float32)  # [crop_h, crop_w, 2], C-contiguous
        return img1, img2, flow


@dataclass(kw_only=True, eq=False)
class FlowAugmentor(_DenseSpatial):
    """Dense-flow augmentation (FlyingChairs, FlyingThings3D, Sintel): official ``FlowAugmentor``.

    Order: colour jitter (asymmetric with probability 0.2) -> eraser on img2 (p=0.5) -> scale
    ``2^U(min_scale, max_scale)`` with stretch ``2^U(-0.2, 0.2)`` per axis (p=0.8), clipped so the crop fits,
    resize (p=0.8) -> horizontal (p=0.5) and vertical (p=0.1) flips -> random crop. Per-stage values (the
    official ``fetch_dataloader`` in ``core/datasets.py``): chairs crop 368x496, scales (-0.1, 1.0); things
    432x960, (-0.4, 0.8); sintel mix 432x960, (-0.2, 0.6); all with flips.
    """

    eraser_prob: float = 0.5

    def __call__(
        self, img1: np.ndarray, img2: np.ndarray, flow: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """uint8 [H, W, 3] x2, float32 flow [H, W, 2] -> the same at ``crop_size``."""
        if self.photometric:
            img1, img2 = _photometric(img1, img2, self.jitter, self.asymmetric_prob, rng)
        img2 = _erase(img2, self.eraser_prob, rng)
        img1, img2, flow = self.spatial(img1, img2, flow, rng)
        return img1, img2, flow  # type: ignore[return-value]


@dataclass(kw_only=True, eq=False)
class ImagePairAugmentor(_DenseSpatial):
    """MCVA pretraining pair augmentation: FlowFormer++'s ``ImageAugmentor``.

    Colour jitter (0.4, 0.4, 0.4, hue 0.5/3.14; asymmetric with probability 0.2), **no eraser**, then the
    dense spatial transform (scale ``2^U(-0.2, 0.6)``, stretch, flips, crop 368x496 in the official recipe).
    """

    max_scale: float = 0.6

    def __call__(
        self, img1: np.ndarray, img2: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """uint8 [H, W, 3] x2 -> uint8 [crop_h, crop_w, 3] x2."""
        if self.photometric:
            img1, img2 = _photometric(img1, img2, self.jitter, self.asymmetric_prob, rng)
        img1, img2, _ = self.spatial(img1, img2, None, rng)
        return img1, img2


def resample_sparse_flow(
    flow: np.ndarray, valid: np.ndarray, scale_x: float, scale_y: float
) -> tuple[np.ndarray, np.ndarray]:
    """Resize sparse flow by scattering its valid points (official ``resize_sparse_flow_map``).

    flow [H, W, 2], valid [H, W] -> flow [round(H*sy), round(W*sx), 2], valid (float32) of the same size.
    A valid pixel at (x, y) lands on the nearest output pixel of ``((x+0.5)*sx - 0.5, (y+0.5)*sy - 0.5)``,
    the pixel-centre mapping that ``cv2.resize`` uses for the images, and its flow is scaled by (sx, sy).
    The official code maps x -> x*sx and drops row 0 and column 0; why we depart: docs/departures.md.
    """
    height, width = flow.shape[:2]
    out_h, out_w = round(height * scale_y), round(width * scale_x)
    ys, xs = np.nonzero(valid >= 0.5)  # valid points, [P] each
    x_new = np.floor((xs + 0.5) * scale_x).astype(np.int64)  # round half up of (x + 0.5) * sx - 0.5
    y_new = np.floor((ys + 0.5) * scale_y).astype(np.int64)
    inside = (x_new >= 0) & (x_new < out_w) & (y_new >= 0) & (y_new < out_h)
    out_flow = np.zeros((out_h, out_w, 2), dtype=np.float32)
    out_valid = np.zeros((out_h, out_w), dtype=np.float32)
    out_flow[y_new[inside], x_new[inside]] = flow[ys[inside], xs[inside]] * np.array(
        [scale_x, scale_y], dtype=np.float32
    )
    out_valid[y_new[inside], x_new[inside]] = 1.0
    return out_flow, out_valid


@dataclass(kw_only=True, eq=False)
class SparseFlowAugmentor(_Augmentor):
    """Sparse-flow augmentation (KITTI, HD1K): official ``SparseFlowAugmentor``.

    Symmetric colour jitter (0.3, 0.3, 0.3, hue 0.3/3.14) -> eraser on img2 (p=0.5) -> zero-pad bottom/right
    when the crop is larger than the image -> scale ``2^U(min_scale, max_scale)`` (no stretch) clipped so the
    crop fits, resize (p=0.8) with the valid points resampled by :func:`resample_sparse_flow` -> horizontal
    flip (p=0.5, only with ``do_flip``) -> crop biased to the borders (offsets drawn from
    ``[0, h-ch+20)`` and ``[-50, w-cw+50)``, then clipped). Per-stage values (official ``fetch_dataloader``):
    sintel mix KITTI (-0.3, 0.5) and HD1K (-0.5, 0.2) with flip; kitti stage (-0.2, 0.4) without flip;
    crop 432x960.
    """

    do_flip: bool = False
    brightness: float = 0.3
    contrast: float = 0.3
    saturation: float = 0.3
    hue: float = 0.3 / 3.14
    eraser_prob: float = 0.5
    margin_y: int = 20
    margin_x: int = 50

    def __call__(
        self,
        img1: np.ndarray,
        img2: np.ndarray,
        flow: np.ndarray,
        valid: np.ndarray,
        rng: np.random.Generator,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """uint8 [H, W, 3] x2, flow [H, W, 2], valid [H, W] -> the same at ``crop_size``."""
        if self.photometric:
            img1, img2 = _photometric(img1, img2, self.jitter, 0.0, rng)  # always symmetric
        img2 = _erase(img2, self.eraser_prob, rng)

        crop_h, crop_w = self.crop_size
        pad_b, pad_r = max(crop_h - img1.shape[0], 0), max(crop_w - img1.shape[1], 0)
        if pad_b or pad_r:  # zero-pad bottom/right: KITTI's ~375 rows always grow to a 432 crop
            img1 = np.pad(img1, ((0, pad_b), (0, pad_r), (0, 0)))
            img2 = np.pad(img2, ((0, pad_b), (0, pad_r), (0, 0)))
            flow = np.pad(flow, ((0, pad_b), (0, pad_r), (0, 0)))
            valid = np.pad(valid, ((0, pad_b), (0, pad_r)))

        height, width = img1.shape[:2]
        floor = max((crop_h + 1) / height, (crop_w + 1) / width)
        scale = max(2.0 ** rng.uniform(self.min_scale, self.max_scale), floor)
        if rng.random() < self.spatial_prob:
            img1, img2 = _resize(img1, scale, scale), _resize(img2, scale, scale)
            flow, valid = resample_sparse_flow(flow, valid, scale, scale)

        flow_sign = np.ones(2, dtype=np.float32)  # (u, v): applied in the crop, as the dense augmentor does
        if self.do_flip and rng.random() < self.h_flip_prob:  # views: the crop below copies
            img1, img2, valid, flow = img1[:, ::-1], img2[:, ::-1], valid[:, ::-1], flow[:, ::-1]
            flow_sign[0] = -1

        height, width = img1.shape[:2]
        y0 = int(rng.integers(0, height - crop_h + self.margin_y))
        x0 = int(rng.integers(-self.margin_x, width - crop_w + self.margin_x))
        y0, x0 = int(np.clip(y0, 0, height - crop_h)), int(np.clip(x0, 0, width - crop_w))
        window = (slice(y0, y0 + crop_h), slice(x0, x0 + crop_w))
        return (
            np.ascontiguousarray(img1[window]),
            np.ascontiguousarray(img2[window]),
            np.multiply(flow[window], flow_sign, dtype=np.float32),
            np.ascontiguousarray(valid[window], dtype=np.float32),
        )
