"""Settings chosen for the device a network runs on, in one place: the memory settings of the backbone that
say `auto` (`backbone.tokenize_chunk`, `backbone.memory_budget_gb`, `backbone.activation_checkpoint`:
`device_memory_settings`) and the optimiser's `fused: auto` (`optimizer_device_settings`). Each choice is logged in one line with its reason; a value the user
set is kept. `describe_device` is the one function that reads the device (its kind, name and free memory).
docs/performance.md, "Settings chosen for the device"."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.optim.optimizer import _get_fused_kernels_supported_devices
from torch.utils.flop_counter import FlopCounterMode

from flowformer.models.build import ACTIVATION_CHECKPOINT_STAGES, AUTO, BOUNDED_TOKENIZE_CHUNK

log = logging.getLogger(__name__)


def available_memory_gb(device: torch.device) -> float:
    """Memory free for new tensors now: the GPU's free memory, or the machine's MemAvailable on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**30
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20  # kB
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


# backbone.tokenize_chunk=auto takes the fast path (every cost map patchified at once) on a GPU with at least this
# many GiB free: the heaviest step measured on it (MCVA, batch 24, flowformer_pp: 37.4 GiB) peaks at the same
# memory either way, since training keeps every chunk's activations; inference holds all of them at once
# (440x1024: 2.55 GiB instead of 0.74). Below it, and on a CPU (where 512 is also the faster), the bounded path.
FAST_PATH_FREE_GB = 32
# backbone.memory_budget_gb=auto where the network only runs forward (eval, infer, a forward bench row): this
# share of the memory free on the device. The network's plan keeps the dense computation wherever its estimate for
# the image at hand (cost volume, patchify activations, GMA's attention map: flowformer/models/memory_plan.py)
# fits in it and bounds those terms where it does not; the rest is left to the other activations and the weights.
FORWARD_SHARE_OF_FREE = 0.5
# backbone.activation_checkpoint=auto in training keeps every activation (the official training, no recomputation)
# where the step's estimated peak fits in this share of the memory free on the device, the rest being the margin
# for what the estimate leaves out (the allocator's fragmentation, the data, other processes).
FIT_SHARE_OF_FREE = 0.9
# A training step's peak memory over the bytes autograd saves for its backward pass (weights, their gradients and
# the optimiser's state apart): the activations' gradients and the backward's transients come on top. Measured on
# an H200 (bf16-mixed): the supervised step of experiment=chairs (batch 8, 368x496, 12 iterations) peaked at
# 23.8 GiB for 20.5 GiB estimated saved (1.15x), the MCVA step of experiment=mcva_pretrain (batch 24,
# [tokenize]) at 37.45 GiB for 30.9 GiB (1.21x, taken) (docs/performance.md, "Settings chosen for the device").
PEAK_PER_SAVED = 1.21
# Copies of a trainable weight a training step keeps (the weight, its gradient, AdamW's two moments).
TRAINABLE_WEIGHT_COPIES = 4
# The memory settings `device_memory_settings` chooses where the config says AUTO, and those run_info.json records.
DEVICE_CHOSEN_SETTINGS = ("tokenize_chunk", "memory_budget_gb", "activation_checkpoint")
# trainer.precision -> the autocast dtype the step's estimate runs under (any other precision: fp32)
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class DeviceMemory:
    """What the memory settings are chosen from: the device's kind (cuda, cpu, ...), its name and the memory free
    on it now, in GiB."""

    kind: str
    name: str
    free_gb: float


def describe_device(device: torch.device) -> DeviceMemory:
    """The one place that reads the device for the choices below (its name and free memory)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return DeviceMemory(kind=device.type, name=name, free_gb=available_memory_gb(device))


def choose_tokenize_chunk(device: DeviceMemory) -> tuple[int | None, str]:
    """(backbone.tokenize_chunk for `device`, why): null (the fast path) on a GPU with FAST_PATH_FREE_GB free,
    BOUNDED_TOKENIZE_CHUNK cost maps at a time elsewhere."""
    if device.kind == "cuda" and device.free_gb >= FAST_PATH_FREE_GB:
        return None, f"{device.name} has {device.free_gb:.1f} GiB free, at least {FAST_PATH_FREE_GB}: all at once"
    if device.kind == "cuda":
        return BOUNDED_TOKENIZE_CHUNK, (
            f"{device.name} has {device.free_gb:.1f} GiB free, under {FAST_PATH_FREE_GB}: the bounded path"
        )
    return BOUNDED_TOKENIZE_CHUNK, f"on the {device.name}, the bounded path is also the faster"


def choose_memory_budget(device: DeviceMemory, *, training: bool) -> tuple[float | None, str]:
    """(backbone.memory_budget_gb for `device`, why): in training null, the dense computation (a bounded
    training step recomputes each block's cost maps in backward); where the network runs forward only,
    FORWARD_SHARE_OF_FREE of the free memory, which the plan compares with its estimate for each image."""
    if training:
        return None, "training keeps the dense computation"
    budget = round(device.free_gb * FORWARD_SHARE_OF_FREE, 3)
    return budget, (
        f"{FORWARD_SHARE_OF_FREE:.0%} of the {device.free_gb:.1f} GiB free on the {device.name}: dense wherever "
        "the image's estimate fits"
    )


@dataclass(frozen=True)
class TrainingStep:
    """The training step backbone.activation_checkpoint=auto is chosen for: the LightningModule's config
    (`model`, cfg.model as YAML: its objective and decoder iterations), the batch of one process, the training
    crop and trainer.precision."""

    model: str
    batch: int
    height: int
    width: int
    precision: str


@dataclass(frozen=True)
class StepMemory:
    """A training step's estimate: the activations autograd keeps for backward (GiB, the weights apart), the
    weights with their gradients and AdamW's moments (GiB) and the FLOPs of forward and backward (counted where
    backward was run, else 0)."""

    saved_gb: float
    state_gb: float
    flops: int

    @property
    def peak_gb(self) -> float:
        return self.state_gb + PEAK_PER_SAVED * self.saved_gb


def training_loss(module: nn.Module, image1: Tensor, image2: Tensor) -> Tensor:
    """The loss one training step of `module` (FlowModule, MCVAPretrainModule, UnsupervisedPretrainModule)
    computes on images [B, 3, H, W], less what reads values (the logged metrics; the sequence loss's L1 terms
    without its validity mask). MCVA's mask, whose block sizes are numbers drawn first, is drawn on real tensors."""
    if hasattr(module, "mask_generator"):
        batch, _, height, width = image1.shape
        with unset_fake_temporarily():
            noise = module.mask_generator.noise(
                batch, height // 8, width // 8, generator=torch.Generator().manual_seed(0)
            )
        return module.pretrain_step(image1, image2, mask_noise=noise).loss
    if hasattr(module, "pretrain_step"):
        return module.pretrain_step(image1, image2)[0]
    predictions = module.backbone(image1, image2, iters=module.hparams.train_iters)["flow_predictions"]
    return torch.stack([prediction.float().abs().mean() for prediction in predictions]).sum()


@cache
def estimate_step_memory(
    step: TrainingStep, backbone_yaml: str, stages: tuple[str, ...], backward: bool
) -> StepMemory:
    """The memory of `step` for the backbone `backbone_yaml` recomputing `stages`, without running it: the
    module is built on the meta device (no weights drawn or loaded) and the step runs on fake tensors (shapes and
    dtypes only: FakeTensorMode), under autocast on the CPU for a mixed trainer.precision. The bytes saved for
    backward are those of each storage autograd keeps (saved_tensors_hooks; a storage once, the weights apart);
    `backward` also runs the backward pass, whose recomputation the FLOP count then includes. Cached: the
    estimate is the same for every device."""
    backbone = OmegaConf.merge(OmegaConf.create(backbone_yaml), {"activation_checkpoint": list(stages)})
    model = OmegaConf.create(step.model)
    fresh = {"init_from": None} if "init_from" in model else {}
    with torch.device("meta"):
        module = hydra.utils.instantiate(model, backbone=OmegaConf.merge(backbone, {"twins_weights": None}), **fresh)
    module.to_empty(device="cpu").train()
    parameters = list(module.parameters())
    weights = {parameter.untyped_storage()._cdata for parameter in parameters}
    saved: dict[int, int] = {}

    def count(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in weights:
            saved[storage._cdata] = storage.nbytes()
        return tensor

    dtype = AUTOCAST_DTYPES.get(step.precision)
    # FLOPs are counted where backward runs (stage_gains); the fit check alone counts none, in half the time
    flops = FlopCounterMode(display=False) if backward else None
    with FakeTensorMode(allow_non_fake_inputs=True), nullcontext() if flops is None else flops:
        image1, image2 = (torch.rand(step.batch, 3, step.height, step.width) * 255 for _ in range(2))
        with (
            torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor),
            torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None),
        ):
            loss = training_loss(module, image1, image2)
        if backward:
            loss.backward()
    copies = {True: TRAINABLE_WEIGHT_COPIES, False: 1}
    state = sum(p.numel() * p.element_size() * copies[p.requires_grad] for p in parameters)
    counted = 0 if flops is None else flops.get_total_flops()
    return StepMemory(saved_gb=sum(saved.values()) / 2**30, state_gb=state / 2**30, flops=counted)


def stage_gains(estimate: Callable[[tuple[str, ...], bool], StepMemory]) -> dict[str, tuple[float, int]]:
    """{stage: (GiB of saved activations recomputing it alone frees, FLOPs its recomputation adds)} for each of
    ACTIVATION_CHECKPOINT_STAGES that frees memory in this network (one it does not have, like tokenize with
    decoder=mcr, is refused by the network's config and left out)."""
    keeping = estimate((), True)
    gains = {}
    for stage in ACTIVATION_CHECKPOINT_STAGES:
        try:
            recomputing = estimate((stage,), True)
        except InstantiationException as error:
            if not isinstance(error.__cause__, ValueError):
                raise
            continue
        freed = keeping.saved_gb - recomputing.saved_gb
        if freed > 0:
            gains[stage] = (freed, max(recomputing.flops - keeping.flops, 1))
    return gains


def choose_recomputed_stages(
    device: DeviceMemory, estimate: Callable[[tuple[str, ...], bool], StepMemory]
) -> tuple[list[str], str]:
    """(backbone.activation_checkpoint for a training step on `device`, why), from `estimate(stages, backward)`:
    none, the fast path, where the step's estimated peak fits in FIT_SHARE_OF_FREE of the free memory; else the
    stages in order of the memory they free per FLOP their recomputation adds, until it fits (all of them
    where it never does, said in the reason)."""
    room = FIT_SHARE_OF_FREE * device.free_gb
    where = f"{FIT_SHARE_OF_FREE:.0%} of the {device.free_gb:.1f} GiB free on the {device.name}"
    keeping = estimate((), False)
    if keeping.peak_gb <= room:
        return [], f"the step's estimated peak, {keeping.peak_gb:.2f} GiB, fits in {where}: every activation kept"
    gains = stage_gains(estimate)
    order = sorted(gains, key=lambda stage: gains[stage][1] / gains[stage][0])
    chosen, peak = [], keeping.peak_gb
    for stage in order:
        if peak <= room:
            break
        chosen.append(stage)
        peak -= PEAK_PER_SAVED * gains[stage][0]
    frees = ", ".join(f"{stage} {gains[stage][0]:.2f} GiB for {gains[stage][1] / 1e12:.2f} TFLOP" for stage in order)
    verdict = (
        f"fits in {where}"
        if peak <= room
        else f"still exceeds {where}: lower data.batch_size or raise trainer.accumulate_grad_batches"
    )
    return chosen, (
        f"the step's estimated peak, {keeping.peak_gb:.2f} GiB, exceeds {where}; recomputing frees {frees}; "
        f"recomputing {as_override(chosen)}, {peak:.2f} GiB {verdict}"
    )


def choose_setting(
    setting: str, device: DeviceMemory, *, training: bool, step: TrainingStep | None, backbone_cfg: DictConfig
) -> tuple[Any, str]:
    """(the value of `setting`, one of DEVICE_CHOSEN_SETTINGS, for `device`, why). activation_checkpoint is
    estimated for `step` with the network of `backbone_cfg` (its other memory settings already chosen)."""
    if setting == "tokenize_chunk":
        return choose_tokenize_chunk(device)
    if setting == "memory_budget_gb":
        return choose_memory_budget(device, training=training)
    if not training:
        return [], "the network runs forward only: nothing is kept for backward"
    if device.kind != "cuda":  # sizing a step traces it (about a CPU-second even for the tiny network)
        return [], f"on the {device.name} every activation is kept: recomputation is sized for a GPU's memory"
    if step is None:
        return [], "no training step to size (bench: bench.activation_checkpoints sets each row's): every one kept"
    # estimated with every cost map tokenized at once: training keeps every chunk's activations, the same bytes,
    # and the step traces in fewer operations
    backbone_yaml = OmegaConf.to_yaml(OmegaConf.merge(backbone_cfg, {"tokenize_chunk": None}), resolve=True)
    return choose_recomputed_stages(
        device, lambda stages, backward: estimate_step_memory(step, backbone_yaml, stages, backward)
    )


def device_memory_settings(
    backbone_cfg: DictConfig, device: torch.device, *, training: bool, step: TrainingStep | None = None
) -> DictConfig:
    """`backbone_cfg` with each of DEVICE_CHOSEN_SETTINGS that says `auto` replaced by the choice for `device`
    (`choose_setting`; `training`: the network trains there, `step` its training step, else it runs forward
    only), one log line each; a value set by the user is kept, and the device is not read when nothing says
    `auto`."""
    automatic = [setting for setting in DEVICE_CHOSEN_SETTINGS if backbone_cfg.get(setting) == AUTO]
    if not automatic:
        return backbone_cfg
    described = describe_device(device)
    for setting in automatic:  # in DEVICE_CHOSEN_SETTINGS' order: activation_checkpoint sized with the others
        value, why = choose_setting(setting, described, training=training, step=step, backbone_cfg=backbone_cfg)
        log.info(
            "backbone.%s=auto -> %s (%s; set backbone.%s to choose)", setting, as_override(value), why, setting
        )
        backbone_cfg = OmegaConf.merge(backbone_cfg, {setting: value})
    return backbone_cfg


def as_override(value: Any) -> str:
    """`value` as the command line writes it: null, 512, [tokenize,cost_layers]."""
    if isinstance(value, list):
        return f"[{','.join(value)}]"
    return "null" if value is None else str(value)


# Why a setting that asks for CUDA is refused where torch.cuda.is_available() is false.
NO_GPU_HERE = "torch sees no GPU here (no NVIDIA GPU, or no working driver for it)"


def training_device(trainer_cfg: DictConfig) -> torch.device:
    """The device Lightning trains on, as far as the memory settings care: the GPU for trainer.accelerator gpu or
    cuda (or auto with a GPU), the CPU otherwise. A ValueError before any work where the accelerator asks for a
    GPU that torch does not see (`trainer=gpu` or `trainer=ddp` on a machine without one, or without its driver)."""
    accelerator = trainer_cfg.get("accelerator", "auto")
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"trainer.accelerator={accelerator} (trainer=gpu and trainer=ddp) asks for a GPU, but {NO_GPU_HERE}; "
            "train on the CPU with trainer=cpu, or with trainer.accelerator=cpu for trainer=ddp's processes"
        )
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if on_gpu else "cpu")


# The trainer.precision values the network trains at, as Lightning writes them and its aliases: full fp32, or
# autocast in bf16 or fp16 around fp32 weights.
TRAINING_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16", "16-mixed", "16")


def check_training_precision(trainer_cfg: DictConfig) -> None:
    """A ValueError before any work where trainer.precision is one the network cannot train at: Lightning's
    "true" precisions other than fp32 (bf16-true, 16-true, 64-true) cast every weight to that dtype, but the cost
    volume, the attention's softmax and the loss stay fp32 (the official code's islands), so the first convolution
    of the cost encoder failed with a dtype mismatch in the first training step."""
    precision = str(trainer_cfg.get("precision", "32-true"))
    if precision not in TRAINING_PRECISIONS:
        raise ValueError(
            f"trainer.precision={precision}: the network trains at 32-true, bf16-mixed or 16-mixed (autocast "
            "around fp32 weights); its cost volume, softmax and loss stay fp32, which weights cast to another "
            "dtype cannot take; to save memory, use bf16-mixed (trainer=gpu's) and "
            "backbone.activation_checkpoint"
        )


def memory_settings(module: nn.Module) -> dict[str, Any]:
    """The memory settings (DEVICE_CHOSEN_SETTINGS) the FlowFormer of `module` (itself, or a LightningModule's
    `backbone`) was built with: the values chosen for the device where the config said `auto` ({} for a network
    assembled by hand, which has no config)."""
    config = getattr(getattr(module, "backbone", module), "config", None) or {}
    return {setting: config[setting] for setting in DEVICE_CHOSEN_SETTINGS if setting in config}


def choose_fused_optimizer(device_kind: str, precision: str) -> tuple[bool | None, str]:
    """(the optimiser's `fused` for parameters on a `device_kind` device trained at trainer `precision`, why):
    true where torch has a fused kernel for it (CUDA, the CPU, ...: one pass over all parameters instead of a few
    kernels per tensor; on 2 CPU cores a 16M-parameter AdamW step took 0.17 s fused, 2.0 s per tensor, 2.3 s
    foreach), else torch's choice. Under 16-mixed torch's choice too: a fused optimiser unscales the fp16
    gradients inside its step, after clipping (bf16-mixed scales nothing: `BackboneModule` clips them itself)."""
    if precision == "16-mixed":
        return None, "under 16-mixed the gradients are clipped before a fused optimiser unscales them: torch's choice"
    if device_kind in _get_fused_kernels_supported_devices():
        return True, f"torch has a fused kernel for {device_kind} parameters"
    return None, f"torch has no fused kernel for {device_kind} parameters: its own choice"


def optimizer_device_settings(
    partial: Mapping[str, Any], device_kind: str, precision: str, setting: str
) -> dict[str, Any]:
    """{"fused": the choice for parameters on a `device_kind` device at `precision`} (`choose_fused_optimizer`,
    logged) when the optimiser partial `partial` (the config `setting`) says `fused: auto`; {} otherwise: the
    user's value."""
    if partial.get("fused") != AUTO:
        return {}
    fused, why = choose_fused_optimizer(device_kind, precision)
    log.info("%s.fused=auto -> %s (%s; set %s.fused to choose)", setting, fused, why, setting)
    return {"fused": fused}
