"""The official optimiser and schedule: AdamW + linear OneCycle, stepped every iteration, as ``fetch_optimizer``
builds them for the official ``train_FlowFormer.py`` and FlowFormer++ ``pretrain_FlowFormer_maemask.py``."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw_onecycle(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    total_steps: int,
    pct_start: float = 0.05,
    eps: float = 1e-8,
) -> dict:
    """Lightning `configure_optimizers` dict. The official loops use total_steps = num_steps + 100."""
    optimizer = torch.optim.AdamW(
        [p for p in params if p.requires_grad], lr=lr, weight_decay=weight_decay, eps=eps
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=lr,
        total_steps=total_steps,
        pct_start=pct_start,
        cycle_momentum=False,
        anneal_strategy="linear",
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def configure_adamw_onecycle(
    module, *, lr: float, weight_decay: float, total_steps: int | None, pct_start: float = 0.05
) -> dict:
    """`adamw_onecycle` over `module.backbone`; total_steps None takes trainer.max_steps + 100 as the official
    training loops do (OneCycleLR total_steps = num_steps + 100)."""
    if total_steps is None:
        max_steps = module.trainer.max_steps
        if max_steps is None or max_steps < 1:
            raise ValueError(
                "model.total_steps is null, so it is derived from trainer.max_steps + 100, but "
                f"trainer.max_steps is {max_steps}; set trainer.max_steps (or model.total_steps)"
            )
        total_steps = max_steps + 100
    return adamw_onecycle(
        module.backbone.parameters(),
        lr=lr,
        weight_decay=weight_decay,
        total_steps=total_steps,
        pct_start=pct_start,
    )
