"""The DataLoader settings of a training run (``data.num_workers``, ``data.pin_memory``,
``data.persistent_workers``, ``data.prefetch_factor``), with ``auto`` chosen for the device the loader feeds.

- ``num_workers: auto``: on a GPU (or any accelerator), the CPU cores this process may use, shared with the
  other processes of its node (DDP), less one for the process itself, at most :data:`MAX_AUTO_WORKERS`; on a
  CPU, 0: the step already keeps every core busy, and a worker would only take cores from it.
- ``pin_memory: auto``: pinned (page-locked) batches when the loader feeds a CUDA device, so the copy to the
  GPU is asynchronous; never otherwise (there is nothing to pin for).
- ``persistent_workers`` keeps the workers between epochs and validations; it and ``prefetch_factor`` (batches
  each worker prepares ahead) only apply with workers.

Workers are forked from the loading process on Linux whatever the interpreter's default start method
(`worker_start_method`; task=eval's loaders too).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

# At most this many workers per process for num_workers=auto: one worker reads 15-52 of the official stages'
# augmented pairs per CPU-second, so 1-3 of them give a 190 ms batch-8 step its 42 pairs/s (docs/performance.md,
# "Does the data keep up"), and every worker holds prefetch_factor batches in (pinned) memory.
MAX_AUTO_WORKERS = 8


def worker_start_method(num_workers: int) -> BaseContext | None:
    """How a DataLoader's `num_workers` workers start: on Linux forked from the loading process, as Python before
    3.14 started them by default and as the stop signals' handling and the workers' seeding were built and tested
    (Python 3.14 starts them from a fork server instead, where every worker imports torch, Lightning and the
    dataset's modules again: a tiny run's two workers took its first step 15 s later on 2 cores,
    docs/reliability.md); elsewhere the interpreter's default (spawn on macOS and Windows). None without workers,
    where a DataLoader refuses a start method."""
    if num_workers == 0 or not sys.platform.startswith("linux"):
        return None
    return multiprocessing.get_context("fork")


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a SLURM or container limit), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class LoaderSettings:
    """What a DataLoader gets, resolved: a worker count, pinning, and the worker-only settings."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None

    def dataloader_kwargs(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
            "prefetch_factor": self.prefetch_factor,
            "multiprocessing_context": worker_start_method(self.num_workers),
        }

    def describe(self) -> str:
        if self.num_workers == 0:
            return f"loaded in the training process, {'pinned' if self.pin_memory else 'not pinned'}"
        return (
            f"{self.num_workers} worker{'s' * (self.num_workers > 1)}{' (persistent)' if self.persistent_workers else ''}, "
            f"{self.prefetch_factor} batches ahead each, {'pinned' if self.pin_memory else 'not pinned'}"
        )


def check_loader_settings(owner: str, num_workers: Any, pin_memory: Any, prefetch_factor: Any) -> None:
    """One line naming the setting when a value is not one the loader takes."""
    if num_workers != "auto" and not (_is_int(num_workers) and num_workers >= 0):
        raise ValueError(f"{owner}: data.num_workers must be auto or an integer >= 0, got {num_workers!r}")
    if pin_memory != "auto" and not isinstance(pin_memory, bool):
        raise ValueError(f"{owner}: data.pin_memory must be auto, true or false, got {pin_memory!r}")
    if not (_is_int(prefetch_factor) and prefetch_factor >= 1):
        raise ValueError(f"{owner}: data.prefetch_factor must be an integer >= 1, got {prefetch_factor!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def auto_workers(device_type: str, processes_on_node: int = 1) -> int:
    """`num_workers: auto` for a loader feeding `device_type` in one of `processes_on_node` processes (training's
    data.num_workers, task=eval's eval.num_workers): 0 on a CPU; elsewhere this process's share of the cores less
    one, at most MAX_AUTO_WORKERS."""
    if device_type == "cpu":
        return 0
    cores = available_cores() // max(processes_on_node, 1)
    return min(max(cores - 1, 0), MAX_AUTO_WORKERS)


def resolve_loader_settings(
    *,
    num_workers: int | str,
    pin_memory: bool | str,
    persistent_workers: bool,
    prefetch_factor: int,
    device_type: str,
    processes_on_node: int = 1,
) -> LoaderSettings:
    """The settings for a loader feeding `device_type` (`cuda`, `cpu`, ...), in one of `processes_on_node`
    processes sharing the node's cores; `auto` as the module docstring says."""
    if num_workers == "auto":
        num_workers = auto_workers(device_type, processes_on_node)
    pin = device_type == "cuda" if pin_memory == "auto" else bool(pin_memory)
    workers = int(num_workers)
    return LoaderSettings(
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=bool(persistent_workers) and workers > 0,
        prefetch_factor=prefetch_factor if workers > 0 else None,
    )
