"""Training draws: the same samples, augmented the same way, in the same order, whatever the number of
DataLoader workers, DDP ranks split an epoch without overlap, and a resumed position skips exactly what was
trained on."""

import pytest
import torch

from flowformer.data.datamodules import FlowDataModule
from flowformer.data.datasets import FlyingChairs, WeightedConcatDataset
from flowformer.data.sampling import ResumableSampler, SampleKey
from flowformer.data.transforms import FlowAugmentor

from helpers.trees import chairs_tree


def augmented_chairs(tmp_path) -> WeightedConcatDataset:
    chairs = FlyingChairs(
        root=chairs_tree(tmp_path, [1, 1, 1]),
        augmentor=FlowAugmentor(crop_size=(16, 16), min_scale=0.0, max_scale=0.5),
    )
    return WeightedConcatDataset(parts=[{"dataset": chairs, "repeat": 4}])  # 12 items, 3 distinct pairs


def epoch_images(module: FlowDataModule, epochs: int = 2) -> list[torch.Tensor]:
    loader = module.train_dataloader()
    images = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        images += [batch["img1"] for batch in loader]
    return images


def test_draws_do_not_depend_on_the_number_of_workers(tmp_path):
    torch.manual_seed(7)
    single = epoch_images(FlowDataModule(train=augmented_chairs(tmp_path), batch_size=2, num_workers=0))
    torch.manual_seed(7)
    pooled = epoch_images(FlowDataModule(train=augmented_chairs(tmp_path), batch_size=2, num_workers=2))
    assert len(single) == len(pooled) == 12
    assert all(torch.equal(a, b) for a, b in zip(single, pooled, strict=True))
    # every draw is its own augmentation: repeats of a pair and the two epochs all differ
    flat = torch.cat(single)
    assert len({image.numpy().tobytes() for image in flat}) == len(flat)


@pytest.mark.parametrize(
    ("position", "first_batch"),
    [
        ({"epoch": 1, "batches_done": 2}, 8),  # mid-epoch: the rest of epoch 1
        ({"epoch": 0, "batches_done": 6}, 6),  # an epoch finished at the checkpoint: all of epoch 1
    ],
)
def test_resumed_position_skips_exactly_the_batches_trained_on(tmp_path, position, first_batch):
    torch.manual_seed(7)
    full = epoch_images(FlowDataModule(train=augmented_chairs(tmp_path), batch_size=2), epochs=2)
    torch.manual_seed(7)
    module = FlowDataModule(train=augmented_chairs(tmp_path), batch_size=2)
    module.load_state_dict(position)
    resumed = [batch["img1"] for batch in module.train_dataloader()]
    assert len(resumed) == len(full) - first_batch
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[first_batch:], strict=True))


def test_ranks_share_an_epoch_without_overlap_and_keep_per_index_seeds():
    dataset = list(range(10))
    ranks = [list(ResumableSampler(dataset, seed=3, num_replicas=2, rank=r)) for r in (0, 1)]
    single = {key.index: key.seed for key in ResumableSampler(dataset, seed=3)}
    indices = [key.index for keys in ranks for key in keys]
    assert sorted(indices) == list(range(10))
    assert all(isinstance(key, SampleKey) and single[key.index] == key.seed for keys in ranks for key in keys)
