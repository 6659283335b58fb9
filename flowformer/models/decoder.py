"""Recurrent cost-memory decoder: cost queries, GMA motion aggregation (optional, the official `gma`), SepConvGRU,
convex upsampling (official `core/FlowFormer/LatentCostFormer/decoder.py`, `MemoryDecoder`), plus FlowFormer++'s
reconstruction head (`PerCostFormer3/decoder.py`, `pretrain_head`). Official module names, so checkpoints load.
The refinement loop (`RecurrentRefinement`) is shared with RAFT's decoder (flowformer/models/raft_decoder.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from flowformer.models.cost_volume import CostVolume, as_cost_volume
from flowformer.models.layers import (
    CONVEX_UPSAMPLE_VALUES_PER_PIXEL,
    convolution_layout,
    coords_grid,
    feed_forward,
    in_layout,
    linear_position_encoding,
    multi_head_attention,
    recomputed_in_backward,
    split_heads,
    upsample_flow_convex,
)
from flowformer.models.memory_plan import FLOAT_BYTES

QUERY_RADIUS = 4  # 9x9 cost crop around the current target position
HEADS = 8


class CostQueryAttention(nn.Module):
    """A cost query attends to the K memory tokens of its own source pixel (official `cross_attend`).

    query [N, 1, Q], coords [B, 2, H1, W1] with N = B*H1*W1, memory keys/values [N, heads, K, Q/heads]
    (`MemoryDecoder.memory_kv`) -> [N, 1, Q].
    `decoder_query="crop_and_pe"`: q = Linear(LN(query) + PE(coords)) (official `add_flow_token` /
    `flow_or_pe="and"`); `"pe"`: q = Linear(PE(coords)) (the MCVA ablation).
    FlowFormer projects cat[attn, query] (proj 2Q -> Q); FlowFormer++ projects attn only (Q -> Q).
    """

    def __init__(self, *, query_dim: int, memory_dim: int, concat_shortcut: bool, decoder_query: str) -> None:
        super().__init__()
        if decoder_query not in ("crop_and_pe", "pe"):
            raise ValueError(f"backbone.decoder_query must be 'crop_and_pe' or 'pe', got {decoder_query!r}")
        self.query_dim, self.concat_shortcut, self.decoder_query = query_dim, concat_shortcut, decoder_query
        self.norm1 = nn.LayerNorm(query_dim)
        self.norm2 = nn.LayerNorm(query_dim)
        self.q = nn.Linear(query_dim, query_dim)
        self.k = nn.Linear(memory_dim, query_dim)
        self.v = nn.Linear(memory_dim, query_dim)
        self.proj = nn.Linear(2 * query_dim if concat_shortcut else query_dim, query_dim)
        self.ffn = feed_forward(query_dim)

    def forward(self, query: Tensor, coords: Tensor, key: Tensor, value: Tensor) -> Tensor:
        batch, _, h1, w1 = coords.shape
        points = coords.permute(0, 2, 3, 1).reshape(batch * h1 * w1, 1, 2)  # [N, 1, (x, y)]
        pe = linear_position_encoding(points, self.query_dim)
        q_in = pe if self.decoder_query == "pe" else self.norm1(query) + pe
        x = multi_head_attention(split_heads(self.q(q_in), HEADS), key, value)
        x = self.proj(torch.cat([x, query], dim=2) if self.concat_shortcut else x)
        x = query + x
        return x + self.ffn(self.norm2(x))


class MemoryDecoderLayer(nn.Module):
    """Holder that gives the cost-query attention its official key prefix `decoder_layer.cross_attend.`."""

    def __init__(self, *, query_dim: int, memory_dim: int, concat_shortcut: bool, decoder_query: str) -> None:
        super().__init__()
        self.cross_attend = CostQueryAttention(
            query_dim=query_dim,
            memory_dim=memory_dim,
            concat_shortcut=concat_shortcut,
            decoder_query=decoder_query,
        )


class RelPosEmb(nn.Module):
    """GMA's relative position embedding: the official code constructs it (so checkpoints hold it) but never
    calls it."""

    def __init__(self, *, max_pos_size: int = 160, dim_head: int = 128) -> None:
        super().__init__()
        self.rel_height = nn.Embedding(2 * max_pos_size - 1, dim_head)
        self.rel_width = nn.Embedding(2 * max_pos_size - 1, dim_head)
        deltas = torch.arange(max_pos_size).view(1, -1) - torch.arange(max_pos_size).view(-1, 1)
        self.register_buffer("rel_ind", deltas + max_pos_size - 1)


class GMAAttention(nn.Module):
    """Global motion attention from the context: inp [B, dim, H1, W1] -> softmax map [B, 1, H1*W1, H1*W1].

    q is scaled by dim^-0.5 before the product (GMA convention). Logits and softmax run in fp32.
    """

    def __init__(self, *, dim: int) -> None:
        super().__init__()
        self.scale = dim**-0.5
        self.to_qk = nn.Conv2d(dim, 2 * dim, 1, bias=False)
        self.pos_emb = RelPosEmb(dim_head=dim)

    def forward(
        self, fmap: Tensor, query_chunk: int | None = None
    ) -> Tensor | CastOnceAttention | ChunkedAttention:
        """The softmax map [B, 1, HW, HW] in to_qk's dtype (training under autocast: a CastOnceAttention); with
        `query_chunk`, the (q, k) it is made of, applied in chunks of that many query pixels when aggregating
        (the map grows with (H/8·W/8)²)."""
        batch, _, height, width = fmap.shape
        qk = self.to_qk(fmap)
        q, k = qk.float().chunk(2, dim=1)
        q = (self.scale * q).view(batch, 1, -1, height * width).transpose(-2, -1)  # [B, 1, HW, C]
        k = k.view(batch, 1, -1, height * width)  # [B, 1, C, HW]
        if query_chunk is not None:
            return ChunkedAttention(q, k, query_chunk)
        with torch.autocast(device_type=fmap.device.type, enabled=False):
            attention = (q @ k).softmax(dim=-1)
        # Every iteration's aggregation reads the map in to_qk's dtype (bf16 under autocast): cast once here.
        if attention.dtype == qk.dtype:
            return attention
        return CastOnceAttention(attention, qk.dtype) if torch.is_grad_enabled() else attention.to(qk.dtype)


class _ReadCast(torch.autograd.Function):
    """One reader of `cast`, made beforehand as source.to(cast.dtype) for many readers: forward gives the cast
    (nothing copied), backward casts this reader's gradient to source's dtype, as the reader's own
    `source.to(...)` would (ToCopyBackward)."""

    @staticmethod
    def forward(ctx: Any, source: Tensor, cast: Tensor) -> Tensor:
        ctx.source_dtype = source.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.source_dtype), None


class CastOnceAttention:
    """The softmax map [B, 1, HW, HW] (fp32) of a training forward under autocast, cast once to `dtype` for all
    the iterations that aggregate with it. Each iteration reads the cast through `_ReadCast`, so its gradient is
    cast back to fp32 and the sum over the iterations accumulates in fp32, as with a cast per iteration: the same
    numbers bitwise, one cast a forward instead of one an iteration, and one copy kept for backward instead of
    one an iteration (130 MB each for a batch of 8 at 368x496 in bf16)."""

    def __init__(self, attention: Tensor, dtype: torch.dtype) -> None:
        self.attention = attention
        self.cast = attention.detach().to(dtype)

    def apply(self, v: Tensor) -> Tensor:
        """v [B, 1, HW, Cv] (in the cast's dtype) -> attention @ v [B, 1, HW, Cv]."""
        return _ReadCast.apply(self.attention, self.cast) @ v


class ChunkedAttention:
    """softmax(q k) applied to values without holding the whole map: q [B, 1, HW, C], k [B, 1, C, HW]."""

    def __init__(self, q: Tensor, k: Tensor, query_chunk: int) -> None:
        self.q, self.k, self.query_chunk = q, k, query_chunk

    def apply(self, v: Tensor) -> Tensor:
        """v [B, 1, HW, Cv] -> softmax(q k) v [B, 1, HW, Cv], logits and softmax in fp32 as the dense map."""
        pieces = []
        for q in self.q.split(self.query_chunk, dim=-2):
            with torch.autocast(device_type=q.device.type, enabled=False):
                attention = (q @ self.k).softmax(dim=-1)
            pieces.append(attention.to(v.dtype) @ v)
        return torch.cat(pieces, dim=-2)


class Aggregate(nn.Module):
    """motion [B, dim, H, W] + gamma · (attention @ to_v(motion))."""

    def __init__(self, *, dim: int) -> None:
        super().__init__()
        self.to_v = nn.Conv2d(dim, dim, 1, bias=False)
        self.gamma = nn.Parameter(torch.zeros(1))

    def forward(self, attention: Tensor | CastOnceAttention | ChunkedAttention, fmap: Tensor) -> Tensor:
        batch, channels, height, width = fmap.shape
        v = self.to_v(fmap).view(batch, 1, channels, height * width).transpose(-2, -1)  # [B, 1, HW, C]
        if isinstance(attention, Tensor):
            out = (attention if attention.dtype == v.dtype else attention.to(v.dtype)) @ v
        else:
            out = attention.apply(v)
        out = out.transpose(-2, -1).reshape(batch, channels, height, width)
        return fmap + self.gamma * out


class MotionEncoder(nn.Module):
    """Official `BasicMotionEncoder`: (flow [B,2,H,W], corr [B,Cc,H,W]) -> motion features [B, dim, H, W].

    Its widths are the official ones (256, 192, 128, 64, 126 for dim 128) scaled with dim."""

    def __init__(self, *, corr_dim: int, dim: int) -> None:
        super().__init__()
        self.convc1 = nn.Conv2d(corr_dim, 2 * dim, 1)
        self.convc2 = nn.Conv2d(2 * dim, 3 * dim // 2, 3, padding=1)
        self.convf1 = nn.Conv2d(2, dim, 7, padding=3)
        self.convf2 = nn.Conv2d(dim, dim // 2, 3, padding=1)
        self.conv = nn.Conv2d(dim // 2 + 3 * dim // 2, dim - 2, 3, padding=1)

    def forward(self, flow: Tensor, corr: Tensor) -> Tensor:
        cor = F.relu(self.convc2(F.relu(self.convc1(corr))))
        flo = F.relu(self.convf2(F.relu(self.convf1(flow))))
        out = F.relu(self.conv(torch.cat([cor, flo], dim=1)))
        return torch.cat([out, flow], dim=1)


def same_padding(weight: Tensor) -> tuple[int, int]:
    """The padding that keeps a stride-1 convolution's odd kernel [.., kh, kw] on the input's size."""
    return weight.shape[-2] // 2, weight.shape[-1] // 2


class GRUPass(NamedTuple):
    """One pass of `SepConvGRU` for one forward: its gates' weights split by what they read, and the share of
    the gates that the context input gives (`SepConvGRU.read_context`)."""

    context_gates: Tensor  # [B, 3*hidden, H, W]: z, r and q's convolutions of the context input, with the biases
    input_weight: Tensor  # [3*hidden, input_dim - context_dim, kh, kw]: z, r and q's over the iteration's input
    state_weight: Tensor  # [2*hidden, hidden, kh, kw]: z and r's over the state h
    reset_weight: Tensor  # [hidden, hidden, kh, kw]: q's over r*h


class SepConvGRU(nn.Module):
    """GRU with a horizontal (1x5) then a vertical (5x1) pass over the state h and the input
    x = cat[context input, the iteration's input] (`context_dim` channels and the rest).

    The official GRU convolves cat[h, x] once per gate. A convolution of concatenated channels is the sum of the
    convolutions of its parts, so each gate here sums the convolutions of the parts with the matching slices of
    its weights: the context input is the same at every iteration of a forward, and its share of the six gates
    is convolved once per forward (`read_context`); no iteration concatenates. The same numbers to float
    rounding (docs/departures.md); the official modules and keys (convz1 ... convq2) hold the weights."""

    def __init__(self, *, hidden: int, input_dim: int, context_dim: int) -> None:
        super().__init__()
        c = hidden + input_dim
        self.context_dim = context_dim
        self.convz1 = nn.Conv2d(c, hidden, (1, 5), padding=(0, 2))
        self.convr1 = nn.Conv2d(c, hidden, (1, 5), padding=(0, 2))
        self.convq1 = nn.Conv2d(c, hidden, (1, 5), padding=(0, 2))
        self.convz2 = nn.Conv2d(c, hidden, (5, 1), padding=(2, 0))
        self.convr2 = nn.Conv2d(c, hidden, (5, 1), padding=(2, 0))
        self.convq2 = nn.Conv2d(c, hidden, (5, 1), padding=(2, 0))

    def read_context(
        self, context: Tensor, layout: torch.memory_format = torch.contiguous_format
    ) -> tuple[GRUPass, GRUPass]:
        """The two passes for one forward from the context input [B, context_dim, H, W]: the weights' slices in
        `layout` (the inputs' memory format, so no call reorders them) and, under autocast, in its dtype (cast
        once per forward, not at every iteration's call), and the context's share of the gates."""
        device_type = context.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        hidden, split = self.convz1.out_channels, self.convz1.out_channels + self.context_dim
        gates_zr, gate_q, every = slice(0, 2 * hidden), slice(2 * hidden, None), slice(None)
        state, own, rest = slice(0, hidden), slice(hidden, split), slice(split, None)  # columns: h | context | rest
        passes = []
        for convs in ((self.convz1, self.convr1, self.convq1), (self.convz2, self.convr2, self.convq2)):
            weight = torch.cat([conv.weight for conv in convs])  # [3*hidden, hidden + input_dim, kh, kw]: z, r, q
            bias = torch.cat([conv.bias for conv in convs])  # [3*hidden]
            if dtype is not None:
                weight, bias = weight.to(dtype), bias.to(dtype)
            context_weight, input_weight, state_weight, reset_weight = (
                weight[rows, columns].contiguous(memory_format=layout)
                for rows, columns in ((every, own), (every, rest), (gates_zr, state), (gate_q, state))
            )
            context_gates = F.conv2d(context, context_weight, bias, padding=same_padding(context_weight))
            passes.append(GRUPass(context_gates, input_weight, state_weight, reset_weight))
        return passes[0], passes[1]

    def forward(self, h: Tensor, passes: tuple[GRUPass, GRUPass], x: Tensor) -> Tensor:
        """h [B, hidden, H, W] and the iteration's input x [B, input_dim - context_dim, H, W] -> the new h."""
        # Under autocast h is bf16 and x fp32 (it holds the raw flow): cast x once, not at each convolution.
        if x.dtype != h.dtype:
            x = x.to(h.dtype)
        hidden = h.shape[1]
        for gates in passes:
            padding = same_padding(gates.state_weight)
            from_input = F.conv2d(x, gates.input_weight, padding=padding) + gates.context_gates  # [B, 3*hidden]
            zr_input, q_input = from_input.split([2 * hidden, hidden], dim=1)
            z, r = torch.sigmoid(zr_input + F.conv2d(h, gates.state_weight, padding=padding)).chunk(2, dim=1)
            q = torch.tanh(q_input + F.conv2d(r * h, gates.reset_weight, padding=padding))
            h = torch.lerp(h, q, z)  # (1 - z) h + z q in one operator where the official code takes four
        return h


class FlowHead(nn.Module):
    """GRU state [B, hidden, H, W] -> flow update [B, 2, H, W] (official width 256 for hidden 128)."""

    def __init__(self, *, hidden: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(hidden, 2 * hidden, 3, padding=1)
        self.conv2 = nn.Conv2d(2 * hidden, 2, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(F.relu(self.conv1(x)))


class UpdateBlock(nn.Module):
    """One refinement step: (net, the GRU's passes, corr, flow, attention) -> (net, up_mask [B,576,H,W],
    delta [B,2,H,W]);
    up_mask is None when `with_mask` is false (an iteration whose full-resolution flow is not wanted).

    global_motion: GMA's aggregation of the motion features over the context's attention joins the GRU input
    (official `GMAUpdateBlock`, `gma` true); without it the GRU reads the context and the motion features only
    and there is no `aggregator` (official `BasicUpdateBlock`, RAFT's update block; attention must be None)."""

    def __init__(self, *, corr_dim: int, hidden: int, global_motion: bool) -> None:
        super().__init__()
        self.encoder = MotionEncoder(corr_dim=corr_dim, dim=hidden)
        # GRU input: context, motion (and aggregated motion)
        self.gru = SepConvGRU(hidden=hidden, input_dim=(3 if global_motion else 2) * hidden, context_dim=hidden)
        self.flow_head = FlowHead(hidden=hidden)
        # 8x8 convex-combination weights over a 3x3 neighbourhood; official width 256 for hidden 128
        self.mask = nn.Sequential(
            nn.Conv2d(hidden, 2 * hidden, 3, padding=1), nn.ReLU(), nn.Conv2d(2 * hidden, 64 * 9, 1)
        )
        if global_motion:
            self.aggregator = Aggregate(dim=hidden)

    def read_context(self, net: Tensor, inp: Tensor) -> tuple[Tensor, tuple[GRUPass, GRUPass]]:
        """Once before the iterations, from the GRU state net and the context input inp (each [B, hidden, H, W]):
        the state in the block's layout, as every iteration returns it (a compiled iteration then sees one
        stride, not a second graph for the first iteration), and the GRU's passes (`SepConvGRU.read_context`)."""
        layout = convolution_layout(inp.device)
        if layout is None:
            return net, self.gru.read_context(inp)
        return in_layout(net, layout), self.gru.read_context(in_layout(inp, layout), layout)

    def forward(
        self,
        net: Tensor,
        gru_passes: tuple[GRUPass, GRUPass],
        corr: Tensor,
        flow: Tensor,
        attention: Tensor | CastOnceAttention | ChunkedAttention | None,
        with_mask: bool = True,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """gru_passes: `read_context` of this forward's context input."""
        layout = convolution_layout(net.device)
        if layout is not None:
            net, corr, flow = (in_layout(t, layout) for t in (net, corr, flow))
        motion = self.encoder(flow, corr)
        # the GRU's input after the context: motion (and aggregated motion)
        gru_input = motion if attention is None else torch.cat([motion, self.aggregator(attention, motion)], dim=1)
        net = self.gru(net, gru_passes, gru_input)
        # 0.25 scales the mask logits "to balance gradients", as the official update blocks do
        return net, 0.25 * self.mask(net) if with_mask else None, self.flow_head(net)


class ReconstructionHead(nn.Sequential):
    """FlowFormer++'s MCVA reconstruction MLP, `recon_head_depth` 1x1 convs with GELU between:
    cost_global [B, Q, H1, W1] -> [B, recon_size², H1, W1]. Depth 3 and recon_size 15 are the official
    `pretrain_head` (Q -> 2Q -> 2Q -> 225, `gt_r = 15`)."""

    def __init__(self, *, query_dim: int, recon_size: int, recon_head_depth: int) -> None:
        if recon_head_depth < 1:
            raise ValueError(f"backbone.recon_head_depth must be >= 1, got {recon_head_depth}")
        widths = [query_dim] + [2 * query_dim] * (recon_head_depth - 1) + [recon_size**2]
        layers: list[nn.Module] = []
        for i in range(recon_head_depth):
            if i > 0:
                layers.append(nn.GELU())
            layers.append(nn.Conv2d(widths[i], widths[i + 1], 1))
        super().__init__(*layers)
        self.recon_size = recon_size


class RecurrentRefinement(nn.Module):
    """The refinement loop both decoders run (RAFT's, with GMA's motion attention when `att` exists): from the
    context's GRU state and input, each iteration reads correlation features at the current target positions,
    the update block turns them into a flow update, and convex upsampling gives the full-resolution flow.

    A subclass sets `update_block` (an UpdateBlock), `att` (a GMAAttention, only with global motion),
    `decoder_dim` and `checkpoint_iterations`, and says how the context becomes the GRU state and input
    (`split_context`) and what an iteration reads at the target positions (`correlation`).

    One iteration is one method (`iteration`) of tensors, the cost source and two flags, so `compile_iteration`
    compiles it once for every iteration and every forward of the same shapes (a second graph for the
    upsampling iteration when the others skip it)."""

    decoder_dim: int
    checkpoint_iterations: bool
    kind = "cost memory decoder"
    min_image_side = 0  # the image encoders' limits are the decoder's
    compiled_iteration: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor | None]] | None = None

    def split_context(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """context [B, C, H1, W1] -> (GRU state, GRU context input), each [B, decoder_dim, H1, W1]."""
        raise NotImplementedError

    def correlation(self, source: Any, coords1: Tensor) -> Tensor:
        """The update block's correlation input [B, corr_dim, H1, W1] read from `source` (what the subclass's
        forward passes to `refine`) at the target positions coords1 [B, 2, H1, W1]."""
        raise NotImplementedError

    def compile_iteration(self, backend: str, mode: str, own_outputs: bool = False) -> None:
        """torch.compile `iteration` (`runtime.compile`) for static shapes: `refine` then runs every iteration
        compiled.
        own_outputs (under CUDA graphs): each iteration's outputs are copied out of the graph's memory, which its
        next replay overwrites while the next iteration reads them and the training loss keeps them."""
        compiled = torch.compile(self.iteration, backend=backend, mode=mode, dynamic=False)
        if not own_outputs:
            self.compiled_iteration = compiled
            return

        def iteration_with_own_outputs(*args: Any) -> tuple[Tensor | None, ...]:
            return tuple(None if output is None else output.clone() for output in compiled(*args))

        self.compiled_iteration = iteration_with_own_outputs

    def iteration(
        self,
        source: Any,
        net: Tensor,
        gru_passes: tuple[GRUPass, GRUPass],
        attention: Tensor | CastOnceAttention | ChunkedAttention | None,
        coords0: Tensor,
        coords1: Tensor,
        upsample: bool,
        upsample_rows: int | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """One refinement iteration: the correlation at coords1, the update block, the flow update and (with
        `upsample`) the convex upsampling of upsample_rows rows at a time
        -> (GRU state, coords1, flow_low [B, 2, H1, W1], flow_up [B, 2, H, W] or None)."""
        flow = coords1 - coords0
        net, up_mask, delta = self.update_block(
            net, gru_passes, self.correlation(source, coords1), flow, attention, with_mask=upsample
        )
        coords1 = coords1 + delta  # fp32: a bf16 delta is promoted exactly
        flow_low = coords1 - coords0
        flow_up = upsample_flow_convex(flow_low, up_mask.float(), upsample_rows) if upsample else None
        return net, coords1, flow_low, flow_up

    def refine(
        self,
        source: Any,
        context: Tensor,
        iters: int,
        flow_init: Tensor | None,
        query_chunk: int | None,
        upsample_all: bool,
        activation_budget: int | None,
    ) -> list[tuple[Tensor | None, Tensor]]:
        """-> (flow_up [B, 2, H, W], flow_low [B, 2, H1, W1]) per iteration; flow_up only for the last one
        unless `upsample_all`. source: what `correlation` reads (the cost memory's keys and values with the
        cost volume, or RAFT's cost pyramid). The other arguments: `MemoryDecoder.forward`."""
        if iters < 1:
            raise ValueError(f"the decoder needs at least one refinement iteration (iters), got {iters}")
        batch, _, h1, w1 = context.shape
        coords0 = coords_grid(batch, h1, w1, device=context.device)
        coords1 = coords0.clone()
        if flow_init is not None:
            if flow_init.shape != coords0.shape:
                raise ValueError(
                    f"flow_init must be [B, 2, H/8, W/8] = {tuple(coords0.shape)} (1/8-res pixels), "
                    f"got {tuple(flow_init.shape)}"
                )
            coords1 = coords1 + flow_init
        net, inp = self.split_context(context)
        attention = self.att(inp, query_chunk) if hasattr(self, "att") else None
        net, gru_passes = self.update_block.read_context(net, inp)
        upsample_rows = None
        if activation_budget is not None:
            row_bytes = batch * w1 * CONVEX_UPSAMPLE_VALUES_PER_PIXEL * FLOAT_BYTES
            upsample_rows = max(1, activation_budget // row_bytes)
        step = self.compiled_iteration or self.iteration
        outputs = []
        for iteration in range(iters):
            upsample = upsample_all or iteration == iters - 1
            net, coords1, flow_low, flow_up = recomputed_in_backward(
                self.checkpoint_iterations, step, source, net, gru_passes, attention, coords0, coords1.detach(), upsample,
                upsample_rows,
            )
            outputs.append((flow_up, flow_low))
        return outputs


class MemoryDecoder(RecurrentRefinement):
    """Iterative flow decoding from the cost memory [B*H1*W1, K, memory_dim] (the paper's cost memory decoder,
    CMD); with `recon_size`, also FlowFormer++'s reconstruction head (`recon_size` None: no head, FlowFormer).
    decoder_dim: the width of the recurrent part (GRU state, context input, motion features; official 128).
    global_motion: GMA's motion aggregation in the update block (official `gma`; `att` exists only with it).
    checkpoint_iterations: each refinement iteration's activations (and each MCVA query round's,
    flowformer/models/mcva.py) are recomputed in the backward pass instead of kept."""

    def __init__(
        self,
        *,
        context_dim: int,
        memory_dim: int,
        query_dim: int,
        cost_heads: int,
        concat_shortcut: bool,
        decoder_query: str,
        recon_size: int | None,
        recon_head_depth: int,
        decoder_dim: int,
        global_motion: bool = True,
        checkpoint_iterations: bool = False,
    ) -> None:
        super().__init__()
        self.decoder_dim = decoder_dim
        self.cost_heads = cost_heads
        self.checkpoint_iterations = checkpoint_iterations
        crop_dim = cost_heads * (2 * QUERY_RADIUS + 1) ** 2
        self.flow_token_encoder = nn.Sequential(
            nn.Conv2d(crop_dim, query_dim, 1), nn.GELU(), nn.Conv2d(query_dim, query_dim, 1)
        )
        if recon_size is not None:
            self.pretrain_head = ReconstructionHead(
                query_dim=query_dim, recon_size=recon_size, recon_head_depth=recon_head_depth
            )
        self.proj = nn.Conv2d(context_dim, 2 * decoder_dim, 1)
        self.decoder_layer = MemoryDecoderLayer(
            query_dim=query_dim,
            memory_dim=memory_dim,
            concat_shortcut=concat_shortcut,
            decoder_query=decoder_query,
        )
        self.update_block = UpdateBlock(
            corr_dim=query_dim + crop_dim, hidden=decoder_dim, global_motion=global_motion
        )
        if global_motion:
            self.att = GMAAttention(dim=decoder_dim)

    def split_context(self, context: Tensor) -> tuple[Tensor, Tensor]:
        net, inp = torch.split(self.proj(context), [self.decoder_dim, self.decoder_dim], dim=1)
        return torch.tanh(net), torch.relu(inp)

    def memory_kv(self, cost_memory: Tensor) -> tuple[Tensor, Tensor]:
        """cost memory [N, K, D] -> keys, values [N, heads, K, Q/heads], computed once per image pair."""
        attend = self.decoder_layer.cross_attend
        return split_heads(attend.k(cost_memory), HEADS), split_heads(attend.v(cost_memory), HEADS)

    def query(
        self, kv: tuple[Tensor, Tensor], cost: Tensor | CostVolume, coords: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Cost query at coords [B, 2, H1, W1] -> (cost_global [B, Q, H1, W1], crop [B, heads*81, H1, W1])."""
        batch, h1 = coords.shape[0], coords.shape[2]
        crop = as_cost_volume(cost).window(coords, QUERY_RADIUS)
        query = rearrange(self.flow_token_encoder(crop), "b q y x -> (b y x) 1 q")  # -> [B*H1*W1, 1, Q]
        cost_global = self.decoder_layer.cross_attend(query, coords, *kv)
        return rearrange(cost_global, "(b y x) 1 q -> b q y x", b=batch, y=h1), crop  # -> [B, Q, H1, W1]

    def forward(
        self,
        cost_memory: Tensor,
        cost: Tensor | CostVolume,
        context: Tensor,
        iters: int,
        flow_init: Tensor | None = None,
        query_chunk: int | None = None,
        upsample_all: bool = True,
        activation_budget: int | None = None,
    ) -> list[tuple[Tensor | None, Tensor]]:
        """-> (flow_up [B, 2, H, W], flow_low [B, 2, H1, W1]) per iteration; flow_up only for the last one
        unless `upsample_all` (training supervises every iteration; inference reads the last).

        cost: the volume or a CostVolume; query_chunk: aggregate the global motion attention for that many
        pixels at a time (None: hold its whole [B, 1, HW, HW] map); activation_budget: bytes for the convex
        upsampling's weights, spent on blocks of rows (None: the whole image at once)."""
        source = (self.memory_kv(cost_memory), as_cost_volume(cost))
        return self.refine(source, context, iters, flow_init, query_chunk, upsample_all, activation_budget)

    def correlation(self, source: tuple[tuple[Tensor, Tensor], CostVolume], coords1: Tensor) -> Tensor:
        """The cost query and the 9x9 cost crop at coords1 -> [B, Q + heads*81, H1, W1]. Under autocast the crop
        (sampled in fp32) joins the query's output in its dtype: the update block's first convolution reads that
        dtype, so the two are cast once, not the query's output to fp32 and the whole back (the same values)."""
        cost_global, crop = self.query(*source, coords1)
        if crop.dtype != cost_global.dtype:
            crop = crop.to(cost_global.dtype)
        return torch.cat([cost_global, crop], dim=1)
