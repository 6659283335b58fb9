"""runtime.compile's cost and gain on the CPU (docs/performance.md, "TF32 and torch.compile"): by default the tiny
backbone, inference, batch 1, 64x96, 32 decoder iterations, one thread, inductor, every part compiled. Prints the
first compiled call's CPU seconds (this process and the C++ compiler it runs) and wall seconds, the compiled flow's
largest difference from eager, and the steady forward (median of 5, this thread's CPU seconds) compiled and eager.

    TORCHINDUCTOR_COMPILE_THREADS=1 OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        .venv/bin/python docs/measured/compile_timing.py [checkout] \\
        [--backbone flowformer] [--size 128 192] [--iters 4] [--regions decoder]

checkout: the repository whose flowformer/ and tests/helpers/ are measured (default: this one), so that another
commit's tree (`git archive <commit> flowformer conf tests/helpers | tar -x -C <dir>`) is timed the same way;
--regions: runtime.compile_regions (default: all its parts)."""

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("checkout", nargs="?", type=Path, default=Path(__file__).resolve().parents[2])
parser.add_argument("--backbone", default="tiny")
parser.add_argument("--size", type=int, nargs=2, default=[64, 96])
parser.add_argument("--iters", type=int, default=32)
parser.add_argument("--regions", nargs="+", default=["image_encoders", "cost_encoder", "decoder"])
ARGS = parser.parse_args()
sys.path[:0] = [str(ARGS.checkout), str(ARGS.checkout / "tests")]

import torch
from omegaconf import OmegaConf

from flowformer.tasks.runtime import compile_network

from helpers.configs import build_backbone

ITERS = ARGS.iters


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def steady_forward(model, images) -> float:
    times = []
    for _ in range(5):
        start = time.thread_time()
        model(*images, iters=ITERS)
        times.append(time.thread_time() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = build_backbone(ARGS.backbone).eval()
    eager = build_backbone(ARGS.backbone).eval()
    eager.load_state_dict(net.state_dict())
    images = [torch.rand(1, 3, *ARGS.size) * 255 for _ in range(2)]
    settings = {
        "compile": True, "compile_backend": "inductor", "compile_mode": "default", "compile_regions": ARGS.regions
    }
    compile_network(net, OmegaConf.create(settings))
    with torch.inference_mode():
        process, compiler, wall = (
            cpu_seconds(resource.RUSAGE_SELF),
            cpu_seconds(resource.RUSAGE_CHILDREN),
            time.time(),
        )
        flow = net(*images, iters=ITERS)["flow"]
        process = cpu_seconds(resource.RUSAGE_SELF) - process
        compiler = cpu_seconds(resource.RUSAGE_CHILDREN) - compiler
        wall = time.time() - wall
        difference = float((flow - eager(*images, iters=ITERS)["flow"]).abs().max())
        print(
            f"first call: {process + compiler:.1f} CPU s ({process:.1f} in the process), wall {wall:.0f} s, "
            f"load {os.getloadavg()[0]:.1f}"
        )
        print(f"max |compiled - eager| {difference:.2e} px")
        compiled_s, eager_s = steady_forward(net, images), steady_forward(eager, images)
        print(
            f"steady forward: compiled {compiled_s:.3f} CPU s, eager {eager_s:.3f} CPU s, "
            f"{eager_s / compiled_s:.2f}x"
        )


if __name__ == "__main__":
    main()
