"""The decoder knobs of the architecture ablation: backbone.decoder_gma (GMA's motion aggregation on or off) and
backbone.decoder=mcr (RAFT's multi-level cost retrieval decoder), against torchvision's RAFT where it has the
same parts."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from torchvision.models.optical_flow import raft_large
from torchvision.models.optical_flow.raft import (
    RAFT,
    CorrBlock,
    FlowHead,
    MaskPredictor,
    MotionEncoder,
    RecurrentBlock,
    UpdateBlock,
)

from flowformer.models import FlowFormer, build_flowformer
from flowformer.models.raft_decoder import PYRAMID_LEVELS, PYRAMID_RADIUS, cost_pyramid
from flowformer.tasks.runtime import compile_network

from helpers.configs import backbone_config, build_backbone, mcva_settings

H, W = 64, 96
MCR = {"decoder": "mcr", "agt_depth": 0}  # the paper's "baseline RAFT" row on the tiny sizes (with decoder_gma)
RAFT_LARGE_PARAMETERS = 5_257_536  # torchvision's raft_large(), counted by test_raft_large_parameter_count
RAFT_LARGE_CONTEXT_NORM_PARAMETERS = 2_880  # its context encoder's BatchNorm weights and biases


def build(**overrides) -> FlowFormer:
    torch.manual_seed(0)
    return build_backbone(**overrides)


def images(height: int = H, width: int = W, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    image1 = torch.rand(batch, 3, height, width, generator=g) * 255
    return image1, torch.roll(image1, shifts=(2, 3), dims=(2, 3))


def train_step(net: FlowFormer, **image_size) -> list[torch.Tensor]:
    """Forward and backward of a training step; -> the upsampled flow of each of 3 iterations."""
    flows = net.train()(*images(**image_size), iters=3)["flow_predictions"]
    sum(flow.abs().mean() for flow in flows).backward()
    return flows


def test_gma_off_is_the_update_block_without_the_aggregated_motion():
    gma = build()
    plain = build(decoder_gma=False)
    gma_keys = set(gma.memory_decoder.state_dict())
    plain_keys = set(plain.memory_decoder.state_dict())
    assert gma_keys - plain_keys == {k for k in gma_keys if k.startswith(("att.", "update_block.aggregator."))}
    assert plain_keys <= gma_keys and not hasattr(plain.memory_decoder, "att")
    hidden = gma.memory_decoder.decoder_dim  # GRU convs read [state, context, motion(, aggregated motion)]
    assert plain.memory_decoder.update_block.gru.convz1.in_channels == 3 * hidden
    assert gma.memory_decoder.update_block.gru.convz1.in_channels == 4 * hidden
    # the GMA network with its GRU blind to the aggregated motion computes what decoder_gma=false computes
    state = {k: v for k, v in gma.state_dict().items() if k in plain.state_dict()}
    with torch.no_grad():
        gma.memory_decoder.update_block.aggregator.gamma.fill_(0.5)
        for name, conv in gma.memory_decoder.update_block.gru.named_children():
            state[f"memory_decoder.update_block.gru.{name}.weight"] = conv.weight[:, : 3 * hidden].clone()
            conv.weight[:, 3 * hidden :] = 0
    plain.load_state_dict(state)
    gma.eval()
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(*images(), iters=3)["flow"], gma(*images(), iters=3)["flow"])
        gma.memory_decoder.update_block.gru.convz1.weight[:, 3 * hidden :] = 0.1
        assert not torch.allclose(plain(*images(), iters=3)["flow"], gma(*images(), iters=3)["flow"])


def test_gma_off_trains_with_every_parameter_used():
    net = build(decoder_gma=False, variant="flowformer")  # FlowFormer: no reconstruction head (used by MCVA only)
    flows = train_step(net)
    assert all(torch.isfinite(flow).all() for flow in flows)
    assert [n for n, p in net.named_parameters() if p.grad is None] == []


def test_mcr_builds_raft_on_the_image_encoders_and_trains():
    net = build(**MCR, decoder_gma=False)
    assert net.cost_encoder is None and not hasattr(net.memory_encoder, "channel_convertor")
    assert {k.split(".")[1] for k in net.state_dict() if k.startswith("memory_")} == {"feat_encoder", "update_block"}
    block = net.memory_decoder.update_block
    assert block.encoder.convc1.in_channels == PYRAMID_LEVELS * (2 * PYRAMID_RADIUS + 1) ** 2
    flows = train_step(net)
    assert [flow.shape for flow in flows] == [(1, 2, H, W)] * 3 and all(torch.isfinite(f).all() for f in flows)
    assert [n for n, p in net.named_parameters() if p.grad is None] == []  # nothing unused: DDP needs no search
    with_gma = build(**MCR)  # GMA: RAFT plus the motion aggregation
    assert hasattr(with_gma.memory_decoder.update_block, "aggregator") and hasattr(with_gma.memory_decoder, "att")
    assert torch.isfinite(with_gma.eval()(*images(), iters=2)["flow"]).all()


def direct_pyramid_value(feat1, feat2, pixel, level, offset, point) -> float:
    """RAFT's pyramid read straight from its definition: the level-l map of source pixel (y, x) is the 2^l x 2^l
    mean of feat1[y, x] · feat2 / sqrt(C), sampled bilinearly at point / 2^l + offset, zero outside."""
    channels = feat1.shape[1]
    size = 2**level
    full = torch.einsum("c,cyx->yx", feat1[0, :, pixel[0], pixel[1]], feat2[0]) / channels**0.5
    rows, cols = full.shape[0] // size, full.shape[1] // size
    level_map = full[: rows * size, : cols * size].reshape(rows, size, cols, size).mean(dim=(1, 3))
    x, y = point[0] / size + offset[0], point[1] / size + offset[1]
    value = 0.0
    for corner_y in (math.floor(y), math.floor(y) + 1):
        for corner_x in (math.floor(x), math.floor(x) + 1):
            weight = (1 - abs(x - corner_x)) * (1 - abs(y - corner_y))
            if 0 <= corner_y < rows and 0 <= corner_x < cols and weight > 0:
                value += weight * float(level_map[corner_y, corner_x])
    return value


@pytest.mark.parametrize("rows_per_block", [None, 5])
def test_pyramid_lookup_equals_a_direct_computation(rows_per_block):
    g = torch.Generator().manual_seed(1)
    feat1, feat2 = torch.randn(2, 1, 16, 8, 8, generator=g)  # 8x8 maps: the coarsest level is 1x1
    coords = torch.rand(1, 2, 8, 8, generator=g) * 10 - 1
    corr = cost_pyramid(feat1, feat2, heads=1, rows_per_block=rows_per_block).lookup(coords)
    side = 2 * PYRAMID_RADIUS + 1
    assert corr.shape == (1, PYRAMID_LEVELS * side**2, 8, 8)
    for pixel in [(0, 0), (3, 5), (7, 2)]:
        point = coords[0, :, pixel[0], pixel[1]].tolist()
        for level in range(PYRAMID_LEVELS):
            for dx, dy in [(0, 0), (-4, 3), (2, -1), (4, 4)]:
                channel = level * side**2 + (dx + PYRAMID_RADIUS) * side + (dy + PYRAMID_RADIUS)  # x-major
                expected = direct_pyramid_value(feat1, feat2, pixel, level, (dx, dy), point)
                assert float(corr[0, channel, pixel[0], pixel[1]]) == pytest.approx(expected, abs=1e-5)


def torchvision_raft(net: FlowFormer) -> RAFT:
    """torchvision's RAFT with `net`'s image and context encoders and its update block's weights, at its sizes."""
    hidden = net.memory_decoder.decoder_dim
    corr_block = CorrBlock(num_levels=PYRAMID_LEVELS, radius=PYRAMID_RADIUS)
    motion = MotionEncoder(
        in_channels_corr=corr_block.out_channels,
        corr_layers=(2 * hidden, 3 * hidden // 2),
        flow_layers=(hidden, hidden // 2),
        out_channels=hidden,
    )
    gru = RecurrentBlock(input_size=2 * hidden, hidden_size=hidden)
    update = UpdateBlock(motion_encoder=motion, recurrent_block=gru, flow_head=FlowHead(in_channels=hidden,
                         hidden_size=2 * hidden))  # fmt: skip
    mask = MaskPredictor(in_channels=hidden, hidden_size=2 * hidden)
    ours = list(net.memory_decoder.update_block.parameters())
    theirs = [*update.parameters(), *mask.parameters()]
    assert [p.shape for p in ours] == [p.shape for p in theirs]  # the same parts in the same order
    with torch.no_grad():
        for mine, other in zip(ours, theirs, strict=True):
            other.copy_(mine)
    return RAFT(
        feature_encoder=net.memory_encoder.feat_encoder,
        context_encoder=net.context_encoder,
        corr_block=corr_block,
        update_block=update,
        mask_predictor=mask,
    )


def test_mcr_computes_torchvisions_raft():
    net = build(**MCR, decoder_gma=False).train()
    reference = torchvision_raft(net).train()
    image1, image2 = images(128, 128)  # torchvision's CorrBlock takes 1/8-resolution maps of 16 pixels or more
    with torch.no_grad():
        ours = net(image1, image2, iters=3)["flow_predictions"]
        theirs = reference(2 * image1 / 255 - 1, 2 * image2 / 255 - 1, num_flow_updates=3)
    for mine, other in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, other, rtol=1e-4, atol=1e-4)


def test_raft_large_parameter_count():
    """FlowFormer with RAFT-large's sizes (CNN encoders 64-64-96-128 -> 256, mcr, hidden 128, no GMA, no cost
    encoder) has raft_large's parameters but for the affine BatchNorm of RAFT's context encoder: our
    BasicEncoder is the official FlowFormer-small's, with instance norm (no parameters) in both encoders."""
    torch.manual_seed(0)
    ours = build_flowformer(image_encoder="cnn", feature_dim=256, cnn_widths=[64, 96, 128], decoder_dim=128,
                            decoder="mcr", agt_depth=0, decoder_gma=False)  # fmt: skip
    reference = raft_large()
    count = lambda module: sum(p.numel() for p in module.parameters())
    context_norms = sum(
        count(m) for m in reference.context_encoder.modules() if isinstance(m, torch.nn.BatchNorm2d)
    )
    assert count(reference) == RAFT_LARGE_PARAMETERS
    assert context_norms == RAFT_LARGE_CONTEXT_NORM_PARAMETERS
    assert count(ours) == RAFT_LARGE_PARAMETERS - RAFT_LARGE_CONTEXT_NORM_PARAMETERS
    assert count(ours.memory_encoder.feat_encoder) == count(reference.feature_encoder)
    assert count(ours.context_encoder) == count(reference.context_encoder) - context_norms
    assert count(ours.memory_decoder) == count(reference.update_block) + count(reference.mask_predictor)


def test_mcr_composes_with_the_memory_options():
    dense = build(**MCR)
    bounded = build(**MCR, memory_budget_gb=3e-5, activation_checkpoint=["image_encoders", "decoder"])
    plan = bounded.memory_plan(1, H // 8, W // 8)
    assert plan.cost_rows is not None and plan.cost_rows < (H // 8) * (W // 8)  # the pyramid in row blocks
    dense_flows, bounded_flows = train_step(dense), train_step(bounded)
    for mine, other in zip(dense_flows, bounded_flows, strict=True):
        torch.testing.assert_close(mine, other, rtol=1e-4, atol=1e-4)
    for (name, p), other in zip(dense.named_parameters(), bounded.parameters(), strict=True):
        torch.testing.assert_close(p.grad, other.grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"decoder": "raft"}, r"backbone.decoder must be one of \('cmd', 'mcr'\), got 'raft'"),
        ({"decoder_gma": "yes"}, r"^backbone.decoder_gma='yes' \(the backbone takes true or false\)"),
        ({"decoder": "mcr"}, r"takes no AGT layers: set backbone.agt_depth=0 \(got 1\)"),
        ({**MCR, "decoder_dim": 16}, r"backbone.feature_dim \(64\) must be 2 x backbone.decoder_dim \(16\)"),
        ({**MCR, "activation_checkpoint": ["tokenize"]}, r"\['tokenize'\]: backbone.decoder=mcr has no cost encoder"),
    ],
)
def test_bad_decoder_knobs_are_one_line(knobs, message):
    with pytest.raises(ValueError, match=message):
        build(**knobs)


def test_mcr_refuses_what_needs_a_cost_memory_or_a_bigger_image():
    from flowformer.lit.mcva import MCVAPretrainModule

    with pytest.raises(ValueError, match="model=mcva pretrains .* backbone.decoder=mcr does not have"):
        MCVAPretrainModule(backbone=backbone_config(**MCR), **mcva_settings())
    net = build(**MCR).eval()
    with pytest.raises(ValueError, match="mcr decoder .4-level correlation pyramid. needs images of at least 64x64"):
        net(*images(56, 96), iters=1)
    with pytest.raises(ValueError, match="builds no cost encoder and no cost memory: use backbone.decoder=cmd"):
        net.encode_cost(torch.zeros(1), torch.zeros(1))


def test_default_knobs_build_the_same_network():
    default, explicit = build(), build(decoder="cmd", decoder_gma=True)
    assert default.config == explicit.config
    assert [(k, v.shape) for k, v in default.state_dict().items()] == [
        (k, v.shape) for k, v in explicit.state_dict().items()
    ]
    with torch.no_grad():
        assert torch.equal(default.eval()(*images(), iters=2)["flow"], explicit.eval()(*images(), iters=2)["flow"])


def test_compile_takes_the_network_without_a_cost_encoder():
    net = build(**MCR)
    compile_network(net, OmegaConf.create({"compile": True, "compile_backend": "eager", "compile_mode": None}))
    assert net.memory_decoder.compiled_iteration is not None
    assert net.context_encoder._compiled_call_impl is not None
