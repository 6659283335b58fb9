"""Unsupervised (photometric) pretraining of the shared FlowFormer backbone on unlabeled video: the
conventional baseline FlowFormer++ compares MCVA pretraining with (loss: flowformer/unsupervised_loss.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from flowformer.lit.base import (
    BackboneModule,
    check_decoder_iterations,
    check_training_size,
    each_weight_cast_once,
)
from flowformer.unsupervised_loss import UnsupervisedLossSettings, unsupervised_loss


class UnsupervisedPretrainModule(BackboneModule):
    """FlowFormer trained to warp image 2 onto image 1 with its own flow: photometric error on the pixels the
    forward-backward check finds visible, plus edge-aware smoothness. Each pair runs through the network in
    both directions in one batch, (1, 2) then (2, 1), for the backward flow of the check. The whole network
    trains (the MCVA `pretrain_head` of a flowformer_pp backbone gets no gradient and keeps its weights, as in
    finetuning). The knobs have no defaults: conf/model/unsup.yaml holds them and says why.

    backbone, optimizer, scheduler: `BackboneModule`.
    train_iters: decoder iterations per step; every iteration's upsampled flow is scored, weighted by
        gamma^(N-1-i) as the supervised sequence loss.
    l1_weight, ssim_weight, census_weight, smooth_weight, smooth_order, edge_constant, mask_occlusions,
    occlusion_relative, occlusion_absolute, gamma: `UnsupervisedLossSettings`.
    """

    def __init__(
        self,
        *,
        backbone: nn.Module | Mapping[str, Any],
        optimizer: Mapping[str, Any],
        scheduler: Mapping[str, Any],
        train_iters: int,
        gamma: float,
        l1_weight: float,
        ssim_weight: float,
        census_weight: float,
        smooth_weight: float,
        smooth_order: int,
        edge_constant: float,
        mask_occlusions: bool,
        occlusion_relative: float,
        occlusion_absolute: float,
    ) -> None:
        check_decoder_iterations(train_iters=train_iters)
        settings = UnsupervisedLossSettings(
            l1_weight=l1_weight,
            ssim_weight=ssim_weight,
            census_weight=census_weight,
            smooth_weight=smooth_weight,
            smooth_order=smooth_order,
            edge_constant=edge_constant,
            mask_occlusions=mask_occlusions,
            occlusion_relative=occlusion_relative,
            occlusion_absolute=occlusion_absolute,
            gamma=gamma,
        )
        super().__init__(backbone=backbone, optimizer=optimizer, scheduler=scheduler)
        self.loss_settings = settings

    def pretrain_step(self, image1: Tensor, image2: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of pairs [B, 3, H, W] (0..255) and its detached terms (`unsupervised_loss`)."""
        first = torch.cat([image1, image2])  # [2B, 3, H, W]: the pairs, then the pairs reversed
        second = torch.cat([image2, image1])
        output = self.backbone(first, second, iters=self.hparams.train_iters)
        return unsupervised_loss(output["flow_predictions"], first, second, self.loss_settings)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        image1, image2 = batch["img1"], batch["img2"]
        check_training_size(image1)
        with each_weight_cast_once(image1.device.type):
            loss, terms = self.pretrain_step(image1, image2)
        self.defer_finite_check(loss, "unsupervised loss")
        batch_size = image1.shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size, sync_dist=True)
        logged = {f"train/{name}": value for name, value in terms.items()}
        self.log_dict(logged, batch_size=batch_size, sync_dist=True)
        if self._trainer is not None and self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=batch_size)
        return loss
