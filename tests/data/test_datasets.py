"""Flow datasets read tiny trees in the real formats (.ppm, .flo, .pfm, .png, 16-bit KITTI png)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from flowformer.data.datasets import (
    HD1K,
    KITTI,
    DatasetRootError,
    FlyingChairs,
    FlyingThings3D,
    MpiSintel,
    WeightedConcatDataset,
)
from flowformer.data.io import write_kitti_flow
from flowformer.data.transforms import FlowAugmentor, SparseFlowAugmentor

from helpers.trees import (
    H,
    W,
    chairs_tree,
    kitti_tree,
    red,
    sintel_tree,
    sparse_flow,
    things_tree,
    write_image,
)

# FlyingChairs ------------------------------------------------------------------------------------------


def test_chairs_split_pairs_and_contract(tmp_path: Path) -> None:
    root = chairs_tree(tmp_path, [1, 2, 1])
    train = FlyingChairs(root=root, split="training")
    val = FlyingChairs(root=root, split="validation")
    assert len(train) == 2 and len(val) == 1
    item = train[1]  # pair 00003
    assert item["img1"].shape == (3, H, W) and item["img1"].dtype == torch.float32
    assert (red(item["img1"]), red(item["img2"])) == (20, 21)
    assert item["flow"].shape == (2, H, W) and item["valid"].shape == (H, W)
    assert torch.all(item["flow"][0] == 2.0) and torch.all(item["flow"][1] == -2.0)
    assert torch.all(item["valid"] == 1.0)
    assert item["meta"] == {"dataset": "chairs", "name": "00003"}
    assert val[0]["meta"]["name"] == "00002"


def test_chairs_split_file_in_parent_and_missing(tmp_path: Path) -> None:
    root = chairs_tree(tmp_path / "a", [1, 2], split_in_parent=True)
    assert len(FlyingChairs(root=root, split="training")) == 1
    root_b = chairs_tree(tmp_path / "b", [1, 2])
    (root_b / "chairs_split.txt").unlink()
    with pytest.raises(DatasetRootError, match="chairs_split.txt") as err:
        FlyingChairs(root=root_b)
    assert "00001_img1.ppm" in str(err.value) and "data=synthetic" in str(err.value)
    with pytest.raises(ValueError, match="'training' or 'validation'"):
        FlyingChairs(root=root, split="train")


def test_missing_root_names_path_tree_and_alternative(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "Sintel"
    with pytest.raises(DatasetRootError) as err:
        MpiSintel(root=missing)
    message = str(err.value)
    assert str(missing) in message
    assert "training/flow/<scene>/frame_0001.flo" in message
    assert "data/README.md" in message and "data=synthetic" in message
    with pytest.raises(DatasetRootError, match="frames_cleanpass"):
        FlyingThings3D(root=tmp_path / "nothing")


# FlyingThings3D -------------------------------------------------------------------------------------


def test_things_official_pairing_both_passes_and_directions(tmp_path: Path) -> None:
    root = things_tree(tmp_path / "FlyingThings3D")
    clean = FlyingThings3D(root=root, passes=["clean"])
    both = FlyingThings3D(root=root, passes=["clean", "final"])
    # 2 sequences x 2 directions x (3 flows - 1) pairs per pass
    assert len(clean) == 8 and len(both) == 16
    future = [i for i in range(len(clean)) if clean.samples[i].meta["direction"] == "into_future"]
    past = [i for i in range(len(clean)) if clean.samples[i].meta["direction"] == "into_past"]
    item = clean[future[1]]  # sequence A/0000, i = 1: (img[1], img[2]) with future flow[1]
    assert (red(item["img1"]), red(item["img2"])) == (1, 2)
    assert float(item["flow"][0, 5, 5]) == 1.0 and float(item["flow"][1, 5, 5]) == -1.0
    assert float(item["flow"][0, 0, 0]) == 1e4 and item["valid"][0, 0] == 0 and item["valid"][5, 5] == 1
    item = clean[past[1]]  # i = 1: (img[2], img[1]) with past flow[2]
    assert (red(item["img1"]), red(item["img2"])) == (2, 1)
    assert float(item["flow"][0, 5, 5]) == -2.0
    final = both[8]
    assert final["meta"]["pass"] == "final" and red(final["img1"]) >= 100


def test_things_mismatched_sequence_is_reported(tmp_path: Path) -> None:
    root = things_tree(tmp_path / "FlyingThings3D")
    next((root / "optical_flow/TRAIN/B/0001/into_past/left").glob("*.pfm")).unlink()
    with pytest.raises(DatasetRootError, match="B/0001"):
        FlyingThings3D(root=root)


# MPI-Sintel -----------------------------------------------------------------------------------------


def test_sintel_training_and_test_splits(tmp_path: Path) -> None:
    root = sintel_tree(tmp_path / "Sintel")
    clean = MpiSintel(root=root, split="training", passes=["clean"])
    assert len(clean) == 3
    assert [s.meta["scene"] for s in clean.samples] == ["alley_1", "market_2", "market_2"]  # sorted scenes
    item = clean[2]
    assert item["meta"] == {
        "dataset": "sintel",
        "name": "clean/market_2/frame_0002",
        "pass": "clean",
        "scene": "market_2",
        "frame": 1,
    }
    assert (red(item["img1"]), red(item["img2"])) == (1, 2) and float(item["flow"][0, 0, 0]) == 2.0
    assert len(MpiSintel(root=root, passes=["clean", "final"])) == 6
    test = MpiSintel(root=root, split="test", passes=["final"])
    assert len(test) == 3 and set(test[0]) == {"img1", "img2", "meta"} and red(test[0]["img1"]) == 100


# KITTI-2015 and HD1K ---------------------------------------------------------------------------------


def test_kitti_sparse_valid_from_png(tmp_path: Path) -> None:
    root = kitti_tree(tmp_path / "KITTI")
    train = KITTI(root=root, split="training")
    assert len(train) == 2
    item = train[1]
    flow, valid = sparse_flow(2.5)
    np.testing.assert_array_equal(item["valid"].numpy(), valid)
    np.testing.assert_allclose(item["flow"].permute(1, 2, 0).numpy(), flow)
    assert item["meta"] == {"dataset": "kitti", "name": "000001", "frame_id": "000001_10.png"}
    test = KITTI(root=root, split="testing")
    assert len(test) == 2 and "flow" not in test[0] and test[0]["meta"]["frame_id"] == "000000_10.png"


def test_hd1k_sequences(tmp_path: Path) -> None:
    root = tmp_path / "HD1k"
    for seq, frames in ((0, 3), (2, 2)):  # no sequence 1: the official loop would stop there
        for j in range(frames):
            write_image(root / "hd1k_input/image_2" / f"{seq:06d}_{j:04d}.png", 10 * seq + j)
            write_kitti_flow(root / "hd1k_flow_gt/flow_occ" / f"{seq:06d}_{j:04d}.png", *sparse_flow(j))
    dataset = HD1K(root=root)
    assert len(dataset) == 3  # (3 - 1) + (2 - 1)
    item = dataset[2]
    assert (red(item["img1"]), red(item["img2"])) == (20, 21) and item["meta"]["sequence"] == "000002"


def test_sparse_dataset_rejects_dense_augmentor(tmp_path: Path) -> None:
    root = kitti_tree(tmp_path / "KITTI")
    with pytest.raises(TypeError, match="SparseFlowAugmentor"):
        KITTI(root=root, augmentor=FlowAugmentor(crop_size=(16, 16)))
    augmented = KITTI(root=root, augmentor=SparseFlowAugmentor(crop_size=(32, 40)))
    item = augmented[0]
    assert item["img1"].shape == (3, 32, 40) and item["valid"].shape == (32, 40)


# Mix and augmentation streams -------------------------------------------------------------------------


def test_weighted_concat_repeats(tmp_path: Path) -> None:
    sintel = MpiSintel(root=sintel_tree(tmp_path / "Sintel"), passes=["clean", "final"])  # 6 pairs
    kitti = KITTI(root=kitti_tree(tmp_path / "KITTI"))  # 2 pairs
    mix = WeightedConcatDataset(parts=[{"dataset": sintel, "repeat": 3}, {"dataset": kitti, "repeat": 5}])
    assert len(mix) == 3 * 6 + 5 * 2
    assert mix[6]["meta"] == sintel[0]["meta"] and mix[18]["meta"]["dataset"] == "kitti"
    assert mix[27]["meta"] == kitti[1]["meta"]
    assert mix.describe() == "3 x MpiSintel (6) + 5 x KITTI (2) = 28 items"
    with pytest.raises(ValueError, match="repeat"):
        WeightedConcatDataset(parts=[{"dataset": kitti, "repeat": 0}])


def test_augmentation_streams_differ_across_workers_and_epochs(tmp_path: Path) -> None:
    root = chairs_tree(tmp_path, [1])
    chairs = FlyingChairs(
        root=root, augmentor=FlowAugmentor(crop_size=(16, 16), min_scale=0.0, max_scale=0.5)
    )
    same_pair = WeightedConcatDataset(parts=[{"dataset": chairs, "repeat": 4}])
    loader = DataLoader(same_pair, batch_size=1, num_workers=2)

    def epoch() -> list[torch.Tensor]:
        return [batch["img1"][0] for batch in loader]

    torch.manual_seed(0)
    first, second = epoch(), epoch()
    # The official per-worker seeding made worker 0 and worker 1 produce identical augmentations of the same
    # pair, and every epoch replay them; here all eight differ.
    everything = first + second
    assert all(
        not torch.equal(everything[i], everything[j])
        for i in range(len(everything))
        for j in range(i + 1, len(everything))
    )
