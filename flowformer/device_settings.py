"""Settings chosen for the device a network runs on, in one place: the memory settings of the backbone that
say `auto` (`backbone.tokenize_chunk`, `backbone.memory_budget_gb`: `device_memory_settings`) and the optimiser's
`fused: auto` (`optimizer_device_settings`). Each choice is logged in one line with its reason; a value the user
set is kept. `describe_device` is the one function that reads the device (its kind, name and free memory).
docs/performance.md, "Settings chosen for the device"."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from flowformer.models.build import AUTO, BOUNDED_TOKENIZE_CHUNK

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
# The memory settings `device_memory_settings` chooses where the config says AUTO, and those run_info.json records.
DEVICE_CHOSEN_SETTINGS = ("tokenize_chunk", "memory_budget_gb")
RECORDED_MEMORY_SETTINGS = (*DEVICE_CHOSEN_SETTINGS, "activation_checkpoint")


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


def choose_memory_settings(device: DeviceMemory, *, training: bool) -> dict[str, tuple[Any, str]]:
    """{setting: (its value for `device`, why)} for each of DEVICE_CHOSEN_SETTINGS."""
    return {
        "tokenize_chunk": choose_tokenize_chunk(device),
        "memory_budget_gb": choose_memory_budget(device, training=training),
    }


def device_memory_settings(backbone_cfg: DictConfig, device: torch.device, *, training: bool) -> DictConfig:
    """`backbone_cfg` with each of DEVICE_CHOSEN_SETTINGS that says `auto` replaced by the choice for `device`
    (`choose_memory_settings`; `training`: the network trains there, else it runs forward only), one log line
    each; a number or null set by the user is kept, and the device is not read when nothing says `auto`."""
    automatic = [setting for setting in DEVICE_CHOSEN_SETTINGS if backbone_cfg.get(setting) == AUTO]
    if not automatic:
        return backbone_cfg
    choices = choose_memory_settings(describe_device(device), training=training)
    chosen = {}
    for setting in automatic:
        value, why = choices[setting]
        log.info(
            "backbone.%s=auto -> %s (%s; set backbone.%s to choose)",
            setting,
            "null" if value is None else value,
            why,
            setting,
        )
        chosen[setting] = value
    return OmegaConf.merge(backbone_cfg, chosen)


def training_device(trainer_cfg: DictConfig) -> torch.device:
    """The device Lightning trains on, as far as the memory settings care: the GPU for trainer.accelerator gpu or
    cuda (or auto with a GPU), the CPU otherwise."""
    accelerator = trainer_cfg.get("accelerator", "auto")
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if on_gpu else "cpu")


def memory_settings(module: nn.Module) -> dict[str, Any]:
    """The memory settings (RECORDED_MEMORY_SETTINGS) the FlowFormer of `module` (itself, or a LightningModule's
    `backbone`) was built with: the values chosen for the device where the config said `auto` ({} for a network
    assembled by hand, which has no config)."""
    config = getattr(getattr(module, "backbone", module), "config", None) or {}
    return {setting: config[setting] for setting in RECORDED_MEMORY_SETTINGS if setting in config}


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
