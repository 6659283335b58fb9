"""RAFT's multi-level cost retrieval decoder (MCR), the baseline of the paper's architecture ablation
(`backbone.decoder=mcr`): a 4-level pyramid of the all-pairs cost volume, a 9x9 window read from every level
around the current target positions, and RAFT's motion encoder, ConvGRU, flow head and convex upsampling (the
refinement loop of flowformer/models/decoder.py, with GMA's motion aggregation when `global_motion`). It reads
the cost volume itself: there is no cost encoder and no cost memory.

torchvision's `CorrBlock` computes the same pyramid and lookup (tests/models/test_decoder_knobs.py compares
them) but is not used: it keeps the pyramid on the module between calls, refuses feature maps under 16 pixels a
side, and always holds the whole volume, where this pyramid can also be computed in blocks from the features
within a memory budget. The update block's parts are decoder.py's (RAFT's motion encoder, GRU, flow head and
mask head under the official FlowFormer names), one implementation for both decoders; torchvision's have the
same parameters and numbers under other names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flowformer.models.cost_volume import CostVolume, DenseCostVolume, FeatureCostVolume, dense_cost_maps
from flowformer.models.decoder import GMAAttention, RecurrentRefinement, UpdateBlock
from flowformer.models.memory_plan import FLOAT_BYTES

PYRAMID_LEVELS = 4  # RAFT's correlation pyramid levels (`corr_levels`)
PYRAMID_RADIUS = 4  # RAFT's lookup radius (`corr_radius`): a 9x9 window at every level


def _zero_row_beyond_single_pixels(maps: Tensor) -> Tensor:
    """maps [..., h, w] with a side of one pixel get a zero row / column after it. Sampling normalises
    coordinates by (side - 1) (align_corners), which a one-pixel side cannot take (RAFT gives NaN there); with
    the zero beside it, every point gets the bilinear weights of an unbounded zero-padded map."""
    height, width = maps.shape[-2:]
    if min(height, width) > 1:
        return maps
    return F.pad(maps, (0, int(width == 1), 0, int(height == 1)))


class CostPyramid:
    """RAFT's correlation pyramid: level l is every cost map average-pooled 2^l x 2^l, a CostVolume of maps
    [B·H1·W1, heads, H1/2^l, W1/2^l]; channels_per_head: the feature channels each head's dot product sums."""

    def __init__(self, levels: list[CostVolume], channels_per_head: int) -> None:
        self.levels = levels
        self.scale = channels_per_head**-0.5

    def lookup(self, coords: Tensor) -> Tensor:
        """coords [B, 2, H1, W1] (1/8-res target pixels, x first) -> [B, levels·heads·81, H1, W1]: level l's 9x9
        window around coords / 2^l, level-major, each in the x-major order of CostVolume.window, times
        (C/heads)^-0.5 (RAFT's 1/sqrt(C) correlation scale; FlowFormer's cost volume is unscaled)."""
        windows = [level.window(coords / 2**index, PYRAMID_RADIUS) for index, level in enumerate(self.levels)]
        return torch.cat(windows, dim=1) * self.scale


def cost_pyramid(feat1: Tensor, feat2: Tensor, heads: int, rows_per_block: int | None) -> CostPyramid:
    """feat1, feat2 [B, C, H1, W1] -> the pyramid. rows_per_block None: the dense volume pooled level by level
    (RAFT's computation); otherwise level l is a FeatureCostVolume of feat1 and feat2 pooled 2^l x 2^l, computed
    for that many source pixels at a time: pooling is linear, so its maps are the pooled maps to float rounding."""
    levels: list[CostVolume] = []
    if rows_per_block is None:
        maps = dense_cost_maps(feat1, feat2, heads)  # [B*H1*W1, heads, H1, W1]
        for index in range(PYRAMID_LEVELS):
            maps = F.avg_pool2d(maps, 2) if index else maps  # -> [B*H1*W1, heads, H1/2^l, W1/2^l]
            levels.append(DenseCostVolume(_zero_row_beyond_single_pixels(maps)))
    else:
        target = feat2.float()
        for index in range(PYRAMID_LEVELS):
            target = F.avg_pool2d(target, 2) if index else target  # -> [B, C, H1/2^l, W1/2^l]
            levels.append(FeatureCostVolume(feat1, _zero_row_beyond_single_pixels(target), heads, rows_per_block))
    return CostPyramid(levels, feat1.shape[1] // heads)


class MultiLevelCostDecoder(RecurrentRefinement):
    """RAFT's decoder (MCR) on FlowFormer's image and context encoders: each iteration reads the cost pyramid
    (`CostPyramid.lookup`, levels·heads·81 channels) at the current target positions.

    As in RAFT, the context encoder's output is split into the GRU state (its first decoder_dim channels, tanh)
    and the GRU's context input (the other decoder_dim, relu): there is no 1x1 `proj` (the cost memory decoder
    has one), so the context has 2·decoder_dim channels. global_motion: GMA's motion aggregation (`att`, the
    update block's `aggregator`); RAFT has none. checkpoint_iterations: as MemoryDecoder's.
    """

    kind = f"mcr decoder ({PYRAMID_LEVELS}-level correlation pyramid)"
    # the coarsest pyramid level, 1/2^(levels-1) of the 1/8-resolution maps, needs at least one pixel a side
    min_image_side = 8 * 2 ** (PYRAMID_LEVELS - 1)

    def __init__(
        self, *, cost_heads: int, decoder_dim: int, global_motion: bool, checkpoint_iterations: bool = False
    ) -> None:
        super().__init__()
        self.decoder_dim = decoder_dim
        self.cost_heads = cost_heads
        self.checkpoint_iterations = checkpoint_iterations
        self.update_block = UpdateBlock(
            corr_dim=PYRAMID_LEVELS * cost_heads * (2 * PYRAMID_RADIUS + 1) ** 2,
            hidden=decoder_dim,
            global_motion=global_motion,
        )
        if global_motion:
            self.att = GMAAttention(dim=decoder_dim)

    def split_context(self, context: Tensor) -> tuple[Tensor, Tensor]:
        net, inp = torch.split(context, [self.decoder_dim, self.decoder_dim], dim=1)
        return torch.tanh(net), torch.relu(inp)

    def cost_map_bytes(self, h1: int, w1: int) -> int:
        """What a lookup holds per cost map at once: the finest level's map. In the memory plan's dense
        estimate it stands for the coarser levels (together a third of the finest): an overestimate."""
        return self.cost_heads * h1 * w1 * FLOAT_BYTES

    def forward(
        self,
        cost_memory: None,
        cost: CostPyramid,
        context: Tensor,
        iters: int,
        flow_init: Tensor | None = None,
        query_chunk: int | None = None,
        upsample_all: bool = True,
        activation_budget: int | None = None,
    ) -> list[tuple[Tensor | None, Tensor]]:
        """As MemoryDecoder.forward, reading the cost pyramid; there is no cost memory (cost_memory: None)."""
        if cost_memory is not None:
            raise ValueError("the mcr decoder reads the cost pyramid and takes no cost memory (pass None)")
        return self.refine(cost, context, iters, flow_init, query_chunk, upsample_all, activation_budget)

    def correlation(self, source: CostPyramid, coords1: Tensor) -> Tensor:
        return source.lookup(coords1)
