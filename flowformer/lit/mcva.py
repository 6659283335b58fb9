"""MCVA pretraining of the shared FlowFormer backbone on unlabeled image pairs (FlowFormer++'s
`pretrain_FlowFormer_maemask.py`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from flowformer.lit.base import BackboneModule, check_training_size, each_weight_cast_once
from flowformer.lit.images import image_api, log_images
from flowformer.models.mcva import (
    CostMaskGenerator,
    MaskingStrategy,
    MCVAOutput,
    NormalizedSide,
    ReconLocation,
    ReconstructionObjective,
    mcva_forward,
)
from flowformer.setting_types import count_at_least

log = logging.getLogger(__name__)

PANEL_ZOOM = 8  # nearest-neighbour magnification of the logged patches and masks


def patch_panel(predictions: Tensor, targets: Tensor, *, num_pixels: int = 4) -> np.ndarray:
    """Target next to prediction for a few source pixels of sample 0 -> uint8 [(n(S+1)-1)*z, (2S+1)*z, 3].

    predictions, targets [B, S^2, H1, W1] with the official x-major window layout (channel k = i*S + j, i the
    x offset, j the y offset; flowformer.models.sample_cost_window), so each patch is shown transposed to (y, x). Every patch is scaled
    to its own min..max (the two sides may live on different scales when the prediction side is normalised).
    """
    _, channels, h1, w1 = targets.shape
    size = round(channels**0.5)
    rows = []
    for i in range(num_pixels):
        y, x = (i + 1) * h1 // (num_pixels + 1), (i + 1) * w1 // (num_pixels + 1)
        pair = []
        for values in (targets[0, :, y, x], predictions[0, :, y, x]):
            patch = values.float().reshape(size, size).T  # [x, y] -> [y, x]
            patch = (patch - patch.min()) / (patch.max() - patch.min()).clamp_min(1e-12)
            pair.append(patch)
        if rows:
            rows.append(torch.ones(1, 2 * size + 1))  # white line between source pixels
        rows.append(torch.cat([pair[0], torch.ones(size, 1), pair[1]], dim=1))
    grey = torch.cat(rows, dim=0).repeat_interleave(PANEL_ZOOM, 0).repeat_interleave(PANEL_ZOOM, 1)
    return (grey.clamp(0, 1) * 255).to(torch.uint8).unsqueeze(-1).expand(-1, -1, 3).cpu().numpy()


def mask_panel(removed: Tensor, h1: int, w1: int) -> np.ndarray:
    """Block mask of sample 0 -> uint8 [H1*z, W1*z, 3]: each source pixel is coloured by a fixed random
    projection of its removed-token vector, so pixels that share a mask (one block) share a colour."""
    pattern = removed[: h1 * w1].float().cpu()  # [H1*W1, L], 1 = removed
    palette = torch.rand(pattern.shape[1], 3, generator=torch.Generator().manual_seed(0))
    colour = pattern @ palette
    colour = (colour - colour.min(0).values) / (colour.max(0).values - colour.min(0).values).clamp_min(1e-12)
    image = colour.reshape(h1, w1, 3).repeat_interleave(PANEL_ZOOM, 0).repeat_interleave(PANEL_ZOOM, 1)
    return (image * 255).to(torch.uint8).numpy()


class MCVAPretrainModule(BackboneModule):
    """Masked Cost Volume Autoencoding: the cost encoder, the decoder's cost query and the reconstruction head
    learn to rebuild S x S cost-map windows around random locations from a masked cost volume.

    The knobs have no defaults: conf/model/mcva.yaml holds them (the official values), and says why the
    network's ablation knobs (decoder_query, recon_size, recon_head_depth) are backbone knobs instead.

    backbone: a FlowFormer with variant="flowformer_pp" (it has `pretrain_head`), or its config mapping.
    optimizer, scheduler: `BackboneModule` (only the trainable parameters are optimised).
    masking, mask_ratio, min_block, max_block: the cost-volume mask (CostMaskGenerator); exactly
        int(L * (1 - mask_ratio)) of the L patch tokens per source pixel stay visible.
    recon_location: "random" (the method) or "fixed" (MAE-style: each source pixel's own position).
    query_num: query rounds per step; the loss is their sum, as in the official code.
    normalize: "target" (the official code) or "prediction" (the paper's equation).
    freeze_image_encoder, freeze_context_encoder: frozen modules get requires_grad=False and stay in eval mode.
    log_images_every_n_steps: pictures of target/prediction patches and of the block mask (0 = never); they go
        to every logger with an image API (`log_image`, or TensorBoard's `experiment.add_image`).
    num_logged_patches: source pixels (at least 1) whose target and predicted patches those pictures show.
    """

    def __init__(
        self,
        *,
        backbone: nn.Module | Mapping[str, Any],
        optimizer: Mapping[str, Any],
        scheduler: Mapping[str, Any],
        masking: MaskingStrategy,
        mask_ratio: float,
        min_block: int,
        max_block: int,
        recon_location: ReconLocation,
        query_num: int,
        normalize: NormalizedSide,
        freeze_image_encoder: bool,
        freeze_context_encoder: bool,
        log_images_every_n_steps: int,
        num_logged_patches: int,
    ) -> None:
        count_at_least(log_images_every_n_steps, "model.log_images_every_n_steps", 0)
        count_at_least(num_logged_patches, "model.num_logged_patches", 1)
        super().__init__(backbone=backbone, optimizer=optimizer, scheduler=scheduler)
        self.objective = ReconstructionObjective(
            recon_location=recon_location, query_num=query_num, normalize=normalize
        )
        if self.backbone.cost_encoder is None:
            raise ValueError(
                "model=mcva pretrains the cost encoder's latent cost memory, which backbone.decoder=mcr does not "
                "have: use backbone.decoder=cmd"
            )
        if not hasattr(self.backbone, "pretrain_head"):
            raise ValueError(
                "model=mcva needs a backbone with the reconstruction head: use a flowformer_pp variant "
                "(backbone=flowformer_pp, or backbone=tiny / small with backbone.variant=flowformer_pp)."
            )
        self.mask_generator = CostMaskGenerator(
            masking=masking, mask_ratio=mask_ratio, min_block=min_block, max_block=max_block
        )
        self._rngs: dict[str, torch.Generator] = {}
        self._pending_rng_states: dict[str, Tensor] = {}
        self.frozen_modules = self._freeze_encoders(freeze_image_encoder, freeze_context_encoder)

    def _freeze_encoders(self, image: bool, context: bool) -> list[nn.Module]:
        """Stops the gradients of the image and/or context encoder; returns the frozen modules."""
        frozen = [
            *(self.backbone.feature_encoder_modules() if image else []),
            *(self.backbone.context_encoder_modules() if context else []),
        ]
        for module in frozen:
            module.requires_grad_(False)
        log.info(
            "MCVA: %d trainable backbone parameters (frozen: image encoder=%s, context encoder=%s)",
            sum(p.numel() for p in self.trainable_parameters()),
            image,
            context,
        )
        return frozen

    def train(self, mode: bool = True) -> MCVAPretrainModule:
        """Frozen encoders stay in eval mode, so a CNN encoder's BatchNorm statistics stay frozen too."""
        super().train(mode)
        for module in self.frozen_modules:
            module.eval()
        return self

    def pretrain_step(
        self,
        image1: Tensor,
        image2: Tensor,
        *,
        mask_noise: Tensor | None = None,
        query_uniform: Tensor | None = None,
        keep_rounds: int = 0,
    ) -> MCVAOutput:
        """The MCVA objective on images [B, 3, H, W] in 0..255 (H, W multiples of 8).

        mask_noise [B, H/8, W/8, L] and query_uniform [query_num, B, 2, H/8, W/8] replay recorded draws; each
        one left None is drawn here (the mask on the CPU torch RNG, the locations on the images' device, as
        torch.rand(B, 2, H1, W1) once per round like the official decoder).
        """
        batch, _, height, width = image1.shape
        if height % 8 or width % 8:
            raise ValueError(
                f"MCVA pretraining needs image sides that are multiples of 8, got {height}x{width}; "
                "crop the pretraining data to multiples of 8 (data.train.augmentor.crop_size, or data.train.size for "
                "synthetic clips)."
            )
        h1, w1 = height // 8, width // 8
        if mask_noise is None:
            mask_noise = self.mask_generator.noise(batch, h1, w1, generator=self._generator("mask", "cpu"))
        objective = self.objective
        if query_uniform is None and objective.recon_location == "random":
            rng = self._generator("query", image1.device)
            query_uniform = torch.stack(
                [
                    torch.rand(batch, 2, h1, w1, device=image1.device, generator=rng)
                    for _ in range(objective.query_num)
                ]
            )
        return mcva_forward(
            self.backbone,
            image1,
            image2,
            mask_noise=mask_noise,
            query_uniform=query_uniform,
            mask_generator=self.mask_generator,
            objective=objective,
            keep_rounds=keep_rounds,
        )

    def _generator(self, stream: str, device: torch.device | str) -> torch.Generator:
        """The random stream of the masks ("mask", CPU) or of the query locations ("query", the images' device).

        Seeded from the run seed (torch.initial_seed()) and the global rank, so DDP processes draw different
        masks for their different images; the states travel with checkpoints, so a resumed run continues them.
        """
        device = torch.device(device)
        if stream not in self._rngs or self._rngs[stream].device != device:
            offset = {"mask": 0, "query": 1}[stream]
            seed = (torch.initial_seed() + 1_000_003 * self.global_rank + offset) % 2**63
            generator = torch.Generator(device=device).manual_seed(seed)
            if stream in self._pending_rng_states:
                generator.set_state(self._pending_rng_states.pop(stream))
            self._rngs[stream] = generator
        return self._rngs[stream]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["mcva_rng_states"] = {name: rng.get_state() for name, rng in self._rngs.items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._rngs = {}
        self._pending_rng_states = dict(checkpoint.get("mcva_rng_states", {}))

    def _should_log_images(self) -> bool:
        every = self.hparams.log_images_every_n_steps
        return bool(every) and self.global_step % every == 0 and any(image_api(lg) for lg in self.loggers)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        image1, image2 = batch["img1"], batch["img2"]
        check_training_size(image1)
        with_images = self._should_log_images()
        with each_weight_cast_once(image1.device.type):
            output = self.pretrain_step(image1, image2, keep_rounds=1 if with_images else 0)
        self.defer_finite_check(output.loss, "MCVA loss")
        batch_size = image1.shape[0]
        self.log("train/loss", output.loss, prog_bar=True, batch_size=batch_size)
        self.log("train/loss_per_round", output.loss.detach() / self.objective.query_num, batch_size=batch_size)
        self.log("train/visible_ratio", output.token_mask.visible_ratio, batch_size=batch_size)
        if self._trainer is not None and self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=batch_size)
        if with_images:
            h1, w1 = image1.shape[-2] // 8, image1.shape[-1] // 8
            log_images(
                self.loggers,
                {
                    "train/recon_patches": patch_panel(
                        output.predictions[0], output.targets[0], num_pixels=self.hparams.num_logged_patches
                    ),
                    "train/block_mask": mask_panel(output.token_mask.removed, h1, w1),
                },
                self.global_step,
            )
        return output.loss
