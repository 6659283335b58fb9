"""Cost-volume encoders: what FlowFormer asks of one (`CostEncoder`) and the official one (`CostPerceiverEncoder`:
patchify each cost map, summarise it into K latent tokens, then alternate intra- and inter-cost-map layers, the
AGT layers), with the paper's architecture ablations as its options: each half of the AGT layer a transformer
(the method), an MLP-Mixer block (intra) or a ConvNeXt stack (inter), or left out; the positional codes of the
tokenisation and of the AGT layers on or off (docs/ablations.md).

Module and parameter names follow the official `CostPerceiverEncoder`
(`core/FlowFormer/LatentCostFormer/encoder.py`, FlowFormer++'s `PerCostFormer3/encoder.py` for the MCVA mask) so
checkpoints load by key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from flowformer.models.cost_volume import CostVolume, as_cost_volume
from flowformer.models.layers import (
    Mlp,
    convolution_layout,
    coords_grid,
    feed_forward,
    in_layout,
    linear_position_encoding,
    multi_head_attention,
    recomputed_in_backward,
    softmax_attention,
    split_heads,
)
from flowformer.models.memory_plan import FLOAT_BYTES
from flowformer.models.token_mask import TokenMask

PATCH = 8  # cost-map patch size: three stride-2 convs, as the official `patch_size = 8`
WINDOW = 7  # LSA window of the inter-cost-map attention (official `LocallyGroupedAttnRPEContext`, ws = 7)
SUBSAMPLE = 4  # GSA sub-sampling ratio (official `GlobalSubSampleAttnRPEContext`, sr_ratio = 4)
HEADS = 8  # attention heads of every cost-encoder attention (official constant)
# backbone.intra_layer / backbone.inter_layer: what each half of an AGT layer is ("none": left out)
INTRA_LAYERS = ("transformer", "mlp", "none")
INTER_LAYERS = ("transformer", "convnext", "none")
CONVNEXT_BLOCKS = 4  # ConvNeXt blocks per inter-cost-map layer (official `ConvNextLayer`, depth = 4)
CONVNEXT_KERNEL = 7  # their depthwise kernel (official `ConvNextBlock`)
CONVNEXT_LAYER_SCALE = 1e-6  # their layer scale's initial value (official `layer_scale_init_value`)


class PatchEmbed(nn.Module):
    """Cost maps [N, cost_heads, H2, W2] -> patch tokens [N, H3*W3, cost_patch_dim + patch_pe_dim] (official
    `PatchEmbed`).

    Zero-pad to multiples of 8, three k6/s2/p2 convs with ReLU only between them (none after the last, unlike
    the paper's figure), concatenate the sine code of the patch centres (8j+4, 8i+4) (`patch_pe_dim` 0: none,
    backbone.token_pe=false), 1x1 conv FFN, LayerNorm.
    With `removed` masks (MCVA, FlowFormer++'s masked `PatchEmbed`), each conv input is multiplied by (1 - mask)
    at its own resolution.
    """

    def __init__(self, *, cost_heads: int, cost_patch_dim: int, patch_pe_dim: int) -> None:
        super().__init__()
        self.cost_heads, self.cost_patch_dim, self.patch_pe_dim = cost_heads, cost_patch_dim, patch_pe_dim
        dim = cost_patch_dim
        self.proj = nn.ModuleList(
            [
                nn.Conv2d(cost_heads, dim // 4, kernel_size=6, stride=2, padding=2),
                nn.ReLU(),
                nn.Conv2d(dim // 4, dim // 2, kernel_size=6, stride=2, padding=2),
                nn.ReLU(),
                nn.Conv2d(dim // 2, dim, kernel_size=6, stride=2, padding=2),
            ]
        )
        token_dim = dim + patch_pe_dim
        self.ffn_with_coord = nn.Sequential(
            nn.Conv2d(token_dim, token_dim, kernel_size=1),
            nn.ReLU(),
            nn.Conv2d(token_dim, token_dim, kernel_size=1),
        )
        self.norm = nn.LayerNorm(token_dim)

    def activation_bytes(self, height: int, width: int) -> int:
        """fp32 activations of one [heads, height, width] cost map through this embedding: the padded map, the
        three convolutions (with their ReLU outputs) and the token FFN on the 1/8 grid."""
        heads, dim = self.cost_heads, self.cost_patch_dim
        hp, wp = -(-height // PATCH) * PATCH, -(-width // PATCH) * PATCH
        tokens = (hp // PATCH) * (wp // PATCH)
        values = (
            heads * hp * wp
            + 2 * (dim // 4) * (hp // 2) * (wp // 2)
            + 2 * (dim // 2) * (hp // 4) * (wp // 4)
            + dim * tokens
            + 4 * (dim + self.patch_pe_dim) * tokens
        )
        return values * FLOAT_BYTES

    def forward(self, cost_maps: Tensor, removed: Tensor | None = None) -> tuple[Tensor, tuple[int, int]]:
        n, _, height, width = cost_maps.shape
        x = F.pad(cost_maps, (0, (PATCH - width % PATCH) % PATCH, 0, (PATCH - height % PATCH) % PATCH))
        h3, w3 = x.shape[2] // PATCH, x.shape[3] // PATCH
        masks: list[Tensor | None] = [None, None, None]
        if removed is not None:
            if removed.shape != (n, h3 * w3):
                raise ValueError(
                    f"TokenMask.removed has shape {tuple(removed.shape)}, expected [B*H1*W1, H3*W3] = "
                    f"[{n}, {h3 * w3}] for cost maps {tuple(cost_maps.shape)} (one bit per 8x8 cost patch)"
                )
            grid = removed.view(n, 1, h3, w3).to(x.dtype)
            # one bit per token -> nearest-upsampled to the input of each conv (48x64, 24x32, 12x16 for 46x62
            # maps), as FlowFormer++'s `random_masking` builds mask_for_patch1..3
            masks = [grid.repeat_interleave(s, dim=2).repeat_interleave(s, dim=3) for s in (8, 4, 2)]
        # The convolutions and the token FFN run in `convolution_layout`'s format; channels-last, the tokens come
        # out contiguous for the LayerNorm (docs/performance.md, "Cost-map tokenization in chunks")
        layout = convolution_layout(x.device)
        for idx, layer in enumerate(self.proj):
            if idx % 2 == 0 and masks[idx // 2] is not None:
                x = x * (1 - masks[idx // 2])
            if idx == 0 and layout is not None:
                x = in_layout(x, layout)  # one cost head: a view; the convolutions then write the layout themselves
            x = layer(x)
        # x [N, dim, H3, W3]; patch centres in 1/8-res cost-map pixels
        if self.patch_pe_dim > 0:
            centres = coords_grid(n, h3, w3, device=x.device) * PATCH + PATCH / 2
            pe = linear_position_encoding(centres.view(n, 2, -1).permute(0, 2, 1), self.patch_pe_dim)
            # [N, patch_pe_dim, H3, W3] as a channels-last view: the concatenation takes x's layout where the two
            # match, NCHW otherwise
            pe = pe.view(n, h3, w3, -1).permute(0, 3, 1, 2)
            x = torch.cat([x, pe.to(x.dtype)], dim=1)  # -> [N, dim + patch_pe_dim, H3, W3]
        x = self.ffn_with_coord(x)
        return self.norm(x.flatten(2).transpose(1, 2)), (h3, w3)


class _PreNormAttentionBlock(nn.Module):
    """The parameters of a pre-norm attention block with its feed-forward, named as in the official checkpoints
    (norm1, q, k, v, proj, norm2, ffn): queries of width `dim`, keys and values read from width `source_dim`."""

    def __init__(self, *, dim: int, source_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(source_dim, dim)
        self.v = nn.Linear(source_dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn = feed_forward(dim)


class LatentCrossAttention(_PreNormAttentionBlock):
    """K latent codewords attend to the patch tokens of each cost map (official `input_layer`, 8 heads, FFN 1x).

    latent [1, K, D], tokens [N, L, T] -> [N, K, D]. With `ids_keep` [N, n_keep] only the kept tokens are
    gathered before k and v (MCVA, as FlowFormer++'s `CrossAttentionLayer`).
    """

    def __init__(self, *, dim: int, token_dim: int) -> None:
        super().__init__(dim=dim, source_dim=token_dim)

    def forward(self, latent: Tensor, tokens: Tensor, ids_keep: Tensor | None = None) -> Tensor:
        if ids_keep is not None:
            tokens = torch.gather(tokens, 1, ids_keep[..., None].expand(-1, -1, tokens.shape[-1]))
        q, k, v = (split_heads(x, HEADS) for x in (self.q(self.norm1(latent)), self.k(tokens), self.v(tokens)))
        x = latent + self.proj(multi_head_attention(q, k, v))
        return x + self.ffn(self.norm2(x))


class SelfAttentionLayer(_PreNormAttentionBlock):
    """Intra-cost-map attention over the K tokens of one source pixel: [N, K, D] -> [N, K, D]."""

    def __init__(self, *, dim: int) -> None:
        super().__init__(dim=dim, source_dim=dim)

    def forward(self, x: Tensor) -> Tensor:
        y = self.norm1(x)
        x = x + self.proj(multi_head_attention(*(split_heads(f(y), HEADS) for f in (self.q, self.k, self.v))))
        return x + self.ffn(self.norm2(x))


def _context_tokens(context: Tensor | None, proj: nn.Linear | None, rows: int) -> Tensor | None:
    """context [B, Cc, H, W] -> projected [B*K, H, W, c], row b*K + k = image b: the per-image pairing of
    FlowFormer++. FlowFormer's `context.repeat(K, 1, 1, 1)` gives row r image r mod B, wrong for B > 1; we
    pair correctly in both variants (docs/departures.md)."""
    if proj is None:
        return None
    if context is None:
        raise ValueError(
            "this cost encoder projects image context into its attention (context_proj_dim > 0); "
            "pass the context features"
        )
    batch, channels, height, width = context.shape
    c = proj(context.view(batch, channels, height * width).permute(0, 2, 1))
    return c.repeat_interleave(rows // batch, dim=0).view(rows, height, width, -1)


def _padded_grids(
    x: Tensor, size: tuple[int, int], context: Tensor | None, proj: nn.Linear | None, multiple: int
) -> tuple[Tensor, Tensor]:
    """Tokens x [rows, H*W, C] -> (x, x_qk) as grids [rows, Hp, Wp, C] and [rows, Hp, Wp, C + c], zero-padded at
    the bottom and right to multiples of `multiple`; x_qk carries the projected context the queries and keys see
    (x itself without context)."""
    rows, _, channels = x.shape
    height, width = size
    x = x.view(rows, height, width, channels)
    ctx = _context_tokens(context, proj, rows)
    x_qk = x if ctx is None else torch.cat([x, ctx.to(x.dtype)], dim=-1)
    pad = (0, 0, 0, (multiple - width % multiple) % multiple, 0, (multiple - height % multiple) % multiple)
    return F.pad(x, pad), F.pad(x_qk, pad)


class LocalWindowAttention(nn.Module):
    """LSA over the source grid, 7x7 windows, window-local sine code (dim D + c) added to q and k (official
    `LocallyGroupedAttnRPEContext`).

    x [B*K, H1*W1, D] -> same. With context (c > 0), q and k see [x ‖ context_proj(ctx)]; v sees x only.
    Zero-padded positions take part in the softmax unmasked, as in the official code. `position_code` False:
    no sine code (backbone.agt_pe=false).
    """

    def __init__(self, *, dim: int, context_dim: int, context_proj_dim: int, position_code: bool = True) -> None:
        super().__init__()
        self.c, self.position_code = context_proj_dim, position_code
        if context_proj_dim > 0:
            self.context_proj = nn.Linear(context_dim, context_proj_dim)
        self.q = nn.Linear(dim + context_proj_dim, dim)
        self.k = nn.Linear(dim + context_proj_dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, size: tuple[int, int], context: Tensor | None) -> Tensor:
        rows, n, channels = x.shape
        height, width = size
        ws, heads = WINDOW, HEADS
        x, x_qk = _padded_grids(x, size, context, getattr(self, "context_proj", None), ws)
        nh = x.shape[1] // ws

        def windows(t: Tensor) -> Tensor:
            # [rows, Hp, Wp, C] -> [rows, nh, nw, ws, ws, C]
            return rearrange(t, "r (nh y) (nw x) c -> r nh nw y x c", y=ws, x=ws)

        def split_heads(t: Tensor) -> Tensor:
            # [rows, nh, nw, ws, ws, C] -> [rows*nh*nw, heads, ws*ws, C/heads]: fused attention needs 4 dims
            return rearrange(t, "r nh nw y x (h c) -> (r nh nw) h (y x) c", h=heads)

        v = split_heads(self.v(windows(x)))
        x_qk = windows(x_qk)
        if self.position_code:
            local = coords_grid(1, ws, ws, device=x.device).view(1, 2, -1).permute(0, 2, 1)
            x_qk = x_qk + linear_position_encoding(local, channels + self.c).view(ws, ws, -1)
        q, k = split_heads(self.q(x_qk)), split_heads(self.k(x_qk))
        attended = softmax_attention(q, k, v, scale=(channels // heads) ** -0.5)
        # [rows*nh*nw, heads, ws*ws, C/heads] -> [rows, Hp, Wp, C], then crop the padding
        out = rearrange(attended, "(r nh nw) h (y x) c -> r (nh y) (nw x) (h c)", r=rows, nh=nh, y=ws)
        out = out[:, :height, :width, :]
        return self.proj(out.reshape(rows, n, channels))


class GlobalSubsampledAttention(nn.Module):
    """GSA: every position attends to a 4x4-strided summary of the grid (official `GlobalSubSampleAttnRPEContext`;
    sine code of the padded absolute position on the query, of the sub-sampled position x4 on the key).

    x [B*K, H1*W1, D] -> same. With context: q from [x ‖ ctx] + PE, keys from `sr_key` on [x ‖ ctx] then the
    shared `norm`, + PE of the sub-sampled coordinates ×4; values from `sr_value` on x then the same `norm`.
    Without context (FlowFormer-small): one `sr` conv; the key PE exists in FlowFormer only (`key_pe`).
    `query_pe` False: no code on the query (backbone.agt_pe=false, which also drops the key's).
    """

    def __init__(
        self, *, dim: int, context_dim: int, context_proj_dim: int, key_pe: bool = True, query_pe: bool = True
    ) -> None:
        super().__init__()
        self.c, self.key_pe, self.query_pe = context_proj_dim, key_pe, query_pe
        if context_proj_dim > 0:
            self.context_proj = nn.Linear(context_dim, context_proj_dim)
        self.q = nn.Linear(dim + context_proj_dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        if context_proj_dim > 0:
            self.sr_key = nn.Conv2d(dim + context_proj_dim, dim, kernel_size=SUBSAMPLE, stride=SUBSAMPLE)
            self.sr_value = nn.Conv2d(dim, dim, kernel_size=SUBSAMPLE, stride=SUBSAMPLE)
        else:
            self.sr = nn.Conv2d(dim, dim, kernel_size=SUBSAMPLE, stride=SUBSAMPLE)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor, size: tuple[int, int], context: Tensor | None) -> Tensor:
        rows, n, channels = x.shape
        height, width = size
        sr, heads = SUBSAMPLE, HEADS
        x, x_qk = _padded_grids(x, size, context, getattr(self, "context_proj", None), sr)
        hp, wp = x.shape[1], x.shape[2]
        x, x_qk = x.view(rows, hp * wp, channels), x_qk.view(rows, hp * wp, -1)

        queries = x_qk  # the keys' sub-sampling reads x_qk without the code
        if self.query_pe:
            coords = coords_grid(1, hp, wp, device=x.device).view(1, 2, -1).permute(0, 2, 1)
            queries = x_qk + linear_position_encoding(coords, channels + self.c)
        q = self.q(queries)
        q = q.reshape(rows, hp * wp, heads, channels // heads).permute(0, 2, 1, 3)

        def subsample(conv: nn.Conv2d, t: Tensor) -> Tensor:
            # The 4x4 stride-4 conv as a product with its patches. oneDNN picks another algorithm, and another
            # rounding, for a batch of one than for several, so blocks of one latent row differed from all rows
            # at once (9e-5 px on fixture A after 32 iterations); a matrix product rounds each row alike. It also
            # beats the batch-of-one conv (3x at 440x1024), at 2.5x the batched conv's few ms.
            # [rows, Hp*Wp, Cin] -> patches [rows, Hp/4*Wp/4, 4*4*Cin] -> [rows, m, D]
            patches = rearrange(t, "r (h y w x) c -> r (h w) (y x c)", h=hp // sr, y=sr, x=sr)
            return self.norm(F.linear(patches, conv.weight.permute(0, 2, 3, 1).flatten(1), conv.bias))

        if self.c > 0:
            keys, values = subsample(self.sr_key, x_qk), subsample(self.sr_value, x)
        else:
            keys = values = subsample(self.sr, x)
        if self.key_pe:
            sub = coords_grid(1, hp // sr, wp // sr, device=x.device).view(1, 2, -1).permute(0, 2, 1) * sr
            keys = keys + linear_position_encoding(sub, channels)
        m = (hp // sr) * (wp // sr)
        k = self.k(keys).reshape(rows, m, heads, channels // heads).permute(0, 2, 1, 3)
        v = self.v(values).reshape(rows, m, heads, channels // heads).permute(0, 2, 1, 3)
        out = softmax_attention(q, k, v, scale=(channels // heads) ** -0.5)  # [rows, heads, Hp*Wp, D/heads]
        out = out.transpose(1, 2).reshape(rows, hp, wp, channels)[:, :height, :width, :]
        return self.proj(out.reshape(rows, n, channels))


class AGTBlock(nn.Module):
    """Pre-norm transformer block around one inter-cost-map attention; MLP 4x; LayerNorm eps 1e-5."""

    def __init__(self, *, dim: int, attn: nn.Module) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim=dim, hidden=4 * dim)

    def forward(self, x: Tensor, size: tuple[int, int], context: Tensor | None) -> Tensor:
        x = x + self.attn(self.norm1(x), size, context)
        return x + self.mlp(self.norm2(x))


class VerticalSelfAttentionLayer(nn.Module):
    """Inter-cost-map attention: LSA block then GSA block over the source grid, per latent slot; `agt_pe`: the
    LSA window code and the GSA query code (and the key code where `key_pe`)."""

    def __init__(self, *, dim: int, context_dim: int, context_proj_dim: int, key_pe: bool, agt_pe: bool) -> None:
        super().__init__()
        kw = {"dim": dim, "context_dim": context_dim, "context_proj_dim": context_proj_dim}
        self.local_block = AGTBlock(dim=dim, attn=LocalWindowAttention(**kw, position_code=agt_pe))
        gsa = GlobalSubsampledAttention(**kw, key_pe=key_pe and agt_pe, query_pe=agt_pe)
        self.global_block = AGTBlock(dim=dim, attn=gsa)

    def forward(self, x: Tensor, size: tuple[int, int], context: Tensor | None) -> Tensor:
        return self.global_block(self.local_block(x, size, context), size, context)


class CostEncoder(nn.Module):
    """What FlowFormer asks of a cost encoder; subclass it to add one (and name it in `COST_ENCODERS`,
    flowformer/models/build.py, to select it with `backbone.cost_encoder=<name>`).

    forward(cost, context, token_mask=None) -> cost memory [B*H1*W1, K, D]
        cost: the cost maps [B*H1*W1, heads, H2, W2], or a CostVolume (the memory-bounded path computes them in
            blocks): read them through `as_cost_volume(cost).maps(rows)`, at most `block_rows` rows at a time.
        context: image 1's context features [B, C, H1, W1] (an encoder may ignore them).
        token_mask: MCVA only: which 8x8 patches of each cost map the encoder must not see. An encoder that
            cannot hide patches sets `supports_token_mask = False`; FlowFormer then refuses masked encoding.
    An encoder with `supports_activation_budget = True` also takes `activation_budget` (bytes or None): a
    memory-bounded plan's share for the transient activations of its layers over the cost memory, which it
    then runs over blocks of rows (FlowFormer passes it only to such encoders).
    Attributes: `cost_heads` (cost maps per source pixel), `num_latent_tokens` (K) and `latent_dim` (D, the
    width the decoder reads the memory with).
    """

    cost_heads: int
    num_latent_tokens: int
    latent_dim: int
    supports_token_mask: bool = True
    supports_activation_budget: bool = False

    def cost_map_bytes(self, height: int, width: int) -> int:
        """Bytes one [heads, height, width] cost map costs while it is encoded (MemoryPlan sizes its blocks
        with it); here the map itself in fp32, subclasses add their activations."""
        return self.cost_heads * height * width * FLOAT_BYTES


class CostPerceiverEncoder(CostEncoder):
    """The official cost encoder: cost maps [B*H1*W1, heads, H2, W2] (+ context [B, Cc, H1, W1]) -> cost memory
    [B*H1*W1, K, D].

    Patch tokens of width `cost_patch_dim` + `patch_pe_dim` (0: no code); K = `num_latent_tokens` latent
    codewords of width D = `latent_dim`; `agt_depth` AGT layers (0: the latent tokens go straight to the
    residual), each an intra-cost-map layer over the K tokens of one source pixel (`intra_layer`, INTRA_LAYERS:
    self-attention, an MLP-Mixer block or none), then an inter-cost-map layer over the source grid per latent
    slot (`inter_layer`, INTER_LAYERS: LSA + GSA with `context_proj_dim` channels of projected context (0:
    context-free, FlowFormer-small), a ConvNeXt stack (no context) or none). `agt_pe`: the LSA and GSA carry
    their sine codes; `gsa_key_pe`: the GSA keys carry one too.
    """

    supports_activation_budget = True

    def __init__(
        self,
        *,
        cost_heads: int,
        cost_patch_dim: int,
        patch_pe_dim: int,
        num_latent_tokens: int,
        latent_dim: int,
        agt_depth: int,
        context_dim: int,
        context_proj_dim: int,
        gsa_key_pe: bool,
        intra_layer: str = "transformer",
        inter_layer: str = "transformer",
        agt_pe: bool = True,
        tokenize_chunk: int | None = None,
        checkpoint_tokenize: bool = False,
        checkpoint_layers: bool = False,
    ) -> None:
        super().__init__()
        if tokenize_chunk is not None and tokenize_chunk < 1:
            raise ValueError(
                f"backbone.tokenize_chunk must be a positive number of cost maps or null, got {tokenize_chunk}"
            )
        self.cost_heads = cost_heads
        self.num_latent_tokens = num_latent_tokens
        self.latent_dim = latent_dim
        self.agt_depth = agt_depth
        self.tokenize_chunk = tokenize_chunk
        self.checkpoint_tokenize = checkpoint_tokenize
        self.checkpoint_layers = checkpoint_layers
        self.patch_embed = PatchEmbed(cost_heads=cost_heads, cost_patch_dim=cost_patch_dim, patch_pe_dim=patch_pe_dim)
        self.latent_tokens = nn.Parameter(torch.randn(1, num_latent_tokens, latent_dim))
        self.input_layer = LatentCrossAttention(dim=latent_dim, token_dim=cost_patch_dim + patch_pe_dim)
        # one module per AGT layer in each half; a half that is "none" keeps its list empty
        self.encoder_layers = nn.ModuleList(
            [_intra_layer(intra_layer, num_tokens=num_latent_tokens, dim=latent_dim) for _ in range(agt_depth)]
            if intra_layer != "none"
            else []
        )
        inter = {"context_dim": context_dim, "context_proj_dim": context_proj_dim, "key_pe": gsa_key_pe}
        self.vertical_encoder_layers = nn.ModuleList(
            [_inter_layer(inter_layer, dim=latent_dim, agt_pe=agt_pe, **inter) for _ in range(agt_depth)]
            if inter_layer != "none"
            else []
        )

    def pixel_row_bytes(self) -> int:
        """Upper estimate of the transient fp32 activations of an intra-cost-map layer per source pixel (one
        [K, D] row): 12 K·D for the normed input, q, k, v, attention output, projection and the FFN's tensors
        (ample for the Mixer's 4x token and channel MLPs too), and the [heads, K, K] logits with their
        softmax."""
        k, d = self.num_latent_tokens, self.latent_dim
        return (12 * k * d + 2 * HEADS * k * k) * FLOAT_BYTES

    def latent_row_bytes(self, h1: int, w1: int) -> int:
        """Upper estimate of the transient fp32 activations of an inter-cost-map layer (LSA or GSA block) per
        latent row [H1·W1, D]: about 16 D per position for the padded copies, q, k, v, outputs and the 4x MLP's
        hidden layer and its GELU. Both attentions are fused (`softmax_attention`): their logits are never held.
        A ConvNeXt block holds about 14 D (the maps in and out, its conv, norm, 4x MLP with GELU, layer scale)."""
        return h1 * w1 * 16 * self.latent_dim * FLOAT_BYTES

    def cost_map_bytes(self, height: int, width: int) -> int:
        return self.patch_embed.activation_bytes(height, width)

    def _tokenize_rows(self, cost_maps: Tensor, removed: Tensor | None, ids_keep: Tensor | None) -> Tensor:
        tokens, _ = self.patch_embed(cost_maps, removed)  # [n, heads, H2, W2] -> [n, H3*W3, T]
        return self.input_layer(self.latent_tokens, tokens, ids_keep)  # -> [n, K, D]

    def tokenize(self, cost: Tensor | CostVolume, token_mask: TokenMask | None = None) -> Tensor:
        """Patchify + latent summary, cost maps [N, heads, H2, W2] -> [N, K, D]; every row is independent.

        The patchify activations are the network's largest (about 15 GB per 432x960 training sample, measured
        with the official code on CPU). Rows are processed in blocks of at most `tokenize_chunk` and of the cost
        volume's `block_rows` (a FeatureCostVolume computes only that many cost maps at a time), and
        `checkpoint_tokenize` recomputes each block in the backward pass instead of storing its activations.
        Blocks give the same numbers as one pass.
        """
        cost = as_cost_volume(cost)
        chunk = min(self.tokenize_chunk or cost.num_rows, cost.block_rows)
        pieces = []
        for part, maps in cost.row_blocks(chunk):
            args = (
                maps,
                None if token_mask is None else token_mask.removed[part],
                None if token_mask is None else token_mask.ids_keep[part],
            )
            pieces.append(recomputed_in_backward(self.checkpoint_tokenize, self._tokenize_rows, *args))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def forward(
        self,
        cost: Tensor | CostVolume,
        context: Tensor,
        token_mask: TokenMask | None = None,
        activation_budget: int | None = None,
    ) -> Tensor:
        """cost: the volume [B*H1*W1, heads, H2, W2] or a CostVolume -> cost memory [B*H1*W1, K, D].

        activation_budget: bytes for the transient activations of each AGT layer (None: every row at once, the
        official computation). The intra-cost-map layers then run over blocks of source pixels and the
        inter-cost-map layers over blocks of the latent rows of one image; every row is computed as in one
        pass. `checkpoint_layers` recomputes each layer's (each block's) activations in the backward pass."""
        batch, _, h1, w1 = context.shape
        x = self.tokenize(cost, token_mask)
        shortcut = x  # [B*H1*W1, K, D]
        pixel_rows = latent_rows = None
        if activation_budget is not None:
            pixel_rows = max(1, activation_budget // self.pixel_row_bytes())
            latent_rows = max(1, activation_budget // self.latent_row_bytes(h1, w1))
        for depth in range(self.agt_depth):
            if self.encoder_layers:
                x = _in_row_blocks(self.encoder_layers[depth], x, pixel_rows, self.checkpoint_layers)
            if self.vertical_encoder_layers:
                inter = self.vertical_encoder_layers[depth]
                # row b*K + k holds slot k of every source pixel of image b
                x = rearrange(x, "(b n) k d -> (b k) n d", b=batch)  # -> [B*K, H1*W1, D]
                x = _inter_in_row_blocks(inter, x, (h1, w1), context, latent_rows, self.checkpoint_layers)
                x = rearrange(x, "(b k) n d -> (b n) k d", b=batch)  # -> [B*H1*W1, K, D]
        return x + shortcut


def _intra_layer(kind: str, *, num_tokens: int, dim: int) -> nn.Module:
    """One intra-cost-map layer of `kind` ("transformer" | "mlp"), [N, K, D] -> [N, K, D]."""
    if kind == "mlp":
        return MixerLayer(num_tokens=num_tokens, dim=dim)
    return SelfAttentionLayer(dim=dim)


def _inter_layer(
    kind: str, *, dim: int, context_dim: int, context_proj_dim: int, key_pe: bool, agt_pe: bool
) -> nn.Module:
    """One inter-cost-map layer of `kind` ("transformer" | "convnext"), [B*K, H1*W1, D] -> same."""
    if kind == "convnext":
        return ConvNextLayer(dim=dim)
    return VerticalSelfAttentionLayer(
        dim=dim, context_dim=context_dim, context_proj_dim=context_proj_dim, key_pe=key_pe, agt_pe=agt_pe
    )


def _in_row_blocks(layer: nn.Module, x: Tensor, rows: int | None, recompute: bool) -> Tensor:
    """layer over x [R, ...] in blocks of at most `rows` rows (None: at once); rows are independent. recompute:
    each block's activations are recomputed in backward instead of kept."""
    if rows is None or rows >= x.shape[0]:
        return recomputed_in_backward(recompute, layer, x)
    return torch.cat([recomputed_in_backward(recompute, layer, part) for part in x.split(rows)])


def _inter_in_row_blocks(
    layer: nn.Module, x: Tensor, size: tuple[int, int], context: Tensor, rows: int | None, recompute: bool
) -> Tensor:
    """An inter-cost-map layer over x [B*K, H1*W1, D] with context [B, C, H1, W1], in blocks of at most `rows`
    latent rows of one image, each with its own image's context [1, C, H1, W1]; None: all rows at once."""
    if rows is None or rows >= x.shape[0]:
        return recomputed_in_backward(recompute, layer, x, size, context)
    per_image = x.shape[0] // context.shape[0]
    return torch.cat(
        [
            _in_row_blocks(lambda part, own=own: layer(part, size, own), image_rows, rows, recompute)
            for image_rows, own in zip(x.split(per_image), context.split(1))
        ]
    )


class MixerLayer(nn.Module):
    """The paper's intra-cost-map ablation ("Transformer v.s. MLP&Conv in AGT", Intra. = MLP; the official
    `use_mlp`, `MLPMixerLayer`): an MLP-Mixer block over the K tokens of one source pixel, [N, K, D] -> [N, K, D]:
    a token-mixing MLP across the K tokens, then a channel-mixing MLP across D, each pre-norm (LayerNorm eps 1e-5)
    and residual, hidden width 4x. Not timm's MixerBlock: it sizes the token MLP's hidden width from D, not from
    K (official 4K), and its norms use eps 1e-6."""

    def __init__(self, *, num_tokens: int, dim: int, expansion: int = 4) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = Mlp(dim=num_tokens, hidden=expansion * num_tokens)
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = Mlp(dim=dim, hidden=expansion * dim)

    def forward(self, x: Tensor) -> Tensor:
        mixed = self.token_mlp(rearrange(self.norm1(x), "n k d -> n d k"))  # mixes the K tokens
        x = x + rearrange(mixed, "n d k -> n k d")
        return x + self.channel_mlp(self.norm2(x))


class ConvNextLayer(nn.Module):
    """The paper's inter-cost-map ablation ("Transformer v.s. MLP&Conv in AGT", Inter. = Conv; the official
    `vertical_conv`, `ConvNextLayer`): CONVNEXT_BLOCKS ConvNeXt blocks (7x7 depthwise conv, channels-last
    LayerNorm eps 1e-6, 4x MLP with GELU, layer scale from 1e-6, residual) over each latent slot's D-channel map
    of the source grid; it reads neither the context nor a positional code. timm's ConvNeXtBlock computes the
    official block (its defaults: eps 1e-6, no drop path).

    x [B*K, H1*W1, D] (row b*K + k: slot k of image b) -> same; rows are independent.
    """

    def __init__(self, *, dim: int) -> None:
        # timm (about a second to import) only where this ablation is built
        from timm.models.convnext import ConvNeXtBlock

        super().__init__()
        self.net = nn.Sequential(
            *[
                ConvNeXtBlock(dim, kernel_size=CONVNEXT_KERNEL, ls_init_value=CONVNEXT_LAYER_SCALE)
                for _ in range(CONVNEXT_BLOCKS)
            ]
        )

    def forward(self, x: Tensor, size: tuple[int, int], context: Tensor | None) -> Tensor:
        height, width = size
        maps = rearrange(x, "r (h w) d -> r d h w", h=height, w=width)  # -> [B*K, D, H1, W1]
        return rearrange(self.net(maps), "r d h w -> r (h w) d")  # -> [B*K, H1*W1, D]
