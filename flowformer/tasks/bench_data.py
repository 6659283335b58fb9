"""task=bench bench=data: does data=<name>'s training loader keep up with the training step?

    python run.py task=bench bench=data data=chairs paths.data_dir=/data
    python run.py task=bench bench=data data=sintel_mix paths.data_dir=/data data.num_workers=12

Two measurements of the config's training set, drawn as training draws them (shuffled, augmented):

- one worker: `bench.repeats` x batch pairs read and augmented one after another in this process with one
  torch thread, as a DataLoader worker does; its pairs per CPU-second (process time, which other processes
  on the machine do not change) are what one worker delivers on a core of its own, and give the workers a
  step needs: `bench.target_pairs_per_s` (42: batch 8 in the 190 ms of issue 35's H200 step) / that rate;
- the loader: the training DataLoader with the settings a GPU run on this machine gets (`auto` resolved for
  CUDA: flowformer/data/loader_settings.py; not pinned where torch sees no GPU), its pairs per second over
  `bench.repeats` batches after the first (the workers' start, reported as `startup_s`) and `bench.warmup` more.

Writes <run dir>/bench.json (the machine and the row) and bench.md; returns the loader's pairs per second. A stop
signal (Ctrl-C) ends it at once, with one line, its loader's workers with it, and nothing written.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset

from flowformer.data.datamodules import FlowDataModule, PretrainDataModule
from flowformer.data.sampling import ResumableSampler
from flowformer.models.output_files import atomic_write_text
from flowformer.stop_signals import deferred_stop, stopping_at_once
from flowformer.tasks.run_setup import instantiate_setting

log = logging.getLogger(__name__)


def one_worker_rate(dataset: Dataset, pairs: int, seed: int) -> dict[str, float]:
    """{pairs per wall-clock second, pairs per CPU-second} of `pairs` training draws read in this process with
    one torch thread (a DataLoader worker's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        keys = itertools.islice(itertools.cycle(ResumableSampler(dataset, seed=seed)), pairs)
        wall, cpu = time.perf_counter(), time.process_time()
        for key in keys:
            dataset[key]
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        torch.set_num_threads(threads)
    return {"pairs_per_s": pairs / wall, "pairs_per_cpu_s": pairs / cpu}


def endless(loader: DataLoader) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (a generated tree can be shorter than the measurement)."""
    while True:
        with deferred_stop:  # a stop while its workers start is raised once they have (flowformer/stop_signals.py)
            batches = iter(loader)
        yield from batches


def loader_rate(loader: DataLoader, warmup: int, repeats: int) -> dict[str, float]:
    """{startup_s: until the first batch, pairs_per_s: over `repeats` batches after `warmup` more}."""
    start = time.perf_counter()
    batches = endless(loader)
    next(batches)
    startup_s = time.perf_counter() - start
    for _ in range(warmup):
        next(batches)
    start = time.perf_counter()
    pairs = sum(len(next(batches)["img1"]) for _ in range(repeats))
    return {"startup_s": startup_s, "pairs_per_s": pairs / (time.perf_counter() - start)}


def measure_loader(cfg: DictConfig) -> dict[str, Any]:
    """The row of bench.md for cfg.data (module docstring)."""
    bench = cfg.bench
    datamodule = instantiate_setting(cfg.data, "data")
    if not isinstance(datamodule, (FlowDataModule, PretrainDataModule)) or datamodule.train_set is None:
        raise ValueError(
            f"bench.mode=data measures a training loader: data={cfg.data._target_} has no data.train"
        )
    settings = datamodule.loader_settings("cuda")
    if not torch.cuda.is_available():
        settings = dataclasses.replace(settings, pin_memory=False)
    one = one_worker_rate(datamodule.train_set, bench.repeats * datamodule.batch_size, cfg.seed)
    loader = loader_rate(datamodule.training_loader(settings), bench.warmup, bench.repeats)
    return {
        "dataset": datamodule.describe_training_set(),
        "batch_size": datamodule.batch_size,
        "loader": settings.describe(),
        "num_workers": settings.num_workers,
        **loader,
        "one_worker_pairs_per_s": one["pairs_per_s"],
        "one_worker_pairs_per_cpu_s": one["pairs_per_cpu_s"],
        "target_pairs_per_s": bench.target_pairs_per_s,
        "workers_for_target": math.ceil(bench.target_pairs_per_s / one["pairs_per_cpu_s"]),
    }


def markdown_table(row: dict[str, Any]) -> str:
    titles = [
        "training set",
        "batch",
        "loader",
        "startup s",
        "pairs/s",
        "one worker: pairs/s",
        "pairs per CPU-second",
        f"workers for {row['target_pairs_per_s']:g} pairs/s",
    ]
    cells = [
        row["dataset"],
        str(row["batch_size"]),
        row["loader"],
        f"{row['startup_s']:.1f}",
        f"{row['pairs_per_s']:.1f}",
        f"{row['one_worker_pairs_per_s']:.2f}",
        f"{row['one_worker_pairs_per_cpu_s']:.2f}",
        str(row["workers_for_target"]),
    ]
    return f"| {' | '.join(titles)} |\n|{'---|' * len(titles)}\n| {' | '.join(cells)} |\n"


def run(cfg: DictConfig, machine: dict[str, Any]) -> float:
    """Measures cfg.data's training loader and writes bench.json and bench.md (module docstring)."""
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    def stopped(signum: signal.Signals) -> str:
        return f"task=bench bench=data stopped by {signum.name} before its row was measured: nothing was written"

    with stopping_at_once(stopped):
        row = measure_loader(cfg)
    setup = {key: cfg.bench[key] for key in ("mode", "warmup", "repeats")} | {
        "data": OmegaConf.to_container(cfg.data, resolve=True)
    }
    atomic_write_text(
        output_dir / "bench.json", json.dumps({"machine": machine, "setup": setup, "rows": [row]}, indent=2)
    )
    table = markdown_table(row)
    atomic_write_text(output_dir / "bench.md", table)
    print(
        f"training loader on {machine['cpu']} ({machine['cpu_cores']} cores)\n{table}\nwrote {output_dir / 'bench.json'}, bench.md"
    )
    return row["pairs_per_s"]
