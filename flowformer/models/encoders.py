"""Image encoders: the first two stages of Twins-SVT-Large (timm) and the GMA/RAFT CNN `BasicEncoder`.

Both map a normalised image [B, 3, H, W] to features [B, feature_dim, H/8, W/8] and say which images they accept:
`kind` names them in messages, `min_image_side` is the smallest image side they take. An encoder with
`supports_activation_budget` also takes `activation_budget` (bytes or None), a bound on its layers' transients.
With `checkpoint_blocks`, training recomputes each block's activations in backward instead of keeping them
(Twins: each transformer block; CNN: each stage of residual blocks), one block at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowformer.models.layers import recomputed_in_backward
from flowformer.models.memory_plan import FLOAT_BYTES

if TYPE_CHECKING:  # timm (about a second to import, with wandb) is imported where a Twins encoder is built
    from timm.models.twins import Block as TwinsBlock

TWINS_DIM = 256  # channels of twins_svt_large's second stage, the official `encoder_latent_dim`
TWINS_LARGE_WIDTHS = (128, TWINS_DIM)  # twins_svt_large's stages 0-1, the widths its ImageNet weights have
TWINS_HEAD_DIM = 32  # channels per attention head in every twins_svt_large stage (128 / 4, 256 / 8)
TWINS_LARGE_FINAL_DIM = 1024  # width of twins_svt_large's last stage, the size of its final `norm`
# backbone.twins_weights value for timm's default twins_svt_large weights (ImageNet-1k, what the official
# code's timm.create_model('twins_svt_large', pretrained=True) loads), downloaded once into timm's cache
IMAGENET = "imagenet"
# backbone.twins_weights value for a fixed initialisation (STANDIN_SEED, not trained) standing in for pretrained
# weights at a width no published weights have: protocol=smoke's tiny Twins, in the rows that start from ImageNet
STANDIN = "standin"
STANDIN_SEED = 0
TWINS_IMAGENET_FILE = "model.safetensors"  # the file timm reads from that Hugging Face repository
_TWINS_NOT_BUILT = (
    "head.",
    "patch_embeds.2.",
    "patch_embeds.3.",
    "blocks.2.",
    "blocks.3.",
    "pos_block.2.",
    "pos_block.3.",
)
# Upper estimate of the fp32 values a Twins block holds at once per token and channel: the normed input, q, k
# and v, the attention output and its projection, the first residual sum, the second norm, the 4x MLP's
# hidden layer and its GELU (8), the MLP output and the second sum (18), and two reshaped copies.
TWINS_BLOCK_VALUES_PER_CHANNEL = 20


class TwinsEncoder(nn.Module):
    """Stages 0 and 1 of timm's `twins_svt_large` (official `core/FlowFormer/encoders.py`, `twins_svt_large`):
    [B,3,H,W] -> [B,widths[-1],H/8,W/8]. `widths`: the two stages' widths (TWINS_LARGE_WIDTHS; a smaller Twins for
    tests and CPU smoke runs, e.g. (32, 64), with one head per TWINS_HEAD_DIM channels as twins_svt_large).

    Only stages 0 and 1 are built (building all four and deleting two cost 0.4 GB of peak memory for nothing);
    there is no head, and `svt.norm` (the LayerNorm 1024 after stage 3) is kept, unused, because the official
    checkpoints contain it. `twins_weights`: None (random weights), `IMAGENET` (timm's ImageNet weights from
    its cache, downloaded there the first time), a local copy of them (`load_imagenet`) or `STANDIN`.

    Images need sides of at least 32 pixels: stage 0's sub-sampled attention runs an 8x8-kernel conv on the
    1/4-resolution tokens (stage 1 a 4x4 one on the 1/8-resolution ones).
    """

    kind = "twins"
    min_image_side = 32
    supports_activation_budget = True

    def __init__(
        self,
        *,
        widths: Sequence[int] = TWINS_LARGE_WIDTHS,
        twins_weights: str | None = None,
        checkpoint_blocks: bool = False,
    ) -> None:
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        self.feature_dim = widths[-1]
        import timm

        standin = twins_weights == STANDIN
        with torch.random.fork_rng(devices=[], enabled=standin):
            if standin:
                torch.manual_seed(STANDIN_SEED)
            # twins_svt_large's settings for its stages 0 and 1 (timm's twins_svt_large: embed dims 128/256,
            # heads 4/8, MLP ratio 4, depth 2 each, LSA window 7, GSA sub-sampling 8/4)
            self.svt = timm.create_model(
                "twins_svt_large",
                pretrained=False,
                embed_dims=list(widths),
                num_heads=[width // TWINS_HEAD_DIM for width in widths],
                mlp_ratios=[4, 4],
                depths=[2, 2],
                wss=[7, 7],
                sr_ratios=[8, 4],
                num_classes=0,
            )
        self.svt.norm = nn.LayerNorm(TWINS_LARGE_FINAL_DIM, eps=1e-6)
        if twins_weights not in (None, STANDIN):
            self.load_imagenet(twins_weights)

    def load_imagenet(self, source: str | Path) -> None:
        """Load timm's ImageNet `twins_svt_large` weights through timm's pretrained-weights loader, from its
        cache (`IMAGENET`: downloaded there once) or from a local file (.safetensors or .pth), ignoring the
        stages not built."""
        import huggingface_hub
        import timm
        from huggingface_hub.errors import LocalEntryNotFoundError

        pretrained_cfg = dict(self.svt.pretrained_cfg)  # timm's default: the Hugging Face hub's in1k weights
        if str(source) != IMAGENET:
            path = Path(source)
            if not path.is_file():
                raise FileNotFoundError(
                    f"backbone.twins_weights: no file at {path}. Point it at a local copy of timm's "
                    f"twins_svt_large ImageNet weights ({imagenet_weights_url()}), set it to {IMAGENET} to "
                    "let timm download them, or to null (random weights)."
                )
            pretrained_cfg["file"] = str(path)
        try:
            # num_classes=0: timm leaves out the classifier; _stages_built checks every other key strictly
            timm.models.load_pretrained(
                self.svt, pretrained_cfg=pretrained_cfg, num_classes=0, filter_fn=_stages_built
            )
        except LocalEntryNotFoundError:
            raise FileNotFoundError(
                f"backbone.twins_weights={IMAGENET}: timm tried to download twins_svt_large's ImageNet "
                f"weights ({imagenet_weights_url()}) but found no network (or the hub unreachable), and they "
                f"are not in its cache ({huggingface_hub.constants.HF_HUB_CACHE}). Download that file on a "
                "machine with a network, copy it to this one and set "
                f"backbone.twins_weights=<path to {TWINS_IMAGENET_FILE}>."
            ) from None

    def forward(self, x: Tensor, activation_budget: int | None = None) -> Tensor:
        """[B, 3, H, W] -> [B, widths[-1], H/8, W/8]. activation_budget (bytes; None: at once) runs each transformer
        block over blocks of token rows (`_block_in_row_blocks`), with the same numbers to float rounding."""
        batch = x.shape[0]
        svt = self.svt
        for embed, drop, blocks, pos_block in zip(svt.patch_embeds, svt.pos_drops, svt.blocks, svt.pos_block):
            x, size = embed(x)  # [B, C, H, W] -> tokens [B, H'*W', C']
            x = drop(x)
            rows = None
            if activation_budget is not None:
                row_bytes = batch * size[1] * x.shape[-1] * TWINS_BLOCK_VALUES_PER_CHANNEL * FLOAT_BYTES
                rows = max(1, activation_budget // row_bytes)
            for j, block in enumerate(blocks):
                x = recomputed_in_backward(self.checkpoint_blocks, _block_in_row_blocks, block, x, size, rows)
                if j == 0:
                    x = pos_block(x, size)  # PEG after the first (LSA) block
            x = x.reshape(batch, *size, -1).permute(0, 3, 1, 2).contiguous()
        return x


def imagenet_weights_url() -> str:
    """Where timm downloads twins_svt_large's ImageNet weights from (its default pretrained config)."""
    import huggingface_hub
    import timm

    hub_id = timm.models.get_pretrained_cfg("twins_svt_large").hf_hub_id
    return huggingface_hub.hf_hub_url(hub_id, TWINS_IMAGENET_FILE)


def _stages_built(state: dict[str, Tensor], svt: nn.Module) -> dict[str, Tensor]:
    """timm's filter_fn for `load_pretrained`: the entries of an ImageNet twins_svt_large state dict (keys
    with or without `svt.`) that stages 0-1 hold, checked to match them exactly."""
    state = {k.removeprefix("svt."): v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith(_TWINS_NOT_BUILT)}
    own = svt.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or mismatched:
        raise ValueError(
            f"backbone.twins_weights does not match twins_svt_large stages 0-1: missing={missing[:10]}, "
            f"unexpected={unexpected[:10]}, shape-mismatched={mismatched[:10]}. Use timm's twins_svt_large "
            f"ImageNet weights ({imagenet_weights_url()})."
        )
    return state


def _block_in_row_blocks(block: TwinsBlock, x: Tensor, size: tuple[int, int], rows: int | None) -> Tensor:
    """A Twins block over tokens x [B, H*W, C] of a size (H, W) grid in blocks of about `rows` token rows
    (None: at once) -> [B, H*W, C].

    Every part of a block but its attention is per token. Locally-grouped attention (LSA) attends within
    ws x ws windows laid from the top-left corner (padding at the bottom and right), so blocks of whole window
    rows hold whole windows. Global sub-sampled attention (GSA) attends from every token to keys that a
    kernel = stride = sr_ratio convolution sums from the whole grid; that convolution runs over blocks of whole
    sr_ratio rows (the rows below the last whole one are dropped either way), and the queries over the blocks.
    Blocks never have fewer rows than a window or an sr_ratio.
    """
    from timm.models.twins import LocallyGroupedAttn

    height, width = size
    attn = block.attn
    stride = attn.ws if isinstance(attn, LocallyGroupedAttn) else attn.sr_ratio
    if rows is None or rows >= height:
        return block(x, size)
    parts = x.split(max(stride, rows // stride * stride) * width, dim=1)
    if isinstance(attn, LocallyGroupedAttn):
        return torch.cat([block(part, (part.shape[1] // width, width)) for part in parts], dim=1)
    keys, values = _gsa_keys_values(block, parts, width)
    return torch.cat([_gsa_block(block, part, keys, values) for part in parts], dim=1)


def _gsa_keys_values(block: TwinsBlock, parts: Sequence[Tensor], width: int) -> tuple[Tensor, Tensor]:
    """GSA's keys and values from token blocks [B, rows*W, C] of whole sr_ratio rows (timm's
    `GlobalSubSampleAttn.forward`) -> each [B, heads, M, C/heads], M the sub-sampled grid's positions."""
    attn = block.attn
    batch, _, channels = parts[0].shape
    pooled = []
    for part in parts:
        normed = block.norm1(part)
        if attn.sr is None:
            pooled.append(normed)
            continue
        part_rows = part.shape[1] // width
        if part_rows < attn.sr_ratio:  # below the last whole sr_ratio rows: the convolution drops them
            continue
        grid = normed.permute(0, 2, 1).reshape(batch, channels, part_rows, width)
        pooled.append(attn.sr(grid).reshape(batch, channels, -1).permute(0, 2, 1))  # -> [B, m, C]
    kv_input = torch.cat(pooled, dim=1)
    if attn.norm is not None:
        kv_input = attn.norm(kv_input)
    kv = attn.kv(kv_input).reshape(batch, -1, 2, attn.num_heads, channels // attn.num_heads)
    keys, values = kv.permute(2, 0, 3, 1, 4).unbind(0)
    return keys, values


def _gsa_block(block: TwinsBlock, part: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """A GSA block (timm's `Block.forward` with `GlobalSubSampleAttn`, no dropout: FlowFormer builds Twins with
    zero drop rates) on token block part [B, n, C] with the whole grid's keys and values -> [B, n, C]."""
    attn = block.attn
    batch, tokens, channels = part.shape
    # norm1 again (the keys needed it too): keeping every block's normed tokens would hold a copy of the grid
    queries = attn.q(block.norm1(part)).reshape(batch, tokens, attn.num_heads, channels // attn.num_heads)
    attended = F.scaled_dot_product_attention(queries.permute(0, 2, 1, 3), keys, values)  # [B, heads, n, C/h]
    part = part + attn.proj(attended.transpose(1, 2).reshape(batch, tokens, channels))
    return part + block.mlp(block.norm2(part))


class ResidualBlock(nn.Module):
    """Two 3x3 convs with instance norm and a (strided) 1x1 shortcut, as in RAFT/GMA's BasicEncoder."""

    def __init__(self, *, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, padding=1)
        self.norm1 = nn.InstanceNorm2d(planes)
        self.norm2 = nn.InstanceNorm2d(planes)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride), nn.InstanceNorm2d(planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.norm1(self.conv1(x)))
        y = self.relu(self.norm2(self.conv2(y)))
        if self.downsample is not None:
            x = self.downsample(x)
        return self.relu(x + y)


class BasicEncoder(nn.Module):
    """GMA/RAFT feature encoder with instance norm (FlowFormer-small's cnet/fnet, official `basicencoder`).

    conv7x7/2 (w0) -> 2 residual blocks (w0) -> 2 (w1, /2) -> 2 (w2, /2) -> conv1x1 (feature_dim), with
    cnn_widths (w0, w1, w2) = (64, 96, 128) in GMA: [B, 3, H, W] -> [B, feature_dim, H/8, W/8].

    Images need sides of at least 16 pixels: the cost-window sampler normalises coordinates by (side/8 - 1)
    (align_corners), so a 1/8-resolution side of 1 gives NaN flow.
    """

    kind = "cnn"
    min_image_side = 16
    # instance norm takes each channel's statistics over the whole image: the encoder runs at once
    supports_activation_budget = False

    def __init__(self, *, feature_dim: int, cnn_widths: Sequence[int], checkpoint_blocks: bool = False) -> None:
        super().__init__()
        if len(cnn_widths) != 3:
            raise ValueError(f"backbone.cnn_widths must list 3 stage widths, got {list(cnn_widths)}")
        self.feature_dim = feature_dim
        self.checkpoint_blocks = checkpoint_blocks
        w0, w1, w2 = cnn_widths
        self.conv1 = nn.Conv2d(3, w0, kernel_size=7, stride=2, padding=3)
        self.norm1 = nn.InstanceNorm2d(w0)
        self.relu1 = nn.ReLU()
        self.layer1 = self._stage(w0, w0, stride=1)
        self.layer2 = self._stage(w0, w1, stride=2)
        self.layer3 = self._stage(w1, w2, stride=2)
        self.conv2 = nn.Conv2d(w2, feature_dim, kernel_size=1)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    @staticmethod
    def _stage(in_planes: int, planes: int, *, stride: int) -> nn.Sequential:
        return nn.Sequential(
            ResidualBlock(in_planes=in_planes, planes=planes, stride=stride),
            ResidualBlock(in_planes=planes, planes=planes, stride=1),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu1(self.norm1(self.conv1(x)))
        for stage in (self.layer1, self.layer2, self.layer3):
            x = recomputed_in_backward(self.checkpoint_blocks, stage, x)
        return self.conv2(x)
