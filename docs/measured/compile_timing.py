"""runtime.compile's cost and gain on the CPU (docs/performance.md, "TF32 and torch.compile"): the tiny backbone,
inference, batch 1, 64x96, 32 decoder iterations, one thread, inductor. Prints the first compiled call's CPU
seconds (this process and the C++ compiler it runs) and wall seconds, the compiled flow's largest difference from
eager, and the steady forward (median of 5, this thread's CPU seconds) compiled and eager.

    TORCHINDUCTOR_COMPILE_THREADS=1 OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        .venv/bin/python docs/measured/compile_timing.py [checkout]

checkout: the repository whose flowformer/ and tests/helpers/ are measured (default: this one), so that another
commit's tree (`git archive <commit> flowformer conf tests/helpers | tar -x -C <dir>`) is timed the same way."""

import os
import resource
import statistics
import sys
import time
from pathlib import Path

CHECKOUT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2])
sys.path[:0] = [str(CHECKOUT), str(CHECKOUT / "tests")]

import torch
from omegaconf import OmegaConf

from flowformer.tasks.runtime import compile_network

from helpers.configs import build_backbone

ITERS = 32


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
    net = build_backbone().eval()
    eager = build_backbone().eval()
    eager.load_state_dict(net.state_dict())
    images = [torch.rand(1, 3, 64, 96) * 255 for _ in range(2)]
    settings = {"compile": True, "compile_backend": "inductor", "compile_mode": "default"}
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
