"""The 4D cost volume, held whole or computed piece by piece from the two feature maps.

FlowFormer reads its cost volume in two ways: the cost encoder patchifies every source pixel's whole cost map,
and the decoder samples a bilinear (2r+1)² window of it around each target position. Both can be computed
from the features when needed instead of from a stored [B·H1·W1, heads, H2, W2] volume, whose size grows
with (H/8·W/8)²:

- a row block of cost maps is ``feat1[rows] · feat2`` per head, the dense volume's numbers bitwise;
- a window is sampled from its row block's maps, computed again for each read: B·N·N·C multiply-adds per
  read of all windows, yet faster on a CPU up to about 1080p than the linear alternative, and the dense
  numbers exactly;
- beyond that, bilinear sampling being linear, sampling a cost map at a point equals the dot product of the
  source feature with feat2 sampled bilinearly at that point (zero outside the map, as ``grid_sample`` pads;
  both sample the same H2 x W2 grid, so the interpolation weights are the same), to float summation order.

:class:`DenseCostVolume` wraps the stored volume (the official computation); :class:`FeatureCostVolume`
computes blocks of ``rows_per_block`` source pixels at a time, so no more than one block of cost maps exists.
Everything that reads the volume takes either (``as_cost_volume``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from flowformer.models.layers import (
    bilinear_sample,
    recomputed_in_backward,
    sample_cost_window,
    window_offsets,
)

__all__ = ["CostVolume", "DenseCostVolume", "FeatureCostVolume", "as_cost_volume", "dense_cost_maps"]


def dense_cost_maps(feat1: Tensor, feat2: Tensor, heads: int) -> Tensor:
    """All-pairs dot products, unscaled, in fp32: feat1, feat2 [B, C, H, W] -> [B*H*W, heads, H, W]."""
    batch, channels, height, width = feat1.shape
    with torch.autocast(device_type=feat1.device.type, enabled=False):
        f1 = feat1.float().view(batch, heads, channels // heads, height * width).transpose(-2, -1)
        f2 = feat2.float().view(batch, heads, channels // heads, height * width).transpose(-2, -1)
        corr = torch.einsum("bhid,bhjd->bhij", f1, f2)  # [B, heads, H1*W1, H2*W2]
    return corr.permute(0, 2, 1, 3).reshape(batch * height * width, heads, height, width)


class CostVolume:
    """The cost maps of `num_rows` = B·H1·W1 source pixels (row b·H1·W1 + y·W1 + x), `heads` each, H2 x W2."""

    num_rows: int
    heads: int
    map_size: tuple[int, int]
    block_rows: int  # the most rows `maps` should be asked for at once

    def maps(self, rows: slice) -> Tensor:
        """Cost maps of the source pixels in `rows` -> [n, heads, H2, W2] (fp32)."""
        raise NotImplementedError

    def row_slices(self, rows_per_block: int) -> Iterator[slice]:
        """The volume's rows in order, in blocks of at most rows_per_block consecutive rows."""
        for start in range(0, self.num_rows, rows_per_block):
            yield slice(start, min(start + rows_per_block, self.num_rows))

    def row_blocks(self, rows_per_block: int) -> Iterator[tuple[slice, Tensor]]:
        """(rows, their maps [n, heads, H2, W2]) for each of `row_slices`: the whole volume, a block at a time."""
        for rows in self.row_slices(rows_per_block):
            yield rows, self.maps(rows)

    def window(self, coords: Tensor, radius: int) -> Tensor:
        """Bilinear (2r+1)² window of every source pixel's cost map around coords [B, 2, H1, W1] (x, y)
        -> [B, heads·(2r+1)², H1, W1], channel = head·(2r+1)² + (dx+r)·(2r+1) + (dy+r) (official order)."""
        raise NotImplementedError

    def window_offsets(self, radius: int, device: torch.device) -> Tensor:
        """`window_offsets(radius)`, made once per volume: the decoder reads a window at every iteration. Under
        torch.compile each call makes them in its graph (inductor folds them to constants): a tensor kept on the
        volume would be one more output of a compiled iteration, which CUDA graphs overwrite at their next replay
        while the volume still holds it (`runtime.compile_mode=reduce-overhead` failed so on an H200)."""
        if torch.compiler.is_compiling():
            return window_offsets(radius, device)
        made = self.__dict__.setdefault("_window_offsets", {})
        if radius not in made:
            made[radius] = window_offsets(radius, device)
        return made[radius]


class DenseCostVolume(CostVolume):
    """The volume held whole: cost_maps [B·H1·W1, heads, H2, W2]."""

    def __init__(self, cost_maps: Tensor) -> None:
        self.cost_maps = cost_maps
        self.num_rows, self.heads = cost_maps.shape[:2]
        self.map_size = tuple(cost_maps.shape[-2:])
        self.block_rows = self.num_rows

    def maps(self, rows: slice) -> Tensor:
        return self.cost_maps[rows]

    def row_blocks(self, rows_per_block: int) -> Iterator[tuple[slice, Tensor]]:
        # one split rather than a slice per block: the blocks' backward is then one concatenation of their
        # gradients. Each slice's backward writes a gradient the size of the whole volume, zero outside its
        # block, and autograd adds those up: for 45 blocks (368x496, batch 8, tokenize_chunk 512) 45 volumes of
        # 248 MiB written and summed where one suffices.
        yield from zip(self.row_slices(rows_per_block), self.cost_maps.split(rows_per_block), strict=True)

    def window(self, coords: Tensor, radius: int) -> Tensor:
        return sample_cost_window(self.cost_maps, coords, radius, self.window_offsets(radius, coords.device))


# Source pixels per image up to which `FeatureCostVolume.window` samples each block's cost maps computed again
# (the dense numbers bitwise; N·C multiply-adds per window) rather than feat2 at every window point, dotted with
# the source feature ((2r+1)²·4 gathered values per channel and window). Measured on 2 CPU threads, 9x9
# windows, both in blocks: the maps were 3.4x faster at 55x128 (7040 pixels, 440x1024 images) and 1.15x at
# 135x240 (32400, 1080x1920); their cost grows with the pixels, so beyond about 36000 sampling wins.
MAPS_FOR_WINDOWS_MAX_PIXELS = 32768


class FeatureCostVolume(CostVolume):
    """The volume as feat1 [B, C, H, W], feat2 [B, C, H2, W2] (smaller than feat1 for RAFT's pooled pyramid
    levels, flowformer/models/raft_decoder.py); maps and windows computed for `rows_per_block` source pixels at
    a time (peak: one block of cost maps, [rows_per_block, heads, H2, W2] fp32)."""

    def __init__(self, feat1: Tensor, feat2: Tensor, heads: int, rows_per_block: int) -> None:
        if rows_per_block < 1:
            raise ValueError(f"FeatureCostVolume: rows_per_block must be >= 1, got {rows_per_block}")
        batch, channels, height, width = feat1.shape
        self.heads = heads
        self.num_rows = batch * height * width
        self.source_pixels = height * width  # per image
        self.map_size = tuple(feat2.shape[-2:])
        self.block_rows = rows_per_block
        self.feat2 = feat2.float()  # [B, C, H2, W2], sampled by `_window_from_features`
        # [B, heads, H*W (f2: H2*W2), C/heads]: per-head features in fp32, laid out as dense_cost_maps lays them
        # out, so a block's maps are the dense volume's numbers
        self.f1 = feat1.float().view(batch, heads, channels // heads, height * width).transpose(-2, -1)
        self.f2 = self.feat2.view(batch, heads, channels // heads, -1).transpose(-2, -1)

    def _over_images(self, rows: slice, block_of_image: Callable[[int, slice, slice], Tensor]) -> Tensor:
        """block_of_image(image, its source pixels, their rows within the block) for each image the row block
        spans, concatenated along the rows."""
        pieces, start = [], rows.start
        while start < rows.stop:
            image, first = divmod(start, self.source_pixels)
            stop = min(rows.stop, (image + 1) * self.source_pixels)
            in_block = slice(start - rows.start, stop - rows.start)
            pieces.append(block_of_image(image, slice(first, first + stop - start), in_block))
            start = stop
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def maps(self, rows: slice) -> Tensor:
        def maps_of_image(image: int, pixels: slice, _: slice) -> Tensor:
            # [heads, n, C/heads] x [heads, H*W, C/heads] -> [heads, n, H*W] -> [n, heads, H*W]
            return torch.einsum("hid,hjd->hij", self.f1[image, :, pixels], self.f2[image]).transpose(0, 1)

        with torch.autocast(device_type=self.f1.device.type, enabled=False):
            block = self._over_images(rows, maps_of_image)
        return block.view(-1, self.heads, *self.map_size)

    def _window_from_maps(self, rows: slice, points: Tensor) -> Tensor:
        """The cost maps of `rows` sampled at points [n, side, side, 2] -> [n, heads, side, side]."""
        return bilinear_sample(self.maps(rows), points)

    def _window_from_features(self, rows: slice, points: Tensor) -> Tensor:
        """feat2 sampled at points [n, side, side, 2], dotted per head with the source features
        -> [n, heads, side, side]."""
        n, side = points.shape[:2]

        def window_of_image(image: int, pixels: slice, in_block: slice) -> Tensor:
            image_points = points[in_block].reshape(1, -1, side * side, 2)  # [1, count, side², 2]
            sampled = bilinear_sample(self.feat2[image : image + 1], image_points)  # [1, C, count, side²]
            sampled = sampled.view(self.heads, -1, *image_points.shape[1:3])  # [heads, C/heads, count, side²]
            return torch.einsum("hnd,hdnw->nhw", self.f1[image, :, pixels], sampled)  # [count, heads, side²]

        return self._over_images(rows, window_of_image).view(n, self.heads, side, side)

    def window(self, coords: Tensor, radius: int) -> Tensor:
        """As CostVolume.window, a block of source pixels at a time: from the block's cost maps computed again
        (the dense numbers bitwise) up to MAPS_FOR_WINDOWS_MAX_PIXELS source pixels per image, from feat2
        sampled at the window points beyond (same to float rounding: bilinear sampling is linear, and both
        sample the same grid with zero padding). When gradients flow (training), each block's maps or sampled
        features are recomputed in backward instead of kept: together they would outweigh the dense volume."""
        batch, _, h1, w1 = coords.shape
        side = 2 * radius + 1
        centres = coords.permute(0, 2, 3, 1).reshape(batch * h1 * w1, 1, 1, 2)
        points = centres + self.window_offsets(radius, coords.device)  # [B*H1*W1, side, side, 2], as the dense
        from_maps = h1 * w1 <= MAPS_FOR_WINDOWS_MAX_PIXELS
        window_block = self._window_from_maps if from_maps else self._window_from_features
        recompute = self.f1.requires_grad or self.feat2.requires_grad
        # written block by block into one tensor: blocks of results kept between the blocks' large transients
        # fragmented the CPU heap (3.5 GiB at 1080x1920)
        out = torch.empty(self.num_rows, self.heads, side, side, device=coords.device)
        with torch.autocast(device_type=coords.device.type, enabled=False):
            for rows in self.row_slices(self.block_rows):
                out[rows] = recomputed_in_backward(recompute, window_block, rows, points[rows])
        # [B*H1*W1, heads, side, side] -> [B, heads*side², H1, W1]
        return out.view(batch, h1, w1, -1).permute(0, 3, 1, 2)


def as_cost_volume(cost: Tensor | CostVolume) -> CostVolume:
    """A stored volume [B·H1·W1, heads, H2, W2] or a CostVolume -> a CostVolume."""
    return cost if isinstance(cost, CostVolume) else DenseCostVolume(cost)
