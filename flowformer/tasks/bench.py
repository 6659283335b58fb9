"""task=bench: time one step of cfg.backbone at one input size and report its peak memory.

bench.mode picks the step:
  forward:  the eval-mode forward (inference);
  train:    a supervised training step: forward, sequence loss, backward, AdamW step (model=flow's loss);
  pretrain: an MCVA pretraining step of cfg.model (model=mcva): masked encode, query rounds, backward, AdamW.

    python run.py task=bench backbone=flowformer bench.height=432 bench.width=960 bench.device=cuda
    python run.py task=bench backbone=flowformer bench.mode=train bench.batch_size=8 bench.precision=bf16-mixed
    python run.py task=bench backbone=flowformer_pp model=mcva bench.mode=pretrain bench.batch_size=8
    python run.py task=bench backbone=tiny bench.device=cpu bench.repeats=3

Writes <run dir>/bench.json and returns the mean seconds per step.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Callable
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from flowformer.lit.mcva import MCVAPretrainModule
from flowformer.losses import sequence_loss
from flowformer.tasks.runtime import autocast_context, load_network, pick_device

log = logging.getLogger(__name__)


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_step(
    cfg: DictConfig, device: torch.device, image1: Tensor, image2: Tensor
) -> tuple[nn.Module, Callable[[], None]]:
    """(the network, one benchmark step of bench.mode on the given images [B,3,H,W])."""
    bench = cfg.bench
    modes = ("forward", "train", "pretrain")
    if bench.mode not in modes:
        raise ValueError(f"bench.mode={bench.mode!r}: expected one of {modes}")
    if bench.mode == "forward":
        net = load_network(cfg.backbone, None, device)  # timing only: random weights

        def forward() -> None:
            with torch.inference_mode(), autocast_context(device, bench.precision, "bench.precision"):
                net(image1, image2, iters=bench.iters)

        return net, forward

    if bench.mode == "pretrain":
        if not issubclass(hydra.utils.get_class(cfg.model._target_), MCVAPretrainModule):
            raise ValueError("bench.mode=pretrain times an MCVA step: add model=mcva (and a flowformer_pp backbone)")
        module = hydra.utils.instantiate(cfg.model).to(device).train()
        net = module.backbone

        def loss() -> Tensor:
            return module.pretrain_step(image1, image2).loss

    else:
        net = hydra.utils.instantiate(cfg.backbone).to(device).train()
        flow_gt = torch.randn(image1.shape[0], 2, *image1.shape[-2:], device=device) * 10  # [B,2,H,W]
        valid = torch.ones(image1.shape[0], *image1.shape[-2:], device=device)  # [B,H,W]

        def loss() -> Tensor:
            predictions = net(image1, image2, iters=bench.iters)["flow_predictions"]
            return sequence_loss(predictions, flow_gt, valid)[0]

    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-6)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast_context(device, bench.precision, "bench.precision"):
            value = loss()
        value.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()

    return net, train_step


def run(cfg: DictConfig) -> float:
    bench = cfg.bench
    if bench.height % 8 or bench.width % 8:
        raise ValueError(f"bench.height/width must be multiples of 8; got {bench.height}x{bench.width}")
    device = pick_device(bench.device)
    torch.manual_seed(cfg.seed)
    shape = (bench.batch_size, 3, bench.height, bench.width)
    image1 = torch.rand(shape, device=device) * 255  # [B,3,H,W] in 0..255
    image2 = torch.rand(shape, device=device) * 255
    net, step = build_step(cfg, device, image1, image2)

    def timed_step() -> None:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(bench.warmup):
        timed_step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(bench.repeats):
        start = time.perf_counter()
        timed_step()
        seconds.append(time.perf_counter() - start)

    result = {
        "mode": bench.mode,
        "backbone": cfg.backbone.get("_target_"),
        "variant": cfg.backbone.get("variant"),
        "size": [bench.height, bench.width],
        "batch_size": bench.batch_size,
        "iters": bench.iters,
        "precision": bench.precision,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "mean_s": sum(seconds) / len(seconds),
        "min_s": min(seconds),
        "parameters_m": sum(p.numel() for p in net.parameters()) / 1e6,
    }
    if device.type == "cuda":
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        result["peak_rss_mib"] = peak_rss_mib()  # whole process, including the warm-up
    output = Path(cfg.paths.output_dir) / "bench.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    log.info("bench: %s", json.dumps(result))
    print(json.dumps(result, indent=2))
    return result["mean_s"]
