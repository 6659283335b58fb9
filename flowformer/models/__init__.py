"""The FlowFormer / FlowFormer++ network as plain nn.Modules (no training logic here).

    net = build_flowformer_pp()                  # or any knobs: build_flowformer(variant=..., cost_encoder=...)
    out = net(image1, image2, iters=12)          # images [B,3,H,W] in 0..255 -> {"flow", "flow_low"}
    net = load_official("things.pth", variant="flowformer")              # released checkpoint, eval mode

Hydra builds it from conf/backbone/*.yaml (`_target_: flowformer.models.build_flowformer`). The network is
assembled from parts (flowformer/models/flowformer.py); a new cost encoder implements `CostEncoder`
(flowformer/models/cost_encoder.py) and is named in `COST_ENCODERS` (flowformer/models/build.py).

Converting a released checkpoint into our format (and back):
    python -m flowformer.models.convert things.pth things.ckpt --variant flowformer
    python -m flowformer.models.convert things.ckpt things_official.pth --to-official
"""

from flowformer.models.build import (
    COST_ENCODERS,
    BackboneConfig,
    build_flowformer,
    build_flowformer_pp,
    build_flowformer_small,
    build_flowformer_tiny,
)
from flowformer.models.checkpoint import export_official, load_backbone_weights, load_official, save_backbone
from flowformer.models.cost_encoder import CostEncoder
from flowformer.models.flowformer import FlowFormer
from flowformer.models.layers import sample_cost_window
from flowformer.models.token_mask import TokenMask

__all__ = [
    "COST_ENCODERS",
    "BackboneConfig",
    "CostEncoder",
    "FlowFormer",
    "TokenMask",
    "build_flowformer",
    "build_flowformer_pp",
    "build_flowformer_small",
    "build_flowformer_tiny",
    "export_official",
    "load_backbone_weights",
    "load_official",
    "sample_cost_window",
    "save_backbone",
]
