"""The seam between FlowFormer and its cost encoder: every cost encoder of COST_ENCODERS keeps the contract
(memory shape, blocks of a CostVolume, MCVA's token mask), a cost encoder written elsewhere plugs into a network
assembled from parts, the backbone configs equal the builders, and the AGT layer's halves are swept by
sweep=cost_encoder (their own tests: test_agt_knobs.py)."""

import math

import hydra
import pytest
import torch
from torch import Tensor, nn

from flowformer.lit.mcva import MCVAPretrainModule
from flowformer.models import (
    COST_ENCODERS,
    CostEncoder,
    FlowFormer,
    TokenMask,
    build_flowformer,
    build_flowformer_pp,
    build_flowformer_small,
    build_flowformer_tiny,
    save_backbone,
)
from flowformer.models.build import PRESETS
from flowformer.models.cost_encoder import (
    ConvNextLayer,
    MixerLayer,
    SelfAttentionLayer,
    VerticalSelfAttentionLayer,
)
from flowformer.models.cost_volume import CostVolume, FeatureCostVolume, as_cost_volume
from flowformer.models.decoder import MemoryDecoder
from flowformer.models.encoders import BasicEncoder

from helpers.compose import compose_run_config
from helpers.configs import backbone_config, backbone_kwargs, build_backbone, mcva_settings

H, W = 64, 96  # 1/8 resolution 8x12: cost maps pad to 8x16, 1x2 patch tokens each


def images(batch: int = 2) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    image1 = torch.rand(batch, 3, H, W, generator=g) * 255
    return image1, torch.roll(image1, shifts=(1, 2), dims=(2, 3))


def encoder_inputs(net: FlowFormer, batch: int = 2) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with torch.no_grad():
        feat1, feat2, context = net.encode_images(*images(batch))
    return feat1, feat2, context, net.cost_volume(feat1, feat2)


@pytest.mark.parametrize("name", sorted(COST_ENCODERS))
def test_each_cost_encoder_keeps_the_contract(name: str) -> None:
    torch.manual_seed(0)
    net = build_backbone(cost_encoder=name, num_latent_tokens=3).eval()
    encoder = net.cost_encoder
    assert isinstance(encoder, COST_ENCODERS[name]) and isinstance(encoder, CostEncoder)
    feat1, feat2, context, cost_maps = encoder_inputs(net)
    with torch.no_grad():
        memory = net.encode_cost(cost_maps, context)
        # [B*H1*W1, K, D], K and D as the encoder declares them
        assert memory.shape == (2 * 8 * 12, encoder.num_latent_tokens, encoder.latent_dim) == (192, 3, 32)
        # cost maps read in blocks from the features (the memory-bounded path) give the same memory
        blocks = FeatureCostVolume(feat1, feat2, encoder.cost_heads, rows_per_block=7)
        torch.testing.assert_close(net.encode_cost(blocks, context), memory, rtol=0, atol=1e-5)

        # MCVA: cost values inside removed patches do not reach the memory, those of kept patches do
        n = cost_maps.shape[0]
        mask = TokenMask.from_noise(torch.rand(n, 2, generator=torch.Generator().manual_seed(1)), mask_ratio=0.5)
        masked = net.encode_cost(cost_maps, context, token_mask=mask)
        removed = mask.removed.view(n, 1, 1, 2).repeat_interleave(8, dim=2).repeat_interleave(8, dim=3)[..., :12]
        noise = 100.0 * torch.randn_like(cost_maps)
        torch.testing.assert_close(
            net.encode_cost(cost_maps + removed * noise, context, token_mask=mask), masked, rtol=0, atol=1e-4
        )
        assert not torch.allclose(net.encode_cost(cost_maps + (1 - removed) * noise, context, token_mask=mask), masked)
    # every part of the encoder learns
    net.train()
    net.encode_cost(cost_maps, context).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.encoder_layers.parameters())


class MeanPoolCostEncoder(CostEncoder):
    """A cost encoder from outside the package: each cost map average-pooled to a 2x2 grid, one token per cell."""

    supports_token_mask = False

    def __init__(self, *, latent_dim: int) -> None:
        super().__init__()
        self.cost_heads, self.num_latent_tokens, self.latent_dim = 1, 4, latent_dim
        self.embed = nn.Linear(1, latent_dim)

    def forward(self, cost: Tensor | CostVolume, context: Tensor, token_mask: TokenMask | None = None) -> Tensor:
        cost = as_cost_volume(cost)
        pieces = []
        for start in range(0, cost.num_rows, cost.block_rows):
            maps = cost.maps(slice(start, min(start + cost.block_rows, cost.num_rows)))  # [n, 1, H2, W2]
            pooled = nn.functional.adaptive_avg_pool2d(maps, 2).flatten(1)  # [n, 4]
            pieces.append(self.embed(pooled[..., None]))  # [n, 4, D]
        return torch.cat(pieces)


def test_a_cost_encoder_written_elsewhere_plugs_into_a_network_of_parts(tmp_path) -> None:
    torch.manual_seed(0)
    net = FlowFormer(
        feature_encoder=BasicEncoder(feature_dim=32, cnn_widths=(8, 8, 16)),
        context_encoder=BasicEncoder(feature_dim=32, cnn_widths=(8, 8, 16)),
        cost_encoder=MeanPoolCostEncoder(latent_dim=24),
        decoder=MemoryDecoder(
            context_dim=32,
            memory_dim=24,
            query_dim=16,
            cost_heads=1,
            concat_shortcut=False,
            decoder_query="crop_and_pe",
            recon_size=None,
            recon_head_depth=3,
            decoder_dim=16,
        ),
        memory_budget_gb=1e-6,  # the plan sizes its blocks with CostEncoder.cost_map_bytes
    ).train()
    out = net(*images(batch=1), iters=2)
    assert out["flow"].shape == (1, 2, H, W) and len(out["flow_predictions"]) == 2
    out["flow"].abs().mean().backward()
    assert net.cost_encoder.embed.weight.grad is not None
    _, _, context, cost_maps = encoder_inputs(net, batch=1)
    mask = TokenMask.from_noise(torch.rand(cost_maps.shape[0], 2), mask_ratio=0.5)
    with pytest.raises(ValueError, match="MeanPoolCostEncoder cannot hide cost-map patches"):
        net.encode_cost(cost_maps, context, token_mask=mask)
    with pytest.raises(ValueError, match="built by flowformer.models.build_flowformer"):
        save_backbone(tmp_path / "hand_made.ckpt", net)


@pytest.mark.parametrize(
    ("name", "builder"),
    [
        ("flowformer", build_flowformer),
        ("flowformer_pp", build_flowformer_pp),
        ("small", build_flowformer_small),
        ("tiny", build_flowformer_tiny),
    ],
)
def test_backbone_configs_equal_the_builders(name, builder) -> None:
    """conf/backbone/<name>.yaml (with what it inherits) holds the builder's knobs, and Hydra builds that network."""
    assert backbone_kwargs(name) == PRESETS[name].stored()
    with torch.device("meta"):
        net, from_hydra = builder(), hydra.utils.instantiate(backbone_config(name))
    assert net.config == from_hydra.config == PRESETS[name].stored()
    assert [(k, v.shape) for k, v in net.state_dict().items()] == [
        (k, v.shape) for k, v in from_hydra.state_dict().items()
    ]


def test_sweep_cost_encoder_compares_the_agt_halves_and_each_value_takes_effect() -> None:
    cfg = compose_run_config(["debug=tiny", "sweep=cost_encoder"])
    assert cfg.hydra.mode.name == "MULTIRUN"
    assert dict(cfg.hydra.sweeper.params) == {
        "backbone.intra_layer": "transformer,mlp",
        "backbone.inter_layer": "transformer,convnext",
    }
    for intra, inter, (intra_class, inter_class) in [
        ("transformer", "transformer", (SelfAttentionLayer, VerticalSelfAttentionLayer)),
        ("mlp", "convnext", (MixerLayer, ConvNextLayer)),
    ]:
        overrides = ["debug=tiny", f"backbone.intra_layer={intra}", f"backbone.inter_layer={inter}"]
        with torch.device("meta"):
            encoder = hydra.utils.instantiate(compose_run_config(overrides).backbone).cost_encoder
        assert isinstance(encoder.encoder_layers[0], intra_class)
        assert isinstance(encoder.vertical_encoder_layers[0], inter_class)
    size = compose_run_config(["debug=tiny", "sweep=cost_encoder_size"]).hydra.sweeper.params
    assert set(size) == {"backbone.num_latent_tokens", "backbone.latent_dim", "backbone.agt_depth"}


def test_mcva_pretrains_the_mixer_intra_layers() -> None:
    torch.manual_seed(0)
    module = MCVAPretrainModule(
        backbone=backbone_config(intra_layer="mlp"), **mcva_settings(query_num=2, log_images_every_n_steps=0)
    )
    output = module.pretrain_step(*images())
    output.loss.backward()
    mixer = module.backbone.cost_encoder.encoder_layers[0]
    assert math.isfinite(output.loss.item()) and mixer.token_mlp.fc1.weight.grad.abs().sum() > 0
