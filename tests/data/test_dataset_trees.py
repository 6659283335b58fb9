"""Dataset trees as the download sites deliver them: FlyingChairs' published split file, the HD1K challenge
(test) images and both FlyingThings3D cameras. Each test writes a tiny tree in the real formats and checks
counts, pairings and values."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from flowformer.data.datasets import HD1K, DatasetRootError, FlyingChairs, FlyingThings3D
from flowformer.data.io import write_kitti_flow

from helpers.configs import CONF_DIR
from helpers.trees import H, W, chairs_tree, red, write_image, write_pfm

THINGS_YAML = CONF_DIR / "data" / "things.yaml"


def _flow(value: float) -> np.ndarray:
    """Both components equal to ``value`` everywhere."""
    return np.full((H, W, 2), value, dtype=np.float32)


# FlyingChairs: FlyingChairs.zip gives FlyingChairs_release/data/; the split file is a separate download ----


def _write_split(path: Path, split: list[int]) -> None:
    path.write_text("".join(f"{s}\n" for s in split))


@pytest.mark.parametrize("beside_data", [True, False])
def test_chairs_reads_the_published_split_file(tmp_path: Path, beside_data: bool) -> None:
    data = chairs_tree(tmp_path, [2, 1, 1], split_name=None)
    _write_split((data.parent if beside_data else data) / "FlyingChairs_train_val.txt", [2, 1, 1])
    train = FlyingChairs(root=data, split="training")
    val = FlyingChairs(root=data, split="validation")
    assert [s.meta["name"] for s in train.samples] == ["00002", "00003"]
    assert len(val) == 1
    item = val[0]  # pair 00001: images 0 and 1, flow 0
    assert (red(item["img1"]), red(item["img2"])) == (0, 1)
    assert torch.all(item["flow"] == 0.0)
    assert (red(train[1]["img1"]), red(train[1]["img2"])) == (20, 21) and torch.all(train[1]["flow"][0] == 2.0)
    assert torch.all(train[1]["flow"][1] == -2.0)


def test_chairs_prefers_the_published_split_file_and_logs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = chairs_tree(tmp_path, [1, 1, 2], split_name=None)
    published = data.parent / "FlyingChairs_train_val.txt"
    _write_split(published, [1, 1, 2])
    _write_split(data / "chairs_split.txt", [2, 2, 1])  # a different split, to tell which file was read
    with caplog.at_level(logging.INFO, logger="flowformer.data.datasets"):
        train = FlyingChairs(root=data, split="training")
    assert [s.meta["name"] for s in train.samples] == ["00001", "00002"]
    message = caplog.text
    assert f"reading the split file {published}" in message and str(data / "chairs_split.txt") in message


def test_chairs_missing_split_file_names_both_names_and_places(tmp_path: Path) -> None:
    data = chairs_tree(tmp_path, [1, 2], split_name=None)
    with pytest.raises(DatasetRootError) as err:
        FlyingChairs(root=data)
    message = str(err.value)
    assert "FlyingChairs_train_val.txt" in message and "chairs_split.txt" in message
    assert f"'{data.parent}'" in message and f"'{data}'" in message
    with pytest.raises(DatasetRootError, match="`split_file` names"):
        FlyingChairs(root=data, split_file=tmp_path / "nowhere.txt")


# HD1K: hd1k_input.zip, hd1k_flow_gt.zip and hd1k_challenge.zip unpack side by side ---------------------------


def _hd1k_tree(root: Path) -> Path:
    """Two training sequences of 3 frames, and three challenge sequences (frames 10 and 11)."""
    for seq in range(2):
        for frame in range(3):
            name = f"{seq:06d}_{frame:04d}.png"
            write_image(root / "hd1k_input/image_2" / name, 10 * seq + frame)
            valid = np.ones((H, W), dtype=np.float32)
            write_kitti_flow(root / "hd1k_flow_gt/flow_occ" / name, _flow(0.5 * frame), valid)
    for seq in (2, 0, 1):  # written out of order on purpose
        write_image(root / "hd1k_challenge/image_2" / f"{seq:06d}_0010.png", 100 + 10 * seq)
        write_image(root / "hd1k_challenge/image_2" / f"{seq:06d}_0011.png", 101 + 10 * seq)
    return root


def test_hd1k_test_split_reads_the_challenge_pairs(tmp_path: Path) -> None:
    root = _hd1k_tree(tmp_path / "HD1k")
    test = HD1K(root=root, split="test")
    assert len(test) == 3
    for seq, item in enumerate(test):
        assert set(item) == {"img1", "img2", "meta"}
        assert (red(item["img1"]), red(item["img2"])) == (100 + 10 * seq, 101 + 10 * seq)
        assert item["meta"] == {"dataset": "hd1k", "name": f"{seq:06d}", "frame_id": f"{seq:06d}_0010.png"}
    training = HD1K(root=root)
    assert len(training) == 4 and all("flow" in training[i] for i in range(len(training)))
    assert float(training[3]["flow"][0, 0, 0]) == 0.5 and red(training[3]["img1"]) == 11


def test_hd1k_test_split_reports_an_unpaired_frame(tmp_path: Path) -> None:
    root = _hd1k_tree(tmp_path / "HD1k")
    (root / "hd1k_challenge/image_2/000001_0011.png").unlink()
    with pytest.raises(DatasetRootError, match="000001_0010.png lack the other frame"):
        HD1K(root=root, split="test")
    with pytest.raises(ValueError, match="'training' or 'test'"):
        HD1K(root=root, split="testing")


# FlyingThings3D: both cameras, as the archives unpack --------------------------------------------------------

SEQUENCES = ("A/0000", "B/0001")
CAMERA_VALUE = {"left": 0, "right": 50}  # added to the image and flow values of a camera
SIDE = {"left": "L", "right": "R"}


def _things_tree(root: Path, frames: int = 3) -> Path:
    for seq, camera, j in itertools.product(SEQUENCES, SIDE, range(frames)):
        offset = CAMERA_VALUE[camera]
        write_image(root / "frames_cleanpass/TRAIN" / seq / camera / f"{6 + j:04d}.png", offset + j)
        write_image(root / "frames_finalpass/TRAIN" / seq / camera / f"{6 + j:04d}.png", 100 + offset + j)
        flows = root / "optical_flow/TRAIN" / seq
        write_pfm(
            flows / "into_future" / camera / f"OpticalFlowIntoFuture_{6 + j:04d}_{SIDE[camera]}.pfm",
            _flow(float(offset + j)),
        )
        write_pfm(
            flows / "into_past" / camera / f"OpticalFlowIntoPast_{6 + j:04d}_{SIDE[camera]}.pfm",
            _flow(-float(offset + j)),
        )
    return root


def _keys(dataset: FlyingThings3D) -> list[tuple]:
    return [
        (s.meta["camera"], s.meta["direction"], s.meta["scene"], s.meta["frame"]) for s in dataset.samples
    ]


def test_things_cameras_pair_each_camera_with_its_own_flow(tmp_path: Path) -> None:
    root = _things_tree(tmp_path / "FlyingThings3D")
    left, right = FlyingThings3D(root=root), FlyingThings3D(root=root, camera="right")
    assert len(left) == len(right) == 8  # 2 sequences x 2 directions x (3 frames - 1)
    assert {s.meta["camera"] for s in left.samples} == {"left"}
    future = right[1]  # right camera, into_future, A/0000, i = 1: (img[1], img[2]) with future flow[1]
    assert future["meta"]["camera"] == "right" and future["meta"]["direction"] == "into_future"
    assert (red(future["img1"]), red(future["img2"])) == (51, 52) and torch.all(future["flow"] == 51.0)
    past = right[5]  # into_past, A/0000, i = 1: (img[2], img[1]) with past flow[2]
    assert past["meta"]["direction"] == "into_past" and past["meta"]["scene"] == "A/0000"
    assert (red(past["img1"]), red(past["img2"])) == (52, 51) and torch.all(past["flow"] == -52.0)


def test_things_both_cameras_in_pass_camera_direction_sequence_order(tmp_path: Path) -> None:
    root = _things_tree(tmp_path / "FlyingThings3D")
    both = FlyingThings3D(root=root, passes=["clean", "final"], camera="both")
    expected = [
        (camera, direction, scene, frame)
        for camera, direction, scene, frame in itertools.product(
            SIDE, ("into_future", "into_past"), SEQUENCES, range(2)
        )
    ]
    assert _keys(both) == expected * 2  # clean, then final
    assert [s.meta["pass"] for s in both.samples] == ["clean"] * 16 + ["final"] * 16
    left = FlyingThings3D(root=root, camera="left")
    right = FlyingThings3D(root=root, camera="right")
    assert both.samples[:16] == left.samples + right.samples
    assert len({s.meta["name"] for s in both.samples}) == 32  # names stay unique across cameras
    assert red(both[16 + 8]["img1"]) == 150  # final pass, right camera, first pair


def test_things_camera_is_validated_and_set_in_the_config(tmp_path: Path) -> None:
    root = _things_tree(tmp_path / "FlyingThings3D")
    with pytest.raises(ValueError, match=r"camera must be 'left', 'right' or 'both', got 'stereo'") as err:
        FlyingThings3D(root=root, camera="stereo")
    assert "conf/data/things.yaml" in str(err.value)
    train = OmegaConf.load(THINGS_YAML).train
    assert train.camera == "left"
    train.root = str(root)
    assert len(instantiate(train)) == 16  # clean + final, left
    train.camera = "both"
    dataset = instantiate(train)
    assert len(dataset) == 32 and {s.meta["camera"] for s in dataset.samples} == {"left", "right"}
