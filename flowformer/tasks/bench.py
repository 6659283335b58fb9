"""task=bench: time the eval-mode forward of cfg.backbone at one input size and report its peak memory.

    python run.py task=bench backbone=flowformer bench.height=432 bench.width=960 bench.device=cuda
    python run.py task=bench backbone=tiny bench.device=cpu bench.repeats=3

Writes <run dir>/bench.json and returns the mean seconds per forward.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else as given (clear error when CUDA is absent)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} asked for CUDA, but torch sees no GPU here; use device=cpu")
    return device


def autocast_context(device: torch.device, precision: str):
    """'32-true' -> no autocast; 'bf16-mixed' / '16-mixed' -> autocast in that dtype (as the trainer does)."""
    if precision == "32-true":
        return nullcontext()
    dtypes = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    if precision not in dtypes:
        raise ValueError(f"bench.precision={precision!r}: expected one of 32-true, bf16-mixed, 16-mixed")
    return torch.autocast(device_type=device.type, dtype=dtypes[precision])


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(cfg: DictConfig) -> float:
    bench = cfg.bench
    if bench.height % 8 or bench.width % 8:
        raise ValueError(f"bench.height/width must be multiples of 8; got {bench.height}x{bench.width}")
    device = pick_device(bench.device)
    torch.manual_seed(cfg.seed)
    net = hydra.utils.instantiate(cfg.backbone).to(device).eval()
    shape = (bench.batch_size, 3, bench.height, bench.width)
    image1 = torch.rand(shape, device=device) * 255  # [B,3,H,W] in 0..255
    image2 = torch.rand(shape, device=device) * 255

    def forward() -> None:
        with torch.inference_mode(), autocast_context(device, bench.precision):
            net(image1, image2, iters=bench.iters)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(bench.warmup):
        forward()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(bench.repeats):
        start = time.perf_counter()
        forward()
        seconds.append(time.perf_counter() - start)

    result = {
        "backbone": cfg.backbone.get("_target_"),
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
