"""task=bench: time one step of cfg.backbone and its peak memory, over a list of input sizes, memory paths
(dense, or bounded by `backbone.memory_budget_gb`), sets of stages recomputed in backward
(`backbone.activation_checkpoint`, for the training steps) and precisions.

bench.mode picks the step:
  forward:  the eval-mode forward (inference);
  train:    a supervised training step: forward, sequence loss, backward, AdamW step (model=flow's loss);
  pretrain: an MCVA pretraining step of cfg.model (model=mcva): masked encode, query rounds, backward, AdamW;
  data:     no step: the pairs per second of cfg.data's training loader (`bench=data`, flowformer/tasks/bench_data.py).

    python run.py task=bench backbone=flowformer bench.sizes=[[432,960]] bench.device=cuda
    python run.py task=bench backbone=flowformer bench.sizes=[[368,496],[720,1280],[1080,1920]] \
        bench.memory_budgets_gb=[null,2] bench.precisions=[32-true,bf16-mixed]
    python run.py task=bench backbone=flowformer bench.mode=train bench.batch_size=8 bench.precisions=[bf16-mixed]
    python run.py task=bench backbone=flowformer bench.mode=train \
        'bench.activation_checkpoints=[[],[image_encoders,tokenize,cost_layers,decoder]]'
    python run.py task=bench backbone=flowformer_pp model=mcva bench.mode=pretrain bench.batch_size=8

With `runtime.compile=true` the network's stages are torch.compiled; the first warmup step of a row compiles
them, and the row's `compile_s` is that step's time minus the row's mean step time (the compile time, with the
warmup's one-off costs such as allocator growth). `runtime.matmul_precision` applies in every row.

`bench.rows` names rows whose settings differ in more than these (mode, backbone, model, batch, iterations,
runtime), each a list of overrides after the command line's: `python run.py task=bench bench=gpu` (`make
bench-gpu`) runs the GPU figures of docs/performance.md that way. The backbone's memory settings left `auto`
are chosen for bench.device (flowformer/device_settings.py); each row records its `tokenize_chunk`.

Every row also counts, on any device, the operators (aten calls: kernel launches on a GPU) that the eager
network dispatches in one step of the row and in one decoder iteration (`count_operators`). A forward row's steps
run as task=eval runs its pairs: under mixed precision each weight is cast at the first step only
(`InferenceContext.keeping_weight_casts`).

`bench.profile_steps=N` runs N more steps of each row under torch.profiler after the timed ones (`profile_steps`):
the row records seconds per profiled step, the seconds the GPU ran kernels in it (wall minus busy: the GPU
waiting for launches) and the operators taking the most device and CPU time, also in bench.md.

Every row (size x memory path x recomputed stages x precision) runs in a fresh process, so its peak memory is its own (a CPU
process's peak RSS only grows) and a row that runs out of memory is recorded as such instead of ending the
benchmark. Writes <run dir>/bench.json (the machine and every row), bench.md (the table) and bench.png (time and
peak memory against megapixels, one line per path, recomputed stages and precision). Returns the first row's mean
seconds per step.

A stop signal (Ctrl-C, SIGTERM, SIGUSR1) ends the row in progress (its process is killed; the rows' processes
never see the signals themselves) and the rows after it: each is recorded "stopped by <signal>", the files are
written with the rows measured so far, and the run exits with status 128 + the signal's number, one line saying so.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import platform
import resource
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from flowformer.device_settings import device_memory_settings, optimizer_device_settings
from flowformer.losses import sequence_loss
from flowformer.models.build import ACTIVATION_CHECKPOINT_STAGES
from flowformer.models.output_files import atomic_write, atomic_write_text
from flowformer.setting_types import check_setting_types, count_at_least, instantiate_partial
from flowformer.stop_signals import STOP_SIGNALS, StoppedBySignal, StopSignals
from flowformer.tasks.runtime import (
    InferenceContext,
    autocast_context,
    check_precision,
    compile_network,
    compiled_parts,
    configure_runtime,
    load_network,
    pick_device,
)

log = logging.getLogger(__name__)

MODES = ("forward", "train", "pretrain", "data")


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_step(
    cfg: DictConfig, device: torch.device, image1: Tensor, image2: Tensor
) -> tuple[nn.Module, Callable[[], None]]:
    """(the network, one benchmark step of bench.mode on the given images [B,3,H,W]) at `bench.precision`."""
    bench = cfg.bench
    if bench.mode == "forward":
        net = load_network(cfg.backbone, None, device)  # timing only: random weights

        def forward() -> None:
            with InferenceContext(device, bench.precision, "bench.precisions"):
                net(image1, image2, iters=bench.iters)

        return net, forward

    if bench.mode == "pretrain":
        check_pretrain_model(cfg.model)
        check_setting_types(cfg.model, "model", given_elsewhere=("backbone",))
        backbone = device_memory_settings(cfg.model.backbone, device, training=True)
        module = hydra.utils.instantiate(cfg.model, backbone=backbone).to(device).train()
        net = module.backbone

        def loss() -> Tensor:
            return module.pretrain_step(image1, image2).loss

    else:
        backbone = device_memory_settings(cfg.backbone, device, training=True)
        net = hydra.utils.instantiate(backbone).to(device).train()
        flow_gt = torch.randn(image1.shape[0], 2, *image1.shape[-2:], device=device) * 10  # [B,2,H,W]
        valid = torch.ones(image1.shape[0], *image1.shape[-2:], device=device)  # [B,H,W]

        def loss() -> Tensor:
            predictions = net(image1, image2, iters=bench.iters)["flow_predictions"]
            return sequence_loss(predictions, flow_gt, valid)[0]

    # the model's optimiser at a tiny rate, its kernel chosen for the device
    optimizer_cfg = OmegaConf.to_container(cfg.model.optimizer, resolve=True)
    on_device = optimizer_device_settings(optimizer_cfg, device.type, bench.precision, "model.optimizer")
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = instantiate_partial(optimizer_cfg, "model.optimizer", lr=1e-6, **on_device)(trainable)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast_context(device, bench.precision, "bench.precisions"):
            value = loss()
        value.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()

    return net, train_step


class OperatorCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active: every aten call, forward, backward and optimizer
    alike, each one kernel launch or more on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def operators_dispatched(run: Callable[[], object]) -> int:
    """How many operators `run()` dispatches."""
    with OperatorCounter() as counter:
        run()
    return counter.count


def count_operators(cfg: DictConfig, net: nn.Module, step: Callable[[], None], images: tuple[Tensor, Tensor]) -> dict:
    """{"operators_per_step": one steady step of the row (after one that creates the optimizer's state),
    "operators_per_decoder_iteration": those of a forward with 2 decoder iterations minus those with 1, in the
    row's precision, as the row runs the network (inference for bench.mode=forward, training otherwise)}."""
    bench = cfg.bench
    device = images[0].device

    def forward(iters: int) -> None:
        if bench.mode == "forward":
            with InferenceContext(device, bench.precision, "bench.precisions"):
                net(*images, iters=iters)
            return
        with torch.enable_grad(), autocast_context(device, bench.precision, "bench.precisions"):
            net(*images, iters=iters)

    step()
    return {
        "operators_per_step": operators_dispatched(step),
        "operators_per_decoder_iteration": operators_dispatched(lambda: forward(2))
        - operators_dispatched(lambda: forward(1)),
    }


def row_config(
    cfg: DictConfig,
    size: list[int],
    budget_gb: float | None,
    precision: str,
    recomputed: list[str] | None = None,
) -> DictConfig:
    """What one row's process needs (seed, runtime, bench, backbone, model) as plain values, with
    `bench.height/width/precision`, `backbone.memory_budget_gb` and `backbone.activation_checkpoint` (None: the
    backbone's) set to the row's. Only these nodes are resolved: resolving the whole config would claim another
    run directory (`paths.output_dir` is `${fresh_dir:...}`)."""
    nodes = ("runtime", "bench", "backbone", "model")
    row = {key: OmegaConf.to_container(cfg[key], resolve=True) for key in nodes}
    row["bench"] |= {"height": size[0], "width": size[1], "precision": precision}
    row["backbone"]["memory_budget_gb"] = budget_gb
    if recomputed is not None:
        row["backbone"]["activation_checkpoint"] = list(recomputed)
    row["model"]["backbone"] = row["backbone"]
    return OmegaConf.create({"seed": cfg.seed, **row})


def measure(cfg: DictConfig) -> dict[str, Any]:
    """Time `bench.repeats` steps after `bench.warmup` ones at bench.height x bench.width, in this process, after
    counting the operators of the eager network (`count_operators`)."""
    bench = cfg.bench
    configure_runtime(cfg.runtime)
    device = pick_device(bench.device, "bench.device")
    torch.manual_seed(cfg.seed)
    shape = (bench.batch_size, 3, bench.height, bench.width)
    image1 = torch.rand(shape, device=device) * 255  # [B,3,H,W] in 0..255
    image2 = torch.rand(shape, device=device) * 255
    net, step = build_step(cfg, device, image1, image2)
    built_rss = peak_rss_mib()
    kept: AbstractContextManager = nullcontext()
    if bench.mode == "forward":  # each weight cast once for all the steps, as task=eval and task=infer run pairs
        kept = InferenceContext(device, bench.precision, "bench.precisions").keeping_weight_casts()
    with kept:
        return measure_steps(cfg, net, step, (image1, image2), built_rss)


def measure_steps(
    cfg: DictConfig, net: nn.Module, step: Callable[[], None], images: tuple[Tensor, Tensor], built_rss: float
) -> dict[str, Any]:
    """`measure`'s counts and timings of `step` on `images` [B,3,H,W]; `built_rss`: the peak RSS (MiB) once the
    network was built."""
    bench = cfg.bench
    device = images[0].device
    operators = count_operators(cfg, net, step, images)  # eager: the counts are of the uncompiled network
    compile_network(net, cfg.runtime)  # in place: the step's calls of the network's stages compile

    def timed_step() -> float:
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    warmup_seconds = [timed_step() for _ in range(bench.warmup)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = [timed_step() for _ in range(bench.repeats)]
    mean_s = sum(seconds) / len(seconds)
    result = {
        "status": "ok",
        "mean_s": mean_s,
        "min_s": min(seconds),
        "pairs_per_s": bench.batch_size / mean_s,  # image pairs through the step per second: the throughput
        "parameters_m": sum(p.numel() for p in net.parameters()) / 1e6,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "tokenize_chunk": net.config["tokenize_chunk"],
        **operators,
    }
    if cfg.runtime.compile:
        result["compile_s"] = warmup_seconds[0] - mean_s
    if device.type == "cuda":
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        # whole process: interpreter, torch and the weights (`built_rss_mib`, before any input) plus the step
        result |= {"peak_rss_mib": peak_rss_mib(), "built_rss_mib": built_rss}
    if bench.profile_steps:
        result |= profile_steps(step, bench.profile_steps, device)
    return result


def profile_steps(step: Callable[[], None], steps: int, device: torch.device) -> dict[str, Any]:
    """`steps` more steps under torch.profiler, after the timed ones: {"profile_wall_s": wall seconds per profiled
    step, "profile_busy_s": seconds per step the GPU ran kernels (0 on a CPU; wall minus busy is the GPU waiting
    for launches), "profile": the operators taking the most device time (CPU time on a CPU), then those taking
    the most CPU time (dispatch and launch overhead)}."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall_s = (time.perf_counter() - start) / steps
    events = profiler.key_averages()
    # the kernels' own rows (an operator's row repeats its kernels' time), as the profiler's "Self CUDA time total"
    busy_us = sum(event.self_device_time_total for event in events if event.device_type != DeviceType.CPU)
    by_device = events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=30,
                             max_name_column_width=70)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70)
    return {"profile_wall_s": wall_s, "profile_busy_s": busy_us / 1e6 / steps,
            "profile": f"{steps} steps, by device time:\n{by_device}\nby CPU time:\n{by_cpu}"}


def _measure_in_child(config: dict, results: multiprocessing.Queue) -> None:
    cfg = OmegaConf.create(config)
    try:
        results.put(measure(cfg))
    except torch.OutOfMemoryError as error:
        results.put({"status": "out of memory", "error": str(error).splitlines()[0]})
    except Exception as error:  # noqa: BLE001 - any error of the row is reported in its row; the next row runs
        results.put({"status": "failed", "error": f"{type(error).__name__}: {error}".splitlines()[0]})


def measure_isolated(cfg: DictConfig, timeout_s: float | None, stop: StopSignals) -> dict[str, Any]:
    """`measure(cfg)` in a fresh (spawned) process; a process killed on the way (e.g. by the kernel's OOM
    killer), past `timeout_s` or on a stop signal (`stop.received`) gives a row with that status instead of an
    exception. The process starts with the stop signals blocked (a spawned process keeps its parent's signal
    mask), so a terminal's Ctrl-C, which reaches every process of the job, leaves it to this one."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_measure_in_child, args=(OmegaConf.to_container(cfg), results))
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        child.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # one that came meanwhile is handled now
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while child.is_alive() and stop.received is None and (deadline is None or time.monotonic() < deadline):
        child.join(0.1 if deadline is None else min(0.1, max(deadline - time.monotonic(), 0.0)))
    if child.is_alive():
        child.kill()
        child.join()
        if stop.received is not None:
            return {"status": f"stopped by {stop.received.name}"}
        return {"status": f"stopped after bench.timeout_s={timeout_s}"}
    if child.exitcode != 0:  # died without reporting: killed, or crashed outside Python
        killed = child.exitcode < 0 and -child.exitcode == 9
        return {"status": "killed (out of memory?)" if killed else f"failed (exit code {child.exitcode})"}
    return results.get()


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    info = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def path_label(budget_gb: float | None, recomputed: list[str]) -> str:
    """The memory path of a row: dense or its budget, and the stages it recomputes in backward, if any."""
    path = "dense" if budget_gb is None else f"budget {budget_gb:g} GB"
    if not recomputed:
        return path
    everything = set(recomputed) == set(ACTIVATION_CHECKPOINT_STAGES)
    return f"{path}, recomputing {'all stages' if everything else '+'.join(recomputed)}"


def memory_measure(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(the rows' memory key, its title): GPU rows report allocated memory, CPU rows the process's RSS."""
    if any("peak_gpu_mib" in row for row in rows):
        return "peak_gpu_mib", "peak GPU allocated"
    return "peak_rss_mib", "peak RSS"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per row (first its name, for the rows of bench.rows): seconds per step and pairs per second
    (batch size / seconds); a `compile s` column when the rows were compiled (runtime.compile); the operators
    dispatched per step and per decoder iteration; on CPU, beside the process's peak RSS, the part above the built
    model (`built_rss_mib`: interpreter, torch, weights), the step's own, which is what the memory paths change."""
    memory_key, memory_title = memory_measure(rows)
    compiled = any("compile_s" in row for row in rows)
    above_built = memory_key == "peak_rss_mib"
    named = any("name" in row for row in rows)
    titles = ["row"] * named + ["size", "megapixels", "path", "precision", "seconds per step", "pairs per second"]
    titles += ["compile s"] * compiled + ["operators per step", "operators per decoder iteration"]
    titles += [memory_title, *(["above the built model"] * above_built), "status"]
    lines = [f"| {' | '.join(titles)} |", "|" + "---|" * len(titles)]
    for row in rows:
        cells = [row.get("name", "-")] * named + [
            f"{row['height']}x{row['width']}",
            f"{row['megapixels']:.2f}",
            row["path"],
            row["precision"],
            f"{row['mean_s']:.3f}" if "mean_s" in row else "-",
            f"{row['pairs_per_s']:.2f}" if "pairs_per_s" in row else "-",
        ]
        if compiled:
            cells.append(f"{row['compile_s']:.1f}" if "compile_s" in row else "-")
        cells += [str(row.get(key, "-")) for key in ("operators_per_step", "operators_per_decoder_iteration")]
        cells.append(f"{row[memory_key] / 1024:.2f} GiB" if memory_key in row else "-")
        if above_built:
            above = row[memory_key] - row["built_rss_mib"] if memory_key in row else None
            cells.append("-" if above is None else f"{above / 1024:.2f} GiB")
        cells.append(row["status"] + (f": {row['error']}" if "error" in row else ""))
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Time and peak memory against megapixels, one line per (path, precision)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    memory_key, memory_title = memory_measure(rows)
    figure, (time_axis, memory_axis) = pyplot.subplots(1, 2, figsize=(11, 4))
    lines: dict[str, list[dict[str, Any]]] = {}  # "<path>, <precision>" -> its finished rows, in size order
    for row in rows:
        done = lines.setdefault(row.get("name") or f"{row['path']}, {row['precision']}", [])
        if row["status"] == "ok":
            done.append(row)
    for label, done in lines.items():
        megapixels = [row["megapixels"] for row in done]
        time_axis.plot(megapixels, [row["mean_s"] for row in done], marker="o", label=label)
        memory_axis.plot(megapixels, [row[memory_key] / 1024 for row in done], marker="o", label=label)
    time_axis.set(xlabel="megapixels", ylabel="seconds per step", title="time")
    memory_axis.set(xlabel="megapixels", ylabel="GiB", title=memory_title)
    for axis in (time_axis, memory_axis):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    with atomic_write(path) as file:
        figure.savefig(file, format=path.suffix[1:], dpi=100)
    pyplot.close(figure)


def check_pretrain_model(model: DictConfig) -> None:
    """bench.mode=pretrain times an MCVA module's step: `model` must be one (model=mcva)."""
    # Lightning, which the forward and train rows' processes start without.
    from flowformer.lit.mcva import MCVAPretrainModule

    if not issubclass(hydra.utils.get_class(model._target_), MCVAPretrainModule):
        raise ValueError(  # noqa: TRY004 - a setting's error, which run.py reports in one line
            "bench.mode=pretrain times an MCVA step: add model=mcva (and a flowformer_pp backbone)"
        )


def check_settings(cfg: DictConfig) -> None:
    bench = cfg.bench
    if bench.mode not in MODES:
        raise ValueError(f"bench.mode={bench.mode!r}: expected one of {MODES}")
    if bench.mode == "pretrain":  # every row would be built, then recorded failed
        check_pretrain_model(cfg.model)
    for key, least in (("iters", 1), ("repeats", 1), ("warmup", 0), ("batch_size", 1), ("profile_steps", 0)):
        count_at_least(bench[key], f"bench.{key}", least)
    for key in ("sizes", "memory_budgets_gb", "activation_checkpoints", "precisions"):  # their product: the rows
        if not bench[key]:
            raise ValueError(f"bench.{key} is empty: the rows are its values times the others'; give at least one")
    for size in bench.sizes:
        pair = OmegaConf.is_list(size) and len(size) == 2 and all(isinstance(side, int) for side in size)
        if not pair or size[0] % 8 or size[1] % 8 or min(size) <= 0:
            raise ValueError(
                f"bench.sizes: each size is [height, width], both positive multiples of 8 (bench.sizes=[[368,496]]); "
                f"got {OmegaConf.to_container(size) if OmegaConf.is_config(size) else size!r}"
            )
    for precision in bench.precisions:
        check_precision(precision, "bench.precisions")
    if cfg.runtime.compile and bench.warmup < 1:
        raise ValueError("runtime.compile=true needs bench.warmup >= 1: the first step compiles (not timed)")


def named_configs(cfg: DictConfig, command_line: list[str]) -> list[tuple[str | None, DictConfig]]:
    """(name, config) of each row of `bench.rows` (a preset's, e.g. conf/bench/gpu.yaml): the config of the
    run's command line (its overrides, which name the preset) with the row's overrides after them, then
    `bench.row_overrides` (e.g. tiny sizes for a CPU rehearsal of the preset); without bench.rows, (None, cfg)."""
    presets = cfg.bench.get("rows") or {}
    if not presets:
        return [(None, cfg)]
    after_every_row = list(cfg.bench.get("row_overrides") or [])
    return [
        (name, compose("config", overrides=[*command_line, *overrides, *after_every_row]))
        for name, overrides in presets.items()
    ]


def measure_rows(cfg: DictConfig, name: str | None, stop: StopSignals) -> list[dict[str, Any]]:
    """The rows of one config: one per size x memory path x recomputed stages x precision, each measured in its
    own process, the backbone's memory settings chosen once for bench.device (and logged); once a stop signal
    came (`stop.received`), each row is recorded stopped instead."""
    check_settings(cfg)
    bench = cfg.bench
    device = pick_device(bench.device, "bench.device")
    chosen = device_memory_settings(cfg.backbone, device, training=bench.mode != "forward")
    cfg = OmegaConf.merge(cfg, {"backbone": chosen})
    bench = cfg.bench  # bench.memory_budgets_gb's default, ${backbone.memory_budget_gb}, is now the chosen one
    recomputed_sets = [list(stages) for stages in bench.activation_checkpoints] if bench.mode != "forward" else [[]]
    rows = []
    for size, budget_gb, recomputed, precision in itertools.product(
        bench.sizes, bench.memory_budgets_gb, recomputed_sets, bench.precisions
    ):
        row = {"name": name} if name else {}
        row |= {
            "mode": bench.mode,
            "backbone": cfg.backbone.get("variant"),
            "batch_size": bench.batch_size,
            "iters": bench.iters,
            "height": size[0],
            "width": size[1],
            "megapixels": size[0] * size[1] / 1e6,
            "path": path_label(budget_gb, recomputed),
            "memory_budget_gb": budget_gb,
            "activation_checkpoint": recomputed,
            "precision": precision,
            "matmul_precision": cfg.runtime.matmul_precision,
        }
        if stop.received is not None:
            rows.append(row | {"status": f"stopped by {stop.received.name}"})
            continue
        log.info("bench: %s", row)
        row |= measure_isolated(row_config(cfg, size, budget_gb, precision, recomputed), bench.timeout_s, stop)
        log.info("bench: %s", json.dumps(row))
        rows.append(row)
    return rows


def run(cfg: DictConfig) -> float:
    check_settings(cfg)
    if cfg.bench.mode == "data":  # the training loader of cfg.data, not a step of the network
        # Lightning's data modules, which the rows' processes start without.
        from flowformer.tasks import bench_data

        return bench_data.run(cfg, machine())
    output_dir = Path(cfg.paths.output_dir)
    configs = named_configs(cfg, list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else [])
    for _, row_cfg in configs:
        check_settings(row_cfg)  # every row's settings before the first row runs
    output_dir.mkdir(parents=True, exist_ok=True)
    with StopSignals() as stop:
        rows = [row for name, row_cfg in configs for row in measure_rows(row_cfg, name, stop)]
    runtime = cfg.runtime
    setup = {
        key: cfg.bench[key] for key in ("mode", "batch_size", "iters", "warmup", "repeats", "device")
    } | {
        "backbone": cfg.backbone.get("variant"),
        "image_encoder": cfg.backbone.get("image_encoder"),
        "matmul_precision": runtime.matmul_precision,
        "cpu_mmap_threshold_mb": runtime.cpu_mmap_threshold_mb,
        "compile": (
            f"{runtime.compile_backend} ({runtime.compile_mode}) of {', '.join(compiled_parts(runtime))}"
            if runtime.compile
            else None
        ),
    }
    about = machine()
    record = {"machine": about, "setup": setup, "rows": rows}
    atomic_write_text(output_dir / "bench.json", json.dumps(record, indent=2))
    table = markdown_table(rows)
    profiles = "".join(
        f"\n### profile of {row.get('name') or row['path']}: {row['profile_wall_s'] * 1e3:.1f} ms a step, GPU busy "
        f"{row['profile_busy_s'] * 1e3:.1f} ms\n\n```\n{row['profile']}\n```\n"
        for row in rows
        if "profile" in row
    )
    atomic_write_text(output_dir / "bench.md", table + profiles)
    steps = (
        f"the rows of bench.rows ({', '.join(name for name, _ in configs)})"
        if configs[0][0]
        else f"{setup['mode']}, batch {setup['batch_size']}, {setup['iters']} iterations"
    )
    title = (
        f"{setup['backbone']} ({setup['image_encoder']}), {steps}, on {about.get('gpu', about['cpu'])}, "
        f"torch {about['torch']}" + (f", compiled: {setup['compile']}" if setup["compile"] else "")
    )
    plot(rows, title, output_dir / "bench.png")
    print(f"{title}\n{table}\nwrote {output_dir / 'bench.json'}, bench.md, bench.png")
    if stop.received is not None:
        measured = sum(row["status"] == "ok" for row in rows)
        raise StoppedBySignal(
            stop.received,
            f"task=bench stopped by {stop.received.name}: {measured} of its {len(rows)} rows measured, in "
            f"{output_dir / 'bench.json'}; the rows it did not finish are recorded stopped",
        )
    return rows[0].get("mean_s", float("nan"))
