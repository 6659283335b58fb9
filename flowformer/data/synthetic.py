"""Built-in synthetic data: layered, textured, moving shapes with exact ground-truth flow.

A scene is a stack of layers, back to front: layer 0 is a textured background covering the whole plane, the
others are textured random shapes (superellipses with lobed outlines). Every layer ``j`` moves with its own
affine motion about its centre ``c_j``: at time ``t`` a layer point ``u`` (layer coordinates = frame-0 pixel
coordinates) is seen at

    A_t(u) = c + t * v + exp(t * log_s) * R(t * theta) (u - c).

Frames are rendered by backward warping: each image pixel ``p`` samples layer ``j``'s texture at
``A_t^{-1}(p)``, and the front-most layer whose shape contains that point wins. Both frames therefore come
from the same continuous scene, so the flow of frame 1 -> frame 2 is exact: ``flow(p) = A_1(p) - p`` for the
front-most layer at ``p`` in frame 1.

``valid`` marks finite flow whose target lies inside the image; ``occlusion`` marks pixels whose surface is
hidden at t=1 (another layer is in front at the target, or the target leaves the image). Everything is
deterministic from ``(seed, index)`` and works at any size; sizes are in pixels, motions scale with the image
(``max_translation`` is given at the 368x496 training size).

Where the layers' textures come from is a :data:`TextureSource`: :func:`procedural_textures` here, crops of
photographs in ``flowformer/data/image_folder.py``; the scenes, their motion and the rendering are the same.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from flowformer.data.sampling import SampleKey, item_index

__all__ = ["SyntheticFlowDataset", "SyntheticVideoDataset", "TextureSource", "procedural_textures"]

_REFERENCE_SIZE = (368, 496)  # the official chairs training crop; max_translation is given at it
_COARSEST_CELL = 64  # multi-scale noise: octaves with cells of 64, 32, ... px down to a finest cell
_EDGE_WIDTH = 1.0  # pixels: texture edges are soft steps about this wide, sharp but not aliased
# A batch's scenes are rendered together in chunks of at most this many pixels (at least one scene): on the 2-core
# CPU, per pair, 8 scenes at once took 0.63-0.79x the time of one at a time at 64x96 and 128x192, but 1.1-2.6x at
# 256x384 and 368x496, where the batch's tensors outgrow the caches (docs/performance.md).
_CHUNK_PIXELS = 2**17

# (each scene's generator, layers, H, W) -> the scenes' layer textures [B, layers, 3, H, W] in 0..255, each
# scene's drawn from its generator only
TextureSource = Callable[[list[torch.Generator], int, int, int], torch.Tensor]


@dataclass(frozen=True)
class _Scene:
    """All per-layer parameters of a batch of B scenes of L layers each (layer 0 = background). Points are
    complex x + iy."""

    textures: torch.Tensor  # [B, L, 3, H, W] colours in 0..255, in layer coordinates (frame-0 pixels)
    centre: torch.Tensor  # [B, L] complex: centre of the shape and of the motion
    velocity: torch.Tensor  # [B, L] complex: translation between t=0 and t=1, pixels
    log_similarity: torch.Tensor  # [B, L] complex: log(scale change) + i * rotation between t=0 and t=1
    radii: torch.Tensor  # [B, L, 2] shape half-axes (x, y) in pixels
    orientation: torch.Tensor  # [B, L] complex unit number: the shape's orientation
    exponent: torch.Tensor  # [B, L] superellipse exponent (1 diamond, 2 ellipse, large -> rectangle)
    lobes: torch.Tensor  # [B, L] number of lobes of the outline
    lobe_amplitude: torch.Tensor  # [B, L] relative lobe depth (0 = plain superellipse)
    lobe_phase: torch.Tensor  # [B, L]


def _check_size(size: tuple[int, int] | list[int]) -> tuple[int, int]:
    if len(size) != 2 or any(int(s) != s or s < 8 for s in size):
        raise ValueError(f"synthetic data: size must be (H, W) with integers >= 8, got {size!r}")
    return int(size[0]), int(size[1])


def _generator(seed: int, index: int) -> torch.Generator:
    """An independent, reproducible random stream for sample ``index`` of dataset ``seed``."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(index)]).generate_state(1, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


def _uniform(gen: torch.Generator, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=gen)


def _noise_octaves(
    gen: torch.Generator, layers: int, channels: int, height: int, width: int, finest_cell: int
) -> list[torch.Tensor]:
    """The random grids of :func:`_multiscale_noise`, cells 64 px down to ``finest_cell`` px: each
    [layers, channels, h, w], just covering the image at its cell size once upsampled from the one before."""
    cell = _COARSEST_CELL
    rows, columns = height // cell + 2, width // cell + 2
    octaves = [torch.randn(layers, channels, rows, columns, generator=gen)]
    while cell > finest_cell:
        cell //= 2
        rows, columns = min(2 * rows, height // cell + 2), min(2 * columns, width // cell + 2)
        octaves.append(torch.randn(layers, channels, rows, columns, generator=gen))
    return octaves


def _multiscale_noise(octaves: list[torch.Tensor], height: int, width: int) -> torch.Tensor:
    """Octaves of random grids [N, channels, h, w], coarsest (64 px cells) first -> noise [N, channels, H, W].

    Octave weights grow as sqrt(cell), and the sum is divided by sqrt(sum of the weights squared), so the
    values are roughly unit scale. Built as a pyramid: the running sum is upsampled 2x and the next (finer,
    weaker) octave added, so the cost is dominated by the last upsampling. The grids are upsampled as one
    channel each ([N * channels, 1, h, w]): on the CPU torch's bilinear kernel is about 2x slower with 3.
    """
    layers, channels = octaves[0].shape[:2]
    cell = _COARSEST_CELL
    total = (math.sqrt(cell) * octaves[0]).view(layers * channels, 1, *octaves[0].shape[-2:])
    weight_sq = float(cell)
    for octave in octaves[1:]:
        cell //= 2
        # Upsample 2x and keep only the grid rows/columns that cover the image at this cell size.
        total = F.interpolate(total, scale_factor=2.0, mode="bilinear", align_corners=False)
        total = total[:, :, : octave.shape[-2], : octave.shape[-1]]
        total += math.sqrt(cell) * octave.view(total.shape)
        weight_sq += cell
    total = F.interpolate(total, scale_factor=float(cell), mode="bilinear", align_corners=False)
    return total[:, :, :height, :width].reshape(layers, channels, height, width) * (1 / math.sqrt(weight_sq))


@dataclass(frozen=True)
class _TextureDraws:
    """The random numbers of procedural textures, each with the layer first (a noise: its octaves)."""

    base: torch.Tensor  # [L, 3, 1] base colours
    colour_noise: list[torch.Tensor]  # octaves [L, 3 fields, h, w]
    mix: torch.Tensor  # [L, 3 colours, 3 fields]
    luminance_gain: torch.Tensor  # [L, 1]
    mix_gain: torch.Tensor  # [L, 1, 1]
    alpha: torch.Tensor  # [L, 1, 1] the stripes' orientation
    period: torch.Tensor  # [L, 1, 1] pixels
    phase: torch.Tensor  # [L, 1, 1]
    blob_noise: list[torch.Tensor]  # octaves [L, 1, h, w]
    edge_on: torch.Tensor  # [L, 3] stripes, checkerboard, blobs: drawn below 0.5 = on
    edge_weight: torch.Tensor  # [L, 3]
    edge_colour: torch.Tensor  # [L, 3]

    @staticmethod
    def draw(gen: torch.Generator, layers: int, height: int, width: int) -> _TextureDraws:
        """One scene's draws from its generator, in the order of the fields."""
        return _TextureDraws(
            base=_uniform(gen, (layers, 3, 1), 40.0, 215.0),
            colour_noise=_noise_octaves(gen, layers, 3, height, width, finest_cell=2),
            mix=torch.randn(layers, 3, 3, generator=gen),
            luminance_gain=_uniform(gen, (layers, 1), 10.0, 30.0),
            mix_gain=_uniform(gen, (layers, 1, 1), 5.0, 20.0),
            alpha=_uniform(gen, (layers, 1, 1), 0.0, math.pi),
            period=_uniform(gen, (layers, 1, 1), 10.0, 40.0),
            phase=_uniform(gen, (layers, 1, 1), 0.0, 2 * math.pi),
            blob_noise=_noise_octaves(gen, layers, 1, height, width, finest_cell=8),
            edge_on=torch.rand(layers, 3, generator=gen),
            edge_weight=_uniform(gen, (layers, 3), 10.0, 30.0),
            edge_colour=torch.randn(layers, 3, generator=gen),
        )

    @staticmethod
    def cat(scenes: list[_TextureDraws]) -> _TextureDraws:
        """The draws of B scenes of L layers -> those of B * L layers (a noise's octaves each joined)."""
        joined = {}
        for field in fields(_TextureDraws):
            values = [getattr(scene, field.name) for scene in scenes]
            joined[field.name] = (
                torch.cat(values) if isinstance(values[0], torch.Tensor) else [torch.cat(o) for o in zip(*values)]
            )
        return _TextureDraws(**joined)


def procedural_textures(gens: list[torch.Generator], layers: int, height: int, width: int) -> torch.Tensor:
    """Textures [B, layers, 3, H, W] in 0..255: a base colour, coloured multi-scale noise and sharp edges.

    Each scene's random numbers are drawn from its generator; the textures are then painted as one batch of
    B * layers layers (the painting is per layer, so a scene's textures do not depend on the batch)."""
    drawn = _TextureDraws.cat([_TextureDraws.draw(gen, layers, height, width) for gen in gens])
    all_layers = len(gens) * layers
    # Luminance noise plus a random colour mix of three noise fields.
    noise = _multiscale_noise(drawn.colour_noise, height, width)  # [B*L, 3 fields, H, W]
    mix = (drawn.mix * 0.5 + torch.eye(3) * 0.5) * drawn.mix_gain  # [B*L, 3 colours, 3 fields]
    mix[:, :, 0] += drawn.luminance_gain  # the luminance: field 0 added to every colour
    texture = torch.baddbmm(drawn.base, mix, noise.view(all_layers, 3, height * width))  # [B*L, 3, H*W]

    # Edges: square-wave stripes at a random orientation and period, a checkerboard, and blobs (level sets
    # of coarse noise). sin(phase) * period / 2pi is about the distance to the nearest edge in pixels.
    ys = torch.arange(height, dtype=torch.float32).view(1, height, 1)
    xs = torch.arange(width, dtype=torch.float32).view(1, 1, width)
    frequency = 2 * math.pi / drawn.period  # radians a pixel
    cos, sin = torch.cos(drawn.alpha) * frequency, torch.sin(drawn.alpha) * frequency
    along = xs * cos + (ys * sin + drawn.phase)  # [B*L, H, W] phases across and along the stripes
    across = xs * -sin + (ys * cos + drawn.phase)
    sharpness = drawn.period / (2 * math.pi * _EDGE_WIDTH)
    stripes = along.sin_().mul_(sharpness).tanh_()
    checker = across.sin_().mul_(sharpness).tanh_().mul_(stripes)
    blobs = _multiscale_noise(drawn.blob_noise, height, width)[:, 0].mul_(3.0).tanh_()
    weights = ((drawn.edge_on < 0.5).float() * drawn.edge_weight).view(all_layers, 3, 1, 1)
    edge_signal = (stripes * weights[:, 0]).addcmul_(checker, weights[:, 1]).addcmul_(blobs, weights[:, 2])
    edge_colour = F.normalize(drawn.edge_colour, dim=1) * math.sqrt(3.0)
    texture = texture.view(all_layers, 3, height, width).addcmul_(
        edge_signal.unsqueeze(1), edge_colour.view(all_layers, 3, 1, 1)
    )
    return texture.clamp_(0.0, 255.0).view(len(gens), layers, 3, height, width)


def _draw_motion(
    gen: torch.Generator,
    height: int,
    width: int,
    *,
    num_layers: int,
    max_translation: float,
    max_rotation: float,
    max_scale_change: float,
    background_motion: float,
) -> dict[str, torch.Tensor]:
    """One scene's layer shapes and motions: the :class:`_Scene` fields but ``textures``, each [L, ...]."""
    layers = num_layers + 1
    motion_scale = math.sqrt(height * width / (_REFERENCE_SIZE[0] * _REFERENCE_SIZE[1]))
    centre = torch.complex(
        torch.rand(layers, generator=gen) * width, torch.rand(layers, generator=gen) * height
    )
    centre[0] = complex((width - 1) / 2, (height - 1) / 2)
    # Translation uniform in a disc; rotation and log-scale uniform; the background (camera) moves less.
    radius = torch.sqrt(torch.rand(layers, generator=gen)) * max_translation * motion_scale
    direction = _uniform(gen, (layers,), 0.0, 2 * math.pi)
    angle = _uniform(gen, (layers,), -1.0, 1.0) * math.radians(max_rotation)
    log_scale = _uniform(gen, (layers,), -1.0, 1.0) * math.log1p(max_scale_change)
    damping = torch.ones(layers)
    damping[0] = background_motion
    radii = _uniform(gen, (layers, 2), 0.1, 0.35) * min(height, width)
    orientation = torch.polar(torch.ones(layers), _uniform(gen, (layers,), 0.0, math.pi))
    exponent = torch.tensor([1.0, 2.0, 2.0, 6.0])[torch.randint(0, 4, (layers,), generator=gen)]
    lobes = torch.randint(2, 7, (layers,), generator=gen).float()
    lobe_amplitude = _uniform(gen, (layers,), 0.0, 0.3) * (torch.rand(layers, generator=gen) < 0.6).float()
    lobe_phase = _uniform(gen, (layers,), 0.0, 2 * math.pi)
    return {
        "centre": centre,
        "velocity": torch.polar(radius * damping, direction),
        "log_similarity": torch.complex(log_scale * damping, angle * damping),
        "radii": radii,
        "orientation": orientation,
        "exponent": exponent,
        "lobes": lobes,
        "lobe_amplitude": lobe_amplitude,
        "lobe_phase": lobe_phase,
    }


def _per_layer(values: torch.Tensor) -> torch.Tensor:
    """[B, L] per-layer values -> [B, L, 1, 1], to broadcast over a layer's pixels."""
    return values[..., None, None]


def _forward_motion(
    centre: torch.Tensor, velocity: torch.Tensor, log_similarity: torch.Tensor, t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_t(u) = offset + u * factor of one scene's layers: complex [L] each -> (offset, factor) [L]."""
    factor = torch.exp(t * log_similarity)
    return centre + t * velocity - centre * factor, factor


def _inverse_motion(
    centre: torch.Tensor, velocity: torch.Tensor, log_similarity: torch.Tensor, t: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_t^{-1}(p) = offset + p * factor of one scene's layers: complex [L] each -> (offset, factor) [L]."""
    factor = torch.exp(-t * log_similarity)
    return centre - (centre + t * velocity) * factor, factor


def _moved(
    scene: _Scene, motion: Callable[..., tuple[torch.Tensor, torch.Tensor]], points: torch.Tensor, t: float
) -> torch.Tensor:
    """Complex points [B or 1, L or 1, H, W] moved by every layer's ``motion`` at time t -> [B, L, H, W].

    The motions' few numbers are computed scene by scene: torch's complex exponential and products round a
    vector's lanes and its remainder differently, so computed for the batch at once, a scene's flow would depend
    on its place in the batch (by an ulp)."""
    offsets, factors = zip(
        *(
            motion(centre, velocity, log_similarity, t)  # one scene's layers: complex [L] each
            for centre, velocity, log_similarity in zip(scene.centre, scene.velocity, scene.log_similarity)
        )
    )
    return torch.addcmul(_per_layer(torch.stack(offsets)), points, _per_layer(torch.stack(factors)))


def _to_layer(scene: _Scene, points: torch.Tensor, t: float) -> torch.Tensor:
    """A_t^{-1} for every layer: complex image points [B or 1, L or 1, H, W] at time t -> layer points
    [B, L, H, W]."""
    return _moved(scene, _inverse_motion, points, t)


def _to_image(scene: _Scene, points: torch.Tensor, t: float) -> torch.Tensor:
    """A_t for every layer: complex layer points [B or 1, L or 1, H, W] -> image points at time t [B, L, H, W]."""
    return _moved(scene, _forward_motion, points, t)


def _power(base: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``base ** exponent`` for ``base >= 0``, in place, as exp(exponent * log(base)): on the CPU 5x faster than
    torch.pow with a tensor exponent, which has no vectorised kernel; within 5e-6 relative for bases up to 100."""
    return base.log_().mul_(exponent).exp_()


def _inside_shapes(scene: _Scene, layer_points: torch.Tensor) -> torch.Tensor:
    """Membership of complex layer points [B, L, H, W] in the foreground layers' shapes -> bool [B, L-1, H, W]
    (the background, layer 0, has no shape: it is everywhere)."""
    fg = (slice(None), slice(1, None))
    # the shape's frame: its centre at 0, its axes along x and y
    local = (layer_points[fg] - _per_layer(scene.centre[fg])) * _per_layer(scene.orientation[fg].conj())
    # dense real and imaginary parts: atan2 of those is ~4x faster on CPU than torch.angle(local), same values
    x, y = torch.view_as_real(local).movedim(-1, 0).contiguous()
    lobe = torch.atan2(y, x).mul_(_per_layer(scene.lobes[fg])).add_(_per_layer(scene.lobe_phase[fg])).sin_()
    n = _per_layer(scene.exponent[fg])
    rx, ry = _per_layer(scene.radii[fg][..., 0]), _per_layer(scene.radii[fg][..., 1])
    rho = _power(_power(x.abs_().div_(rx), n) + _power(y.abs_().div_(ry), n), 1.0 / n)
    return rho < lobe.mul_(_per_layer(scene.lobe_amplitude[fg])).add_(1.0)


def _front_layer(inside_shapes: torch.Tensor) -> torch.Tensor:
    """Index of the front-most layer containing each pixel: bool [B, L-1, H, W] of the foreground layers'
    shapes -> long [B, H, W], 0 (the background) where no shape is."""
    batch, foreground, height, width = inside_shapes.shape
    if not foreground:
        return torch.zeros(batch, height, width, dtype=torch.long)
    order = torch.arange(1, foreground + 1).view(-1, 1, 1)
    return torch.where(inside_shapes, order, 0).amax(dim=1)


def _reflect(coordinate: torch.Tensor, size: int) -> torch.Tensor:
    """Pixel coordinates folded into [0, size - 1] by mirroring about the image's edges (-0.5 and
    size - 0.5), as grid_sample's reflection padding: the texture continued as its mirror images."""
    folded = torch.remainder(coordinate + 0.5, 2 * size)  # [0, 2 * size)
    return torch.where(folded < size, folded, 2 * size - folded).sub_(0.5).clamp_(0, size - 1)


def _sample_front(scene: _Scene, layer_points: torch.Tensor, front: torch.Tensor) -> torch.Tensor:
    """Each pixel's colour: a bilinear lookup in its front layer's texture at its point on that layer.
    Complex layer points [B, L, H, W] and front layer ids [B, H, W] -> colours [B, 3, H, W].

    Reflection padding keeps each texture a continuous function of the whole plane, so points that move in
    from outside the frame are still well defined and consistent between frames. One lookup per pixel: the
    layers' textures are stacked vertically, each point reflected into its own layer's rows (a bilinear tap
    past a layer's last row has weight 0).
    """
    batch, layers, _, height, width = scene.textures.shape
    points = torch.view_as_real(layer_points).gather(1, front[:, None, :, :, None].expand(-1, 1, -1, -1, 2))
    x = _reflect(points[:, 0, ..., 0], width)  # [B, H, W] pixels in the front layer's texture
    y = _reflect(points[:, 0, ..., 1], height).add_(front, alpha=height)  # [B, H, W] rows of the stacked textures
    # pixel centres -> [-1, 1], corners off
    grid = torch.stack([x.add_(0.5).mul_(2 / width).sub_(1), y.add_(0.5).mul_(2 / (layers * height)).sub_(1)], -1)
    stacked = scene.textures.transpose(1, 2).reshape(batch, 3, layers * height, width)
    return F.grid_sample(stacked, grid, mode="bilinear", padding_mode="border", align_corners=False)


@functools.lru_cache(maxsize=8)
def _pixel_grid(height: int, width: int) -> torch.Tensor:
    """Complex pixel coordinates x + iy -> [1, 1, H, W] (cached: read only)."""
    ys = torch.arange(height, dtype=torch.float32).view(height, 1)
    xs = torch.arange(width, dtype=torch.float32).view(1, width)
    return torch.complex(xs.expand(height, width), ys.expand(height, width))[None, None]


def _render(scene: _Scene, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames at time t -> (float32 [B, 3, H, W] in 0..255 rounded to 8-bit levels, front layer ids [B, H, W])."""
    height, width = scene.textures.shape[-2:]
    layer_points = _to_layer(scene, _pixel_grid(height, width), t)  # [B, L, H, W]
    front = _front_layer(_inside_shapes(scene, layer_points))  # [B, H, W]
    frame = _sample_front(scene, layer_points, front)  # [B, 3, H, W]
    return frame.round_().clamp_(0.0, 255.0), front


def _flow_and_masks(scene: _Scene, front: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact flow t=0 -> t=1 given frame 0's front layers [B, H, W] -> (flow [B, 2, H, W], valid, occlusion
    [B, H, W])."""
    height, width = front.shape[-2:]
    pixels = _pixel_grid(height, width)  # [1, 1, H, W]; at t=0 layer points are the pixels themselves
    target = _to_image(scene, pixels, 1.0).gather(1, front.unsqueeze(1))  # [B, 1, H, W] complex
    flow = torch.view_as_real(target[:, 0] - pixels[0]).permute(0, 3, 1, 2).contiguous()  # [B, 2, H, W]
    in_image = (
        (target.real >= 0) & (target.real <= width - 1) & (target.imag >= 0) & (target.imag <= height - 1)
    )[:, 0]
    valid = torch.isfinite(flow).all(dim=1) & in_image
    # The surface is occluded when another layer is in front at the (continuous) target point at t=1.
    front_at_target = _front_layer(_inside_shapes(scene, _to_layer(scene, target, 1.0)))
    occlusion = (front_at_target != front) | ~in_image
    return flow, valid.float(), occlusion.float()


class _SceneSource(abc.ABC):
    """Construction and validation of the scene parameters, shared by both synthetic datasets (and the
    photograph-textured ones of ``flowformer/data/image_folder.py``, which replace ``textures``).

    Args:
        num_samples: number of samples; sample ``i`` is a pure function of ``(seed, i)``.
        size: (H, W) in pixels, any integers >= 8.
        seed: dataset seed; use different seeds for training and validation sets.
        num_layers: moving foreground shapes in front of the background.
        max_translation: largest object translation in pixels at 368x496, scaled with sqrt(H*W).
        max_rotation: largest rotation between the frames, degrees.
        max_scale_change: largest relative scale change between the frames (0.1 = +-10%).
        background_motion: the background's motion as a fraction of the objects' (camera motion).
    """

    dataset_name = "synthetic"  # meta["dataset"]

    def __init__(
        self,
        *,
        num_samples: int,
        size: tuple[int, int] | list[int] = _REFERENCE_SIZE,
        seed: int = 0,
        num_layers: int = 4,
        max_translation: float = 100.0,
        max_rotation: float = 10.0,
        max_scale_change: float = 0.1,
        background_motion: float = 0.25,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"synthetic data: num_samples must be >= 1, got {num_samples}")
        if num_layers < 0:
            raise ValueError(f"synthetic data: num_layers must be >= 0, got {num_layers}")
        if not 0 <= max_scale_change < 1:
            raise ValueError(f"synthetic data: max_scale_change must be in [0, 1), got {max_scale_change}")
        self.num_samples = int(num_samples)
        self.size = _check_size(size)
        self.seed = int(seed)
        self.num_layers = int(num_layers)
        self.max_translation = float(max_translation)
        self.max_rotation = float(max_rotation)
        self.max_scale_change = float(max_scale_change)
        self.background_motion = float(background_motion)
        self.textures: TextureSource = procedural_textures

    def __len__(self) -> int:
        return self.num_samples

    def _scenes(self, indices: list[int]) -> _Scene:
        """The scenes of samples ``indices`` (negative counting from the end) as one batch. Each scene's random
        stream is its own: its shapes and motions are drawn first (they do not depend on the image size), then
        its textures."""
        gens = []
        for index in indices:
            if not -self.num_samples <= index < self.num_samples:
                raise IndexError(f"synthetic data: index {index} out of range for {self.num_samples} samples")
            gens.append(_generator(self.seed, index % self.num_samples))
        motions = [
            _draw_motion(
                gen,
                *self.size,
                num_layers=self.num_layers,
                max_translation=self.max_translation,
                max_rotation=self.max_rotation,
                max_scale_change=self.max_scale_change,
                background_motion=self.background_motion,
            )
            for gen in gens
        ]
        textures = self.textures(gens, self.num_layers + 1, *self.size)
        return _Scene(textures=textures, **{name: torch.stack([m[name] for m in motions]) for name in motions[0]})

    def __getitem__(self, item: int | SampleKey) -> dict[str, object]:
        return self.__getitems__([item])[0]

    def __getitems__(self, items: list[int | SampleKey]) -> list[dict[str, object]]:
        """A batch's samples (a DataLoader's fetch), their scenes rendered together in chunks of at most
        ``_CHUNK_PIXELS`` pixels: each sample is that of its item alone."""
        indices = [item_index(item) for item in items]  # scenes are a function of (seed, index)
        per_chunk = max(1, _CHUNK_PIXELS // (self.size[0] * self.size[1]))
        chunks = [indices[start : start + per_chunk] for start in range(0, len(indices), per_chunk)]
        return [sample for chunk in chunks for sample in self._samples(chunk)]

    @abc.abstractmethod
    def _samples(self, indices: list[int]) -> list[dict[str, object]]:
        """The samples of scenes ``indices``, rendered as one batch."""

    def _meta(self, index: int) -> dict[str, int | str]:
        return {"dataset": self.dataset_name, "seed": self.seed, "index": int(index) % self.num_samples}


class SyntheticFlowDataset(_SceneSource, Dataset):
    """Image pairs with exact ground-truth flow, valid and occlusion masks (the data contract, plus
    ``occlusion`` float [H, W], 1 = the pixel's surface is not visible at the target in frame 2).

    Arguments: the scene parameters of :class:`_SceneSource` (``num_samples``, ``size``, ``seed``,
    ``num_layers``, ``max_translation``, ``max_rotation``, ``max_scale_change``, ``background_motion``).
    """

    def _samples(self, indices: list[int]) -> list[dict[str, object]]:
        scenes = self._scenes(indices)
        img1, front = _render(scenes, 0.0)
        img2, _ = _render(scenes, 1.0)
        flow, valid, occlusion = _flow_and_masks(scenes, front)
        return [
            {
                "img1": img1[b],
                "img2": img2[b],
                "flow": flow[b],
                "valid": valid[b],
                "occlusion": occlusion[b],
                "meta": self._meta(index),
            }
            for b, index in enumerate(indices)
        ]


class SyntheticVideoDataset(_SceneSource, Dataset):
    """Unlabeled clips of the same kind of scenes, for MCVA pretraining.

    Clip ``i`` has ``num_frames`` frames at evenly spaced times from 0 to 1, so its first and last frames move
    as much as a :class:`SyntheticFlowDataset` pair. As a dataset it yields the pair (frame 0, frame
    ``frame_gap``) as ``img1``, ``img2`` (float32 [3, H, W], 0..255) with ``meta``; ``clip(i)`` returns all
    frames [T, 3, H, W]. Arguments as for :class:`SyntheticFlowDataset`, plus ``num_frames`` (>= 3) and
    ``frame_gap`` (1..num_frames-1, default: the last frame).
    """

    def __init__(self, *, num_frames: int = 3, frame_gap: int | None = None, **scene: Any) -> None:
        super().__init__(**scene)
        if num_frames < 3:
            raise ValueError(f"SyntheticVideoDataset: num_frames must be >= 3, got {num_frames}")
        frame_gap = num_frames - 1 if frame_gap is None else int(frame_gap)
        if not 1 <= frame_gap < num_frames:
            raise ValueError(
                f"SyntheticVideoDataset: frame_gap must be in 1..{num_frames - 1} (num_frames - 1), got {frame_gap}"
            )
        self.num_frames = int(num_frames)
        self.frame_gap = frame_gap

    def _times(self) -> list[float]:
        return [k / (self.num_frames - 1) for k in range(self.num_frames)]

    def clip(self, index: int) -> torch.Tensor:
        """All frames of clip ``index`` -> float32 [T, 3, H, W] in 0..255."""
        scene = self._scenes([index])
        return torch.cat([_render(scene, t)[0] for t in self._times()])

    def _samples(self, indices: list[int]) -> list[dict[str, object]]:
        scenes = self._scenes(indices)
        img1, _ = _render(scenes, 0.0)
        img2, _ = _render(scenes, self._times()[self.frame_gap])
        return [{"img1": img1[b], "img2": img2[b], "meta": self._meta(index)} for b, index in enumerate(indices)]
