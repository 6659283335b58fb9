"""The AGT layer's knobs (the paper's architecture ablations): each half of the layer (`backbone.intra_layer`,
`backbone.inter_layer`), no AGT layer at all, and the positional codes (`backbone.token_pe`, `backbone.agt_pe`).
Each value builds and trains, composes with the memory options, changes the widths docs/ablations.md says; the
ConvNeXt layer is the official one in structure and mixes positions, not latent slots; the retired
`cost_encoder=mixer` still builds (and loads) the MLP-Mixer network. Defaults keep the official numbers: the
parity tests (test_parity.py, test_mcva_parity.py)."""

import math

import pytest
import torch
from torch import Tensor

from flowformer.models import FlowFormer, build_flowformer, save_backbone
from flowformer.models.checkpoint import load_backbone
from flowformer.models.cost_encoder import ConvNextLayer, MixerLayer, PatchEmbed

from helpers.configs import build_backbone
from helpers.run import run_py

H, W = 64, 96  # 1/8 resolution 8x12

KNOBS = {
    "intra_mlp": {"intra_layer": "mlp"},
    "intra_none": {"intra_layer": "none"},
    "inter_convnext": {"inter_layer": "convnext"},
    "inter_none": {"inter_layer": "none"},
    "mlp_and_convnext": {"intra_layer": "mlp", "inter_layer": "convnext"},
    "no_agt_layer": {"agt_depth": 0},
    "no_token_pe": {"token_pe": False},
    "no_agt_pe": {"agt_pe": False},
}


def images(batch: int = 2) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    image1 = torch.rand(batch, 3, H, W, generator=g) * 255
    return image1, torch.roll(image1, shifts=(1, 2), dims=(2, 3))


def tiny(**knobs) -> FlowFormer:
    torch.manual_seed(0)
    return build_backbone(**knobs)


@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
def test_each_knob_value_builds_and_trains(knobs: dict) -> None:
    net = tiny(**knobs)
    assert {k: net.config[k] for k in knobs} == knobs  # stored as given, to rebuild the network
    out = net(*images(), iters=2)
    assert out["flow"].shape == (2, 2, H, W) and torch.isfinite(out["flow"]).all()
    out["flow"].abs().mean().backward()
    encoder = net.cost_encoder
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.parameters()), "a cost-encoder part"
    layers = knobs.get("agt_depth", 1)  # the tiny backbone has one AGT layer
    assert len(encoder.encoder_layers) == (0 if knobs.get("intra_layer") == "none" else layers)
    assert len(encoder.vertical_encoder_layers) == (0 if knobs.get("inter_layer") == "none" else layers)


def test_both_halves_none_is_the_network_without_agt_layers() -> None:
    """The paper's "None" row of the architecture ablation can be written either way: the same network."""
    empty, no_layer = tiny(intra_layer="none", inter_layer="none"), tiny(agt_depth=0)
    assert [(k, v.shape) for k, v in empty.state_dict().items()] == [
        (k, v.shape) for k, v in no_layer.state_dict().items()
    ]
    with torch.no_grad():
        assert torch.equal(empty(*images(), iters=2)["flow"], no_layer(*images(), iters=2)["flow"])


@pytest.mark.parametrize(
    "knobs",
    [{"intra_layer": "mlp", "inter_layer": "convnext"}, {"intra_layer": "none", "token_pe": False, "agt_pe": False}],
    ids=["mlp_convnext", "no_codes"],
)
def test_knobs_compose_with_the_memory_options(knobs: dict) -> None:
    """Row blocks of a bounded plan, activation checkpointing of the tokenisation and the AGT layers, and a small
    tokenize_chunk give the memory and the gradients of one plain pass."""
    plain = tiny(**knobs)
    bounded = tiny(**knobs, tokenize_chunk=50, activation_checkpoint=["tokenize", "cost_layers"])
    encoder = bounded.cost_encoder
    budget = 3 * encoder.latent_row_bytes(8, 12) // 2  # one latent row at a time, 8x12 at 1/8 resolution
    with torch.no_grad():
        feat1, feat2, context = plain.encode_images(*images())
        cost_maps = plain.cost_volume(feat1, feat2)
    memories = [plain.encode_cost(cost_maps, context), bounded.encode_cost(cost_maps, context, activation_budget=budget)]
    for memory in memories:
        memory.square().mean().backward()
    torch.testing.assert_close(memories[1], memories[0], rtol=0, atol=1e-5)
    for whole, blocked in zip(plain.cost_encoder.parameters(), bounded.cost_encoder.parameters()):
        torch.testing.assert_close(blocked.grad, whole.grad, rtol=1e-4, atol=1e-6)


def test_convnext_inter_layer_is_the_official_block_stack() -> None:
    """4 blocks of a 7x7 depthwise conv, channels-last LayerNorm (eps 1e-6), 4x MLP, layer scale from 1e-6."""
    layer = tiny(inter_layer="convnext").cost_encoder.vertical_encoder_layers[0]
    assert isinstance(layer, ConvNextLayer) and len(layer.net) == 4
    d = 32  # the tiny backbone's latent_dim
    for block in layer.net:
        assert block.conv_dw.kernel_size == (7, 7) and block.conv_dw.groups == d and block.conv_dw.padding == (3, 3)
        assert block.norm.eps == 1e-6 and block.norm.normalized_shape == (d,)
        assert block.mlp.fc1.weight.shape == (4 * d, d) and block.mlp.fc2.weight.shape == (d, 4 * d)
        assert torch.equal(block.gamma, torch.full((d,), 1e-6))


def test_convnext_layer_mixes_source_positions_within_each_latent_slot_only() -> None:
    """A change in slot k of one source pixel reaches slot k of the other pixels of that image, never another
    slot or another image."""
    torch.manual_seed(0)
    net = build_backbone(intra_layer="none", inter_layer="convnext").eval()
    encoder = net.cost_encoder
    with torch.no_grad():
        for block in encoder.vertical_encoder_layers[0].net:
            block.gamma.fill_(1.0)  # layer scale 1e-6 would hide the change in float32 rounding
    with torch.no_grad():
        _, _, context = net.encode_images(*images())
    tokens = torch.randn(2 * 8 * 12, 4, 32)  # [B*H1*W1, K, D] straight from "the tokenizer"
    changed = tokens.clone()
    pixel, slot = 5 * 12 + 6, 2  # image 0, row 5, column 6
    changed[pixel, slot] += 1.0
    with torch.no_grad():
        outputs = []
        for latent in (tokens, changed):
            encoder.tokenize = lambda cost, mask, latent=latent: latent
            outputs.append(encoder(None, context).view(2, 8 * 12, 4, 32))
    moved = (outputs[1] - outputs[0]).abs().amax(dim=-1)  # [B, H1*W1, K]
    assert (moved[:, :, [0, 1, 3]] == 0).all() and (moved[1] == 0).all()
    assert (moved[0, :, slot] > 0).sum() > 1 and moved[0, pixel - 1, slot] > 0


@pytest.mark.parametrize("variant", ["flowformer", "flowformer_pp"])
def test_token_pe_false_narrows_the_patch_ffn_and_the_latent_cross_attention(variant: str) -> None:
    """Tokens lose their code's width (FlowFormer: cost_patch_dim, FlowFormer++: 64): patch_embed.ffn_with_coord,
    patch_embed.norm and input_layer.k / .v read cost_patch_dim channels; nothing else changes shape."""
    with torch.device("meta"):
        default, narrow = (build_flowformer(variant=variant, token_pe=pe).state_dict() for pe in (True, False))
    assert list(default) == list(narrow)
    changed = {k: (tuple(default[k].shape), tuple(narrow[k].shape)) for k in default if default[k].shape != narrow[k].shape}
    prefix = "memory_encoder.cost_perceiver_encoder."
    width = 64 + 64  # cost_patch_dim 64 + the code's 64 in both variants
    assert changed == {
        prefix + "patch_embed.ffn_with_coord.0.weight": ((width, width, 1, 1), (64, 64, 1, 1)),
        prefix + "patch_embed.ffn_with_coord.0.bias": ((width,), (64,)),
        prefix + "patch_embed.ffn_with_coord.2.weight": ((width, width, 1, 1), (64, 64, 1, 1)),
        prefix + "patch_embed.ffn_with_coord.2.bias": ((width,), (64,)),
        prefix + "patch_embed.norm.weight": ((width,), (64,)),
        prefix + "patch_embed.norm.bias": ((width,), (64,)),
        prefix + "input_layer.k.weight": ((128, width), (128, 64)),
        prefix + "input_layer.v.weight": ((128, width), (128, 64)),
    }


def test_without_token_pe_the_patch_tokens_carry_no_position() -> None:
    """Two inner patches of a constant cost map (out of reach of the convolutions' zero padding) give the same
    token without the code and different tokens with it."""
    maps = torch.ones(1, 1, 64, 64)  # 8x8 patches
    for pe_dim, same in [(0, True), (16, False)]:
        torch.manual_seed(0)
        tokens, _ = PatchEmbed(cost_heads=1, cost_patch_dim=16, patch_pe_dim=pe_dim)(maps)  # [1, 64, 16 + pe_dim]
        assert tokens.shape == (1, 64, 16 + pe_dim)
        inner = tokens[0].detach().view(8, 8, -1)[3]
        assert torch.equal(inner[3], inner[4]) == same


def test_agt_pe_false_keeps_every_width_and_drops_the_codes() -> None:
    """The AGT codes are added, not concatenated: the network keeps its parameters (it loads the default's) and
    only the codes leave its output."""
    default, no_codes = tiny(), tiny(agt_pe=False)
    no_codes.load_state_dict(default.state_dict(), strict=True)
    with torch.no_grad():
        flows = [net.eval()(*images(batch=1), iters=2)["flow"] for net in (default, no_codes)]
    assert not torch.allclose(flows[0], flows[1])
    for agt_pe in (True, False):  # FlowFormer's context-free GSA also has the key code
        layer = tiny(variant="flowformer", context_proj_dim=0, agt_pe=agt_pe).cost_encoder.vertical_encoder_layers[0]
        lsa, gsa = layer.local_block.attn, layer.global_block.attn
        assert lsa.position_code == gsa.query_pe == gsa.key_pe == agt_pe


def test_the_retired_cost_encoder_mixer_builds_and_loads_the_mlp_mixer_network(tmp_path) -> None:
    """Stored configs (backbone files, Lightning hyper-parameters) and command lines naming cost_encoder=mixer
    build intra_layer=mlp; the MLP-Mixer's parameters keep their names."""
    net = tiny(intra_layer="mlp")
    assert isinstance(net.cost_encoder.encoder_layers[0], MixerLayer)
    assert tiny(cost_encoder="mixer").config == net.config
    save_backbone(tmp_path / "new.ckpt", net)
    saved = torch.load(tmp_path / "new.ckpt", weights_only=True)
    old_knobs = ("intra_layer", "inter_layer", "token_pe", "agt_pe")  # the knobs old files lack
    old = {**{k: v for k, v in saved["config"].items() if k not in old_knobs}, "cost_encoder": "mixer"}
    torch.save({**saved, "config": old}, tmp_path / "old.ckpt")
    lightning = {
        "state_dict": {f"backbone.{k}": v for k, v in saved["state_dict"].items()},
        "hyper_parameters": {"backbone": {"_target_": "flowformer.models.build_flowformer", **old}},
    }
    torch.save(lightning, tmp_path / "old_lightning.ckpt")
    assert "memory_encoder.cost_perceiver_encoder.encoder_layers.0.token_mlp.fc1.weight" in saved["state_dict"]
    for path in ("old.ckpt", "old_lightning.ckpt"):
        rebuilt = load_backbone(tmp_path / path)
        assert rebuilt.config == net.config
        assert all(torch.equal(v, rebuilt.state_dict()[k]) for k, v in net.state_dict().items())
    with pytest.raises(ValueError, match="cost_encoder=mixer is the retired name of backbone.intra_layer=mlp"):
        build_backbone(cost_encoder="mixer", intra_layer="none")


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"intra_layer": "attention"}, r"backbone.intra_layer must be one of \('transformer', 'mlp', 'none'\)"),
        ({"inter_layer": "conv"}, r"backbone.inter_layer must be one of \('transformer', 'convnext', 'none'\)"),
        ({"token_pe": "no"}, r"^backbone.token_pe='no' \(the backbone takes true or false\): set it to such a"),
        ({"agt_pe": 0}, r"^backbone.agt_pe=0 \(the backbone takes true or false\)"),
        (
            {"agt_depth": "abc", "latent_dim": 1.5},
            (r"^backbone.latent_dim=1.5 \(the backbone takes a whole number\); "
            r"backbone.agt_depth='abc' \(the backbone takes a whole number\): set them"),
        ),
    ],
)
def test_bad_knob_values_are_refused_in_one_line(knobs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message), torch.device("meta"):
        build_flowformer(**knobs)


def test_the_knobs_train_through_run_py(tmp_path) -> None:
    knobs = ["intra_layer=mlp", "inter_layer=convnext", "token_pe=false", "agt_pe=false"]
    run_py("debug=tiny", *(f"backbone.{k}" for k in knobs), "trainer.max_steps=2", f"hydra.run.dir={tmp_path}")
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    stored = last["hyper_parameters"]["backbone"]
    assert last["global_step"] == 2
    assert (stored["intra_layer"], stored["inter_layer"], stored["token_pe"], stored["agt_pe"]) == (
        "mlp",
        "convnext",
        False,
        False,
    )
    prefix = "backbone.memory_encoder.cost_perceiver_encoder."
    assert prefix + "vertical_encoder_layers.0.net.3.gamma" in last["state_dict"]
    assert last["state_dict"][prefix + "input_layer.k.weight"].shape == (32, 16)  # tiny: D 32, cost_patch_dim 16
    assert all(math.isfinite(v.float().sum().item()) for v in last["state_dict"].values())
