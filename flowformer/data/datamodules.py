"""LightningDataModules over Hydra-instantiated datasets (``conf/data/*.yaml``).

The datasets are built by Hydra from their ``_target_`` entries (recursive instantiation), so a config names
its datasets, roots and augmentation declaratively; the modules only add the DataLoaders.

- :class:`FlowDataModule`: a training dataset and named validation sets; ``val_names`` is in the order of
  ``val_dataloader()``'s list (``val/<name>/epe`` etc. in the logs).
- :class:`PretrainDataModule`: unlabeled pairs for MCVA pretraining.

Training loaders shuffle and drop the last incomplete batch, as the official loaders do (SPEC §6.3);
validation runs at batch 1 by default because validation images differ in size (the model pads them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import lightning as L
from torch.utils.data import DataLoader, Dataset

__all__ = ["FlowDataModule", "PretrainDataModule"]

log = logging.getLogger(__name__)


def _describe(dataset: Dataset) -> str:
    """``WeightedConcatDataset.describe()`` where available, else the class name and size."""
    describe = getattr(dataset, "describe", None)
    return describe() if callable(describe) else f"{type(dataset).__name__} ({len(dataset)} items)"


def _check_loader_args(owner: str, batch_size: int, num_workers: int) -> None:
    if batch_size < 1:
        raise ValueError(f"{owner}: batch_size must be >= 1, got {batch_size} (set data.batch_size)")
    if num_workers < 0:
        raise ValueError(f"{owner}: num_workers must be >= 0, got {num_workers} (set data.num_workers)")


class _LoaderOptions:
    """The DataLoader settings shared by both modules."""

    def __init__(self, *, num_workers: int, pin_memory: bool, persistent_workers: bool) -> None:
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0

    def loader(self, dataset: Dataset, *, batch_size: int, shuffle: bool, drop_last: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
        )


class FlowDataModule(L.LightningDataModule):
    """Supervised flow data: ``train`` (a dataset or None) and ``val`` (name -> dataset, in order).

    Args:
        train: the training dataset (e.g. a ``WeightedConcatDataset`` for the sintel mix); None for
            evaluation-only configs.
        val: validation datasets by name, e.g. ``{sintel_clean: ..., sintel_final: ..., kitti: ...}``.
        batch_size: training batch size (the official stages use 8 for chairs, 6 after).
        val_batch_size: validation batch size; 1 unless all validation images share one size.
        num_workers, pin_memory, persistent_workers: DataLoader settings.
    """

    def __init__(
        self,
        *,
        train: Dataset | None = None,
        val: Mapping[str, Dataset] | None = None,
        batch_size: int = 8,
        val_batch_size: int = 1,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        super().__init__()
        _check_loader_args("FlowDataModule", batch_size, num_workers)
        _check_loader_args("FlowDataModule (val)", val_batch_size, num_workers)
        self.train_set = train
        self.val_sets: dict[str, Dataset] = {str(name): dataset for name, dataset in (val or {}).items()}
        for name, dataset in self.val_sets.items():
            if len(dataset) == 0:
                raise ValueError(f"FlowDataModule: validation set '{name}' is empty")
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size
        self.options = _LoaderOptions(
            num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers
        )

    @property
    def val_names(self) -> list[str]:
        """Names of the validation sets, in the order of ``val_dataloader()``."""
        return list(self.val_sets)

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            raise ValueError("FlowDataModule: this data config has no training dataset (data.train is null)")
        if len(self.train_set) < self.batch_size:
            raise ValueError(
                f"FlowDataModule: the training set has {len(self.train_set)} items, fewer than one batch of "
                f"{self.batch_size} (batches are drop_last); lower data.batch_size"
            )
        return self.options.loader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> list[DataLoader]:
        return [
            self.options.loader(dataset, batch_size=self.val_batch_size, shuffle=False, drop_last=False)
            for dataset in self.val_sets.values()
        ]

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            log.info("training data: %s", _describe(self.train_set))
        for name, dataset in self.val_sets.items():
            log.info("validation set %s: %s", name, _describe(dataset))


class PretrainDataModule(L.LightningDataModule):
    """Unlabeled image pairs for MCVA pretraining (YouTube-VOS, a video folder or synthetic clips).

    The official recipe: batch 24, shuffle, drop_last, 368x496 crops (SPEC §5.1). There is no validation set.
    """

    def __init__(
        self,
        *,
        train: Dataset,
        batch_size: int = 24,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
    ) -> None:
        super().__init__()
        _check_loader_args("PretrainDataModule", batch_size, num_workers)
        self.train_set = train
        self.batch_size = batch_size
        self.options = _LoaderOptions(
            num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers
        )

    @property
    def val_names(self) -> list[str]:
        return []

    def setup(self, stage: str) -> None:
        log.info("pretraining data: %s", _describe(self.train_set))

    def train_dataloader(self) -> DataLoader:
        if len(self.train_set) < self.batch_size:
            raise ValueError(
                f"PretrainDataModule: the training set has {len(self.train_set)} pairs, fewer than one batch of "
                f"{self.batch_size} (batches are drop_last); lower data.batch_size"
            )
        return self.options.loader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)
