"""Running the network: the `runtime` settings of every task that runs it (GPU matmul precision, the host
allocator, torch.compile), its parameter counts (logged by every task that builds it, and in run_info.json)
and, for the tasks that run it themselves (eval, infer, bench), the device, autocast precision, free memory,
the network with its checkpoint loaded and the progress bar over its pairs."""

from __future__ import annotations

import atexit
import ctypes
import logging
import platform
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text
from torch import nn

from flowformer.device_settings import NO_GPU_HERE, device_memory_settings
from flowformer.models import FlowFormer
from flowformer.models.checkpoint import checkpoint_file, load_backbone_weights
from flowformer.models.cost_encoder import CostPerceiverEncoder
from flowformer.models.decoder import MemoryDecoder
from flowformer.models.encoders import TwinsEncoder

log = logging.getLogger(__name__)


def pick_device(name: str, setting: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else as given (a ValueError naming `setting`, e.g.
    'eval.device', when it asks for CUDA and there is none)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{setting}={name} asks for CUDA, but {NO_GPU_HERE}; use {setting}=cpu")
    return device


PRECISION_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def check_precision(precision: str, setting: str) -> None:
    """'32-true' or a key of PRECISION_DTYPES, else a ValueError naming `setting` (e.g. 'eval.precision')."""
    if precision != "32-true" and precision not in PRECISION_DTYPES:
        raise ValueError(f"{setting}={precision!r}: expected one of 32-true, {', '.join(PRECISION_DTYPES)}")


def autocast_context(device: torch.device, precision: str, setting: str) -> AbstractContextManager:
    """'32-true' -> no autocast; 'bf16-mixed' / '16-mixed' -> autocast in that dtype (as the trainer does).
    `setting` names the config key the precision came from, for the error message (e.g. 'eval.precision')."""
    check_precision(precision, setting)
    if precision == "32-true":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=PRECISION_DTYPES[precision])


class InferenceContext:
    """Inference without autograd at `precision` (`autocast_context`), reusable: torch.inference_mode in full
    precision; under mixed precision torch.no_grad, where autocast casts each weight once per forward. Under
    inference_mode autocast's weight cache does not work and every call casts its weights again: 39 of the
    tiny decoder's 50 casts per iteration (docs/performance.md, "Operators dispatched")."""

    def __init__(self, device: torch.device, precision: str, setting: str) -> None:
        self.autocast = autocast_context(device, precision, setting)
        self.full_precision = precision == "32-true"
        self.device_type = device.type
        self.no_autograd: AbstractContextManager = nullcontext()

    def keeping_weight_casts(self) -> AbstractContextManager:
        """Open around a run of forwards, each in this context, of one network whose weights do not change
        (task=eval's and task=infer's pairs, bench's forward steps): under mixed precision autocast then casts each
        weight at the first forward and keeps the cast until this closes, instead of casting every weight again at
        every forward (282 of a flowformer_pp forward's 2392 operators: docs/performance.md, "Operators
        dispatched"). torch drops autocast's cast weights when the last open autocast region closes; this region
        is disabled, so it changes nothing inside it, but stays open (tests/models/test_operator_counts.py checks
        that torch keeps them). In full precision nothing is cast."""
        return nullcontext() if self.full_precision else torch.autocast(self.device_type, enabled=False)

    def __enter__(self) -> None:
        self.no_autograd = torch.inference_mode() if self.full_precision else torch.no_grad()
        self.no_autograd.__enter__()
        self.autocast.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        self.autocast.__exit__(*exc_info)
        self.no_autograd.__exit__(*exc_info)


MATMUL_PRECISIONS = ("highest", "high", "medium")
# Compiles dynamo keeps per compiled function (its default 8): a Twins block's forward meets 8 static shapes in
# each mode (2 widths x local/global attention x 1 or 2 images), so training and validation in one process need
# 16, and each further validation size 8 more; past the limit the function runs eagerly
COMPILES_PER_FUNCTION = 64
# glibc's mallopt parameters (malloc.h), its default cap on memory maps, and the largest mmap threshold it accepts
# on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX, 4 MiB x sizeof(long)); above it glibc refuses the setting.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
GLIBC_DEFAULT_MMAP_MAX = 65536
GLIBC_MAX_MMAP_THRESHOLD_MB = 32
TRIM_PER_MMAP_THRESHOLD = 4  # free memory kept at the heap's top, in mmap thresholds: no brk churn per step
NO_TRIM = -1  # M_TRIM_THRESHOLD: never give the heap's free top back (mallopt(3))


def configure_host_allocator(threshold_mb: float | None) -> None:
    """`runtime.cpu_mmap_threshold_mb`, how glibc's allocator serves CPU tensors (Linux with glibc only).

    None (the default): no tensor gets a memory map of its own, and freed memory stays in the process's heap for
    the next tensors. glibc would otherwise map every block above its threshold (at most 32 MiB; a 440x1024
    forward's largest tensors are 115 MiB) and unmap it when freed, so each such tensor is faulted in afresh, a
    page fault per 4 KiB: 37 ms for 115 MiB here. The process keeps its peak heap (docs/performance.md, "The host
    allocator"). run.py also has torch advise huge pages for tensors of 2 MiB and more (THP_MEM_ALLOC_ENABLE).

    A number: tensors of at least this many MiB get a memory map, given back to the OS when freed (the least
    memory, for more time: "Memory budgets and the mmap threshold"); the heap keeps at most
    TRIM_PER_MMAP_THRESHOLD thresholds free at its top."""
    setting = "runtime.cpu_mmap_threshold_mb"
    if threshold_mb is not None and not 0 < threshold_mb <= GLIBC_MAX_MMAP_THRESHOLD_MB:
        raise ValueError(
            f"{setting}={threshold_mb}: expected a size in MiB in (0, {GLIBC_MAX_MMAP_THRESHOLD_MB}] (glibc's "
            "largest), or null: no memory maps, freed memory reused"
        )
    if platform.libc_ver()[0] != "glibc":
        if threshold_mb is None:
            return  # another C library: its allocator keeps its own policy
        raise ValueError(f"{setting}={threshold_mb} needs glibc's allocator (Linux); set it to null here")
    libc = ctypes.CDLL(None)
    if threshold_mb is None:
        applied = libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM)
    else:
        size = int(threshold_mb * 2**20)
        applied = (
            libc.mallopt(M_MMAP_MAX, GLIBC_DEFAULT_MMAP_MAX)  # maps again, after a null in this process
            and libc.mallopt(M_MMAP_THRESHOLD, size)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_PER_MMAP_THRESHOLD * size)
        )
    if not applied:
        raise RuntimeError(f"{setting}={threshold_mb}: glibc's mallopt refused the setting")


# oneDNN's fp32 matmul precision, a setting of newer torch releases (torch 2.6 has none)
ONEDNN_MATMUL = getattr(torch.backends.mkldnn, "matmul", None)


def configure_runtime(settings: DictConfig) -> None:
    """Apply `runtime.matmul_precision` and `runtime.cpu_mmap_threshold_mb` to this process (torch's settings
    are per process) and check `runtime.compile_regions`: fp32 matmuls and cuDNN convolutions on the GPU in
    strict fp32 ('highest') or on TF32 tensor cores ('high', 'medium').
    CPU matmuls stay strict fp32 whatever the setting (torch would otherwise let oneDNN use TF32 or bf16 on
    CPUs that have them), so CPU numbers do not depend on it."""
    precision = settings.matmul_precision
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(
            f"runtime.matmul_precision={precision!r}: expected one of {', '.join(MATMUL_PRECISIONS)}"
        )
    torch.set_float32_matmul_precision(precision)
    if ONEDNN_MATMUL is not None:  # the setting would also reach oneDNN CPU matmuls
        ONEDNN_MATMUL.fp32_precision = "ieee"
    torch.backends.cudnn.allow_tf32 = precision != "highest"
    configure_host_allocator(settings.cpu_mmap_threshold_mb)
    compiled_parts(settings)  # checked also with runtime.compile off, where a typo would go unnoticed


def leave_process_group() -> None:
    """At this process's exit, while the interpreter is whole: the process group of its DDP run or of its
    launcher's table ends here (a local act under gloo and NCCL: no other process is waited for). Left to the
    interpreter's end, gloo's worker threads are destroyed after it and abort the process (torch 2.14: "terminate
    called without an active exception", SIGABRT, in about 4 of 10 two-process runs that end without it;
    docs/reliability.md). Lightning 2.6 does this at exit for NCCL groups only."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


atexit.register(leave_process_group)  # once per process: a multirun's jobs share its group (tasks/pipeline.py)


# runtime.compile_regions: the parts of the network runtime.compile compiles (`compile_regions`)
COMPILED_PARTS = ("image_encoders", "cost_encoder", "decoder")


def compile_regions(net: FlowFormer, parts: tuple[str, ...]) -> list[nn.Module]:
    """The modules `compile_network` compiles of `parts` (of COMPILED_PARTS) besides the decoder's refinement
    iteration, each a region that runs many times with the same shapes: the image encoders (a Twins encoder by
    its transformer blocks; once per forward), the cost encoder's patch embedding and latent summary (once per
    `tokenize_chunk` block) and each of its AGT layers, and the decoder's cost query, its token encoder and
    attention (once per MCVA query round; inside the iteration they are part of its graph). The loops between
    them run eagerly, so one compiled graph per region serves every call, however many."""
    decoder, cost_encoder = net.memory_decoder, net.cost_encoder
    regions: list[nn.Module] = []
    if "image_encoders" in parts:
        for encoder in [*net.feature_encoder_modules(), *net.context_encoder_modules()]:
            twins = isinstance(encoder, TwinsEncoder)
            regions += [block for stage in encoder.svt.blocks for block in stage] if twins else [encoder]
    if "cost_encoder" in parts:
        if isinstance(cost_encoder, CostPerceiverEncoder):
            regions += [cost_encoder.patch_embed, cost_encoder.input_layer]
            regions += [*cost_encoder.encoder_layers, *cost_encoder.vertical_encoder_layers]
        elif cost_encoder is not None:
            regions.append(cost_encoder)
    if "decoder" in parts and isinstance(decoder, MemoryDecoder):
        regions += [decoder.flow_token_encoder, decoder.decoder_layer.cross_attend]
    return regions


def compiled_parts(settings: DictConfig) -> tuple[str, ...]:
    """runtime.compile_regions as a tuple of COMPILED_PARTS; anything else is one error naming the key."""
    parts = settings.get("compile_regions", list(COMPILED_PARTS))
    if not isinstance(parts, (list, tuple, ListConfig)) or not set(parts) <= set(COMPILED_PARTS):
        raise ValueError(
            f"runtime.compile_regions={parts}: expected a list of {', '.join(COMPILED_PARTS)} (the parts "
            "runtime.compile compiles), e.g. runtime.compile_regions=[decoder]"
        )
    return tuple(parts)


def compile_network(net: FlowFormer, settings: DictConfig) -> None:
    """With `runtime.compile`, torch.compile the repeated regions of `net`'s parts in `runtime.compile_regions`
    in place (`compile_regions`, `nn.Module.compile`) and, with the decoder, its refinement iteration, one graph
    for the correlation lookup, update block, flow update and upsampling (`RecurrentRefinement.compile_iteration`;
    the decoder alone compiled in a third of the time on a CPU, docs/performance.md): compile time does not grow
    with the decoder's iterations, and `state_dict()` keys stay the plain ones (no `_orig_mod.`), so checkpoints
    load into uncompiled networks. Each region compiles on its first call with a new input shape or mode (train /
    eval), a static graph for each shape (`dynamic=False`): the image encoders meet one compiled block at several
    shapes in every forward (both images in the feature encoder, one in the context encoder; a Twins encoder's two
    widths), and dynamo's automatic dynamic shapes recompiled them for symbolic sizes, slower to compile and to
    run (docs/performance.md, "TF32 and torch.compile"). Under CUDA graphs (`region_compile_settings`) only the
    decoder's iteration is graphed."""
    if not settings.compile:
        return
    backend, mode, parts = settings.compile_backend, settings.compile_mode, compiled_parts(settings)
    regions_settings, cuda_graphs = region_compile_settings(backend, mode)
    dynamo = torch._dynamo.config
    limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # its older name
    setattr(dynamo, limit, max(getattr(dynamo, limit), COMPILES_PER_FUNCTION))
    regions = compile_regions(net, parts)
    for region in regions:
        region.compile(backend=backend, dynamic=False, **regions_settings)
    if "decoder" in parts:
        net.memory_decoder.compile_iteration(backend=backend, mode=mode, own_outputs=cuda_graphs)
    log.info(
        "torch.compile %s (mode %s) of %s: %d regions%s%s", backend, mode, ", ".join(parts), len(regions),
        " and the decoder's iteration" if "decoder" in parts else "",
        " (CUDA graphs: the iteration alone)" if cuda_graphs and "decoder" in parts else "",
    )


def region_compile_settings(backend: str, mode: str) -> tuple[dict[str, Any], bool]:
    """(torch.compile's keyword arguments for the regions other than the decoder's iteration, whether `mode` uses
    CUDA graphs). Inductor's modes with CUDA graphs (reduce-overhead, max-autotune) graph the decoder's iteration
    alone; the other regions get the mode's other options. Torch's CUDA graph trees refuse a graphed region's
    output as the input of another graphed region, or of its own next replay, in the same step ("accessing tensor
    output of CUDAGraphs that has been overwritten by a subsequent run": every region graphed failed on an H200,
    docs/performance.md), and batch-1 inference is bound by the decoder iteration's launches."""
    if backend != "inductor":
        return {"mode": mode}, False
    from torch._inductor import list_mode_options  # here: importing inductor costs every run 1.5 s of CPU

    modes = list(list_mode_options())
    if mode not in modes:
        raise ValueError(f"runtime.compile_mode={mode!r}: expected one of inductor's modes {', '.join(modes)}")
    options = dict(list_mode_options(mode))
    if not options.pop("triton.cudagraphs", False):
        return {"mode": mode}, False
    return {"options": options}, True


def load_network(
    backbone_cfg: DictConfig, checkpoint: str | None, device: torch.device, setting: str = "checkpoint"
) -> nn.Module:
    """The network of `backbone_cfg` on `device` in eval mode, with `checkpoint` (ours, an official .pth or a
    Lightning .ckpt; `setting` names where it was given, checked to be a file before the network is built) loaded
    strictly; None keeps the initial weights (random, or ImageNet Twins as backbone.twins_weights says: with a
    checkpoint they are not read). Logs its parameter counts."""
    if checkpoint is not None:
        checkpoint_file(checkpoint, setting)
        backbone_cfg = OmegaConf.merge(backbone_cfg, {"twins_weights": None})
    net = hydra.utils.instantiate(device_memory_settings(backbone_cfg, device, training=False))
    log_parameter_counts(parameter_counts(net))
    if checkpoint is not None:
        report = load_backbone_weights(net, str(checkpoint))
        log.info("loaded %s: %s", checkpoint, report)
    return net.to(device).eval()


def network_parts(net: FlowFormer) -> dict[str, list[nn.Module]]:
    """FlowFormer's top-level parts, which together hold all its parameters: the image encoders (feature and
    context), the channel convertor (FlowFormer's), the cost encoder (none with RAFT's decoder) and the decoder
    (with FlowFormer++'s reconstruction head); the parts a network lacks are left out."""
    parts = {
        "image_encoders": [*net.feature_encoder_modules(), *net.context_encoder_modules()],
        "channel_convertor": [getattr(net.memory_encoder, "channel_convertor", None)],
        "cost_encoder": [net.cost_encoder],
        "decoder": [net.memory_decoder],
    }
    present = {name: [module for module in modules if module is not None] for name, modules in parts.items()}
    return {name: modules for name, modules in present.items() if modules}


def parameter_counts(module: nn.Module) -> dict[str, Any]:
    """{"total", "trainable" (requires_grad)} parameter counts of a network or of a LightningModule holding
    one as `backbone`, with "by_part" ({part: count}, `network_parts`) when that network is a FlowFormer."""
    parameters = list(module.parameters())
    counts: dict[str, Any] = {
        "total": sum(p.numel() for p in parameters),
        "trainable": sum(p.numel() for p in parameters if p.requires_grad),
    }
    net = getattr(module, "backbone", module)
    if isinstance(net, FlowFormer):
        counts["by_part"] = {
            name: sum(p.numel() for m in modules for p in m.parameters())
            for name, modules in network_parts(net).items()
        }
    return counts


def log_parameter_counts(counts: dict[str, Any]) -> None:
    """One line: 'parameters: 16.17M total, 16.17M trainable (image_encoders 8.44M, ...)'."""
    parts = ", ".join(f"{name} {count / 1e6:.2f}M" for name, count in counts.get("by_part", {}).items())
    log.info(
        "parameters: %.2fM total, %.2fM trainable%s",
        counts["total"] / 1e6,
        counts["trainable"] / 1e6,
        f" ({parts})" if parts else "",
    )


class PairsPerSecond(ProgressColumn):
    """The progress bar's speed: flow fields per second."""

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:.2f} pairs/s" if task.speed else "-- pairs/s")


def pair_progress() -> Progress:
    """The progress bar of task=infer and task=eval over flow pairs: the task's description, the bar, pairs
    done of all, pairs per second and the time left."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        PairsPerSecond(),
        TimeRemainingColumn(),
    )
