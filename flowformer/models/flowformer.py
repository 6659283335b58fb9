"""FlowFormer / FlowFormer++ assembled from its parts, with separately callable stages.

Parts: a feature encoder and a context encoder (images -> 1/8-resolution features), an optional bias-free 1x1
`channel_convertor` on the features (FlowFormer has it), a cost encoder (`CostEncoder`: cost maps -> cost memory)
and the decoder (`MemoryDecoder`, the cost memory decoder). Or, for the RAFT baseline, no cost encoder and RAFT's
`MultiLevelCostDecoder`, reading a correlation pyramid of the cost volume (flowformer/models/raft_decoder.py).
flowformer/models/build.py builds them from the backbone knobs (`build_flowformer`, conf/backbone/*.yaml) and
names the published variants.

Stages: `encode_images` -> `cost_volume` -> `encode_cost` (optionally masked, MCVA) -> `decode` (without a cost
encoder: `encode_images` -> `correlation`, the pyramid -> `decode`). With
`memory_budget_gb`, `forward` bounds the terms that grow with (H/8·W/8)² (flowformer/models/memory_plan.py): the
cost volume is then a FeatureCostVolume, computed in blocks, and the layers whose transients grow with the
pixels run over blocks of rows (`MemoryPlan.activation_bytes`).
Children carry the official names (`memory_encoder`, `memory_decoder`, `context_encoder`), so `state_dict()` keys
equal the official checkpoint keys without the `module.` prefix that the released files carry (they were saved
from `nn.DataParallel`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from flowformer.models.cost_encoder import CostEncoder
from flowformer.models.cost_volume import CostVolume, FeatureCostVolume, dense_cost_maps
from flowformer.models.decoder import RecurrentRefinement
from flowformer.models.memory_plan import MemoryPlan, plan_memory
from flowformer.models.raft_decoder import CostPyramid, cost_pyramid
from flowformer.models.token_mask import TokenMask


class MemoryEncoder(nn.Module):
    """Holds the feature encoder, the optional `channel_convertor` and the optional cost encoder under their
    official names (`memory_encoder.feat_encoder.`, `.channel_convertor.`, `.cost_perceiver_encoder.`)."""

    def __init__(
        self, *, feat_encoder: nn.Module, channel_convertor: nn.Module | None, cost_encoder: CostEncoder | None
    ) -> None:
        super().__init__()
        self.feat_encoder = feat_encoder
        if channel_convertor is not None:
            self.channel_convertor = channel_convertor
        if cost_encoder is not None:
            self.cost_perceiver_encoder = cost_encoder


class FlowFormer(nn.Module):
    """The FlowFormer network from its parts (build one with flowformer/models/build.py).

    feature_encoder, context_encoder: images [B, 3, H, W] in [-1, 1] -> [B, C, H/8, W/8], with the attributes
        `kind` and `min_image_side` (flowformer/models/encoders.py).
    cost_encoder: a `CostEncoder`, or None for the RAFT baseline; channel_convertor: a module applied to both
        images' features, or None.
    decoder: a `MemoryDecoder` reading cost memory of width `cost_encoder.latent_dim`, or, without a cost
        encoder, a `MultiLevelCostDecoder` reading the correlation pyramid.
    memory_budget_gb: bound the memory `forward` spends on the (H/8·W/8)² terms (None: the dense computation).
    config: the builder knobs that rebuild this network, stored with checkpoints (`build_flowformer` sets it).

    Input images are float [B, 3, H, W] in 0..255, H and W multiples of 8 and at least the image encoders'
    `min_image_side`; they are mapped to [-1, 1] inside (`2·I/255 - 1`, the official normalisation, no ImageNet
    mean/std), the one place where normalisation happens.
    """

    def __init__(
        self,
        *,
        feature_encoder: nn.Module,
        context_encoder: nn.Module,
        cost_encoder: CostEncoder | None,
        decoder: RecurrentRefinement,
        channel_convertor: nn.Module | None = None,
        memory_budget_gb: float | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if memory_budget_gb is not None and memory_budget_gb <= 0:
            raise ValueError(
                f"backbone.memory_budget_gb must be > 0 (or null for the dense computation), got {memory_budget_gb}"
            )
        self.memory_budget_gb = memory_budget_gb
        self.config = None if config is None else dict(config)
        self.memory_encoder = MemoryEncoder(
            feat_encoder=feature_encoder, channel_convertor=channel_convertor, cost_encoder=cost_encoder
        )
        self.memory_decoder = decoder
        self.context_encoder = context_encoder

    @property
    def variant(self) -> str | None:
        """The published variant this network was built as (None for one assembled by hand)."""
        return None if self.config is None else self.config["variant"]

    @property
    def cost_encoder(self) -> CostEncoder | None:
        """The cost encoder; None with the mcr decoder, which reads the cost volume itself."""
        return getattr(self.memory_encoder, "cost_perceiver_encoder", None)

    def smallest_image(self) -> tuple[int, str]:
        """(side, part): the smallest image side in pixels the network takes (the largest `min_image_side` of its
        image encoders and decoder, the encoders first on a tie) and that part as messages name it ("the cnn
        image encoder")."""
        parts = [
            (encoder.min_image_side, f"the {encoder.kind} image encoder")
            for encoder in (self.memory_encoder.feat_encoder, self.context_encoder)
        ]
        parts.append((self.memory_decoder.min_image_side, f"the {self.memory_decoder.kind}"))
        return max(parts, key=lambda part: part[0])

    # ---- stages ---------------------------------------------------------------------------------------------
    def encode_images(
        self, image1: Tensor, image2: Tensor, activation_budget: int | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """images [B, 3, H, W] in 0..255 -> (feat1, feat2 [B, C, H/8, W/8], context [B, C, H/8, W/8]).

        The feature encoder sees both images as one batch [2B, 3, H, W], as the official code. With an
        activation_budget (bytes, MemoryPlan.activation_bytes), encoders that support it (Twins) bound their
        layers' transients to it by running over blocks of rows, still on the pair, so the features stay the
        dense path's bitwise; one that does not (the CNN) runs on each image in turn, which halves its peak, with
        the same numbers to float rounding (its InstanceNorm normalises each image on its own)."""
        _check_images(image1, image2, *self.smallest_image())
        image1 = 2 * (image1 / 255.0) - 1.0
        image2 = 2 * (image2 / 255.0) - 1.0
        context = _within_budget(self.context_encoder, activation_budget, image1)
        encoder = self.memory_encoder.feat_encoder
        if activation_budget is None or encoder.supports_activation_budget:
            feats = _within_budget(encoder, activation_budget, torch.cat([image1, image2], dim=0))
        else:
            feats = torch.cat([encoder(image) for image in (image1, image2)], dim=0)
        if hasattr(self.memory_encoder, "channel_convertor"):
            feats = self.memory_encoder.channel_convertor(feats)
        feat1, feat2 = feats.chunk(2, dim=0)
        return feat1, feat2, context

    def cost_volume(self, feat1: Tensor, feat2: Tensor) -> Tensor:
        """All-pairs dot products, unscaled (no 1/sqrt(C), as the official `corr`), in fp32:
        -> cost_maps [B*H1*W1, heads, H1, W1]."""
        return dense_cost_maps(feat1, feat2, self.memory_decoder.cost_heads)

    def memory_plan(self, batch: int, h1: int, w1: int) -> MemoryPlan:
        """How `forward` bounds its memory for B image pairs with 1/8-resolution size h1 x w1 within
        `memory_budget_gb`."""
        reader = self.memory_decoder if self.cost_encoder is None else self.cost_encoder
        return plan_memory(
            self.memory_budget_gb,
            batch=batch,
            h1=h1,
            w1=w1,
            heads=self.memory_decoder.cost_heads,
            cost_map_bytes=reader.cost_map_bytes(h1, w1),
        )

    def correlation(self, feat1: Tensor, feat2: Tensor, plan: MemoryPlan) -> Tensor | CostVolume | CostPyramid:
        """The cost volume as the plan allows: the dense volume, or a FeatureCostVolume computing blocks of
        `plan.cost_rows` cost maps when they are needed; without a cost encoder, the mcr decoder's correlation
        pyramid, dense or in such blocks."""
        heads = self.memory_decoder.cost_heads
        if self.cost_encoder is None:
            return cost_pyramid(feat1, feat2, heads, plan.cost_rows)
        if plan.cost_rows is None:
            return self.cost_volume(feat1, feat2)
        return FeatureCostVolume(feat1, feat2, heads, plan.cost_rows)

    def planned_cost_volume(
        self, image1: Tensor, image2: Tensor
    ) -> tuple[MemoryPlan, Tensor | CostVolume | CostPyramid, Tensor]:
        """images [B, 3, H, W] in 0..255 -> (the memory plan for them, the unmasked cost volume (or pyramid) as
        the plan allows, context [B, C, H/8, W/8]): the first stages of `forward` and of MCVA pretraining. A bounded
        plan also encodes the images one at a time, within its activation budget."""
        batch, _, height, width = image1.shape
        plan = self.memory_plan(batch, height // 8, width // 8)
        feat1, feat2, context = self.encode_images(image1, image2, plan.activation_bytes)
        return plan, self.correlation(feat1, feat2, plan), context

    def encode_cost(
        self,
        cost: Tensor | CostVolume,
        context: Tensor,
        token_mask: TokenMask | None = None,
        activation_budget: int | None = None,
    ) -> Tensor:
        """cost maps [B*H1*W1, heads, H1, W1] (or a CostVolume), context [B, C, H1, W1] -> cost memory
        [B*H1*W1, K, D]; token_mask (MCVA) hides cost-map patches from the cost encoder; activation_budget
        (MemoryPlan.activation_bytes) bounds the transients of its layers over the cost memory, where the encoder
        supports it."""
        if self.cost_encoder is None:
            raise ValueError(
                "backbone.decoder=mcr builds no cost encoder and no cost memory: use backbone.decoder=cmd"
            )
        if token_mask is not None and not self.cost_encoder.supports_token_mask:
            raise ValueError(
                f"the cost encoder {type(self.cost_encoder).__name__} cannot hide cost-map patches, so MCVA "
                "cannot pretrain it; pick a cost encoder with supports_token_mask (backbone.cost_encoder)"
            )
        return _within_budget(self.cost_encoder, activation_budget, cost, context, token_mask)

    def query_cost_memory(
        self,
        cost_memory: Tensor,
        cost: Tensor | CostVolume,
        coords: Tensor,
        memory_kv: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Cost query at coords [B, 2, H1, W1] (1/8-res target pixels, x first) -> cost_global [B, Q, H1, W1].

        memory_kv: `cost_memory_kv(cost_memory)`, passed to reuse the keys/values over many queries of one cost
        memory (MCVA's query rounds, as the official code does); computed here when None."""
        decoder = self.memory_decoder
        kv = decoder.memory_kv(cost_memory) if memory_kv is None else memory_kv
        return decoder.query(kv, cost, coords)[0]

    def cost_memory_kv(self, cost_memory: Tensor) -> tuple[Tensor, Tensor]:
        """cost memory [B*H1*W1, K, D] -> the decoder's keys and values [B*H1*W1, heads, K, Q/heads]."""
        return self.memory_decoder.memory_kv(cost_memory)

    def decode(
        self,
        cost_memory: Tensor | None,
        cost: Tensor | CostVolume | CostPyramid,
        context: Tensor,
        iters: int,
        flow_init: Tensor | None = None,
        query_chunk: int | None = None,
        upsample_all: bool = True,
        activation_budget: int | None = None,
    ) -> list[tuple[Tensor | None, Tensor]]:
        """-> one (flow_up [B, 2, H, W], flow_low [B, 2, H/8, W/8]) pair per refinement iteration, flow_up None
        before the last one unless `upsample_all`; query_chunk bounds the global motion attention
        (MemoryPlan.gma_queries), activation_budget the convex upsampling (MemoryPlan.activation_bytes)."""
        return self.memory_decoder(
            cost_memory, cost, context, iters, flow_init, query_chunk, upsample_all, activation_budget
        )

    @property
    def pretrain_head(self) -> nn.Module:
        """FlowFormer++ reconstruction head: cost_global [B, Q, H1, W1] -> [B, recon_size², H1, W1]."""
        if not hasattr(self.memory_decoder, "pretrain_head"):
            raise AttributeError("pretrain_head exists only in the flowformer_pp variant (backbone.variant)")
        return self.memory_decoder.pretrain_head

    def feature_encoder_modules(self) -> list[nn.Module]:
        return [self.memory_encoder.feat_encoder]

    def context_encoder_modules(self) -> list[nn.Module]:
        return [self.context_encoder]

    # ---- full forward ---------------------------------------------------------------------------------------
    def forward(
        self, image1: Tensor, image2: Tensor, iters: int, flow_init: Tensor | None = None
    ) -> dict[str, Tensor | list[Tensor]]:
        """-> {"flow": [B,2,H,W], "flow_low": [B,2,H/8,W/8]} (+ "flow_predictions": list per iteration when
        training). iters: decoder refinement iterations (each caller's setting: model.train_iters /
        model.val_iters, eval.benchmarks.<set>.iters, infer.iters, bench.iters)."""
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
            raise ValueError(
                f"FlowFormer.forward: iters must be an integer >= 1 (refinement iterations), got {iters!r}"
            )
        plan, cost, context = self.planned_cost_volume(image1, image2)
        cost_memory = None
        if self.cost_encoder is not None:
            cost_memory = self.encode_cost(cost, context, activation_budget=plan.activation_bytes)
        steps = self.decode(
            cost_memory,
            cost,
            context,
            iters,
            flow_init,
            query_chunk=plan.gma_queries,
            upsample_all=self.training,  # inference returns the last iteration only
            activation_budget=plan.activation_bytes,
        )
        out: dict[str, Tensor | list[Tensor]] = {"flow": steps[-1][0], "flow_low": steps[-1][1]}
        if self.training:
            out["flow_predictions"] = [flow_up for flow_up, _ in steps]
        return out


def _within_budget(module: nn.Module, activation_budget: int | None, *args: object) -> Tensor:
    """module(*args), its transients bounded to activation_budget (bytes; None: unbounded) where the module
    supports that (`supports_activation_budget`: the image encoders and the cost encoders)."""
    if activation_budget is not None and module.supports_activation_budget:
        return module(*args, activation_budget=activation_budget)
    return module(*args)


def _check_images(image1: Tensor, image2: Tensor, side: int, part: str) -> None:
    """Refuses images that are not both [B, 3, H, W], smaller than `side` (`FlowFormer.smallest_image`, needed
    by `part`) or not a multiple of 8."""
    if image1.shape != image2.shape or image1.dim() != 4 or image1.shape[1] != 3:
        raise ValueError(
            f"images must both be [B, 3, H, W]; got {tuple(image1.shape)} and {tuple(image2.shape)}"
        )
    height, width = image1.shape[-2:]
    if min(height, width) < side:
        raise ValueError(
            f"FlowFormer with {part} needs images of at least {side}x{side} pixels, got {height}x{width}; pad or "
            "upscale the images"
        )
    if height % 8 or width % 8:
        pad_h, pad_w = (-height) % 8, (-width) % 8
        raise ValueError(
            f"image size {height}x{width} is not a multiple of 8: pad by {pad_h} rows and {pad_w} columns "
            f"(to {height + pad_h}x{width + pad_w}) before calling the network (padding is the caller's job)"
        )
