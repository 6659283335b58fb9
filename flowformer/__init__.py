"""FlowFormer and FlowFormer++ (MCVA) on PyTorch Lightning + Hydra."""
