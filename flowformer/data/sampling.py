"""Training draws that a resumed run repeats exactly.

A training DataLoader iterates a :class:`ResumableSampler`, which yields :class:`SampleKey` items instead of
plain indices: the dataset index and the seed of that draw's augmentation stream. The seed depends only on
(run seed, epoch, index), so the same sample is augmented the same way whichever worker, process or DDP world
size loads it, and a run resumed mid-epoch (the sampler skips the draws already trained on) sees the same
batches in the same order as the run it continues. Datasets accept a ``SampleKey`` or a plain ``int``
(validation, evaluation, user code); for a plain index the augmentation draws from the worker's stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from torch.utils.data import Dataset, DistributedSampler

from flowformer.data.transforms import WorkerRNG

__all__ = ["ResumableSampler", "SampleKey", "unpack_item"]


class SampleKey(NamedTuple):
    """One training draw: the dataset ``index`` and the ``seed`` of its augmentation stream."""

    index: int
    seed: int

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def unpack_item(item: int | SampleKey, worker_rng: WorkerRNG) -> tuple[int, np.random.Generator]:
    """A dataset's ``__getitem__`` argument -> (index, augmentation generator)."""
    if isinstance(item, SampleKey):
        return int(item.index), item.rng()
    return int(item), worker_rng.get()


def item_index(item: int | SampleKey) -> int:
    """The dataset index of an item (for datasets without random augmentation)."""
    return int(item.index) if isinstance(item, SampleKey) else int(item)


def draw_seed(seed: int, epoch: int, index: int) -> int:
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch, index]).generate_state(1, dtype=np.uint64)[0])


class ResumableSampler(DistributedSampler):
    """``DistributedSampler``'s epoch permutations (seed + epoch; this rank's share), yielding ``SampleKey``s.

    ``resume(epoch, samples_done)`` makes the next iteration that epoch's, without its first ``samples_done``
    draws. ``len()`` stays the whole epoch's, which is what Lightning counts a resumed epoch against. Being a
    ``DistributedSampler``, Lightning does not replace it under DDP.
    """

    def __init__(
        self, dataset: Dataset, *, seed: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self._skip = 0

    def resume(self, epoch: int, samples_done: int) -> None:
        self.set_epoch(epoch)
        self._skip = samples_done

    def __iter__(self) -> Iterator[SampleKey]:  # type: ignore[override]
        skip, self._skip = self._skip, 0
        for index in itertools.islice(super().__iter__(), skip, None):
            yield SampleKey(index, draw_seed(self.seed, self.epoch, index))
