"""Our FlowFormer beside the official code on the CPU (docs/performance.md, "Side by side with the official code
(CPU)"): both networks built with the same weights, their flows compared, then forward passes timed alternately
(official, ours, official, ours, ...), fp32, batch 1, under torch.no_grad (the official evaluation's context).

    PYTHONPATH=<dir with loguru and yacs> .venv/bin/python docs/measured/official_side_by_side.py \\
        --official /path/to/FlowFormer-Official [--height 440 --width 1024 --iters 32 --repeats 5]

--official: a checkout of github.com/drinkingcoder/FlowFormer-Official (its core/ and configs/things_eval.py);
under timm 1.0.x two imports it never uses must be deleted first (`overlay_external_default_cfg` in
core/FlowFormer/LatentCostFormer/twins.py, `activations` in .../encoder.py). It needs loguru and yacs, which this
repository does not install. The weights: --weights (an official .pth, e.g. a released things.pth), else the
official model's own initialisation (seeded) with every constant tensor (zero biases, LayerNorm weights, GMA's
gamma) given N(0, 0.1^2) noise so that no branch is switched off. Ours is `build_flowformer()` as a task builds
it on the CPU (bounded tokenization, dense plan).

Prints the flows' difference (px), then per network the median wall and user-CPU seconds of --repeats forwards
(after the flow comparison's, which warm both up, and --warmup more rounds), the ratios official / ours of the
medians and the median of the per-round ratios (the rounds interleave, so a round's two forwards share the
machine's load), and the same for the wall seconds of each forward's stages (`STAGES`) and of the rest (the cost
volume, the images' scaling). With --profile N, instead of the timing: the N operators of most self CPU time in
one forward of each network (torch.profiler). With --reuse-host-memory, ours runs on run.py's host allocator
(freed memory reused, flowformer/tasks/runtime.py) and the official forwards on glibc's memory maps; run.py's huge
pages come from THP_MEM_ALLOC_ENABLE=1 in the environment, for both networks (torch reads it when it is imported).
"""

import argparse
import ctypes
import os
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY))

from flowformer.models import build_flowformer
from flowformer.models.checkpoint import from_official
from flowformer.tasks.runtime import GLIBC_DEFAULT_MMAP_MAX, M_MMAP_MAX, configure_host_allocator

# The modules of each stage of a forward. Ours keeps the official module names (the state dicts' prefixes), and
# both networks call each of these modules once a forward (the decoder's iterations run inside memory_decoder).
STAGES = {
    "image encoders": ("context_encoder", "memory_encoder.feat_encoder"),
    "cost encoder": ("memory_encoder.cost_perceiver_encoder",),
    "decoder": ("memory_decoder",),
}


class StageClock:
    """The wall seconds a network's forward spends in each of STAGES, summed over its modules (forward hooks)."""

    def __init__(self, network: torch.nn.Module) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._started: dict[str, float] = {}
        for stage, names in STAGES.items():
            for name in names:
                module = network.get_submodule(name)
                module.register_forward_pre_hook(partial(self._start, stage))
                module.register_forward_hook(partial(self._stop, stage))

    def _start(self, stage: str, *_) -> None:
        self._started[stage] = time.perf_counter()

    def _stop(self, stage: str, *_) -> None:
        self.seconds[stage] += time.perf_counter() - self._started.pop(stage)

    def taken(self, total: float) -> dict[str, float]:
        """The stages' seconds since the last call, and "rest": `total` (the forward's wall seconds) less them."""
        seconds, self.seconds = self.seconds, dict.fromkeys(STAGES, 0.0)
        return {**seconds, "rest": total - sum(seconds.values())}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--official", type=Path, required=True, help="FlowFormer-Official checkout")
    parser.add_argument(
        "--weights", type=Path, default=None, help="official .pth (default: seeded random init)"
    )
    parser.add_argument("--height", type=int, default=440)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=0, help="rounds not kept, after the flow comparison")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", type=int, default=0, help="instead of timing, the N operators of most self CPU time"
    )
    parser.add_argument(
        "--reuse-host-memory",
        action="store_true",
        help="ours with run.py's host allocator (runtime.cpu_mmap_threshold_mb null: freed memory reused), the "
        "official forwards with glibc's memory maps; THP_MEM_ALLOC_ENABLE=1 in the environment gives both huge pages",
    )
    return parser.parse_args()


def build_official(checkout: Path, iters: int) -> torch.nn.Module:
    """The official model of configs/things_eval.py (FlowFormer, Things), `iters` decoder iterations."""
    if not (checkout / "core" / "FlowFormer").is_dir():
        sys.exit(
            f"error: --official {checkout}: no core/FlowFormer there; pass a FlowFormer-Official checkout"
        )
    sys.path[:0] = [str(checkout), str(checkout / "core")]
    try:
        from configs.things_eval import get_cfg
        from core.FlowFormer import build_flowformer as build_official_flowformer
    except ModuleNotFoundError as err:
        sys.exit(
            f"error: the official code needs {err.name}: pip install loguru yacs (or put them on PYTHONPATH)"
        )
    cfg = get_cfg()
    cfg.latentcostformer.pretrain = False  # no ImageNet download: the weights are loaded afterwards
    cfg.latentcostformer.decoder_depth = iters
    return build_official_flowformer(cfg).eval()


def official_weights(official: torch.nn.Module, path: Path | None, seed: int) -> dict[str, torch.Tensor]:
    """The weights both networks get, in the official layout without `module.`."""
    if path is not None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        return {
            k.removeprefix("module."): v.float() if v.is_floating_point() else v for k, v in state.items()
        }
    generator = torch.Generator().manual_seed(seed)
    state = {k: v.clone() for k, v in official.state_dict().items()}
    for value in state.values():
        if value.is_floating_point() and value.numel() > 0 and bool((value == value.flatten()[0]).all()):
            value += 0.1 * torch.randn(value.shape, generator=generator)
    return state


def image_pair(height: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth random colour texture (0..255) and the same texture moved by (+3.37, -1.62) px."""
    waves_per_channel = torch.randn(3, 24, 3, generator=torch.Generator().manual_seed(seed))
    ys, xs = torch.meshgrid(torch.arange(height).float(), torch.arange(width).float(), indexing="ij")

    def texture(dx: float, dy: float) -> torch.Tensor:
        channels = []
        for waves in waves_per_channel:
            period = 6 + 114 * waves[:, 0].sigmoid()
            angle, phase = waves[:, 1] * 3.1416, waves[:, 2] * 3.1416
            along = (xs[..., None] - dx) * angle.cos() + (ys[..., None] - dy) * angle.sin()
            channels.append((2 * 3.1416 * along / period + phase).sin().mean(-1))
        image = torch.stack(channels)
        return (127.5 + 127.5 * image / image.abs().amax()).round()[None]

    return texture(0.0, 0.0), texture(3.37, -1.62)


def user_seconds() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def timed(run) -> tuple[float, float]:
    """(wall, user CPU) seconds of one call."""
    wall, user = time.perf_counter(), user_seconds()
    run()
    return time.perf_counter() - wall, user_seconds() - user


def agreement(official_run, our_run) -> str:
    flow_up, flow_low = official_run()
    ours = our_run()
    up, low = (ours["flow"] - flow_up).abs(), (ours["flow_low"] - flow_low).abs()
    return (
        f"flow: max |d| {up.max():.3g} px, mean |d| {up.mean():.3g} px (max |flow| {flow_up.abs().max():.3g} px); "
        f"1/8 flow: max |d| {low.max():.3g}"
    )


Times = dict[str, list[tuple[float, float]]]
StageTimes = dict[str, list[dict[str, float]]]


def alternate(
    runs: dict, clocks: dict[str, StageClock], warmup: int, repeats: int
) -> tuple[Times, StageTimes]:
    """Each round runs every network once, in turn; the first `warmup` rounds are not kept. -> ({network: [(wall,
    user CPU) a round]}, {network: [its stages' wall seconds a round]})."""
    times: Times = {name: [] for name in runs}
    stage_times: StageTimes = {name: [] for name in runs}
    for round_index in range(warmup + repeats):
        for name, run in runs.items():
            measured = timed(run)
            stages = clocks[name].taken(measured[0])
            if round_index >= warmup:
                times[name].append(measured)
                stage_times[name].append(stages)
            print(
                f"round {round_index}: {name} {measured[0]:.2f} s wall, {measured[1]:.2f} s user "
                f"({', '.join(f'{stage} {seconds:.2f}' for stage, seconds in stages.items())} s wall)",
                flush=True,
            )
    return times, stage_times


def report(times: Times, stage_times: StageTimes) -> None:
    official, ours = times["official"], times["ours"]
    for column, label in ((0, "wall"), (1, "user CPU")):
        median_official = statistics.median(t[column] for t in official)
        median_ours = statistics.median(t[column] for t in ours)
        per_round = statistics.median(o[column] / u[column] for o, u in zip(official, ours, strict=True))
        print(
            f"{label}: official {median_official:.2f} s, ours {median_ours:.2f} s (medians of {len(ours)}); "
            f"official/ours {median_official / median_ours:.2f}x, median per round {per_round:.2f}x"
        )
    for stage in stage_times["ours"][0]:
        median_official, median_ours = (
            statistics.median(t[stage] for t in stage_times[network]) for network in ("official", "ours")
        )
        print(
            f"{stage}: official {median_official:.2f} s, ours {median_ours:.2f} s wall (medians); "
            f"official/ours {median_official / median_ours:.2f}x"
        )


def profile(runs: dict, top: int) -> None:
    """One forward of each network under torch.profiler: its `top` operators by self CPU time."""
    for name, run in runs.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        events = sorted(prof.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
        total = sum(event.self_cpu_time_total for event in events)
        print(f"{name}: {total / 1e6:.2f} s self CPU time in all, the {top} largest operators:")
        for event in events[:top]:
            seconds = event.self_cpu_time_total / 1e6
            share = 100 * event.self_cpu_time_total / total
            print(f"  {event.key:<36} {event.count:>6} calls {seconds:7.2f} s {share:5.1f}%")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    official = build_official(args.official.resolve(), args.iters)
    state = official_weights(official, args.weights, args.seed)
    official.load_state_dict(state, strict=True)
    ours = build_flowformer().eval()
    ours.load_state_dict(from_official(state), strict=True)
    image1, image2 = image_pair(args.height, args.width, args.seed)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"{args.height}x{args.width}, {args.iters} iterations, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, load average {load}"
    )
    libc = ctypes.CDLL(None)

    def run_official():
        if args.reuse_host_memory:
            libc.mallopt(M_MMAP_MAX, GLIBC_DEFAULT_MMAP_MAX)  # tensors above glibc's threshold mapped again
        return official(image1, image2)

    def run_ours():
        if args.reuse_host_memory:
            configure_host_allocator(None)
        return ours(image1, image2, iters=args.iters)

    print(f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}, reuse host memory: {args.reuse_host_memory}")
    with torch.no_grad():
        runs = {"official": run_official, "ours": run_ours}
        print(agreement(runs["official"], runs["ours"]), flush=True)
        if args.profile:
            profile(runs, args.profile)
        else:
            clocks = {"official": StageClock(official), "ours": StageClock(ours)}
            report(*alternate(runs, clocks, args.warmup, args.repeats))


if __name__ == "__main__":
    main()
