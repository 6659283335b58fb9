"""Small pure helpers shared by the network's modules: coordinates, positional code, sampling, attention
arithmetic, convex upsampling and activation checkpointing, with the official constants and orders."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

Output = TypeVar("Output")


def coords_grid(batch: int, height: int, width: int, device: torch.device | None = None) -> Tensor:
    """Pixel coordinates [batch, 2, height, width]; channel 0 = x (column), channel 1 = y (row)."""
    ys, xs = torch.meshgrid(
        torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij"
    )
    coords = torch.stack([xs, ys], dim=0).float()
    return coords[None].repeat(batch, 1, 1, 1)


def convolution_layout(device: torch.device) -> torch.memory_format | None:
    """The memory format the network's convolution stacks (the update block, the cost patch embedding) give their
    tensors; the numbers are the same to float rounding either way:
    - the CPU: channels-last, which oneDNN convolves without reordering to its blocked layout and back (the
      update block 1.15x faster on 2 CPU cores, docs/performance.md, "Side by side with the official code"; the
      patch embedding's chunk 1.27x, "Cost-map tokenization in chunks");
    - a GPU while autograd records (training): channels-last, which cuDNN's bf16 and TF32 convolutions take
      without reordering around each call (on an H200 the bf16 training step took 265 ms against 274 with the
      update block so; the patch embedding so is not measured on a GPU);
    - a GPU in inference: None, the tensors as they come. Batch-1 inference is bound by launches, and the update
      block's copies into channels-last at each iteration cost more than the reorders they save (on an H200,
      440x1024, 32 iterations: 73 ms against 70 in TF32, 90.5 against 86 in bf16; docs/performance.md, "One
      H200")."""
    if device.type == "cpu" or (device.type == "cuda" and torch.is_grad_enabled()):
        return torch.channels_last
    return None


def in_layout(x: Tensor, layout: torch.memory_format) -> Tensor:
    """x [N, C, H, W] with `layout`'s strides. A one-channel tensor has the same memory in NCHW and channels-last,
    and torch counts it contiguous in both, so `contiguous` would keep its NCHW strides: a view gives it the
    channels-last ones (nothing copied), which convolutions then read and write channels-last."""
    if layout == torch.channels_last and x.shape[1] == 1:
        n, _, height, width = x.shape
        return x.contiguous().view(n, height, width, 1).permute(0, 3, 1, 2)
    return x.contiguous(memory_format=layout)


def linear_position_encoding(xy: Tensor, dim: int) -> Tensor:
    """Sine code of (x, y) points: xy [..., 2] -> [..., dim] = [sin ωx, cos ωx, sin ωy, cos ωy].

    ω_k = 3.14 · k / 200 for k = 0..dim/4-1: the literal 3.14 (not π) and the /200 factor are the official
    constants (`LinearPositionEmbeddingSine`, LatentCostFormer/attention.py). The multiplication order mirrors
    the official code so fp32 rounding matches.
    """
    if dim % 4 != 0:
        raise ValueError(f"positional-code dim must be a multiple of 4, got {dim}")
    freq = torch.linspace(0, dim // 4 - 1, dim // 4, device=xy.device)
    scale = 1 / 200
    angles = 3.14 * xy[..., None] * freq * scale  # [..., 2 (x, y), dim/4], each once for its sine and cosine
    # [..., 2 (x, y), 2 (sin, cos), dim/4] -> [..., dim] = [sin ωx, cos ωx, sin ωy, cos ωy]
    return torch.stack([torch.sin(angles), torch.cos(angles)], dim=-2).flatten(-3)


# cuDNN's grid sampler refuses batches this large (CUDNN_STATUS_NOT_SUPPORTED): on an H100, 24 x 46 x 62 =
# 68448 cost maps (MCVA batch 24 at 368x496) failed and 34224 ran. Larger batches are sampled in chunks.
GRID_SAMPLE_MAX_BATCH = 32768


def bilinear_sample(maps: Tensor, coords: Tensor) -> Tensor:
    """maps [N, C, H, W], coords [N, h, w, 2] (x, y) pixels -> [N, C, h, w].

    `grid_sample` with align_corners=True and zero padding, coordinates normalised as 2x/(W-1) - 1 (the official
    `bilinear_sampler`),
    over at most GRID_SAMPLE_MAX_BATCH maps per call.
    """
    height, width = maps.shape[-2:]
    # x and y at once, each divided by its own side - 1 (the same float32 division as by a scalar). The divisor
    # [W-1, H-1] is made on the device, by one kernel whose two values are its exact endpoints: a tensor made
    # from a list is copied from the host, which on a GPU waits for every queued kernel (the decoder and MCVA's
    # query rounds sample at every iteration: 13 waits in a training step on the H200)
    divisor = torch.linspace(width - 1, height - 1, 2, dtype=coords.dtype, device=coords.device)
    grid = 2 * coords / divisor - 1
    if maps.shape[0] <= GRID_SAMPLE_MAX_BATCH:
        return F.grid_sample(maps, grid, align_corners=True)
    chunks = zip(maps.split(GRID_SAMPLE_MAX_BATCH), grid.split(GRID_SAMPLE_MAX_BATCH))
    return torch.cat([F.grid_sample(m, g, align_corners=True) for m, g in chunks])


def window_offsets(radius: int, device: torch.device) -> Tensor:
    """[2r+1, 2r+1, 2] offsets; entry [i, j] = (i - r, j - r) read as (x, y): the window's row index is the x
    offset (the official x-major order)."""
    offsets = torch.linspace(-radius, radius, 2 * radius + 1, device=device)
    return torch.stack(torch.meshgrid(offsets, offsets, indexing="ij"), dim=-1)


def sample_cost_window(cost_maps: Tensor, coords: Tensor, radius: int, offsets: Tensor | None = None) -> Tensor:
    """Bilinear (2r+1)^2 crop of each source pixel's cost map around its target position.

    cost_maps [B*H1*W1, heads, H2, W2], coords [B, 2, H1, W1] (x, y) -> [B, heads*(2r+1)^2, H1, W1].
    Channel order is the official x-major one: channel = head·(2r+1)² + (dx+r)·(2r+1) + (dy+r) (the official
    `encode_flow_token` stacks meshgrid(dy, dx) and reads it as (x, y); the loaded `flow_token_encoder` weights
    depend on this order). offsets: `window_offsets(radius)`, when the caller keeps them (None: made here).
    """
    batch, _, h1, w1 = coords.shape
    if cost_maps.shape[0] != batch * h1 * w1:
        raise ValueError(
            f"sample_cost_window: cost_maps has {cost_maps.shape[0]} rows, expected B*H1*W1 = {batch * h1 * w1} "
            f"for coords of shape {tuple(coords.shape)}"
        )
    centre = coords.permute(0, 2, 3, 1).reshape(batch * h1 * w1, 1, 1, 2)
    if offsets is None:
        offsets = window_offsets(radius, coords.device)
    window = bilinear_sample(cost_maps, centre + offsets)
    # window [B*H1*W1, heads, 2r+1, 2r+1] -> [B, heads*(2r+1)^2, H1, W1]
    return window.view(batch, h1, w1, -1).permute(0, 3, 1, 2)


# attentions with at most this many logits per head (Lq x Lk: the decoder's 1x8, the AGT's 8x8 and 8x48) run
# unfused on every device: on a GPU torch's fused kernels refuse their batch (the grids of cuDNN's, flash and
# memory-efficient attention take at most 65535 rows; an MCVA step at batch 24 has 24*46*62 = 68448 source
# pixels), and on the CPU the fused kernel's backward is slower for them (the quickstart's decoder attention 4.9
# -> 1.3 ms a training step). Longer ones (the LSA's 49x49 windows, the GSA's) run fused: their logits would cost
# memory (the LSA's held for backward added 2.3 GiB to the bf16 training step on an H200) and time.
# docs/performance.md, "Attention kernels".
UNFUSED_MAX_LOGITS = 8 * 64
# rows of one fused-kernel call on a GPU: CUDA's grid y and z dimensions, which those kernels put the batch in
GPU_FUSED_MAX_ROWS = 65535
# the fused kernels a GPU may use, in the order tried; cuDNN's is left out (it failed the MCVA step, and its
# backward was the largest term of the bf16 training step on an H200: docs/performance.md, "Attention kernels")
GPU_FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# fused attentions of at most this many logits per head (the cost encoder's 7x7 LSA windows: 49x49) try
# memory-efficient attention first on a GPU: on an H200 (bf16, [4032, 8, 49, 16], forward + backward) it took
# 1.68 ms a call, flash attention 2.89; flash stays first for the long ones (the cost encoder's GSA
# [64, 8, 3072, 16] / 192 keys: flash 1.57 ms, memory-efficient 2.72)
GPU_SHORT_FUSED_MAX_LOGITS = 64 * 64
GPU_SHORT_FUSED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """softmax(q kᵀ · scale) v over the last two dims, q [..., Lq, d], k [..., Lk, d], v [..., Lk, dv]
    -> [..., Lq, dv]. One query (the decoder's) by products and sums (`single_query_attention`); other short
    attentions (UNFUSED_MAX_LOGITS) as the product written out, as the official layers compute it; longer ones by
    torch's fused attention, which never holds the [Lq, Lk] logits whole (at 1080p the cost encoder's would take
    16 GB) and is faster (on a GPU: `gpu_fused_attention`). The fused kernel differs from the written-out product
    by float32 rounding only (on fixture A it moved the flow at 32 iterations from 1.9e-4 to 1.7e-4 px of the
    official flow)."""
    if q.shape[-2] == 1:
        return single_query_attention(q, k, v, scale=scale)
    if q.shape[-2] * k.shape[-2] <= UNFUSED_MAX_LOGITS:
        return torch.matmul(torch.matmul(q, k.transpose(-2, -1)).mul_(scale).softmax(dim=-1), v)
    if q.device.type == "cuda":
        return gpu_fused_attention(q, k, v, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def single_query_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float) -> Tensor:
    """softmax(q kᵀ · scale) v for one query, q [..., 1, d], k [..., Lk, d], v [..., Lk, dv] -> [..., 1, dv], by
    elementwise products and sums: batched matrix products of 1 x d by d x Lk ran as cuBLAS tiles of 64x8, about
    200 us a call on an H200, where this takes a few (the decoder's [22816, 8, 1, 8] x 8 keys, bf16, forward +
    backward: 3.86 ms written out, 0.65 ms so; docs/performance.md, "Attention kernels"). The weights take v's
    dtype, as the written-out product's second matmul gives them under autocast."""
    weights = (q * k).sum(dim=-1).mul_(scale).softmax(dim=-1)  # [..., Lk]
    return (weights.unsqueeze(-1).to(v.dtype) * v).sum(dim=-2, keepdim=True)


def gpu_fused_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, max_rows: int = GPU_FUSED_MAX_ROWS
) -> Tensor:
    """Fused attention as a GPU runs it (any device runs it so; tests run it on the CPU): by GPU_FUSED_BACKENDS
    (GPU_SHORT_FUSED_BACKENDS for at most GPU_SHORT_FUSED_MAX_LOGITS logits per head), in that order,
    `max_rows` rows of the batch (dim 0) a call."""
    short = q.shape[-2] * k.shape[-2] <= GPU_SHORT_FUSED_MAX_LOGITS
    with sdpa_kernel(GPU_SHORT_FUSED_BACKENDS if short else GPU_FUSED_BACKENDS, set_priority=True):
        if q.shape[0] <= max_rows:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        parts = zip(*(x.split(max_rows) for x in (q, k, v)), strict=True)
        return torch.cat([F.scaled_dot_product_attention(*part, scale=scale) for part in parts])


def split_heads(x: Tensor, heads: int) -> Tensor:
    """[N, L, C] -> [N, heads, L, C/heads], a view (head h holds channels h·C/heads onwards)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def multi_head_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Heads split by `split_heads`: q [N, heads, Lq, d] (or [1, heads, Lq, d], broadcast), k [N, heads, Lk, d],
    v [N, heads, Lk, dv] -> [N, Lq, heads·dv], softmax((q kᵀ)·d^-0.5) v per head (`softmax_attention`; the heads
    split once, not at every call as the official layers do). A broadcast q is expanded: torch's fused CPU kernel
    takes only equal batches."""
    n = k.shape[0]
    out = softmax_attention(q if q.shape[0] == n else q.expand(n, -1, -1, -1), k, v, scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2).flatten(2)


# fp32 values per 1/8-resolution pixel that convex upsampling holds at once: the 9x64 softmax weights, their
# product with the 2-channel flow neighbours (2x9x64) and the sum (2x64).
CONVEX_UPSAMPLE_VALUES_PER_PIXEL = 9 * 64 + 2 * 9 * 64 + 2 * 64


class _ConvexCombination(torch.autograd.Function):
    """softmax(mask over its 9 neighbours) weighing the 3x3 flow neighbourhood, summed: the official forward,
    with a backward that makes the incoming gradient dense first. Autograd's own backward of the broadcast
    product multiplied the permuted (strided) gradient of the [B, 2, 8H, 8W] flow with both factors, the most of
    a call's time on the CPU (measured: docs/performance.md, "Operators dispatched")."""

    @staticmethod
    def forward(ctx, mask: Tensor, neighbours: Tensor) -> Tensor:
        # mask [B, 1, 9, 8, 8, n, W] (weights of the 9 neighbours), neighbours [B, 2, 9, 1, 1, n, W]
        weights = torch.softmax(mask, dim=2)
        ctx.save_for_backward(weights, neighbours)
        return torch.sum(weights * neighbours, dim=2)  # [B, 2, 8, 8, n, W]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        weights, neighbours = ctx.saved_tensors
        grad = grad.contiguous().unsqueeze(2)  # [B, 2, 1, 8, 8, n, W]
        grad_weights = (grad * neighbours).sum(1, keepdim=True)  # [B, 1, 9, 8, 8, n, W]
        grad_mask = torch._softmax_backward_data(grad_weights, weights, 2, weights.dtype)
        grad_neighbours = (grad * weights).sum((3, 4), keepdim=True)  # [B, 2, 9, 1, 1, n, W]
        return grad_mask, grad_neighbours


def upsample_flow_convex(flow: Tensor, mask: Tensor, rows_per_block: int | None = None) -> Tensor:
    """Convex 8x upsampling: flow [B, 2, H, W] (1/8 pixels), mask [B, 9*64, H, W] -> [B, 2, 8H, 8W] pixels.

    rows_per_block: weigh that many 1/8-resolution rows at a time (None: all at once). Each output pixel reads
    only its own mask values and its 3x3 flow neighbourhood (taken from the whole map), so blocks give the
    same numbers; at 2160x3840 the weights and products of the whole image take about 1 GB."""
    batch, _, height, width = flow.shape
    mask = mask.view(batch, 1, 9, 8, 8, height, width)
    neighbours = F.unfold(8 * flow, [3, 3], padding=1).view(batch, 2, 9, 1, 1, height, width)
    step = height if rows_per_block is None else max(1, rows_per_block)
    if step >= height:
        up = _ConvexCombination.apply(mask, neighbours)  # [B, 2, 8, 8, H, W]
    else:
        rows = [slice(top, top + step) for top in range(0, height, step)]
        up = torch.cat([_ConvexCombination.apply(mask[..., r, :], neighbours[..., r, :]) for r in rows], dim=-2)
    return up.permute(0, 1, 4, 2, 5, 3).reshape(batch, 2, 8 * height, 8 * width)


class Mlp(nn.Module):
    """fc1 -> GELU -> fc2 (the Twins-style block MLP; key names fc1/fc2 as timm's)."""

    def __init__(self, *, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def feed_forward(dim: int) -> nn.Sequential:
    """Linear -> GELU -> Linear at width 1x (the official FFN of the latent, intra and decoder attention layers, not
    4x). Identity slots stand for the official Dropouts, keeping the key indices ffn.0/ffn.3."""
    return nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Identity(), nn.Linear(dim, dim), nn.Identity())


def recomputed_in_backward(enabled: bool, fn: Callable[..., Output], *args: object) -> Output:
    """fn(*args); with `enabled`, while autograd records, its activations are recomputed in the backward pass
    instead of kept (`backbone.activation_checkpoint`). The recomputation runs the same kernels on the same
    inputs, so the numbers are those of keeping them."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
