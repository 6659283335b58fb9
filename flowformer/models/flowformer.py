"""FlowFormer / FlowFormer++ as one configurable backbone with separately callable stages.

Stages: `encode_images` -> `cost_volume` -> `encode_cost` (optionally masked, MCVA) -> `decode`. With
`memory_budget_gb`, `forward` bounds the terms that grow with (H/8·W/8)² (flowformer/models/memory_plan.py): the
cost volume is then a FeatureCostVolume, computed in blocks. Children carry the
official names (`memory_encoder`, `memory_decoder`, `context_encoder`), so `state_dict()` keys equal the official
checkpoint keys without the `module.` prefix (SPEC §3).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from flowformer.models.cost_encoder import CostPerceiverEncoder
from flowformer.models.cost_volume import CostVolume, FeatureCostVolume, dense_cost_maps
from flowformer.models.decoder import HIDDEN, MemoryDecoder
from flowformer.models.encoders import TWINS_DIM, BasicEncoder, TwinsEncoder
from flowformer.models.memory_plan import MemoryPlan, plan_memory
from flowformer.models.token_mask import TokenMask

VARIANTS = ("flowformer", "flowformer_pp")
IMAGE_ENCODERS = ("twins", "cnn")


class MemoryEncoder(nn.Module):
    """Holds the feature encoder, FlowFormer's bias-free `channel_convertor` and the cost encoder."""

    def __init__(
        self, *, feat_encoder: nn.Module, feature_dim: int, convertor: bool, cost_encoder: nn.Module
    ) -> None:
        super().__init__()
        self.feat_encoder = feat_encoder
        if convertor:
            self.channel_convertor = nn.Conv2d(feature_dim, feature_dim, 1, bias=False)
        self.cost_perceiver_encoder = cost_encoder


class FlowFormer(nn.Module):
    """The FlowFormer (`variant="flowformer"`, official LatentCostFormer) or FlowFormer++ (`"flowformer_pp"`,
    official PerCostFormer3 incl. its `pretrain_head`) network.

    Input images are float [B, 3, H, W] in 0..255, H and W multiples of 8 and at least `MIN_IMAGE_SIDE` (32 with
    the twins image encoder, 16 with the cnn one); they are mapped to [-1, 1] inside (`2·I/255 - 1`, SPEC §1.1),
    the one place where normalisation happens.
    """

    def __init__(
        self,
        *,
        variant: str = "flowformer",
        image_encoder: str = "twins",
        twins_weights: str | None = None,
        feature_dim: int = 256,
        cnn_widths: Sequence[int] = (64, 96, 128),
        cost_patch_dim: int = 64,
        num_latent_tokens: int = 8,
        latent_dim: int = 128,
        agt_depth: int = 3,
        query_dim: int = 64,
        cost_heads: int = 1,
        context_proj_dim: int = 64,
        decoder_query: str = "crop_and_pe",
        recon_size: int = 15,
        recon_head_depth: int = 3,
        decoder_dim: int = HIDDEN,
        tokenize_chunk: int | None = None,
        tokenize_checkpoint: bool = False,
        memory_budget_gb: float | None = None,
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"backbone.variant must be one of {VARIANTS}, got {variant!r}")
        if image_encoder not in IMAGE_ENCODERS:
            raise ValueError(f"backbone.image_encoder must be one of {IMAGE_ENCODERS}, got {image_encoder!r}")
        if image_encoder == "twins" and feature_dim != TWINS_DIM:
            raise ValueError(
                f"backbone.feature_dim must be {TWINS_DIM} with the twins image encoder, got {feature_dim}"
            )
        if image_encoder == "cnn" and twins_weights is not None:
            raise ValueError(
                "backbone.twins_weights is set but backbone.image_encoder is 'cnn'; set it to null"
            )
        if memory_budget_gb is not None and memory_budget_gb <= 0:
            raise ValueError(
                f"backbone.memory_budget_gb must be > 0 (or null for the dense computation), got {memory_budget_gb}"
            )
        if feature_dim % cost_heads != 0:
            raise ValueError(
                f"backbone.feature_dim ({feature_dim}) must be divisible by cost_heads ({cost_heads})"
            )
        # plain-value constructor arguments, stored with checkpoints (weights travel in the state dict, so the
        # ImageNet file is not needed to rebuild)
        self.config = {
            "variant": variant,
            "image_encoder": image_encoder,
            "twins_weights": None,
            "feature_dim": feature_dim,
            "cnn_widths": list(cnn_widths),
            "cost_patch_dim": cost_patch_dim,
            "num_latent_tokens": num_latent_tokens,
            "latent_dim": latent_dim,
            "agt_depth": agt_depth,
            "query_dim": query_dim,
            "cost_heads": cost_heads,
            "context_proj_dim": context_proj_dim,
            "decoder_query": decoder_query,
            "recon_size": recon_size,
            "recon_head_depth": recon_head_depth,
            "decoder_dim": decoder_dim,
            "tokenize_chunk": tokenize_chunk,
            "tokenize_checkpoint": tokenize_checkpoint,
            "memory_budget_gb": memory_budget_gb,
        }
        self.variant = variant
        self.cost_heads = cost_heads
        self.memory_budget_gb = memory_budget_gb
        is_pp = variant == "flowformer_pp"

        def image_net() -> nn.Module:
            if image_encoder == "twins":
                return TwinsEncoder(weights=twins_weights)
            return BasicEncoder(out_dim=feature_dim, widths=cnn_widths)

        cost_encoder = CostPerceiverEncoder(
            cost_heads=cost_heads,
            patch_dim=cost_patch_dim,
            patch_pe_dim=64 if is_pp else cost_patch_dim,  # FF++ fixes the patch PE at 64 (SPEC §4)
            num_latent_tokens=num_latent_tokens,
            latent_dim=latent_dim,
            depth=agt_depth,
            context_dim=feature_dim,
            context_proj_dim=context_proj_dim,
            gsa_key_pe=not is_pp or context_proj_dim > 0,
            tokenize_chunk=tokenize_chunk,
            tokenize_checkpoint=tokenize_checkpoint,
        )
        self.memory_encoder = MemoryEncoder(
            feat_encoder=image_net(), feature_dim=feature_dim, convertor=not is_pp, cost_encoder=cost_encoder
        )
        self.memory_decoder = MemoryDecoder(
            context_dim=feature_dim,
            memory_dim=latent_dim,
            query_dim=query_dim,
            cost_heads=cost_heads,
            concat_shortcut=not is_pp,
            query_source=decoder_query,
            recon_size=recon_size if is_pp else None,
            recon_head_depth=recon_head_depth,
            hidden_dim=decoder_dim,
        )
        self.context_encoder = image_net()

    # ---- stages ---------------------------------------------------------------------------------------------
    def encode_images(self, image1: Tensor, image2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """images [B, 3, H, W] in 0..255 -> (feat1, feat2 [B, C, H/8, W/8], context [B, C, H/8, W/8])."""
        _check_images(image1, image2, self.config["image_encoder"])
        image1 = 2 * (image1 / 255.0) - 1.0
        image2 = 2 * (image2 / 255.0) - 1.0
        context = self.context_encoder(image1)
        feats = self.memory_encoder.feat_encoder(torch.cat([image1, image2], dim=0))
        if hasattr(self.memory_encoder, "channel_convertor"):
            feats = self.memory_encoder.channel_convertor(feats)
        feat1, feat2 = feats.chunk(2, dim=0)
        return feat1, feat2, context

    def cost_volume(self, feat1: Tensor, feat2: Tensor) -> Tensor:
        """All-pairs dot products, unscaled, in fp32 (SPEC §1.4): -> cost_maps [B*H1*W1, heads, H1, W1]."""
        return dense_cost_maps(feat1, feat2, self.cost_heads)

    def memory_plan(self, feat1: Tensor) -> MemoryPlan:
        """How `forward` bounds its memory for features feat1 [B, C, H1, W1] within `memory_budget_gb`."""
        batch, _, h1, w1 = feat1.shape
        patch_embed = self.memory_encoder.cost_perceiver_encoder.patch_embed
        return plan_memory(
            self.memory_budget_gb,
            batch=batch,
            h1=h1,
            w1=w1,
            heads=self.cost_heads,
            patch_dim=self.config["cost_patch_dim"],
            pe_dim=patch_embed.pe_dim,
        )

    def correlation(self, feat1: Tensor, feat2: Tensor, plan: MemoryPlan) -> Tensor | CostVolume:
        """The cost volume as the plan allows: the dense volume, or a FeatureCostVolume computing blocks of
        `plan.cost_rows` cost maps when they are needed."""
        if plan.cost_rows is None:
            return self.cost_volume(feat1, feat2)
        return FeatureCostVolume(feat1, feat2, self.cost_heads, plan.cost_rows)

    def encode_cost(
        self, cost: Tensor | CostVolume, context: Tensor, token_mask: TokenMask | None = None
    ) -> Tensor:
        """cost maps [B*H1*W1, heads, H1, W1] (or a CostVolume), context [B, C, H1, W1] -> cost memory
        [B*H1*W1, K, D]."""
        return self.memory_encoder.cost_perceiver_encoder(cost, context, token_mask)

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
        """cost memory [B*H1*W1, K, D] -> the decoder's keys and values [B*H1*W1, K, Q]."""
        return self.memory_decoder.memory_kv(cost_memory)

    def decode(
        self,
        cost_memory: Tensor,
        cost: Tensor | CostVolume,
        context: Tensor,
        iters: int,
        flow_init: Tensor | None = None,
        query_chunk: int | None = None,
        upsample_all: bool = True,
    ) -> list[tuple[Tensor | None, Tensor]]:
        """-> one (flow_up [B, 2, H, W], flow_low [B, 2, H/8, W/8]) pair per refinement iteration, flow_up None
        before the last one unless `upsample_all`; query_chunk bounds the global motion attention
        (MemoryPlan.gma_queries)."""
        return self.memory_decoder(cost_memory, cost, context, iters, flow_init, query_chunk, upsample_all)

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
        feat1, feat2, context = self.encode_images(image1, image2)
        plan = self.memory_plan(feat1)
        cost = self.correlation(feat1, feat2, plan)
        cost_memory = self.encode_cost(cost, context)
        steps = self.decode(
            cost_memory,
            cost,
            context,
            iters,
            flow_init,
            query_chunk=plan.gma_queries,
            upsample_all=self.training,  # inference returns the last iteration only
        )
        out: dict[str, Tensor | list[Tensor]] = {"flow": steps[-1][0], "flow_low": steps[-1][1]}
        if self.training:
            out["flow_predictions"] = [flow_up for flow_up, _ in steps]
        return out


# Smallest image side each image encoder accepts. The cost-window sampler normalises coordinates by (side/8 - 1)
# (align_corners), so a 1/8-resolution side of 1 gives NaN flow: 16 pixels. Twins' stage-0 sub-sampled attention
# runs an 8x8-kernel conv on the 1/4-resolution tokens (stage 1 a 4x4 one on the 1/8-resolution ones): 32 pixels.
MIN_IMAGE_SIDE = {"twins": 32, "cnn": 16}


def _check_images(image1: Tensor, image2: Tensor, image_encoder: str) -> None:
    if image1.shape != image2.shape or image1.dim() != 4 or image1.shape[1] != 3:
        raise ValueError(
            f"images must both be [B, 3, H, W]; got {tuple(image1.shape)} and {tuple(image2.shape)}"
        )
    height, width = image1.shape[-2:]
    side = MIN_IMAGE_SIDE[image_encoder]
    if min(height, width) < side:
        raise ValueError(
            f"FlowFormer with the {image_encoder} image encoder needs images of at least {side}x{side} pixels, "
            f"got {height}x{width}; pad or upscale the images"
        )
    if height % 8 or width % 8:
        pad_h, pad_w = (-height) % 8, (-width) % 8
        raise ValueError(
            f"image size {height}x{width} is not a multiple of 8: pad by {pad_h} rows and {pad_w} columns "
            f"(to {height + pad_h}x{width + pad_w}) before calling the network (padding is the caller's job)"
        )
