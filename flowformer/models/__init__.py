"""The FlowFormer / FlowFormer++ network as plain nn.Modules (no training logic here)."""

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
