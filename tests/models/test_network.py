"""The tiny network's output contract, stages, batch independence, warm start, bf16 and input validation."""

import copy

import pytest
import torch
from torch.nn.functional import grid_sample
from torch.utils._python_dispatch import TorchDispatchMode

from flowformer.models import FlowFormer, TokenMask, build_flowformer, layers, sample_cost_window

from helpers.configs import build_backbone

H, W = 64, 96


def build(**overrides) -> FlowFormer:
    """The tiny network with `overrides`, seeded, with GMA switched on."""
    torch.manual_seed(0)
    net = build_backbone(**overrides)
    with torch.no_grad():  # GMA's gamma starts at 0, which would switch global aggregation off in every test
        net.memory_decoder.update_block.aggregator.gamma.fill_(0.5)
    return net


def images(batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image1 = torch.rand(batch, 3, H, W, generator=g) * 255
    image2 = torch.roll(image1, shifts=(1, 2), dims=(2, 3))
    return image1, image2


@pytest.fixture(scope="module")
def tiny() -> FlowFormer:
    return build().eval()


def test_eval_output_contract(tiny: FlowFormer) -> None:
    with torch.no_grad():
        out = tiny(*images(), iters=2)
    assert set(out) == {"flow", "flow_low"}
    assert out["flow"].shape == (1, 2, H, W)
    assert out["flow_low"].shape == (1, 2, H // 8, W // 8)
    assert torch.isfinite(out["flow"]).all()


def test_train_mode_returns_every_iteration_and_backpropagates() -> None:
    net = build().train()
    out = net(*images(), iters=3)
    assert len(out["flow_predictions"]) == 3
    assert all(f.shape == (1, 2, H, W) for f in out["flow_predictions"])
    assert torch.equal(out["flow_predictions"][-1], out["flow"])
    sum(f.abs().mean() for f in out["flow_predictions"]).backward()
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    assert "memory_encoder.cost_perceiver_encoder.latent_tokens" in grads
    assert "context_encoder.conv1.weight" in grads


def test_stages_compose_to_forward(tiny: FlowFormer) -> None:
    image1, image2 = images()
    with torch.no_grad():
        feat1, feat2, context = tiny.encode_images(image1, image2)
        cost_maps = tiny.cost_volume(feat1, feat2)
        assert cost_maps.shape == (H // 8 * W // 8, 1, H // 8, W // 8) and cost_maps.dtype == torch.float32
        # row y1*W1+x1 of the cost maps holds <feat1[:, y1, x1], feat2[:, y2, x2]> at (y2, x2)
        assert torch.allclose(
            cost_maps[1 * 12 + 5, 0, 3, 7], (feat1[0, :, 1, 5] * feat2[0, :, 3, 7]).sum(), atol=1e-4
        )
        memory = tiny.encode_cost(cost_maps, context)
        assert memory.shape == (H // 8 * W // 8, 4, 32)
        steps = tiny.decode(memory, cost_maps, context, iters=2)
        full = tiny(image1, image2, iters=2)
    assert torch.equal(steps[-1][0], full["flow"]) and torch.equal(steps[-1][1], full["flow_low"])


def test_batch_of_two_equals_two_batches_of_one() -> None:
    """The official FlowFormer pairs image r mod B's context with cost-token row r when B > 1 (its
    `context.repeat`); ours pairs each image with its own (docs/departures.md)."""
    net = build(variant="flowformer").eval()
    a1, a2 = images(seed=1)
    b1, b2 = images(seed=2)
    with torch.no_grad():
        both = net(torch.cat([a1, b1]), torch.cat([a2, b2]), iters=2)["flow"]
        one = torch.cat([net(a1, a2, iters=2)["flow"], net(b1, b2, iters=2)["flow"]])
    assert (both - one).abs().max() < 1e-4
    assert (one[0] - one[1]).abs().max() > 1e-2  # the two pairs really differ


def test_warm_start_changes_the_result(tiny: FlowFormer) -> None:
    with torch.no_grad():
        cold = tiny(*images(), iters=1)["flow_low"]
        init = torch.full((1, 2, H // 8, W // 8), 1.5)
        warm = tiny(*images(), iters=1, flow_init=init)["flow_low"]
        zero = tiny(*images(), iters=1, flow_init=torch.zeros_like(init))["flow_low"]
    assert torch.equal(cold, zero)
    assert (warm - cold).abs().mean() > 0.5  # the 1/8 flow starts from flow_init, not from zero
    with pytest.raises(ValueError, match="flow_init"):
        tiny(*images(), iters=1, flow_init=torch.zeros(1, 2, 3, 3))
    with pytest.raises(ValueError, match="iters must be an integer >= 1"):
        tiny(*images(), iters=0)


@pytest.mark.parametrize("size", [(60, 96), (64, 90)])
def test_size_not_multiple_of_8_names_the_padding(tiny: FlowFormer, size: tuple[int, int]) -> None:
    image = torch.zeros(1, 3, *size)
    with pytest.raises(ValueError, match=r"pad by (4 rows and 0 columns|0 rows and 6 columns)"):
        tiny(image, image, iters=1)


CUDA_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_MARKS)])
def test_bf16_autocast_stays_close_to_fp32(device: str) -> None:
    net = build().eval().to(device)
    image1, image2 = (image.to(device) for image in images())
    with torch.no_grad():
        ref = net(image1, image2, iters=2)["flow"]
        with torch.autocast(device, dtype=torch.bfloat16):
            feat1, feat2, _ = net.encode_images(image1, image2)
            assert feat1.dtype == torch.bfloat16  # the encoders do run in bf16
            assert net.cost_volume(feat1, feat2).dtype == torch.float32  # fp32 island
            low = net(image1, image2, iters=2)["flow"]
    assert low.dtype == torch.float32
    diff = (low - ref).abs()
    assert diff.max() < 0.5 and diff.mean() < 0.05, (diff.max(), diff.mean())


def official_gru(gru, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The official SepConvGRU on the same modules: each gate one convolution of cat[h, x]."""
    for convz, convr, convq in ((gru.convz1, gru.convr1, gru.convq1), (gru.convz2, gru.convr2, gru.convq2)):
        hx = torch.cat([h, x], dim=1)
        z, r = torch.sigmoid(convz(hx)), torch.sigmoid(convr(hx))
        q = torch.tanh(convq(torch.cat([r * h, x], dim=1)))
        h = (1 - z) * h + z * q
    return h


class CountOperators(TorchDispatchMode):
    """The operators dispatched while active, the shapes of their tensor outputs, and for each convolution whether
    its input is channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []
        self.output_shapes: list[torch.Size] = []
        self.convolutions_channels_last: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        if func is torch.ops.aten.convolution.default:
            x = args[0]  # channels innermost too: a one-channel NCHW tensor is contiguous as channels-last
            self.convolutions_channels_last.append(x.is_contiguous(memory_format=torch.channels_last) and x.stride(1) == 1)
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.output_shapes.append(out.shape)
        return out


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_gru_from_its_weights_slices_equals_the_official_gru(layout) -> None:
    """The GRU sums the convolutions of its input's parts (the context's share once per forward, in
    `read_context`) where the official one convolves their concatenation: the same numbers to float rounding,
    with gradients, and no iteration concatenates."""
    from flowformer.models.decoder import SepConvGRU

    torch.manual_seed(0)
    gru = SepConvGRU(hidden=8, input_dim=24, context_dim=8)
    h = torch.randn(2, 8, 6, 7).contiguous(memory_format=layout).requires_grad_()
    context, rest = torch.randn(2, 8, 6, 7), torch.randn(2, 16, 6, 7).contiguous(memory_format=layout)
    expected = official_gru(gru, h, torch.cat([context, rest], dim=1))
    expected_grads = torch.autograd.grad(expected.square().sum(), [h, gru.convz1.weight, gru.convq2.bias])
    passes = gru.read_context(context.contiguous(memory_format=layout), layout)
    with CountOperators() as operators:
        out = gru(h, passes, rest)
    grads = torch.autograd.grad(out.square().sum(), [h, gru.convz1.weight, gru.convq2.bias])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)
    assert torch.ops.aten.cat.default not in operators.calls
    assert all(weight.is_contiguous(memory_format=layout) for gates in passes for weight in gates[1:])


def test_gru_casts_its_input_once_under_autocast() -> None:
    """Under bf16 autocast the GRU state is bf16 and its input fp32 (the raw flow): an iteration casts the
    input once, and no weight (`read_context` casts the weights once per forward)."""
    from flowformer.models.decoder import SepConvGRU

    torch.manual_seed(0)
    gru = SepConvGRU(hidden=8, input_dim=12, context_dim=4)
    h = torch.randn(1, 8, 6, 7).bfloat16()
    x = torch.randn(1, 12, 6, 7)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        passes = gru.read_context(x[:, :4])
        with CountOperators() as operators:
            out = gru(h, passes, x[:, 4:])
        expected = official_gru(gru, h, x.bfloat16())
    assert operators.calls.count(torch.ops.aten._to_copy.default) == 1
    assert all(weight.dtype == torch.bfloat16 for gates in passes for weight in gates)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=0.05)


def test_a_bf16_training_forward_keeps_one_cast_of_the_motion_attention_with_the_gradient_of_a_cast_per_reader():
    """Under bf16 autocast a training forward casts GMA's fp32 attention map to bf16 once: autograd keeps that one
    copy for every iteration's backward, not one per iteration. Each reader's gradient is cast back to fp32
    before the readers' gradients are summed, so the map's gradient is bitwise that of a cast per reader."""
    from flowformer.models.decoder import CastOnceAttention

    net = build().train()
    hw = (H // 8) * (W // 8)
    saved_maps = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.shape[-2:] == (hw, hw) and tensor.dtype == torch.bfloat16:
            saved_maps.append(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), torch.autocast("cpu", torch.bfloat16):
        net(*images(), iters=3)
    assert len(saved_maps) == 3 and len(set(saved_maps)) == 1, "one bf16 map kept for the 3 iterations"

    fp32_map = torch.rand(1, 1, hw, hw, generator=torch.Generator().manual_seed(0)).softmax(dim=-1).requires_grad_()
    values = [torch.randn(1, 1, hw, 8, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3)]
    shared = CastOnceAttention(fp32_map, torch.bfloat16)
    outputs = [shared.apply(v) for v in values]
    (once,) = torch.autograd.grad(sum(out.float().square().sum() for out in outputs), fp32_map)
    expected_outputs = [fp32_map.to(torch.bfloat16) @ v for v in values]
    (each,) = torch.autograd.grad(sum(out.float().square().sum() for out in expected_outputs), fp32_map)
    assert all(torch.equal(out, expected) for out, expected in zip(outputs, expected_outputs, strict=True))
    assert once.dtype == torch.float32 and torch.equal(once, each)


def test_sample_cost_window_is_x_major() -> None:
    """The official x-major order, channel (dx+r)*(2r+1) + (dy+r); integer centres sample the map exactly."""
    h1, w1 = 5, 6
    maps = torch.arange(h1 * w1 * h1 * w1, dtype=torch.float32).view(h1 * w1, 1, h1, w1)
    coords = torch.zeros(1, 2, h1, w1)
    coords[:, 0], coords[:, 1] = 2.0, 3.0  # every source pixel looks at target (x=2, y=3)
    crop = sample_cost_window(maps, coords, radius=1)
    assert crop.shape == (1, 9, h1, w1)
    src = 7  # source pixel (y1=1, x1=1)
    for dx in (-1, 0, 1):
        for dy in (-1, 0, 1):
            channel = (dx + 1) * 3 + (dy + 1)
            assert crop[0, channel, 1, 1] == maps[src, 0, 3 + dy, 2 + dx]
    far = sample_cost_window(maps, torch.full((1, 2, h1, w1), 50.0), radius=1)
    assert torch.equal(far, torch.zeros_like(far))  # zero padding outside the map


def test_token_mask_hides_removed_patches_from_the_cost_encoder(tiny: FlowFormer) -> None:
    image1, image2 = images()
    with torch.no_grad():
        feat1, feat2, context = tiny.encode_images(image1, image2)
        cost_maps = tiny.cost_volume(feat1, feat2)
        n, tokens = cost_maps.shape[0], 2  # 8x12 maps pad to 8x16 -> 1x2 patch tokens
        noise = torch.rand(n, tokens, generator=torch.Generator().manual_seed(0))
        mask = TokenMask.from_noise(noise, mask_ratio=0.5)
        masked = tiny.encode_cost(cost_maps, context, token_mask=mask)
        # changing the cost values inside removed patches must not change the memory
        removed = (
            mask.removed.view(n, 1, 1, 2).repeat_interleave(8, dim=2).repeat_interleave(8, dim=3)[..., :12]
        )
        noisy = cost_maps + 100.0 * removed * torch.randn_like(cost_maps)
        assert torch.allclose(tiny.encode_cost(noisy, context, token_mask=mask), masked, atol=1e-4)
        assert not torch.allclose(tiny.encode_cost(cost_maps, context), masked, atol=1e-3)
        with pytest.raises(ValueError, match="TokenMask.removed"):
            tiny.encode_cost(cost_maps, context, token_mask=TokenMask.from_noise(torch.rand(n, 5), 0.4))


def test_query_cost_memory_and_pretrain_head_shapes(tiny: FlowFormer) -> None:
    image1, image2 = images()
    with torch.no_grad():
        feat1, feat2, context = tiny.encode_images(image1, image2)
        cost_maps = tiny.cost_volume(feat1, feat2)
        memory = tiny.encode_cost(cost_maps, context)
        coords = torch.rand(1, 2, H // 8, W // 8) * 4 + 2
        cost_global = tiny.query_cost_memory(memory, cost_maps, coords)
        assert cost_global.shape == (1, 32, H // 8, W // 8)
        assert tiny.pretrain_head(cost_global).shape == (1, 225, H // 8, W // 8)
    assert [type(m).__name__ for m in tiny.feature_encoder_modules()] == ["BasicEncoder"]
    assert tiny.context_encoder_modules() == [tiny.context_encoder]


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_recon_head_depth(depth: int) -> None:
    head = build(recon_head_depth=depth, recon_size=7).pretrain_head
    convs = [m for m in head if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == depth and convs[-1].out_channels == 49
    assert sum(isinstance(m, torch.nn.GELU) for m in head) == depth - 1


@pytest.mark.parametrize(("query", "depends_on_crop"), [("pe", False), ("crop_and_pe", True)])
def test_decoder_query_source(query: str, depends_on_crop: bool) -> None:
    """decoder_query="pe" (MCVA ablation): the attention read-out ignores the crop feature."""
    net = build(decoder_query=query).eval()
    attend = net.memory_decoder.decoder_layer.cross_attend
    memory = torch.randn(H // 8 * W // 8, 4, 32)
    kv = net.memory_decoder.memory_kv(memory)
    coords = torch.rand(1, 2, H // 8, W // 8) * 4 + 2
    seen = []
    handle = attend.proj.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
    with torch.no_grad():
        for _ in range(2):
            attend(torch.randn(H // 8 * W // 8, 1, 32), coords, *kv)
    handle.remove()
    assert torch.allclose(seen[0], seen[1]) != depends_on_crop


def test_decoder_query_rejects_unknown_source() -> None:
    with pytest.raises(ValueError, match="decoder_query"):
        build(decoder_query="flow")


def test_bad_settings_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="variant"):
        build_flowformer(variant="raft")
    with pytest.raises(ValueError, match=r"feature_dim must be the Twins encoder's width, .* = 256"):
        build_flowformer(image_encoder="twins", feature_dim=64)
    with pytest.raises(ValueError, match="twins_widths must be two positive multiples of 32"):
        build_flowformer(image_encoder="twins", twins_widths=[48, 64], feature_dim=64)
    with pytest.raises(ValueError, match=r"twins_weights=imagenet are twins_svt_large's weights, \[128, 256\]"):
        build_flowformer(image_encoder="twins", twins_widths=[32, 64], feature_dim=64, twins_weights="imagenet")
    with pytest.raises(FileNotFoundError, match="twins_weights"):
        build_flowformer(image_encoder="twins", twins_weights="/nonexistent/twins.pth")
    with pytest.raises(ValueError, match="cost_encoder must be one of"):
        build_flowformer(cost_encoder="convnext")


@pytest.mark.parametrize("masked", [False, True])
def test_chunked_and_checkpointed_tokenization_is_equivalent(masked: bool) -> None:
    """Memory options: chunking over source pixels and activation checkpointing change no number."""
    plain = build().train()
    chunked = build(tokenize_chunk=7, activation_checkpoint=["tokenize"]).train()
    chunked.load_state_dict(plain.state_dict())
    image1, image2 = images()
    results = []
    for net in (plain, chunked):
        feat1, feat2, context = net.encode_images(image1, image2)
        cost_maps = net.cost_volume(feat1, feat2)
        mask = None
        if masked:
            mask = TokenMask.from_noise(
                torch.rand(cost_maps.shape[0], 2, generator=torch.Generator().manual_seed(3)), 0.5
            )
        memory = net.encode_cost(cost_maps, context, token_mask=mask)
        memory.square().mean().backward()
        results.append(
            (memory.detach(), net.memory_encoder.cost_perceiver_encoder.patch_embed.proj[0].weight.grad)
        )
    assert torch.allclose(results[0][0], results[1][0], atol=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="tokenize_chunk"):
        build(tokenize_chunk=0)


def test_the_gradient_of_cost_maps_tokenized_in_blocks_is_written_once() -> None:
    """The backward of a tokenization in blocks writes no more volume-sized tensors than that of all maps at
    once (the blocks' gradients joined; a slice's backward is the whole volume, zero outside the slice: 56 for
    28 slices), and gives the same gradient."""
    heads, h1, w1 = 1, H // 8, W // 8
    maps = torch.randn(2 * h1 * w1, heads, h1, w1, generator=torch.Generator().manual_seed(5))  # 2 images
    writes, gradients = [], []
    for chunk in (None, 7):  # 192 rows: 28 blocks of 7 (the last of 3)
        encoder = build(tokenize_chunk=chunk).train().cost_encoder
        cost = maps.clone().requires_grad_()
        loss = encoder.tokenize(cost).square().mean()
        with CountOperators() as operators:
            loss.backward()
        writes.append(operators.output_shapes.count(cost.shape))
        gradients.append(cost.grad)
    assert writes[1] <= writes[0], f"volume-sized tensors in the backward: {writes[0]} at once, {writes[1]} in blocks"
    assert torch.allclose(gradients[0], gradients[1], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(
    "knobs", [{"cost_heads": 2}, {"agt_depth": 2, "num_latent_tokens": 2}, {"context_proj_dim": 0}]
)
def test_swept_knobs_build_and_run(knobs: dict) -> None:
    net = build(**knobs).eval()
    with torch.no_grad():
        feat1, feat2, context = net.encode_images(*images())
        cost_maps = net.cost_volume(feat1, feat2)
        assert cost_maps.shape[1] == knobs.get("cost_heads", 1)
        memory = net.encode_cost(cost_maps, context)
        assert memory.shape[1] == knobs.get("num_latent_tokens", 4)
        assert net(*images(), iters=1)["flow"].shape == (1, 2, H, W)


def test_cost_window_sampling_in_chunks_equals_one_call(monkeypatch) -> None:
    """Above GRID_SAMPLE_MAX_BATCH cost maps (cuDNN's limit) the window is sampled in chunks, same numbers."""
    torch.manual_seed(0)
    maps = torch.randn(2 * 5 * 6, 1, 5, 6)  # B=2, H1=5, W1=6
    coords = torch.rand(2, 2, 5, 6) * 6 - 0.5
    whole = sample_cost_window(maps, coords, radius=2)
    monkeypatch.setattr(layers, "GRID_SAMPLE_MAX_BATCH", 7)  # 60 maps -> 9 chunks, the last one short
    calls = []
    monkeypatch.setattr(layers.F, "grid_sample", lambda *a, **k: calls.append(a[0].shape[0]) or grid_sample(*a, **k))
    chunked = sample_cost_window(maps, coords, radius=2)
    assert calls == [7] * 8 + [4]
    assert torch.equal(chunked, whole)


def test_decoder_dim_scales_the_recurrent_decoder_and_keeps_its_keys() -> None:
    official = build(decoder_dim=128).memory_decoder
    small = build(decoder_dim=32).memory_decoder
    block = official.update_block
    # the official GMA update block's widths (GRU state 128, motion encoder 256/192/128/64/126, heads 256)
    widths = [block.encoder.convc1.out_channels, block.encoder.convc2.out_channels, block.encoder.convf1.out_channels,
              block.encoder.convf2.out_channels, block.encoder.conv.out_channels, block.flow_head.conv1.out_channels,
              block.gru.convz1.out_channels, block.mask[0].out_channels, official.proj.out_channels]
    assert widths == [256, 192, 128, 64, 126, 256, 128, 256, 256]
    assert small.update_block.gru.convz1.out_channels == 32 and small.proj.out_channels == 64
    assert official.state_dict().keys() == small.state_dict().keys()
    net = build(decoder_dim=32).eval()
    with torch.no_grad():
        assert net(*images(), iters=2)["flow"].shape == (1, 2, H, W)


# each stack's convolutions in one forward of the tiny network with 2 iterations: the update block's per
# iteration (motion encoder 5, GRU 6, flow head 2, GMA's to_v 1; no mask before the last), the patch embedding's
# once (3 and the token FFN's 2)
CONVOLUTION_STACKS = {"memory_decoder.update_block": 2 * (5 + 6 + 2 + 1), "cost_encoder.patch_embed": 3 + 2}


@pytest.mark.parametrize("stack", list(CONVOLUTION_STACKS))
@pytest.mark.parametrize(
    ("device", "training", "channels_last"),
    [("cpu", False, True), ("cpu", True, True), pytest.param("cuda", True, True, marks=CUDA_MARKS),
     pytest.param("cuda", False, False, marks=CUDA_MARKS)],
)
def test_convolution_stacks_convolve_channels_last_tensors(
    tiny: FlowFormer, stack: str, device: str, training: bool, channels_last: bool
) -> None:
    """Every convolution of the update block (its modules' and the GRU's with its weights' slices) and of the cost
    patch embedding reads a channels-last tensor on the CPU, where oneDNN then skips reordering it to its blocked
    layout and back, and on a GPU in training, where cuDNN then skips its NCHW <-> NHWC reorders; on a GPU in
    inference, none does (`layers.convolution_layout`; docs/performance.md, "Side by side with the official code"
    and "One H200")."""
    net = copy.deepcopy(tiny).to(device)
    block = net.get_submodule(stack)
    mode = CountOperators()

    def enter(*_) -> None:  # a pre-hook's return value would replace the block's arguments
        mode.__enter__()

    hooks = [block.register_forward_pre_hook(enter),
             block.register_forward_hook(lambda *_: mode.__exit__(None, None, None))]
    try:
        with torch.set_grad_enabled(training):
            net(*(image.to(device) for image in images()), iters=2)
    finally:
        for hook in hooks:
            hook.remove()
    layouts = mode.convolutions_channels_last
    assert len(layouts) >= CONVOLUTION_STACKS[stack] and set(layouts) == {channels_last}
