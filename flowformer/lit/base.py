"""What every LightningModule training the shared FlowFormer backbone has in common: the backbone built from
its config, the constructor arguments saved once as plain hyperparameters, the finite checks, and the
optimiser and LR schedule of `model.optimizer` / `model.scheduler` (Hydra partials; the official AdamW +
linear OneCycle are conf/model/optimizer/adamw.yaml and conf/model/scheduler/onecycle.yaml)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.utilities.parsing import collect_init_args
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import Tensor, nn

from flowformer.models.checkpoint import BackboneTargetError, backbone_builder

# The official loops build OneCycleLR(total_steps=num_steps + 100): the schedule outlasts the run by 100.
SCHEDULE_STEPS_AFTER_MAX_STEPS = 100


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/inf loss or gradient; raised before the optimiser touches the weights."""


def check_finite(value: Tensor, what: str, step: int) -> None:
    if not torch.isfinite(value).all():
        raise NonFiniteLossError(
            f"non-finite {what} ({value.item() if value.numel() == 1 else 'tensor'}) at global step {step}: "
            "training stopped before the optimiser step, so the weights and the last saved checkpoint are "
            "intact. Lower model.optimizer.lr, check the data (NaN/inf flow or images), or resume from the "
            "last checkpoint with ckpt_path=..."
        )


def build_backbone(backbone: nn.Module | Mapping[str, Any]) -> nn.Module:
    """An nn.Module as is, or a `_target_` mapping (e.g. conf/backbone/*.yaml, or the `backbone`
    hyper-parameters of a checkpoint, which may hold knobs FlowFormer no longer takes), built by the package
    builder its `_target_` names (`backbone_builder`: no other code is called, nested `_target_`s neither)."""
    if isinstance(backbone, nn.Module):
        return backbone
    if "_target_" not in backbone:
        raise ValueError(
            f"model.backbone must be an nn.Module or a config with `_target_` (see conf/backbone/); "
            f"got keys {sorted(backbone)}"
        )
    builder, knobs = backbone_builder(plain_value(backbone), "model.backbone")
    return builder(**knobs)


def plain_value(value: Any) -> Any:
    """A constructor argument as checkpoint hyperparameters hold it: configs as plain dicts and lists
    (resolved), tuples as lists, and None for a backbone passed as a network (its weights: the state_dict)."""
    if isinstance(value, nn.Module):
        return None
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {key: plain_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(item) for item in value]
    return value


def instantiate_partial(config: Mapping[str, Any], name: str, **overrides: Any) -> Any:
    """The callable a Hydra partial config (`_partial_: true`) describes, with `overrides` bound too."""
    if not config.get("_partial_"):
        raise ValueError(
            f"{name} must be a Hydra partial (`_partial_: true`): the module passes the parameters "
            f"(optimizer) or the optimiser (scheduler) itself; got {dict(config)}"
        )
    return hydra.utils.instantiate(config, **overrides)


class BackboneModule(L.LightningModule):
    """A LightningModule training `self.backbone` (FlowFormer or FlowFormer++).

    A subclass's ``__init__`` starts with ``super().__init__(backbone=..., optimizer=..., scheduler=...)``:
    every argument of its ``__init__`` is then saved once, as plain values (``torch.load(weights_only=True)``
    opens the checkpoints), and the backbone is built.

    backbone: the network, or its config mapping with `_target_` (Hydra passes conf/backbone/*.yaml with
        `_recursive_: false`, so the plain config is what the checkpoint's hyperparameters store).
    optimizer: a Hydra partial of the optimiser, called with the backbone's trainable parameters (frozen ones,
        e.g. MCVA's encoders, are left out).
    scheduler: a Hydra partial of the LR scheduler, called with the optimiser and stepped every iteration;
        `total_steps: null` takes trainer.max_steps + 100, as the official loops.
    Gradient clipping (1.0) comes from the trainer config (`gradient_clip_val`).
    """

    def __init__(
        self,
        *,
        backbone: nn.Module | Mapping[str, Any],
        optimizer: Mapping[str, Any],
        scheduler: Mapping[str, Any],
    ) -> None:
        super().__init__()
        arguments: dict[str, Any] = {}
        for level in collect_init_args(inspect.currentframe(), [], classes=(BackboneModule,)):
            arguments.update(level)
        self.save_hyperparameters({name: plain_value(value) for name, value in arguments.items()})
        self.backbone = build_backbone(backbone)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's loader, with a refused backbone `_target_` (`build_backbone`) naming the checkpoint."""
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        except BackboneTargetError as error:
            raise BackboneTargetError(f"checkpoint {checkpoint_path}: {error}") from None

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.backbone.parameters() if p.requires_grad]

    def configure_optimizers(self) -> dict:
        optimizer = instantiate_partial(self.hparams.optimizer, "model.optimizer")(
            self.trainable_parameters()
        )
        schedule = instantiate_partial(self.hparams.scheduler, "model.scheduler", **self._schedule_length())
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": schedule(optimizer), "interval": "step"},
        }

    @classmethod
    def own_hyperparameters(cls) -> set[str]:
        """The constructor arguments this kind of module adds to BackboneModule's: the hyper-parameters that
        tell its checkpoints from another kind's."""
        shared = inspect.signature(BackboneModule.__init__).parameters
        return {name for name in inspect.signature(cls.__init__).parameters if name not in shared}

    def _schedule_length(self) -> dict[str, int]:
        """{"total_steps": trainer.max_steps + 100} where the scheduler's total_steps is null, else {}; a set
        total_steps must cover trainer.max_steps (torch refuses to step a OneCycle schedule past its end)."""
        scheduler = self.hparams.scheduler
        if "total_steps" not in scheduler:
            return {}
        max_steps = self.trainer.max_steps
        if scheduler["total_steps"] is not None:
            if max_steps is not None and max_steps > scheduler["total_steps"]:
                raise ValueError(
                    f"model.scheduler.total_steps={scheduler['total_steps']} is below trainer.max_steps="
                    f"{max_steps}: the schedule would end before training does; set "
                    f"model.scheduler.total_steps >= {max_steps}, or null for trainer.max_steps + "
                    f"{SCHEDULE_STEPS_AFTER_MAX_STEPS}"
                )
            return {}
        if max_steps is None or max_steps < 1:
            raise ValueError(
                "model.scheduler.total_steps is null, so it is derived from trainer.max_steps + 100, but "
                f"trainer.max_steps is {max_steps}; set trainer.max_steps (or model.scheduler.total_steps)"
            )
        return {"total_steps": max_steps + SCHEDULE_STEPS_AFTER_MAX_STEPS}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log the gradient norm and refuse to step on NaN/inf gradients (they would poison the weights)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        grad_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        )
        check_finite(grad_norm, "gradient norm", self.global_step)
        self.log("train/grad_norm", grad_norm)
