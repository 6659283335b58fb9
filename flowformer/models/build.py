"""Building FlowFormer from its knobs: the backbone config (`conf/backbone/*.yaml`, `_target_: build_flowformer`),
what tells the two published variants apart, and one builder per published or test-sized network.

    net = build_flowformer_pp()                       # FlowFormer++ as released
    net = build_flowformer_small(intra_layer="mlp")   # FlowFormer-small with the MLP-Mixer ablation
    net = build_flowformer(**cfg.backbone)            # any knobs (Hydra: hydra.utils.instantiate(cfg.backbone))

Each knob is defined once, with its default and its check, in `BackboneConfig`; the defaults are the paper's
FlowFormer (conf/backbone/flowformer.yaml lists the same values so that the command line can override them).
A knob keeps its name down to the module that uses it.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from torch import nn

from flowformer.models.cost_encoder import INTER_LAYERS, INTRA_LAYERS, CostEncoder, CostPerceiverEncoder
from flowformer.models.decoder import MemoryDecoder, RecurrentRefinement
from flowformer.models.encoders import (
    IMAGENET,
    TWINS_DIM,
    TWINS_HEAD_DIM,
    TWINS_LARGE_WIDTHS,
    BasicEncoder,
    TwinsEncoder,
)
from flowformer.models.flowformer import FlowFormer
from flowformer.models.raft_decoder import MultiLevelCostDecoder
from flowformer.setting_types import typed_values

# backbone.cost_encoder -> its class; a new cost encoder (a whole replacement) subclasses `CostEncoder` or
# `CostPerceiverEncoder` and is added here. The AGT layer's own options are knobs (intra_layer, inter_layer, ...).
COST_ENCODERS: dict[str, type[CostPerceiverEncoder]] = {"agt": CostPerceiverEncoder}
# backbone.cost_encoder values that were options of the AGT encoder, as the knobs they now are: stored configs
# (checkpoints, run records) and command lines that name them keep building the same network.
RETIRED_COST_ENCODERS = {"mixer": {"intra_layer": "mlp"}}
IMAGE_ENCODERS = ("twins", "cnn")
# backbone.decoder: "cmd" the cost memory decoder (FlowFormer's), "mcr" RAFT's multi-level cost retrieval
# decoder, which reads a correlation pyramid of the cost volume: no cost encoder, no channel_convertor
DECODERS = ("cmd", "mcr")
# knob -> the least value it takes (sizes of at least 1; agt_depth 0 keeps no AGT layer, context_proj_dim 0 makes
# the AGT context-free)
KNOB_MINIMUMS = {
    "feature_dim": 1,
    "cost_heads": 1,
    "cost_patch_dim": 1,
    "num_latent_tokens": 1,
    "latent_dim": 1,
    "agt_depth": 0,
    "context_proj_dim": 0,
    "query_dim": 1,
    "decoder_dim": 1,
}
# backbone.activation_checkpoint names the stages whose activations the backward pass recomputes instead of
# keeping (same numbers, less memory, another forward of those stages): the image encoders (each Twins block,
# each CNN stage); the cost maps' patchify + latent summary; the AGT layers (each, or each row block of a bounded
# plan); each decoder iteration (and each MCVA query round: the decoder's cost query and the reconstruction head).
ACTIVATION_CHECKPOINT_STAGES = ("image_encoders", "tokenize", "cost_layers", "decoder")
# backbone.tokenize_chunk, backbone.memory_budget_gb and backbone.activation_checkpoint: a value, null (the
# official computation) or AUTO, which the tasks replace by their choice for the device they run on
# (flowformer/device_settings.py, `device_memory_settings`). A network built without a device in view takes, for
# tokenize_chunk, the bounded path, as on a CPU, for memory_budget_gb the dense computation, and for
# activation_checkpoint no recomputation.
AUTO = "auto"
BOUNDED_TOKENIZE_CHUNK = 512


@dataclass(frozen=True)
class VariantTraits:
    """Where FlowFormer (official `LatentCostFormer`) and FlowFormer++ (official `PerCostFormer3`) differ."""

    channel_convertor: bool  # a bias-free 1x1 conv on the features before the correlation (FF only)
    patch_pe_dim: int | None  # sine-code width of the patch tokens; None = cost_patch_dim (FF), FF++ fixes 64
    gsa_key_pe_without_context: bool  # the context-free GSA adds a sine code to its keys (FF only)
    decoder_concat_shortcut: bool  # cost-query proj on cat[attn, query] 2Q -> Q (FF) or on attn Q -> Q (FF++)
    reconstruction_head: bool  # the MCVA `pretrain_head` (FF++; kept, unused, in its finetuned checkpoints)


VARIANTS = {
    "flowformer": VariantTraits(
        channel_convertor=True,
        patch_pe_dim=None,
        gsa_key_pe_without_context=True,
        decoder_concat_shortcut=True,
        reconstruction_head=False,
    ),
    "flowformer_pp": VariantTraits(
        channel_convertor=False,
        patch_pe_dim=64,
        gsa_key_pe_without_context=False,
        decoder_concat_shortcut=False,
        reconstruction_head=True,
    ),
}


@dataclass(frozen=True)
class BackboneConfig:
    """The backbone knobs (plain values; stored with checkpoints to rebuild the network). Defaults: the paper's
    FlowFormer, the official `configs/things.py`.

    variant: "flowformer" | "flowformer_pp" (VARIANTS). image_encoder: "twins" (Twins-SVT-Large stages 0-1 of
    `twins_widths`, feature_dim = twins_widths[1]) | "cnn" (GMA's BasicEncoder with `cnn_widths`);
    twins_weights: "imagenet" (timm's ImageNet weights, from its cache, for the large widths), a local copy of
    them, "standin" (a fixed initialisation standing in for them, encoders.STANDIN), or None (random).
    cost_encoder: a name in COST_ENCODERS; cost_heads, cost_patch_dim, num_latent_tokens (K), latent_dim (D),
    agt_depth, context_proj_dim (0: context-free AGT), tokenize_chunk (a memory option, same numbers;
    AUTO: chosen by the tasks from the device, BOUNDED_TOKENIZE_CHUNK without one): its
    knobs; intra_layer (INTRA_LAYERS), inter_layer (INTER_LAYERS), token_pe, agt_pe: the AGT layer's halves and
    the positional codes of the tokens and of the AGT layers (the paper's architecture ablations).
    query_dim, decoder_query ("crop_and_pe" | "pe"): the decoder's cost query;
    recon_size, recon_head_depth: the FlowFormer++ reconstruction head (MCVA target window, MLP depth);
    decoder_dim: the recurrent decoder's width (GRU state, context input, motion features; official 128).
    decoder: "cmd" | "mcr" (DECODERS); decoder_gma: GMA's motion aggregation in either decoder's update block.
    memory_budget_gb: bound the forward pass's memory (None: the dense, official computation; AUTO: chosen by
    the tasks from the device, dense without one).
    activation_checkpoint: stages in ACTIVATION_CHECKPOINT_STAGES whose activations training recomputes in
    backward instead of keeping (none: the official training; AUTO: chosen by the training tasks from the
    device and the step, none without one).
    """

    variant: str = "flowformer"
    image_encoder: str = "twins"
    twins_weights: str | None = None
    feature_dim: int = TWINS_DIM
    twins_widths: tuple[int, int] = TWINS_LARGE_WIDTHS
    cnn_widths: tuple[int, int, int] = (64, 96, 128)
    cost_encoder: str = "agt"
    cost_heads: int = 1
    cost_patch_dim: int = 64
    num_latent_tokens: int = 8
    latent_dim: int = 128
    agt_depth: int = 3
    context_proj_dim: int = 64
    # the AGT layer's halves and positional codes, the paper's architecture ablations (docs/ablations.md)
    intra_layer: str = "transformer"  # INTRA_LAYERS: self-attention over the K tokens | MLP-Mixer | none
    inter_layer: str = "transformer"  # INTER_LAYERS: LSA + GSA over the source grid | ConvNeXt | none
    token_pe: bool = True  # the sine code concatenated to each cost patch token
    agt_pe: bool = True  # the sine codes of the LSA window and of the GSA queries and keys
    query_dim: int = 64
    decoder_query: str = "crop_and_pe"
    recon_size: int = 15
    recon_head_depth: int = 3
    decoder_dim: int = 128
    tokenize_chunk: int | str | None = AUTO
    activation_checkpoint: tuple[str, ...] | str = AUTO
    memory_budget_gb: float | str | None = AUTO
    # the decoder and its update block, the paper's architecture ablations (docs/ablations.md)
    decoder: str = "cmd"  # DECODERS: cost memory decoder | RAFT's multi-level cost retrieval (the baseline row)
    decoder_gma: bool = True  # GMA's global motion aggregation in the update block (official `gma`)

    def __post_init__(self) -> None:
        knobs = {knob.name: getattr(self, knob.name) for knob in fields(self)}
        for knob, value in typed_values(knobs, knob_types(), "backbone", "the backbone").items():
            object.__setattr__(self, knob, value)  # `backbone.agt_depth=2e0`: Hydra's float for the count meant
        self._take_agt_knobs()
        self._check_decoder_knobs()
        object.__setattr__(self, "cnn_widths", tuple(self.cnn_widths))  # Hydra passes a ListConfig
        object.__setattr__(self, "twins_widths", tuple(self.twins_widths))
        if isinstance(self.activation_checkpoint, str) and self.activation_checkpoint != AUTO:
            raise TypeError(
                "backbone.activation_checkpoint is a list of stages, e.g. [decoder] or [tokenize,cost_layers], "
                f"or {AUTO}, got the string {self.activation_checkpoint!r}"
            )
        if self.activation_checkpoint != AUTO:
            object.__setattr__(self, "activation_checkpoint", tuple(self.activation_checkpoint))
        if isinstance(self.tokenize_chunk, str) and self.tokenize_chunk != AUTO:
            raise ValueError(
                f"backbone.tokenize_chunk must be a positive number of cost maps, null or {AUTO}, "
                f"got {self.tokenize_chunk!r}"
            )
        if isinstance(self.memory_budget_gb, str) and self.memory_budget_gb != AUTO:
            raise ValueError(
                f"backbone.memory_budget_gb must be a number of GB > 0, null (dense) or {AUTO}, "
                f"got {self.memory_budget_gb!r}"
            )
        unknown = [stage for stage in self.recomputed_stages if stage not in ACTIVATION_CHECKPOINT_STAGES]
        for knob, least in KNOB_MINIMUMS.items():
            if getattr(self, knob) < least:
                raise ValueError(f"backbone.{knob} must be >= {least}, got {getattr(self, knob)}")
        if min(self.cnn_widths) < 1:
            raise ValueError(f"backbone.cnn_widths must all be >= 1, got {list(self.cnn_widths)}")
        checks = [
            (self.variant in VARIANTS, f"backbone.variant must be one of {tuple(VARIANTS)}, got {self.variant!r}"),
            (
                self.image_encoder in IMAGE_ENCODERS,
                f"backbone.image_encoder must be one of {IMAGE_ENCODERS}, got {self.image_encoder!r}",
            ),
            (
                self.cost_encoder in COST_ENCODERS,
                f"backbone.cost_encoder must be one of {tuple(COST_ENCODERS)}, got {self.cost_encoder!r}",
            ),
            (
                self.image_encoder != "cnn" or self.twins_weights is None,
                "backbone.twins_weights is set but backbone.image_encoder is 'cnn'; set it to null",
            ),
            (
                self.feature_dim % self.cost_heads == 0,
                f"backbone.feature_dim ({self.feature_dim}) must be divisible by cost_heads ({self.cost_heads})",
            ),
            (
                not unknown,
                f"backbone.activation_checkpoint takes stages from {ACTIVATION_CHECKPOINT_STAGES}, got {unknown}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self._check_twins_knobs()

    def _check_twins_knobs(self) -> None:
        """The Twins encoder's widths: two multiples of its head width, the second the feature width, and the
        large ones when it loads the ImageNet weights."""
        widths = list(self.twins_widths)
        if len(widths) != 2 or any(width < 1 or width % TWINS_HEAD_DIM for width in widths):
            raise ValueError(
                f"backbone.twins_widths must be two positive multiples of {TWINS_HEAD_DIM} (one attention head "
                f"per {TWINS_HEAD_DIM} channels), got {widths}"
            )
        if self.image_encoder != "twins":
            return
        if self.feature_dim != widths[-1]:
            raise ValueError(
                f"backbone.feature_dim must be the Twins encoder's width, backbone.twins_widths[1] = {widths[-1]}, "
                f"with the twins image encoder, got {self.feature_dim}"
            )
        if self.twins_weights == IMAGENET and self.twins_widths != TWINS_LARGE_WIDTHS:
            raise ValueError(
                f"backbone.twins_weights=imagenet are twins_svt_large's weights, {list(TWINS_LARGE_WIDTHS)} wide, "
                f"but backbone.twins_widths is {widths}: set backbone.twins_weights=null (or standin)"
            )

    def _take_agt_knobs(self) -> None:
        """A retired cost_encoder value becomes the knobs it means (RETIRED_COST_ENCODERS); the AGT knobs are
        checked."""
        retired = RETIRED_COST_ENCODERS.get(self.cost_encoder, {})
        for knob, value in retired.items():
            if getattr(self, knob) not in (value, getattr(BackboneConfig, knob)):
                raise ValueError(
                    f"backbone.cost_encoder={self.cost_encoder} is the retired name of backbone.{knob}={value}, "
                    f"which contradicts backbone.{knob}={getattr(self, knob)!r}; drop backbone.cost_encoder"
                )
            object.__setattr__(self, knob, value)
        if retired:
            object.__setattr__(self, "cost_encoder", BackboneConfig.cost_encoder)
        for knob, kinds in (("intra_layer", INTRA_LAYERS), ("inter_layer", INTER_LAYERS)):
            if getattr(self, knob) not in kinds:
                raise ValueError(f"backbone.{knob} must be one of {kinds}, got {getattr(self, knob)!r}")

    def _check_decoder_knobs(self) -> None:
        """backbone.decoder and backbone.decoder_gma; mcr has no cost encoder, so its knobs that would build or
        run one are refused (agt_depth must say 0 AGT layers; the others are left unused)."""
        if self.decoder not in DECODERS:
            raise ValueError(f"backbone.decoder must be one of {DECODERS}, got {self.decoder!r}")
        if self.decoder != "mcr":
            return
        if self.agt_depth != 0:
            raise ValueError(
                "backbone.decoder=mcr reads the cost volume without a cost encoder, so it takes no AGT layers: "
                f"set backbone.agt_depth=0 (got {self.agt_depth})"
            )
        if self.feature_dim != 2 * self.decoder_dim:
            raise ValueError(
                "backbone.decoder=mcr splits the context features into the GRU state and input as RAFT does, so "
                f"backbone.feature_dim ({self.feature_dim}) must be 2 x backbone.decoder_dim ({self.decoder_dim})"
            )
        cost_stages = sorted({"tokenize", "cost_layers"} & set(self.recomputed_stages))
        if cost_stages:
            raise ValueError(
                f"backbone.activation_checkpoint {cost_stages}: backbone.decoder=mcr has no cost encoder to "
                "recompute; keep image_encoders and decoder only"
            )

    @property
    def recomputed_stages(self) -> tuple[str, ...]:
        """The stages whose activations backward recomputes: activation_checkpoint's, none for AUTO (a training
        task replaces AUTO by its choice for the device; a network built without one keeps every activation)."""
        return () if self.activation_checkpoint == AUTO else self.activation_checkpoint

    def stored(self) -> dict:
        """The knobs as stored with checkpoints: plain values, without `twins_weights` (the ImageNet weights
        travel in the state dict, so rebuilding does not need the file)."""
        return {
            **asdict(self),
            "cnn_widths": list(self.cnn_widths),
            "twins_widths": list(self.twins_widths),
            "activation_checkpoint": (
                AUTO if self.activation_checkpoint == AUTO else list(self.activation_checkpoint)
            ),
            "twins_weights": None,
        }

    def image_encoder_module(self) -> nn.Module:
        recompute = "image_encoders" in self.recomputed_stages
        if self.image_encoder == "twins":
            return TwinsEncoder(widths=self.twins_widths, twins_weights=self.twins_weights, checkpoint_blocks=recompute)
        return BasicEncoder(feature_dim=self.feature_dim, cnn_widths=self.cnn_widths, checkpoint_blocks=recompute)

    def cost_encoder_module(self) -> CostEncoder:
        traits = VARIANTS[self.variant]
        return COST_ENCODERS[self.cost_encoder](
            cost_heads=self.cost_heads,
            cost_patch_dim=self.cost_patch_dim,
            patch_pe_dim=(traits.patch_pe_dim or self.cost_patch_dim) if self.token_pe else 0,
            num_latent_tokens=self.num_latent_tokens,
            latent_dim=self.latent_dim,
            agt_depth=self.agt_depth,
            context_dim=self.feature_dim,  # the context encoder's output width
            context_proj_dim=self.context_proj_dim,
            gsa_key_pe=traits.gsa_key_pe_without_context or self.context_proj_dim > 0,
            intra_layer=self.intra_layer,
            inter_layer=self.inter_layer,
            agt_pe=self.agt_pe,
            tokenize_chunk=(
                BOUNDED_TOKENIZE_CHUNK if self.tokenize_chunk == AUTO else self.tokenize_chunk
            ),
            checkpoint_tokenize="tokenize" in self.recomputed_stages,
            checkpoint_layers="cost_layers" in self.recomputed_stages,
        )

    def build(self) -> FlowFormer:
        if self.decoder == "mcr":
            return self._flowformer(cost_encoder=None, decoder=self.mcr_decoder_module(), convertor=None)
        traits = VARIANTS[self.variant]
        cost_encoder = self.cost_encoder_module()
        decoder = MemoryDecoder(
            context_dim=self.feature_dim,
            memory_dim=cost_encoder.latent_dim,  # the decoder reads the cost memory at the encoder's width D
            query_dim=self.query_dim,
            cost_heads=self.cost_heads,
            concat_shortcut=traits.decoder_concat_shortcut,
            decoder_query=self.decoder_query,
            recon_size=self.recon_size if traits.reconstruction_head else None,
            recon_head_depth=self.recon_head_depth,
            decoder_dim=self.decoder_dim,
            global_motion=self.decoder_gma,
            checkpoint_iterations="decoder" in self.recomputed_stages,
        )
        convertor = nn.Conv2d(self.feature_dim, self.feature_dim, 1, bias=False) if traits.channel_convertor else None
        return self._flowformer(cost_encoder=cost_encoder, decoder=decoder, convertor=convertor)

    def mcr_decoder_module(self) -> MultiLevelCostDecoder:
        return MultiLevelCostDecoder(
            cost_heads=self.cost_heads,
            decoder_dim=self.decoder_dim,
            global_motion=self.decoder_gma,
            checkpoint_iterations="decoder" in self.recomputed_stages,
        )

    def _flowformer(
        self, *, cost_encoder: CostEncoder | None, decoder: RecurrentRefinement, convertor: nn.Module | None
    ) -> FlowFormer:
        return FlowFormer(
            feature_encoder=self.image_encoder_module(),
            context_encoder=self.image_encoder_module(),
            cost_encoder=cost_encoder,
            decoder=decoder,
            channel_convertor=convertor,
            memory_budget_gb=None if self.memory_budget_gb == AUTO else self.memory_budget_gb,
            config=self.stored(),
        )


def build_flowformer(**knobs) -> FlowFormer:
    """FlowFormer from backbone knobs (`BackboneConfig`); with none, the paper's FlowFormer (the released
    chairs/things/sintel/kitti .pth). The `_target_` of conf/backbone/*.yaml."""
    return BackboneConfig(**knobs).build()


@functools.cache
def knob_types() -> dict[str, Any]:
    """BackboneConfig's field annotations as types, resolved once (0.65 ms each time: most of building a config)."""
    return typing.get_type_hints(BackboneConfig)


# The published and test-sized networks, as knobs that differ from the defaults (conf/backbone/<name>.yaml
# inherit the same way: flowformer_pp and small from flowformer, tiny from small).
PRESETS: dict[str, BackboneConfig] = {"flowformer": BackboneConfig()}
PRESETS["flowformer_pp"] = replace(PRESETS["flowformer"], variant="flowformer_pp")
# the official configs/small_things_eval.py: GMA CNN encoders, K=4, D=32, one AGT layer, context-free AGT
PRESETS["small"] = replace(
    PRESETS["flowformer"],
    image_encoder="cnn",
    num_latent_tokens=4,
    latent_dim=32,
    agt_depth=1,
    context_proj_dim=0,
)
# tests and CPU demos: a 64x96 pair runs forward+backward in well under a second on CPU
PRESETS["tiny"] = replace(
    PRESETS["small"],
    variant="flowformer_pp",
    feature_dim=64,
    twins_widths=(32, 64),
    cnn_widths=(16, 24, 32),
    cost_patch_dim=16,
    context_proj_dim=16,
    query_dim=32,
    decoder_dim=32,  # the recurrent decoder is most of a CPU step
)


def build_flowformer_pp(**knobs) -> FlowFormer:
    """FlowFormer++ as released, incl. its reconstruction head, with `knobs` changed."""
    return replace(PRESETS["flowformer_pp"], **knobs).build()


def build_flowformer_small(**knobs) -> FlowFormer:
    """The paper's FlowFormer-small, with `knobs` changed."""
    return replace(PRESETS["small"], **knobs).build()


def build_flowformer_tiny(**knobs) -> FlowFormer:
    """A FlowFormer++ small enough for CPU tests, with `knobs` changed."""
    return replace(PRESETS["tiny"], **knobs).build()
