"""Supervised optical-flow training of the shared FlowFormer backbone (the official `train_FlowFormer.py`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from flowformer.eval.protocol import Protocol, validation_protocol
from flowformer.lit.base import (
    BackboneModule,
    check_decoder_iterations,
    check_training_size,
    each_weight_cast_once,
)
from flowformer.lit.images import image_api, log_images
from flowformer.losses import sequence_loss
from flowformer.metrics import NothingScoredError
from flowformer.models.checkpoint import checkpoint_file, load_backbone_weights
from flowformer.setting_types import count_at_least
from flowformer.viz import flow_panel

log = logging.getLogger(__name__)


class FlowModule(BackboneModule):
    """FlowFormer trained with the official sequence loss. The knobs have no defaults: conf/model/flow.yaml
    holds them (the chairs stage's); backbone, optimizer, scheduler: `BackboneModule`.

    gamma, max_flow: sequence-loss weight decay and the validity threshold on |gt| (official: 400).
    train_iters / val_iters: decoder iterations in training and validation (every validation set).
    init_from: checkpoint to initialise the backbone from (ours, an official .pth, or a Lightning .ckpt of a
        previous stage); keys under `skip_init_prefixes` are not loaded (e.g. the MCVA `pretrain_head`).
    add_noise: FlowFormer's pixel noise: per batch std ~ U(0,5), images clamped to 0..255 (FF only).
    num_val_panels: image | gt | prediction | error panels logged from the first batch of each validation set
        (to loggers that take images: wandb, TensorBoard).
    """

    def __init__(
        self,
        *,
        backbone: nn.Module | Mapping[str, Any],
        optimizer: Mapping[str, Any],
        scheduler: Mapping[str, Any],
        gamma: float,
        max_flow: float,
        train_iters: int,
        val_iters: int,
        init_from: str | None,
        skip_init_prefixes: Sequence[str],
        add_noise: bool,
        num_val_panels: int,
    ) -> None:
        if gamma < 0:
            raise ValueError(
                f"model.gamma={gamma}: the loss weighs iteration i by gamma^(N-1-i), so gamma must be >= 0 "
                "(official: 0.8)"
            )
        if not max_flow > 0:  # also NaN
            raise ValueError(
                f"model.max_flow={max_flow}: the loss counts the pixels whose ground-truth flow is shorter than "
                "max_flow, so none would count and nothing would be learned; expected > 0 (official: 400)"
            )
        check_decoder_iterations(train_iters=train_iters, val_iters=val_iters)
        count_at_least(num_val_panels, "model.num_val_panels", 0)
        super().__init__(backbone=backbone, optimizer=optimizer, scheduler=scheduler)
        if init_from is not None:
            checkpoint_file(  # experiment=things|sintel|kitti start from a released .pth's path
                init_from,
                "model.init_from",
                "give the weights to start from: the previous stage's, model.init_from=<its run>/checkpoints/"
                "last.ckpt, or the released checkpoint at that path",
            )
            report = load_backbone_weights(self.backbone, init_from, skip_prefixes=tuple(skip_init_prefixes))
            log.info("initialised the backbone from %s: %s", init_from, report)
        self.val_names: list[str] = []
        self.val_protocols: dict[str, Protocol] = {}
        self.val_metrics = nn.ModuleDict()

    def setup(self, stage: str) -> None:
        """The datamodule's validation sets (`val_names`, and `val_sets` where it has them) are scored as in
        task=eval: each with its protocol (`flowformer.eval.protocol.validation_protocol`) and metric bundle."""
        datamodule = getattr(self.trainer, "datamodule", None)
        names = list(getattr(datamodule, "val_names", []) or [])
        if names and names != self.val_names:
            self.set_validation_sets(getattr(datamodule, "val_sets", {name: None for name in names}))

    def set_validation_sets(self, sets: Mapping[str, Any]) -> None:
        """{name: dataset} in the order of the validation dataloaders; a dataset that is not an `EvalSet` (or
        None) is scored as kind `flow`."""
        self.val_names = list(sets)
        self.val_protocols = {
            name: validation_protocol(dataset, self.hparams.val_iters) for name, dataset in sets.items()
        }
        metrics = {name: protocol.metrics() for name, protocol in self.val_protocols.items()}
        self.val_metrics = nn.ModuleDict(metrics).to(self.device)

    def forward(self, image1: Tensor, image2: Tensor, iters: int | None = None) -> dict[str, Tensor]:
        return self.backbone(image1, image2, iters=iters or self.hparams.val_iters)

    def _add_pixel_noise(self, image1: Tensor, image2: Tensor) -> tuple[Tensor, Tensor]:
        std = float(torch.empty(()).uniform_(0.0, 5.0))
        image1 = (image1 + std * torch.randn_like(image1)).clamp(0.0, 255.0)
        image2 = (image2 + std * torch.randn_like(image2)).clamp(0.0, 255.0)
        return image1, image2

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        image1, image2 = batch["img1"], batch["img2"]
        check_training_size(image1)
        if self.hparams.add_noise:
            image1, image2 = self._add_pixel_noise(image1, image2)
        with each_weight_cast_once(image1.device.type):
            output = self.backbone(image1, image2, iters=self.hparams.train_iters)
        loss, metrics = sequence_loss(
            output["flow_predictions"],
            batch["flow"],
            batch["valid"],
            gamma=self.hparams.gamma,
            max_flow=self.hparams.max_flow,
        )
        self.defer_finite_check(loss, "loss")
        batch_size = image1.shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log_dict({f"train/{k}": v for k, v in metrics.items()}, batch_size=batch_size)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        name = self.val_names[dataloader_idx] if self.val_names else "val"
        if name not in self.val_protocols:  # the loaders of a datamodule without `val_names`: one set `val`
            self.set_validation_sets({"val": None})
        image1, image2 = batch["img1"], batch["img2"]
        with each_weight_cast_once(image1.device.type):
            flow = self.val_protocols[name].predict(self.backbone, image1, image2)["flow"]  # [B,2,H,W]
        self.val_metrics[name].update(flow, batch["flow"], batch.get("valid"))
        if batch_idx == 0 and any(image_api(logger) for logger in self.loggers):
            panels = {
                f"val/{name}/panel_{i}": flow_panel(image1[i], flow[i], batch["flow"][i], batch["valid"][i])
                for i in range(min(self.hparams.num_val_panels, image1.shape[0]))
            }
            log_images(self.loggers, panels, self.global_step)

    def on_validation_epoch_end(self) -> None:
        for name, metric in self.val_metrics.items():
            if not metric.update_called:
                continue
            try:
                values = metric.compute()
            except NothingScoredError as error:
                raise NothingScoredError(f"validation set {name}: {error}") from None
            self.log_dict({f"val/{name}/{k}": v.float() for k, v in values.items()}, sync_dist=False)
            metric.reset()
