"""LightningDataModules over Hydra-instantiated datasets (``conf/data/*.yaml``).

The datasets are built by Hydra from their ``_target_`` entries (recursive instantiation), so a config names
its datasets, roots and augmentation declaratively; the modules only add the DataLoaders.

- :class:`FlowDataModule`: a training dataset and named validation sets; ``val_names`` is in the order of
  ``val_dataloader()``'s list (``val/<name>/epe`` etc. in the logs).
- :class:`PretrainDataModule`: unlabeled pairs for MCVA pretraining.

Training loaders shuffle and drop the last incomplete batch, as the official ``fetch_dataloader`` does;
validation runs at batch 1 by default because validation images differ in size (the model pads them).

The loaders' settings (``data.num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``) are
resolved for the device the trainer runs on when a loader is made (``auto``: :mod:`flowformer.data.loader_settings`).

Resuming is exact: the training loader draws from a :class:`~flowformer.data.sampling.ResumableSampler`
seeded with the run seed, the module's ``state_dict`` (saved in every checkpoint) records the epoch and the
batches of it already trained on, and a resumed run skips exactly those. Every loader has its own torch
Generator, so creating one does not advance the global random stream the model draws from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Mapping
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader, Dataset, default_collate

from flowformer.data.loader_settings import LoaderSettings, check_loader_settings, resolve_loader_settings
from flowformer.data.sampling import ResumableSampler
from flowformer.setting_types import count_at_least
from flowformer.stop_signals import worker_ignores_stop_signals

__all__ = ["FlowDataModule", "PretrainDataModule"]

log = logging.getLogger(__name__)


def _describe(dataset: Dataset) -> str:
    """``WeightedConcatDataset.describe()`` where available, else the class name and size."""
    describe = getattr(dataset, "describe", None)
    return describe() if callable(describe) else f"{type(dataset).__name__} ({len(dataset)} items)"


def collate_pairs(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch of dataset items: every key stacked as ``default_collate`` does, but ``meta``, which stays the list
    of the items' own dicts: the parts of a mix (the sintel stage's Sintel, KITTI, HD1K and Things items) carry
    different meta keys, which ``default_collate`` cannot join. Items that are not dicts go to
    ``default_collate`` whole."""
    if not all(isinstance(item, Mapping) for item in items):
        return default_collate(items)
    batch = default_collate([{key: value for key, value in item.items() if key != "meta"} for item in items])
    if any("meta" in item for item in items):
        batch["meta"] = [item.get("meta", {}) for item in items]
    return batch


def start_worker(worker_id: int, rank: int) -> None:
    """Each DataLoader worker as it starts: it ignores the stop signals as it was forked to (SLURM and a terminal
    signal every process of the job; the training process stops and ends its workers), and it is seeded as
    Lightning's ``seed_everything(workers=True)`` seeds it (which Lightning does only for a loader that has no
    worker_init_fn). `rank`: the loader's process's global rank, as Lightning passes it."""
    worker_ignores_stop_signals(worker_id)
    if int(os.environ.get("PL_SEED_WORKERS", "0")):
        pl_worker_init_function(worker_id, rank)


class _TrainingData(L.LightningDataModule):
    """The training set, the DataLoader settings shared by both modules, and the resumable training loader."""

    def __init__(
        self,
        *,
        train: Dataset | None,
        batch_size: int,
        num_workers: int | str = "auto",
        pin_memory: bool | str = "auto",
        persistent_workers: bool = True,
        prefetch_factor: int = 2,
    ) -> None:
        count_at_least(batch_size, "data.batch_size", 1)
        check_loader_settings(type(self).__name__, num_workers, pin_memory, prefetch_factor)
        super().__init__()
        self.train_set = train
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.prefetch_factor = prefetch_factor
        # seed_everything(cfg.seed) ran before the module was built, so this is the run seed.
        self.seed = torch.initial_seed()
        self._resume_at: tuple[int, int] | None = None

    def describe_training_set(self) -> str:
        return _describe(self.train_set)

    def loader_settings(self, device_type: str | None = None) -> LoaderSettings:
        """The DataLoader settings for `device_type` (None: the trainer's device, the CPU without a trainer),
        sharing the node's cores with the trainer's other processes there."""
        trainer = self.trainer
        if device_type is None:
            device_type = trainer.strategy.root_device.type if trainer else "cpu"
        return resolve_loader_settings(
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor,
            device_type=device_type,
            processes_on_node=trainer.num_devices if trainer else 1,
        )

    def loader(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        settings: LoaderSettings | None = None,
        sampler: ResumableSampler | None = None,
    ) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=sampler is not None,
            collate_fn=collate_pairs,
            generator=torch.Generator().manual_seed(self.seed),
            worker_init_fn=partial(start_worker, rank=self.trainer.global_rank if self.trainer else 0),
            **(settings or self.loader_settings()).dataloader_kwargs(),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, this process's share under DDP, drop_last; resumes where the checkpoint stopped."""
        settings = self.loader_settings()
        log.info("training loader: %s", settings.describe())
        return self.training_loader(settings)

    def training_loader(self, settings: LoaderSettings) -> DataLoader:
        """The training loader (`train_dataloader`) with the given settings."""
        dataset = self.train_set
        if dataset is None:
            raise ValueError(f"{type(self).__name__}: this data config has no training dataset (data.train is null)")
        if len(dataset) < self.batch_size:
            raise ValueError(
                f"{type(self).__name__}: the training set has {len(dataset)} items, fewer than one batch of "
                f"{self.batch_size} (batches are drop_last); lower data.batch_size"
            )
        trainer = self.trainer
        sampler = ResumableSampler(
            dataset,
            seed=self.seed,
            num_replicas=trainer.world_size if trainer else 1,
            rank=trainer.global_rank if trainer else 0,
        )
        if self._resume_at is not None:
            epoch, batches_done = self._resume_at
            if batches_done >= len(sampler) // self.batch_size:  # saved at the end of an epoch
                epoch, batches_done = epoch + 1, 0
            sampler.resume(epoch, batches_done * self.batch_size)
            self._resume_at = None
            # Lightning warns that a mid-epoch resume is unreliable unless the loader is stateful; this
            # module restores the position itself (the sampler skips the batches already trained on).
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")
        return self.loader(dataset, batch_size=self.batch_size, settings=settings, sampler=sampler)

    def state_dict(self) -> dict[str, Any]:
        """The training position: the epoch and how many of its batches were trained on, from Lightning's loop
        progress (an epoch is in progress while its `started` count is ahead of its `processed` count), and
        the seed the draws are keyed by (a resume with another seed is warned about)."""
        trainer = self.trainer
        if trainer is None:
            return {}
        epochs = trainer.fit_loop.epoch_progress.current
        in_epoch = epochs.started > epochs.processed
        batches_done = trainer.fit_loop.epoch_loop.batch_progress.current.processed if in_epoch else 0
        return {"epoch": epochs.processed, "batches_done": batches_done, "seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._resume_at = (int(state_dict["epoch"]), int(state_dict["batches_done"]))


class FlowDataModule(_TrainingData):
    """Supervised flow data: ``train`` (a dataset or None) and ``val`` (name -> dataset, in order).

    Args:
        train: the training dataset (e.g. a ``WeightedConcatDataset`` for the sintel mix); None for
            evaluation-only configs.
        val: validation datasets by name, e.g. ``{sintel_clean: ..., sintel_final: ..., kitti: ...}``.
        batch_size: training batch size (the official stages use 8 for chairs, 6 after).
        val_batch_size: validation batch size; 1 unless all validation images share one size.
        num_workers, pin_memory, persistent_workers, prefetch_factor: DataLoader settings (of
            :class:`_TrainingData`; ``auto`` resolved by :mod:`flowformer.data.loader_settings`).
    """

    def __init__(
        self,
        *,
        train: Dataset | None = None,
        val: Mapping[str, Dataset] | None = None,
        batch_size: int = 8,
        val_batch_size: int = 1,
        **loader_settings: Any,
    ) -> None:
        super().__init__(train=train, batch_size=batch_size, **loader_settings)
        count_at_least(val_batch_size, "data.val_batch_size", 1)
        self.val_sets: dict[str, Dataset] = {str(name): dataset for name, dataset in (val or {}).items()}
        for name, dataset in self.val_sets.items():
            if isinstance(dataset, Mapping):  # a config node Hydra left as it is: it names no class
                raise ValueError(  # noqa: TRY004 - a setting's error, which run.py reports in one line
                    f"FlowDataModule: validation set '{name}' is the settings {dict(dataset)}, not a dataset: "
                    f"data.val.{name} names no class (_target_); give it a set of conf/eval/sets/, as a data "
                    f"config's defaults do (`/eval/sets@val.{name}: <set>`), or remove it"
                )
            if len(dataset) == 0:
                raise ValueError(f"FlowDataModule: validation set '{name}' is empty")
        self.val_batch_size = val_batch_size

    @property
    def val_names(self) -> list[str]:
        """Names of the validation sets, in the order of ``val_dataloader()``."""
        return list(self.val_sets)

    def val_dataloader(self) -> list[DataLoader]:
        """One loader per validation set; their workers end with each validation (only the training loader's
        persist: kept, a run's idle validation workers would outnumber its training ones)."""
        settings = dataclasses.replace(self.loader_settings(), persistent_workers=False)
        return [
            self.loader(dataset, batch_size=self.val_batch_size, settings=settings)
            for dataset in self.val_sets.values()
        ]

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            log.info("training data: %s", self.describe_training_set())
        for name, dataset in self.val_sets.items():
            log.info("validation set %s: %s", name, _describe(dataset))


class PretrainDataModule(_TrainingData):
    """Unlabeled image pairs for MCVA pretraining (YouTube-VOS, a video folder, or synthetic clips textured
    procedurally or with photographs: data=synthetic_video, data=image_folder_video).

    The official recipe (FlowFormer++ ``pretrain_FlowFormer_maemask.py``): batch 24, shuffle, drop_last,
    368x496 crops. There is no validation set. ``num_workers``, ``pin_memory``, ``persistent_workers``,
    ``prefetch_factor``: the DataLoader settings of :class:`_TrainingData`.
    """

    def __init__(self, *, train: Dataset, batch_size: int = 24, **loader_settings: Any) -> None:
        super().__init__(train=train, batch_size=batch_size, **loader_settings)

    @property
    def val_names(self) -> list[str]:
        return []

    def setup(self, stage: str) -> None:
        log.info("pretraining data: %s", self.describe_training_set())
