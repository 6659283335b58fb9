"""Masked Cost Volume Autoencoding (MCVA, FlowFormer++): masks, query rounds, targets and the loss, as the official
FlowFormer++ pretraining does it (`generate_mask.py`, `PerCostFormer3/encoder.py` `random_masking`,
`PerCostFormer3/decoder.py` `pretrain_forward`).

Everything here is a pure function of tensors and of a `FlowFormer` built with `variant="flowformer_pp"`; the
Lightning side (optimiser, logging, random draws) lives in `flowformer.lit.mcva`. The objective's knobs have no
defaults here: conf/model/mcva.yaml holds them (the official values).

Random draws are explicit inputs so that a step can be replayed: the mask noise [B, H1, W1, L] (L cost-map
patch tokens per source pixel) and, per query round, a uniform draw [B, 2, H1, W1] for the query locations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from flowformer.models.cost_encoder import PATCH
from flowformer.models.cost_volume import CostVolume, as_cost_volume
from flowformer.models.layers import recomputed_in_backward
from flowformer.models.token_mask import TokenMask

MaskingStrategy = Literal["block", "random"]
ReconLocation = Literal["random", "fixed"]
NormalizedSide = Literal["target", "prediction"]

TARGET_NORM_EPS = 1e-6  # (x - mean) / sqrt(var_unbiased + 1e-6) over the window values, the official constant


def cost_token_grid(h1: int, w1: int) -> tuple[int, int]:
    """Patch-token grid (H3, W3) of one H1 x W1 cost map, which the cost encoder zero-pads to multiples of 8 and
    patchifies into 8x8 tokens: ceil(H1/8) x ceil(W1/8); 46x62 -> 6x8."""
    return -(-h1 // PATCH), -(-w1 // PATCH)


def expand_block_noise(
    low: Tensor, *, block_hw: tuple[int, int], offset_hw: tuple[int, int], out_hw: tuple[int, int]
) -> Tensor:
    """Repeat one noise vector per block over its gh x gw source pixels, then crop at the offset (official
    `generate_mask.py`).

    low [H1//gh + 2, W1//gw + 2, L] -> noise [H1, W1, L] with
    noise[y, x] = low[(y + start_h) // gh, (x + start_w) // gw].
    """
    (gh, gw), (start_h, start_w), (h1, w1) = block_hw, offset_hw, out_hw
    up = low.repeat_interleave(gh, dim=0).repeat_interleave(gw, dim=1)
    if start_h + h1 > up.shape[0] or start_w + w1 > up.shape[1]:
        raise ValueError(
            f"expand_block_noise: a {h1}x{w1} crop at offset ({start_h}, {start_w}) does not fit the "
            f"up-sampled block noise of {up.shape[0]}x{up.shape[1]}; low must be [H1//gh+2, W1//gw+2, L]."
        )
    return up[start_h : start_h + h1, start_w : start_w + w1]


def block_sharing_noise(
    batch: int,
    h1: int,
    w1: int,
    num_tokens: int,
    *,
    min_block: int,
    max_block: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-sharing mask noise, drawn on the fly as the official `generate_mask.py` draws it offline (100,000
    files there).

    Per sample: block size gh, gw ~ U{min_block..max_block} (1/8-res source pixels; the official 4..15 are
    32..120 image pixels), one U[0,1) vector of `num_tokens` values per block, and a random offset start ~
    U{0..(H1//gh + 2)*gh - H1 - 1} so that block borders do not align with the image origin.

    Returns (noise [B, H1, W1, L] float32 on CPU, params [B, 4] int64 = (gh, gw, start_h, start_w)).
    """
    if not 1 <= min_block <= max_block:
        raise ValueError(
            f"block_sharing_noise: need 1 <= min_block <= max_block, got {min_block}, {max_block}"
        )
    noises, params = [], []
    for _ in range(batch):
        gh, gw = (int(v) for v in torch.randint(min_block, max_block + 1, (2,), generator=generator))
        n_bh, n_bw = h1 // gh + 2, w1 // gw + 2
        low = torch.rand(n_bh, n_bw, num_tokens, generator=generator)
        start_h = int(torch.randint(0, n_bh * gh - h1, (1,), generator=generator))
        start_w = int(torch.randint(0, n_bw * gw - w1, (1,), generator=generator))
        noises.append(
            expand_block_noise(low, block_hw=(gh, gw), offset_hw=(start_h, start_w), out_hw=(h1, w1))
        )
        params.append((gh, gw, start_h, start_w))
    return torch.stack(noises), torch.tensor(params, dtype=torch.int64)


@dataclass(frozen=True)
class CostMaskGenerator:
    """Which cost-map patches the cost encoder sees: `block` (source pixels of a block share one mask) or
    `random` (independent per source pixel), with exactly int(L * (1 - mask_ratio)) visible patches per pixel."""

    masking: MaskingStrategy
    mask_ratio: float
    min_block: int
    max_block: int

    def __post_init__(self) -> None:
        if self.masking not in ("block", "random"):
            raise ValueError(f"model.masking={self.masking!r}: expected 'block' or 'random'.")
        if not 0.0 <= self.mask_ratio < 1.0:
            raise ValueError(f"model.mask_ratio={self.mask_ratio}: expected a value in [0, 1).")
        if self.masking == "block" and not 1 <= self.min_block <= self.max_block:
            raise ValueError(
                f"model.min_block={self.min_block}, model.max_block={self.max_block}: expected 1 <= min_block <= "
                "max_block (block sides in 1/8-resolution source pixels; official: 4 and 15)"
            )

    def noise(self, batch: int, h1: int, w1: int, *, generator: torch.Generator | None = None) -> Tensor:
        """-> noise [B, H1, W1, L] (CPU float32), L = H3*W3 cost-map tokens per source pixel."""
        h3, w3 = cost_token_grid(h1, w1)
        num_tokens = h3 * w3
        if self.masking == "random":
            return torch.rand(batch, h1, w1, num_tokens, generator=generator)
        noise, _ = block_sharing_noise(
            batch, h1, w1, num_tokens, min_block=self.min_block, max_block=self.max_block, generator=generator
        )
        return noise

    def token_mask(self, noise: Tensor) -> TokenMask:
        """noise [B, H1, W1, L] -> TokenMask over rows b*H1*W1 + y1*W1 + x1 (the cost_maps row order)."""
        if noise.dim() != 4:
            raise ValueError(f"mask noise must be [B, H1, W1, L], got shape {tuple(noise.shape)}")
        n_keep = int(noise.shape[-1] * (1 - self.mask_ratio))
        if n_keep < 1:
            raise ValueError(
                f"model.mask_ratio={self.mask_ratio} keeps no cost-map patch out of {noise.shape[-1]}; lower it."
            )
        return TokenMask.from_noise(noise.reshape(-1, noise.shape[-1]), self.mask_ratio)


@dataclass(frozen=True)
class ReconstructionObjective:
    """How MCVA queries the cost memory and scores its reconstructions: `query_num` rounds per step at
    `recon_location` "random" (the method) or "fixed" (MAE-style: each source pixel's own position), the loss on
    the `normalize`d side, "target" (the official code) or "prediction" (the paper's equation)."""

    recon_location: ReconLocation
    query_num: int
    normalize: NormalizedSide

    def __post_init__(self) -> None:
        if self.query_num < 1:
            raise ValueError(f"model.query_num={self.query_num}: expected at least one query round per step.")
        if self.normalize not in ("target", "prediction"):
            raise ValueError(f"model.normalize={self.normalize!r}: expected 'target' or 'prediction'.")
        if self.recon_location not in ("random", "fixed"):
            raise ValueError(f"model.recon_location={self.recon_location!r}: expected 'random' or 'fixed'.")


def recon_locations(
    uniform: Tensor | None,
    *,
    shape: tuple[int, int, int],
    recon_size: int,
    location: ReconLocation,
    device: torch.device | None = None,
) -> Tensor:
    """Where each source pixel's cost map is queried and reconstructed, in 1/8-res target-map pixels.

    random (the official `no_border=True` draw): uniform [B, 2, H1, W1] (channel 0 = x, 1 = y) ->
        x = u_x * (W1 - S) + S // 2, y = u_y * (H1 - S) + S // 2, so the S x S window lies inside the map
        (maps smaller than S, e.g. tiny test images, get windows that reach into the zero padding).
    fixed (the paper's MAE-style ablation row): every source pixel at its own position (x1, y1), the zero-flow
        location the decoder starts from in finetuning; `uniform` must be None.
    -> coords [B, 2, H1, W1] (x, y).
    """
    batch, h1, w1 = shape
    if location == "fixed":
        if uniform is not None:
            raise ValueError("recon_location='fixed' draws no query locations; pass query_uniform=None.")
        ys, xs = torch.meshgrid(
            torch.arange(h1, dtype=torch.float32, device=device),
            torch.arange(w1, dtype=torch.float32, device=device),
            indexing="ij",
        )
        return torch.stack([xs, ys]).unsqueeze(0).expand(batch, 2, h1, w1)
    if location != "random":
        raise ValueError(f"recon_location={location!r}: expected 'random' or 'fixed'.")
    if uniform is None or tuple(uniform.shape) != (batch, 2, h1, w1):
        got = None if uniform is None else tuple(uniform.shape)
        raise ValueError(f"query_uniform must be [B, 2, H1, W1] = {(batch, 2, h1, w1)}, got {got}")
    x = uniform[:, 0] * (w1 - recon_size) + recon_size // 2
    y = uniform[:, 1] * (h1 - recon_size) + recon_size // 2
    return torch.stack([x, y], dim=1)


def normalize_per_pixel(values: Tensor, eps: float = TARGET_NORM_EPS) -> Tensor:
    """[B, C, H, W] -> per pixel (x - mean_C) / sqrt(var_C + eps), var unbiased (divides by C-1, torch.var's
    default, as the official code)."""
    mean = values.mean(dim=1, keepdim=True)
    var = values.var(dim=1, keepdim=True)
    return (values - mean) / (var + eps) ** 0.5


def reconstruction_loss(
    prediction: Tensor, target: Tensor, *, normalize: NormalizedSide
) -> Tensor:
    """MSE of one query round, averaged over B * S^2 * H1 * W1 (every source pixel counts, masked or not).

    normalize="target": mean((pred - Normalize(q^L))^2), as the official code does (docs/departures.md).
    normalize="prediction": mean((q^L - Normalize(pred))^2), the paper's equation taken literally; its minimum is
        the target's own per-pixel variance, so its values are not comparable with the code's loss.
    """
    if prediction.shape != target.shape:
        raise ValueError(
            f"reconstruction head output {tuple(prediction.shape)} does not match the target "
            f"{tuple(target.shape)}; backbone.recon_size must match the head (S^2 channels per cost head)."
        )
    prediction, target = prediction.float(), target.float()  # fp32 under bf16 autocast: cost values are ~1e2
    if normalize == "target":
        return ((prediction - normalize_per_pixel(target)) ** 2).mean()
    if normalize == "prediction":
        return ((target - normalize_per_pixel(prediction)) ** 2).mean()
    raise ValueError(f"normalize={normalize!r}: expected 'target' or 'prediction'.")


@dataclass
class MCVAOutput:
    """loss: sum of the per-round losses (scalar); round_losses [R]; predictions / targets: the head outputs and
    the normalised/raw targets [B, S^2, H1, W1] of the first `keep_rounds` rounds (detached)."""

    loss: Tensor
    round_losses: Tensor
    token_mask: TokenMask
    predictions: list[Tensor] = field(default_factory=list)
    targets: list[Tensor] = field(default_factory=list)


def _check_inputs(
    net: nn.Module,
    image1: Tensor,
    mask_noise: Tensor,
    query_uniform: Tensor | None,
    objective: ReconstructionObjective,
) -> None:
    """A network with a reconstruction head, and recorded draws that fit the images [B, 3, H, W]."""
    if not hasattr(net, "pretrain_head"):
        raise ValueError(
            "MCVA needs a backbone with a reconstruction head: build it with variant='flowformer_pp' "
            "(e.g. backbone=flowformer_pp or backbone=tiny)."
        )
    batch, h1, w1 = image1.shape[0], image1.shape[-2] // 8, image1.shape[-1] // 8  # the cost volume's grid
    if tuple(mask_noise.shape[:3]) != (batch, h1, w1):
        raise ValueError(
            f"mask noise {tuple(mask_noise.shape)} does not match the 1/8-res cost volume: expected "
            f"[{batch}, {h1}, {w1}, L]"
        )
    if objective.recon_location == "random" and (query_uniform is None or query_uniform.shape[0] != objective.query_num):
        got = None if query_uniform is None else tuple(query_uniform.shape)
        raise ValueError(f"query_uniform must be [query_num={objective.query_num}, B, 2, H1, W1], got {got}")


def _reconstruction_round(
    net: nn.Module,
    cost: CostVolume,
    cost_memory: Tensor,
    memory_kv: tuple[Tensor, Tensor],
    coords: Tensor,
    objective: ReconstructionObjective,
) -> tuple[Tensor, Tensor, Tensor]:
    """One query round at coords [B, 2, H1, W1] -> (its loss, prediction and target [B, heads*S^2, H1, W1])."""
    recon_size = net.pretrain_head.recon_size
    with torch.no_grad():  # the target is a constant of the loss
        target = cost.window(coords, recon_size // 2)

    def reconstruct(coords: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        cost_global = net.query_cost_memory(cost_memory, cost, coords, memory_kv)  # [B, Q, H1, W1]
        prediction = net.pretrain_head(cost_global)  # [B, heads*S^2, H1, W1]
        return reconstruction_loss(prediction, target, normalize=objective.normalize), prediction

    # with backbone.activation_checkpoint's `decoder`, each round's query and head recompute in backward
    loss, prediction = recomputed_in_backward(
        net.memory_decoder.checkpoint_iterations, reconstruct, coords, target
    )
    return loss, prediction, target


def mcva_forward(
    net: nn.Module,
    image1: Tensor,
    image2: Tensor,
    *,
    mask_noise: Tensor,
    query_uniform: Tensor | None,
    mask_generator: CostMaskGenerator,
    objective: ReconstructionObjective,
    keep_rounds: int = 0,
) -> MCVAOutput:
    """One MCVA objective evaluation: the masked cost volume encoded into cost memory, then `query_num` rounds
    of cost queries at new locations, each reconstructing the unmasked S x S cost window there.

    image1, image2 [B, 3, H, W] in 0..255; mask_noise [B, H1, W1, L]; query_uniform [R, B, 2, H1, W1] with
    R = query_num for recon_location="random", None for "fixed".
    """
    _check_inputs(net, image1, mask_noise, query_uniform, objective)
    # backbone.memory_budget_gb bounds pretraining as it bounds forward: the cost maps are then computed in
    # blocks from the features and the target windows sampled from each block's maps, with the same numbers
    plan, cost, context = net.planned_cost_volume(image1, image2)
    cost = as_cost_volume(cost)  # unmasked, [B*H1*W1, heads, H1, W1] maps
    batch, (h1, w1), device = image1.shape[0], cost.map_size, context.device
    token_mask = mask_generator.token_mask(mask_noise.to(device))
    cost_memory = net.encode_cost(cost, context, token_mask, plan.activation_bytes)  # [B*H1*W1, K, D]

    memory_kv = net.cost_memory_kv(cost_memory)  # computed once, reused by every round as the official code does
    total = torch.zeros((), device=device, dtype=torch.float32)
    round_losses, predictions, targets = [], [], []
    for round_idx in range(objective.query_num):
        uniform = None if query_uniform is None else query_uniform[round_idx].to(device)
        coords = recon_locations(
            uniform,
            shape=(batch, h1, w1),
            recon_size=net.pretrain_head.recon_size,
            location=objective.recon_location,
            device=device,
        )
        round_loss, prediction, target = _reconstruction_round(
            net, cost, cost_memory, memory_kv, coords, objective
        )
        total = total + round_loss  # summed (not averaged) left to right from 0, as the official loop
        round_losses.append(round_loss.detach())
        if round_idx < keep_rounds:
            predictions.append(prediction.detach())
            targets.append((normalize_per_pixel(target) if objective.normalize == "target" else target).detach())
    return MCVAOutput(
        loss=total,
        round_losses=torch.stack(round_losses),
        token_mask=token_mask,
        predictions=predictions,
        targets=targets,
    )
