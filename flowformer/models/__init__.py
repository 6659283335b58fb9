"""The FlowFormer / FlowFormer++ network as plain nn.Modules (no training logic here).

    net = FlowFormer(variant="flowformer_pp", image_encoder="cnn", ...)   # or hydra: conf/backbone/*.yaml
    out = net(image1, image2, iters=12)       # images [B,3,H,W] in 0..255 -> {"flow", "flow_low"}
    net = load_official("things.pth", variant="flowformer")              # released checkpoint, eval mode

Converting a released checkpoint into our format (and back):
    python -m flowformer.models.convert things.pth things.ckpt --variant flowformer
    python -m flowformer.models.convert things.ckpt things_official.pth --to-official
"""

from flowformer.models.checkpoint import export_official, load_backbone_weights, load_official, save_backbone
from flowformer.models.flowformer import FlowFormer
from flowformer.models.layers import sample_cost_window
from flowformer.models.token_mask import TokenMask

__all__ = [
    "FlowFormer",
    "TokenMask",
    "export_official",
    "load_backbone_weights",
    "load_official",
    "sample_cost_window",
    "save_backbone",
]
