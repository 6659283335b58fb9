"""The bounded-memory computation (`backbone.memory_budget_gb`) gives the dense computation's numbers: a cost
volume computed in blocks from the features (maps and bilinear windows), chunked global attentions, and the
plan that picks them from the budget."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import flowformer.models.decoder as decoder_module
from flowformer.models import FlowFormer, cost_volume, sample_cost_window
from flowformer.models.cost_encoder import GlobalSubsampledAttention, PatchEmbed
from flowformer.models.cost_volume import DenseCostVolume, FeatureCostVolume, dense_cost_maps
from flowformer.models.encoders import TwinsEncoder
from flowformer.models.layers import (
    CONVEX_UPSAMPLE_VALUES_PER_PIXEL,
    gpu_fused_attention,
    softmax_attention,
    upsample_flow_convex,
)
from flowformer.models.memory_plan import MemoryPlan, plan_memory

from helpers.configs import build_backbone, refuse_dense_volume


def tiny(**overrides) -> FlowFormer:
    torch.manual_seed(0)
    return build_backbone(**overrides).eval()


def features(batch: int = 2, channels: int = 8, size: tuple[int, int] = (5, 7)) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(batch, channels, *size, generator=g) for _ in range(2))


@pytest.mark.parametrize("rows_per_block", [1, 6, 34, 1000])
def test_feature_cost_volume_maps_equal_the_dense_volume(rows_per_block):
    feat1, feat2 = features()
    dense = dense_cost_maps(feat1, feat2, heads=2)  # [2*35, 2, 5, 7]
    volume = FeatureCostVolume(feat1, feat2, heads=2, rows_per_block=rows_per_block)
    for start in range(0, volume.num_rows, volume.block_rows):  # blocks that straddle the two images too
        rows = slice(start, min(start + volume.block_rows, volume.num_rows))
        torch.testing.assert_close(volume.maps(rows), dense[rows], rtol=1e-5, atol=1e-5)


@pytest.fixture(params=["maps", "features"])
def window_source(request, monkeypatch) -> str:
    """Both ways FeatureCostVolume reads a window: from block maps (up to MAPS_FOR_WINDOWS_MAX_PIXELS source
    pixels per image, every test size here) and from feat2 sampled at the window points (beyond)."""
    if request.param == "features":
        monkeypatch.setattr(cost_volume, "MAPS_FOR_WINDOWS_MAX_PIXELS", 0)
    return request.param


@pytest.mark.parametrize("radius", [4, 7])  # the decoder's 9x9 window and MCVA's 15x15
def test_feature_volume_windows_equal_windows_of_the_volume(radius, window_source):
    feat1, feat2 = features()
    g = torch.Generator().manual_seed(5)
    # targets inside, on the border and far outside the map: grid_sample's zero padding must agree
    coords = torch.rand(2, 2, 5, 7, generator=g) * torch.tensor([12.0, 10.0]).view(1, 2, 1, 1) - 3.0
    expected = sample_cost_window(dense_cost_maps(feat1, feat2, heads=2), coords, radius)
    volume = FeatureCostVolume(feat1, feat2, heads=2, rows_per_block=4)  # blocks straddle the two images
    source = "maps" if window_source == "maps" else "features"
    reads = []
    for name in ("_window_from_maps", "_window_from_features"):
        method = getattr(volume, name)
        setattr(volume, name, lambda *a, m=method, n=name: reads.append(n) or m(*a))
    got = volume.window(coords, radius)
    assert set(reads) == {f"_window_from_{source}"} and len(reads) == 18  # 70 rows in blocks of 4
    assert got.shape == expected.shape == (2, 2 * (2 * radius + 1) ** 2, 5, 7)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        DenseCostVolume(dense_cost_maps(feat1, feat2, 2)).window(coords, radius), expected
    )


def test_training_windows_are_recomputed_in_backward(window_source):
    """In training, no block's maps or sampled features are kept for backward (all blocks together would
    outweigh the dense volume): only the window points are, each block is computed again in backward, and
    the gradients are those of the dense volume's window."""
    feat1, feat2 = (f.requires_grad_() for f in features(channels=32))
    coords = torch.rand(2, 2, 5, 7, generator=torch.Generator().manual_seed(5)) * 6.0
    saved = []

    def record(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel():  # torch 2.6 also hands the hooks an empty tensor for each recomputed block
            saved.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        window = FeatureCostVolume(feat1, feat2, heads=2, rows_per_block=4).window(coords, 4)
    assert saved and all(shape[-3:] == (9, 9, 2) for shape in saved)  # [n, side, side, 2] window points
    got = torch.autograd.grad(window.square().sum(), [feat1, feat2])
    dense = sample_cost_window(dense_cost_maps(feat1, feat2, heads=2), coords, 4)
    expected = torch.autograd.grad(dense.square().sum(), [feat1, feat2])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("lq", "lk"), [(1, 8), (8, 48), (37, 20), (49, 49)])  # the last two above 8x64: fused
def test_attention_equals_the_written_out_product(lq, lk):
    """softmax_attention: short attentions written out, long ones by torch's fused kernel; values and gradients."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 4, n, 16, generator=g, requires_grad=True) for n in (lq, lk, lk))
    got = softmax_attention(q, k, v, scale=0.25)
    written_out = ((q @ k.transpose(-2, -1)) * 0.25).softmax(dim=-1) @ v
    torch.testing.assert_close(got, written_out)
    grads = (torch.autograd.grad(out.sum(), (q, k, v)) for out in (got, written_out))
    torch.testing.assert_close(*grads)


@pytest.mark.parametrize(("lq", "lk"), [(80, 70), (49, 49)])  # flash attention first; memory-efficient first
def test_fused_attention_as_a_gpu_runs_it_equals_the_written_out_product(lq, lk):
    """gpu_fused_attention (what softmax_attention runs on a GPU for long attentions), on the CPU: without cuDNN's
    kernel and in blocks of rows (max_rows=2 of 5: three calls), values and gradients."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(5, 2, n, 8, generator=g, requires_grad=True) for n in (lq, lk, lk))
    got = gpu_fused_attention(q, k, v, scale=0.3, max_rows=2)
    written_out = ((q @ k.transpose(-2, -1)) * 0.3).softmax(dim=-1) @ v
    torch.testing.assert_close(got, written_out)
    grads = (torch.autograd.grad(out.sum(), (q, k, v)) for out in (got, written_out))
    torch.testing.assert_close(*grads)


@pytest.mark.parametrize(("lq", "lk", "first"), [(80, 70, "FLASH_ATTENTION"), (49, 49, "EFFICIENT_ATTENTION")])
def test_gpu_fused_attention_tries_memory_efficient_first_for_short_windows(monkeypatch, lq, lk, first):
    """The kernels allowed while gpu_fused_attention's call runs, in torch's order of priority: flash attention
    first for long attentions, memory-efficient attention first for the LSA's 49x49 windows (faster on an H200),
    cuDNN's never; torch's own order back after the call."""
    seen = []
    fused = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(allowed_attention_kernels())
        return fused(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    before = allowed_attention_kernels()
    q, k, v = (torch.randn(2, 2, n, 8) for n in (lq, lk, lk))
    gpu_fused_attention(q, k, v, scale=0.3)
    (allowed,) = seen
    assert allowed[0] == first and "CUDNN_ATTENTION" not in allowed
    assert allowed_attention_kernels() == before


def allowed_attention_kernels() -> list[str]:
    """The names of the attention kernels torch may run now (torch.backends.cuda's switches), in its order of
    priority (what sdpa_kernel(..., set_priority=True) sets), on every torch pyproject.toml admits."""
    order = torch._C._get_sdp_priority_order()
    switches = {
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
        SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
        SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
    }
    allowed = [kernel for kernel, enabled in switches.items() if enabled()]
    return [kernel.name for kernel in sorted(allowed, key=lambda kernel: order.index(int(kernel)))]


@pytest.mark.parametrize("rows_per_block", [1, 2, 4, 5])
def test_convex_upsampling_in_row_blocks_equals_one_pass(rows_per_block):
    """Each output pixel reads its own mask values and its 3x3 flow neighbourhood (rows above and below a
    block included), so blocks of rows give the whole image's numbers, and its gradients to float rounding (the
    backward's sums over each pixel's 64 outputs reduce blocks of another shape)."""
    g = torch.Generator().manual_seed(2)
    flow = (torch.randn(2, 2, 5, 7, generator=g) * 3).requires_grad_()
    mask = torch.randn(2, 9 * 64, 5, 7, generator=g).requires_grad_()
    whole = upsample_flow_convex(flow, mask)
    blocks = upsample_flow_convex(flow, mask, rows_per_block)
    assert blocks.shape == (2, 2, 40, 56)
    torch.testing.assert_close(blocks, whole, rtol=0, atol=0)
    weights = torch.randn(whole.shape, generator=g)
    expected = torch.autograd.grad((whole * weights).sum(), [flow, mask])
    got = torch.autograd.grad((blocks * weights).sum(), [flow, mask])
    for got_grad, expected_grad in zip(got, expected):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-5)


def official_convex_upsampling(flow, mask):
    """The official `upsample_flow` (RAFT's), written out: autograd differentiates the broadcast product."""
    batch, _, height, width = flow.shape
    mask = torch.softmax(mask.view(batch, 1, 9, 8, 8, height, width), dim=2)
    neighbours = torch.nn.functional.unfold(8 * flow, [3, 3], padding=1).view(batch, 2, 9, 1, 1, height, width)
    up = torch.sum(mask * neighbours, dim=2).permute(0, 1, 4, 2, 5, 3)
    return up.reshape(batch, 2, 8 * height, 8 * width)


@pytest.mark.parametrize("rows_per_block", [None, 2])
def test_convex_upsampling_equals_the_official_values_and_gradients(rows_per_block):
    """The forward is the official one bit for bit; its own backward gives autograd's gradients (to float
    rounding: the sums run in another order), for the dense gradient of a loss on the [B, 2, 8H, 8W] flow."""
    g = torch.Generator().manual_seed(3)
    flow = (torch.randn(2, 2, 5, 7, generator=g) * 3).requires_grad_()
    mask = torch.randn(2, 9 * 64, 5, 7, generator=g).requires_grad_()
    target = torch.randn(2, 2, 40, 56, generator=g)
    ours = upsample_flow_convex(flow, mask, rows_per_block)
    official = official_convex_upsampling(flow, mask)
    torch.testing.assert_close(ours, official, rtol=0, atol=0)
    got = torch.autograd.grad((ours - target).abs().sum(), [flow, mask])
    expected = torch.autograd.grad((official - target).abs().sum(), [flow, mask])
    for got_grad, expected_grad in zip(got, expected):
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-5)


def test_bounded_decoder_upsamples_in_row_blocks_within_its_budget(monkeypatch):
    net = tiny()
    calls = []

    def recording(flow, mask, rows_per_block=None):
        calls.append(rows_per_block)
        return upsample_flow_convex(flow, mask, rows_per_block)

    monkeypatch.setattr(decoder_module, "upsample_flow_convex", recording)
    image1 = torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(0)) * 255
    image2 = torch.roll(image1, shifts=(2, 3), dims=(2, 3))
    row_bytes = 8 * CONVEX_UPSAMPLE_VALUES_PER_PIXEL * 4  # one 1/8-resolution row of 8 pixels, fp32
    with torch.no_grad():
        feat1, feat2, context = net.encode_images(image1, image2)
        cost_maps = net.cost_volume(feat1, feat2)
        memory = net.encode_cost(cost_maps, context)
        whole = net.decode(memory, cost_maps, context, iters=2, upsample_all=False)
        blocks = net.decode(
            memory, cost_maps, context, iters=2, upsample_all=False, activation_budget=2 * row_bytes
        )
    assert calls == [None, 2]  # the last iteration only, then in blocks of 2 of the 6 rows
    assert torch.equal(blocks[-1][0], whole[-1][0])


def test_plan_is_dense_when_it_fits_and_bounded_when_not():
    patch_embed = PatchEmbed(cost_heads=1, cost_patch_dim=64, patch_pe_dim=64)
    sizes = {"heads": 1, "cost_map_bytes": patch_embed.activation_bytes(135, 240)}
    assert plan_memory(None, batch=1, h1=135, w1=240, **sizes).dense
    assert plan_memory(64.0, batch=1, h1=46, w1=62, **sizes).dense  # 368x496 fits 64 GB
    plan = plan_memory(4.0, batch=1, h1=135, w1=240, **sizes)  # 1080p in 4 GB
    assert not plan.dense and plan.cost_rows < 135 * 240 and plan.gma_queries < 135 * 240


def test_memory_budget_must_be_positive():
    with pytest.raises(ValueError, match="memory_budget_gb must be > 0"):
        tiny(memory_budget_gb=0)


def small_blocks(net: FlowFormer, batch: int, h1: int, w1: int) -> MemoryPlan:
    """A bounded plan with small blocks, so every bounded path runs in several pieces at test sizes (one
    latent row and one source pixel per AGT block)."""
    return MemoryPlan(cost_rows=7, gma_queries=9, activation_bytes=1)


@pytest.mark.parametrize("batch", [1, 2])
def test_bounded_forward_equals_dense_forward(batch, window_source, monkeypatch):
    g = torch.Generator().manual_seed(0)
    image1 = torch.rand(batch, 3, 48, 64, generator=g) * 255
    image2 = torch.roll(image1, shifts=(2, 3), dims=(2, 3))
    dense_net, bounded_net = tiny(), tiny(memory_budget_gb=1e-6)
    bounded_net.load_state_dict(dense_net.state_dict())
    plan = bounded_net.memory_plan(batch, 6, 8)
    assert plan.cost_rows is not None and plan.gma_queries is not None
    monkeypatch.setattr(FlowFormer, "memory_plan", small_blocks)
    with torch.no_grad():
        dense = dense_net(image1, image2, iters=4)
        bounded = bounded_net(image1, image2, iters=4)
    torch.testing.assert_close(bounded["flow"], dense["flow"], rtol=0, atol=1e-5)
    torch.testing.assert_close(bounded["flow_low"], dense["flow_low"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("intra_layer", ["transformer", "mlp"])
def test_agt_layers_in_row_blocks_equal_one_pass(intra_layer):
    """With an activation budget the AGT layers run over blocks of rows (source pixels for the intra-cost-map
    layers, one image's latent rows with that image's context for LSA/GSA), and give the same cost memory."""
    net = tiny(intra_layer=intra_layer)
    encoder = net.cost_encoder
    g = torch.Generator().manual_seed(1)
    image1 = torch.rand(2, 3, 48, 64, generator=g) * 255
    image2 = torch.roll(image1, shifts=(2, 3), dims=(2, 3))
    inter_rows, intra_rows = [], []
    encoder.vertical_encoder_layers[0].register_forward_hook(lambda m, a, out: inter_rows.append(len(a[0])))
    encoder.encoder_layers[0].register_forward_hook(lambda m, a, out: intra_rows.append(len(a[0])))
    budget = 5 * encoder.latent_row_bytes(6, 8) // 2  # 2 latent rows at once
    pixels = budget // encoder.pixel_row_bytes()
    assert pixels < 2 * 48
    with torch.no_grad():
        feat1, feat2, context = net.encode_images(image1, image2)
        cost_maps = net.cost_volume(feat1, feat2)
        whole = net.encode_cost(cost_maps, context)
        blocks = net.encode_cost(cost_maps, context, activation_budget=budget)
    k = encoder.num_latent_tokens  # 4: two blocks of 2 latent rows per image
    assert inter_rows == [2 * k, 2, 2, 2, 2]
    assert intra_rows == [2 * 48, *(len(part) for part in torch.arange(2 * 48).split(pixels))]
    torch.testing.assert_close(blocks, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("context_proj_dim", [0, 32])
def test_global_subsampled_attention_rounds_each_latent_row_alike(context_proj_dim):
    """Blocks of one latent row give the numbers of all rows at once, bitwise, at the official widths and
    fixture A's 1/8 grid (46x62). Its 4x4 sub-sampling as a convolution did not: oneDNN picked another
    algorithm for a batch of one (keys 7.6e-6 apart, the flow 9.2e-5 px after 32 iterations)."""
    torch.manual_seed(0)
    layer = GlobalSubsampledAttention(dim=128, context_dim=128, context_proj_dim=context_proj_dim).eval()
    g = torch.Generator().manual_seed(2)
    size = (46, 62)
    x = torch.randn(4, size[0] * size[1], 128, generator=g)
    context = torch.randn(1, 128, *size, generator=g)
    with torch.no_grad():
        whole = layer(x, size, context)
        rows = torch.cat([layer(row, size, context) for row in x.split(1)])
    assert torch.equal(rows, whole)


def test_twins_blocks_in_row_blocks_equal_one_pass():
    """With an activation budget each Twins block runs over blocks of token rows: LSA blocks over whole rows
    of 7x7 windows, GSA blocks over whole rows of the sr_ratio convolution (8 at 1/4, 4 at 1/8 resolution),
    including a last block below the final whole sr_ratio row, and the features are the same as one pass."""
    torch.manual_seed(0)
    encoder = TwinsEncoder().eval()
    image = torch.randn(1, 3, 72, 120)  # tokens: 18x30 at 1/4 resolution, 9x15 at 1/8
    calls = {name: [] for name in ("lsa0", "gsa0", "lsa1", "gsa1")}
    for stage, blocks in enumerate(encoder.svt.blocks):
        blocks[0].register_forward_hook(lambda m, a, out, s=stage: calls[f"lsa{s}"].append(a[1][0]))
        blocks[1].attn.sr.register_forward_hook(
            lambda m, a, out, s=stage: calls[f"gsa{s}"].append(a[0].shape[2])
        )
    with torch.no_grad():
        whole = encoder(image)
        assert calls == {"lsa0": [18], "gsa0": [18], "lsa1": [9], "gsa1": [9]}
        calls = {name: [] for name in calls}
        blocks = encoder(image, activation_budget=1)  # one window or sr_ratio row at a time
    # token rows per call: LSA in blocks of 7 rows, GSA's convolution in blocks of sr_ratio rows, the rows
    # below the last whole one (2 at 1/4, 1 at 1/8) left to no convolution as in one pass
    assert calls == {"lsa0": [7, 7, 4], "gsa0": [8, 8], "lsa1": [7, 2], "gsa1": [4, 4]}
    torch.testing.assert_close(blocks, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("image_encoder", ["cnn", "twins"])
def test_bounded_forward_encodes_the_pair_in_row_blocks_or_one_image_at_a_time(image_encoder, monkeypatch):
    """The feature encoder's activations are the largest left once the cost volume is bounded. The dense path
    runs it on the pair as one batch (as the official code); a bounded plan keeps the pair for Twins, whose
    blocks then run over rows, and runs the CNN on each image in turn; the features stay the dense ones."""
    twins = image_encoder == "twins"
    net = tiny(image_encoder="twins") if twins else tiny()
    batches = []
    net.memory_encoder.feat_encoder.register_forward_hook(
        lambda module, args, out: batches.append(len(args[0]))
    )
    image1 = torch.rand(2, 3, 48, 64) * 255
    image2 = torch.roll(image1, shifts=(2, 3), dims=(2, 3))
    with torch.no_grad():
        dense = net.encode_images(image1, image2)
        assert batches == [4]
        bounded = net.encode_images(image1, image2, activation_budget=1)
    assert batches == ([4, 4] if twins else [4, 2, 2])
    for got, expected in zip(bounded, dense):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_bounded_forward_never_builds_the_whole_volume(monkeypatch):
    net = tiny()
    monkeypatch.setattr(FlowFormer, "memory_plan", small_blocks)
    monkeypatch.setattr(net, "cost_volume", refuse_dense_volume)
    with torch.no_grad():
        out = net(torch.rand(1, 3, 48, 64) * 255, torch.rand(1, 3, 48, 64) * 255, iters=2)
    assert torch.isfinite(out["flow"]).all()
