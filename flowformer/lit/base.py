"""What every LightningModule training the shared FlowFormer backbone has in common: the backbone built from
its config, the constructor arguments saved once as plain hyperparameters, the finite checks, and the
optimiser and LR schedule of `model.optimizer` / `model.scheduler` (Hydra partials; the official AdamW +
linear OneCycle are conf/model/optimizer/adamw.yaml and conf/model/scheduler/onecycle.yaml), and the mapping
of the hyper-parameters checkpoints held before those partials (`current_hyperparameters`)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.parsing import collect_init_args
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import Tensor, nn

from flowformer.device_settings import optimizer_device_settings
from flowformer.models.checkpoint import BackboneTargetError, backbone_builder, read_checkpoint
from flowformer.setting_types import instantiate_partial, whole_number

# The official loops build OneCycleLR(total_steps=num_steps + 100): the schedule outlasts the run by 100.
SCHEDULE_STEPS_AFTER_MAX_STEPS = 100

# Checkpoints written before model.optimizer / model.scheduler hold four top-level hyper-parameters instead of
# those partials; the module then always trained with the official AdamW and linear OneCycle, so each former
# name is one key of today's partials (conf/model/optimizer/adamw.yaml, conf/model/scheduler/onecycle.yaml):
#   lr -> optimizer.lr (and scheduler.max_lr, the peak), weight_decay -> optimizer.weight_decay,
#   total_steps -> scheduler.total_steps, pct_start -> scheduler.pct_start.
FORMER_HYPERPARAMETERS: dict[str, tuple[str, str]] = {
    "lr": ("optimizer", "lr"),
    "weight_decay": ("optimizer", "weight_decay"),
    "total_steps": ("scheduler", "total_steps"),
    "pct_start": ("scheduler", "pct_start"),
}
# The rest of what the module built around them then (fixed in its code: the official fetch_optimizer's).
FORMER_PARTIALS: dict[str, dict[str, Any]] = {
    "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "eps": 1e-8},
    "scheduler": {
        "_target_": "torch.optim.lr_scheduler.OneCycleLR",
        "_partial_": True,
        "cycle_momentum": False,
        "anneal_strategy": "linear",
    },
}
# What a checkpoint's optimizer / scheduler partial may name: a torch optimiser / LR scheduler class (as
# conf/model/optimizer/ and conf/model/scheduler/ do). Configuring the optimisers of a module loaded from a
# file calls it, and Hydra first calls any `_target_` nested in its values: other code is refused.
STORED_PARTIAL_CLASSES: dict[str, tuple[Any, type]] = {
    "optimizer": (torch.optim, torch.optim.Optimizer),
    "scheduler": (torch.optim.lr_scheduler, torch.optim.lr_scheduler.LRScheduler),
}
# load_from_checkpoint's own arguments (Lightning's); its other keyword arguments are hyper-parameters.
LOAD_ARGUMENTS = ("map_location", "hparams_file", "strict", "weights_only")


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/inf loss or gradient; raised before the optimiser touches the weights."""


def check_finite(values: list[tuple[str, Tensor]], step: int) -> None:
    """Raises NonFiniteLossError for the first of `values` ((what it is, a scalar tensor), all on one device) that
    is NaN or inf. They are checked on their device together: on a GPU one wait for the queued kernels."""
    stacked = torch.stack([value.detach().float() for _, value in values])
    if torch.isfinite(stacked).all():
        return
    for (what, _), value in zip(values, stacked.tolist()):
        if not math.isfinite(value):
            raise NonFiniteLossError(
                f"non-finite {what} ({value}) at global step {step}: training stopped before the optimiser step, "
                "so the weights and the last saved checkpoint are intact. Lower model.optimizer.lr, check the data "
                "(NaN/inf flow or images), or resume from the last checkpoint with ckpt_path=..."
            )


def check_training_size(image: Tensor) -> None:
    """Training pairs `image` [B, 3, H, W] are a multiple of 8 on each side (the network works at 1/8
    resolution); otherwise the one line names the data settings that make the crop."""
    height, width = image.shape[-2:]
    if height % 8 or width % 8:
        fit = f"{height - height % 8 or 8}x{width - width % 8 or 8}"
        raise ValueError(
            f"training pairs are {height}x{width}, not a multiple of 8 on each side (the network works at 1/8 "
            f"resolution): set the data config's training crop to a multiple of 8, e.g. {fit} (data.train.size "
            "for rendered pairs, the augmentor's crop_size for a dataset, e.g. data.train.augmentor.crop_size)"
        )


def check_decoder_iterations(**settings: int) -> None:
    """Each `model.<setting>` given (train_iters, val_iters) is at least 1: the decoder refines at least once."""
    for setting, iters in settings.items():
        if iters < 1:
            raise ValueError(f"model.{setting}={iters}: the decoder needs at least 1 iteration")


def each_weight_cast_once(device_type: str) -> AbstractContextManager:
    """Open inside a step that Lightning runs under mixed precision: autocast as Lightning opened it, with its
    weight cache. Lightning's MixedPrecision plugin (2.6) enters autocast with `cache_enabled=False`, so every
    call of a convolution or linear layer casts its weight again: at each of the decoder's iterations, and
    each cast has its own cast back in backward (682 casts more in a 12-iteration training step of the
    official-size network; docs/performance.md, "Operators dispatched"). With the cache a step casts each
    weight once, as the official code's autocast does, and the bench's and the memory estimate's steps. Torch
    drops the casts when the outermost autocast region closes: at the end of the step. Without autocast (full
    precision), nothing to cast. Under torch.inference_mode autocast keeps no cast, whatever the cache says
    (the trainer configs validate under torch.no_grad: `inference_mode: false`)."""
    if not torch.is_autocast_enabled(device_type):
        return nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=True)


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


def current_hyperparameters(hparams: Mapping[str, Any], source: str, advice: str) -> dict[str, Any]:
    """A checkpoint's hyper-parameters by today's names: the former lr, weight_decay, total_steps and
    pct_start become the `optimizer` and `scheduler` partials they meant (FORMER_HYPERPARAMETERS,
    FORMER_PARTIALS); without former names, as they are. Some of the former names only, or former names
    beside `optimizer` / `scheduler`, cannot be mapped: one ValueError naming `source` and what was found,
    ending with `advice`."""
    former = [name for name in FORMER_HYPERPARAMETERS if name in hparams]
    if not former:
        return dict(hparams)
    missing = [name for name in FORMER_HYPERPARAMETERS if name not in hparams]
    current = [name for name in FORMER_PARTIALS if name in hparams]
    if missing or current:
        found = f"without {', '.join(missing)}" if missing else f"beside {' and '.join(current)}"
        raise ValueError(
            f"{source}: its hyper-parameters hold {', '.join(former)} {found}, so they cannot be mapped to "
            f"model.optimizer / model.scheduler (a checkpoint from before them holds all of "
            f"{', '.join(FORMER_HYPERPARAMETERS)} and neither partial); {advice}"
        )
    mapped = {name: value for name, value in hparams.items() if name not in FORMER_HYPERPARAMETERS}
    mapped |= {group: dict(partial) for group, partial in FORMER_PARTIALS.items()}
    for name, (group, key) in FORMER_HYPERPARAMETERS.items():
        mapped[group][key] = hparams[name]
    mapped["scheduler"]["max_lr"] = hparams["lr"]
    return mapped


def check_stored_partial(config: Any, group: str, source: str) -> None:
    """Refuses the `group` partial (optimizer, scheduler) of a checkpoint's hyper-parameters unless its
    `_target_` is a class STORED_PARTIAL_CLASSES allows and none of its values nests a `_target_`."""
    module, base = STORED_PARTIAL_CLASSES[group]
    settings = dict(config) if isinstance(config, Mapping) else {}
    target = str(settings.pop("_target_", ""))
    name = target.removeprefix(f"{module.__name__}.")
    named = getattr(module, name, None) if name != target and "." not in name else None
    nested = holds_target(settings)
    if isinstance(named, type) and issubclass(named, base) and not nested:
        return
    raise ValueError(
        f"{source} names model.{group} `_target_: {target}`{' with a nested `_target_`' if nested else ''}, "
        f"which is refused: a checkpoint's {group} may name only a {module.__name__} class ({base.__name__}) "
        f"with plain settings, since configuring the optimisers calls it; pass {group}=... to "
        "load_from_checkpoint"
    )


def holds_target(value: Any) -> bool:
    """Whether a config value (a mapping, a list, a plain value) holds a `_target_` at any depth."""
    if isinstance(value, Mapping):
        return "_target_" in value or any(holds_target(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_target(item) for item in value)
    return False


def stored_hyperparameters(checkpoint: Any) -> dict[str, Any]:
    """The hyper-parameters of a checkpoint file (a path, or a file object, read from where it stands and put
    back there), read weights-only."""
    if isinstance(checkpoint, (str, Path)):
        return read_checkpoint(checkpoint).get("hyper_parameters") or {}
    start = checkpoint.tell()
    stored = torch.load(checkpoint, map_location="cpu", weights_only=True).get("hyper_parameters") or {}
    checkpoint.seek(start)
    return stored


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
        hparams = {name: plain_value(value) for name, value in arguments.items()}
        if isinstance(hparams["backbone"], dict) and "twins_weights" in hparams["backbone"]:
            # the ImageNet weights travel in the state dict: a load from the checkpoint does not read them again
            hparams["backbone"] = {**hparams["backbone"], "twins_weights": None}
        self.save_hyperparameters(hparams)
        self.backbone = build_backbone(backbone)
        self.unchecked_losses: list[tuple[str, Tensor]] = []  # `defer_finite_check`

    def defer_finite_check(self, loss: Tensor, what: str) -> None:
        """Has `loss` (a training step's, detached) checked with the gradient norm before the optimiser step
        (`on_before_optimizer_step`, at the last of accumulated batches) instead of now: reading it now would make
        the CPU wait for a GPU's forward before it queues the backward. Under DDP every process then reaches the
        check after the same gradient exchange, which carries one process's NaN to every process's gradients."""
        self.unchecked_losses.append((what, loss.detach()))

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's loader, also for checkpoints written before model.optimizer / model.scheduler: their
        former settings are passed as the partials they mean (`current_hyperparameters`). Keyword arguments
        other than Lightning's own (LOAD_ARGUMENTS) replace stored hyper-parameters, as in Lightning. A
        checkpoint (a local path or a file object) whose hyper-parameters cannot be mapped, lack a constructor
        argument or name code to run (`_checkpoint_settings`), and a refused backbone `_target_`
        (`build_backbone`), are one error naming the checkpoint. Hyper-parameters from `hparams_file` and
        remote checkpoints (`<protocol>://...`) go to Lightning as they are."""
        load_arguments = dict(zip(LOAD_ARGUMENTS, args))
        load_arguments |= {name: value for name, value in kwargs.items() if name in LOAD_ARGUMENTS}
        settings = {name: value for name, value in kwargs.items() if name not in LOAD_ARGUMENTS}
        remote = isinstance(checkpoint_path, str) and "://" in checkpoint_path
        if not remote and load_arguments.get("hparams_file") is None:
            settings = cls._checkpoint_settings(checkpoint_path, settings)
        try:
            return super().load_from_checkpoint(checkpoint_path, **load_arguments, **settings)
        except BackboneTargetError as error:
            raise BackboneTargetError(f"checkpoint {checkpoint_path}: {error}") from None

    @classmethod
    def _checkpoint_settings(cls, path: Any, settings: dict[str, Any]) -> dict[str, Any]:
        """`settings` with the checkpoint's optimizer and scheduler partials by today's names; refuses (one
        line) hyper-parameters that cannot be mapped, lack a constructor argument of this module, or name code
        other than a torch optimiser / LR scheduler (`check_stored_partial`)."""
        stored = stored_hyperparameters(path)
        name = path if isinstance(path, (str, Path)) else getattr(path, "name", "(a file object)")
        source = f"checkpoint {name}"
        advice = (
            "pass optimizer=... and scheduler=... (conf/model/optimizer/, conf/model/scheduler/) to "
            "load_from_checkpoint, or load only its weights (flowformer.models.load_backbone_weights, "
            "model.init_from)"
        )
        hparams = {**stored, **settings}
        if not FORMER_PARTIALS.keys() <= settings.keys():  # partials passed here replace the stored settings
            hparams = current_hyperparameters(hparams, source, advice)
        required = [
            name
            for name, parameter in inspect.signature(cls.__init__).parameters.items()
            if parameter.kind is parameter.KEYWORD_ONLY and parameter.default is parameter.empty
        ]
        missing = [name for name in required if name not in hparams]
        if missing:
            raise ValueError(
                f"{source} lacks the hyper-parameters {', '.join(missing)} that {cls.__name__} "
                "takes (saved by another module or version?): pass them to load_from_checkpoint as keyword "
                "arguments"
            )
        for group in (group for group in FORMER_PARTIALS if group not in settings):  # those from the file
            check_stored_partial(hparams[group], group, source)
        return settings | {group: hparams[group] for group in FORMER_PARTIALS}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.backbone.parameters() if p.requires_grad]

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm=None
    ) -> None:
        """Lightning's clipping (trainer.gradient_clip_val, by norm), except for a fused optimiser under
        bf16-mixed, whose gradients are clipped here by the same norm: Lightning's mixed-precision plugin refuses
        every fused optimiser, for 16-mixed, where it unscales the gradients inside its step; bf16 scales none."""
        fused = any(group.get("fused") for group in optimizer.param_groups)
        if not (fused and gradient_clip_val and self.trainer.precision == "bf16-mixed"):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"trainer.gradient_clip_algorithm={gradient_clip_algorithm}: a fused optimiser under bf16-mixed is "
                "clipped by norm; set it to norm, or model.optimizer.fused=null"
            )
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(parameters, gradient_clip_val)
        return None

    def configure_optimizers(self) -> dict:
        parameters = self.trainable_parameters()
        on_device = optimizer_device_settings(
            self.hparams.optimizer, parameters[0].device.type, str(self.trainer.precision), "model.optimizer"
        )
        optimizer = instantiate_partial(self.hparams.optimizer, "model.optimizer", **on_device)(parameters)
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
        """{"total_steps": trainer.max_steps + 100} where the scheduler's total_steps is null, else the whole
        number set (`1e5` read as 100000; a word is refused naming it), which must cover trainer.max_steps (torch
        refuses to step a OneCycle schedule past its end)."""
        scheduler = self.hparams.scheduler
        if "total_steps" not in scheduler:
            return {}
        max_steps = self.trainer.max_steps
        if scheduler["total_steps"] is not None:
            total_steps = whole_number(scheduler["total_steps"], "model.scheduler.total_steps")
            if max_steps is not None and max_steps > total_steps:
                raise ValueError(
                    f"model.scheduler.total_steps={total_steps} is below trainer.max_steps="
                    f"{max_steps}: the schedule would end before training does; set "
                    f"model.scheduler.total_steps >= {max_steps}, or null for trainer.max_steps + "
                    f"{SCHEDULE_STEPS_AFTER_MAX_STEPS}"
                )
            return {"total_steps": total_steps}
        if max_steps is None or max_steps < 1:
            raise ValueError(
                "model.scheduler.total_steps is null, so it is derived from trainer.max_steps + 100, but "
                f"trainer.max_steps is {max_steps}; set trainer.max_steps (or model.scheduler.total_steps)"
            )
        return {"total_steps": max_steps + SCHEDULE_STEPS_AFTER_MAX_STEPS}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse to step on a NaN/inf loss of the steps since the last one (`defer_finite_check`) or gradient
        (they would poison the weights), read together; log the gradient norm."""
        checked, self.unchecked_losses = self.unchecked_losses, []
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        # the 2-norm of all gradients together; on a GPU by torch's foreach kernels, a few launches where one per
        # parameter (about 400 in the official-size network) went before; on the CPU one norm per gradient
        grad_norm = torch.nn.utils.get_total_norm(grads) if grads else None
        if grad_norm is not None:
            checked.append(("gradient norm", grad_norm))
        if checked:
            check_finite(checked, self.global_step)
        if grad_norm is not None:
            self.log("train/grad_norm", grad_norm)
